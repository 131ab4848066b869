"""Chapter 06's overlap section, notebook side: collective matmul's runs read, printed and drawn.

The chapter runs ``workers/ch06_collective_matmul.py``: one forward and backward of the sequence-parallel MLP per mode
(``blocking``: the all-gather and reduce-scatter as whole collectives; ``decomposed``: each cut into ring steps whose
transfers run while the previous block multiplies, ``workers/parallel/collective_matmul.py``; ``serialized``: the same
ring, each transfer waited for at once), and with ``repeats`` that many timed float32 steps of each.

What is exact here, and printed in checked cells: the float64 verdicts (errors ~1e-15 against a tolerance of 1e-12,
the margin ``tests/test_collective_matmul.py`` measured), the ring's counts and bytes (integers), and the planner's
prices (pure arithmetic on committed constants). What varies (every time, every rank) is read from the timed runs
and shown only in figures and tables labelled as CPU measurements.
"""
from __future__ import annotations

import contextlib
import statistics
import torch

from course_utils import tp_check
from course_utils.plots import CPU_NOTE
from course_utils.tables import Table
from workers.parallel.collective_matmul import (ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, overlapped, ring_all_gather,
                                                ring_reduce_scatter)

MODES = ("blocking", "decomposed", "serialized")  # the worker's MODES
# float64 on the ranks against float64 in one process, the same float32 weights and inputs: only the order of the sums
# differs. tests/test_collective_matmul.py measured at most 2.7e-15 on values of size ~10; a lost block misses by ~1.
FLOAT64_ATOL = 1e-12
# The four rings of one step, in the order they run: (op, pass) -> what a learner calls it
RINGS = {
    (ALL_GATHER_MATMUL, "forward"): "fc1 forward: all-gather x, multiply",
    (MATMUL_REDUCE_SCATTER, "forward"): "fc2 forward: multiply, reduce-scatter",
    (MATMUL_REDUCE_SCATTER, "backward"): "fc2 backward: all-gather dY, multiply",
    (ALL_GATHER_MATMUL, "backward"): "fc1 backward: multiply, reduce-scatter dX",
}
RING_COLOURS = dict(zip(RINGS, ("C0", "C1", "C2", "C4")))
WAIT_COLOUR = "0.6"


def _tensors(record: dict) -> dict:
    return {"output": record["output"]["value"], "grad_input": record["grad_input"]["value"],
            **{f"grads.{name}": g["value"] for name, g in record["grads"].items()}}


def _worst(errors) -> float:
    """The largest error, NaN if any is NaN (Python's ``max`` would skip a NaN that is not first)."""
    errors = list(errors)
    return float(torch.tensor(errors, dtype=torch.float64).max()) if errors else 0.0


def mode_records(res, mode: str) -> list[dict]:
    """Every rank's record of one mode, in the form ``tp_check.compare`` reads."""
    return [{**r[mode], "tp_group_ranks": r["tp_group_ranks"]} for r in res.ranks]


def equality(res) -> dict:
    """Per mode: the largest error against the dense MLP (float64, every tensor, every TP group) and, for the two
    rings, against the blocking collectives rank by rank; each with its verdict at ``FLOAT64_ATOL``."""
    cfg = tp_check.config_of(res[0]["config"])
    seq, batch = res[0]["seq"], res[0]["batch"]
    out = {}
    for mode in MODES:
        report = tp_check.compare(mode_records(res, mode), "mlp", cfg, seq=seq, batch=batch)
        dense = _worst(report.errors.values())
        # report.failed as well: its errors keep the larger of two groups' with Python's max, which skips a NaN
        row = {"tensors": len(report.errors), "dense_error": dense,
               "equals_dense": not report.problems and not report.failed and dense <= FLOAT64_ATOL}
        if mode != "blocking":
            errors = [(got - _tensors(r["blocking"])[name]).abs().max().item()
                      for r in res.ranks for name, got in _tensors(r[mode]).items()]
            row["blocking_error"] = _worst(errors)
            row["equals_blocking"] = row["blocking_error"] <= FLOAT64_ATOL
        out[mode] = row
    return out


def equality_lines(res) -> list[str]:
    """The verdicts, without the error sizes (which depend on the CPU's rounding)."""
    r0 = res[0]
    groups = len(res.ranks) // r0["tp"]
    rows = equality(res)
    lines = [f"tp {r0['tp']} ({groups} group{'s' if groups > 1 else ''} of {r0['tp']} ranks), {r0['dtype']}, "
             f"output, input gradient and {rows['blocking']['tensors'] - 2} parameter gradients:"]
    for mode, row in rows.items():
        line = f"  {mode:<11} equals the dense MLP within {FLOAT64_ATOL:g}: {row['equals_dense']}"
        if "equals_blocking" in row:
            line += f"; equals blocking on every rank: {row['equals_blocking']}"
        lines.append(line)
    return lines


# -- the ring's structure: counts and bytes, exact ---------------------------------------------------------------

def ring_rows(record: dict) -> list[dict]:
    """One rank's four rings in the decomposed mode: chunks multiplied, transfers and their bytes, next to what a
    ring all-gather or reduce-scatter of the ``[s, b, h]`` activation sends per rank, (t-1)/t of it."""
    tp, seq, batch = record["tp"], record["seq"], record["batch"]
    hidden = record["config"]["hidden"]
    element = torch.empty((), dtype=getattr(torch, record["dtype"])).element_size()
    collective = (tp - 1) * seq * batch * hidden * element // tp
    rows = []
    for (op, pass_), name in RINGS.items():
        events = [e for e in record["decomposed"]["timeline"] if e["op"] == op and e["pass"] == pass_]
        waits = [e for e in events if e["kind"] == "wait"]
        sizes = sorted({w["bytes"] for w in waits})
        rows.append({"ring": name, "chunks": sum(e["kind"] == "compute" for e in events), "transfers": len(waits),
                     "bytes each": ", ".join(f"{b:,}" for b in sizes) or "-", "sent": sum(w["bytes"] for w in waits),
                     "collective": collective})
    return rows


def ring_table(res, rank: int = 0) -> Table:
    """``ring_rows`` as the chapter prints it, with whether each ring sends exactly the collective's bytes."""
    record = res[rank]
    element = torch.empty((), dtype=getattr(torch, record["dtype"])).element_size()
    return Table.of([{**r, "sent": f"{r['sent']:,}", "collective": f"{r['collective']:,}",
                      "same": r["sent"] == r["collective"]} for r in ring_rows(record)],
                    ["ring", "chunks", "transfers", "bytes each", "sent", "collective", "same"],
                    caption=f"tp {record['tp']}, rank {rank}, s={record['seq']}, b={record['batch']}, "
                            f"h={record['config']['hidden']}, {record['dtype']}: bytes each ring sends per rank "
                            f"('sent') and what a ring collective of the [s, b, h] activation sends, "
                            f"(t-1)/t x s*b*h*{element} ('collective')")


# -- the chunk order: the module's own rings, driven without communication ----------------------------------------

class _Recorder:
    """A ring that moves nothing: ``ring_all_gather`` and ``ring_reduce_scatter`` driven with it record which block
    each of their steps computes, from the very loops the ranks run."""

    def __init__(self, rank: int, tp: int):
        self.size, self.rank, self.blocks = tp, rank, []

    def exchange(self, send, step):
        return send

    def finish(self, transfer):
        return torch.zeros(1)

    def compute(self, step, chunk):
        self.blocks.append(chunk)
        return contextlib.nullcontext()


def ring_order(rank: int, tp: int) -> tuple[list[int], list[int]]:
    """``(gather, scatter)``: the shard rank ``rank`` multiplies at each step of the all-gather ring (whose rows it
    came from), and the block whose partial sum it computes at each step of the reduce-scatter ring (and sends on,
    at every step but the last, where the block is complete and its own)."""
    gather, scatter = _Recorder(rank, tp), _Recorder(rank, tp)
    ring_all_gather(torch.zeros(1), lambda block, src: None, gather)
    ring_reduce_scatter(lambda dst: torch.zeros(1), scatter)
    return gather.blocks, scatter.blocks


# -- timed runs: wall time and exposed waits per mode (CPU) -------------------------------------------------------

def exposed_wait_s(events: list[dict]) -> float:
    """Seconds this rank spent blocked on communication in one step: the sum of its waits."""
    return sum(e["end"] - e["start"] for e in events if e["kind"] == "wait")


def _recorded_steps(res):
    """Every step of a timed run that has a timeline, as ``{mode: events}`` per rank: the worker's first step of each
    mode (``r[mode]["timeline"]``) and the round after the timed steps (``timed_timelines``). Two per rank and run:
    one step's waits swing with the load on the shared cores, so every statistic pools them."""
    for r in res.ranks:
        yield {mode: r[mode]["timeline"] for mode in MODES}
        yield r["timed_timelines"]


def timing_summary(runs) -> dict:
    """Per mode, over every run and rank: step seconds (every timed step), each step over the blocking step of the same
    round, exposed wait seconds (every recorded step), and the counts of waits and of chunks multiplied while a transfer was in flight (rank 0, first run: the
    same in every step)."""
    out = {}
    for mode in MODES:
        first = runs[0][0]["timed_timelines"][mode]
        # each timed round runs the three modes back to back: a ratio within a round cancels the load of that moment
        paired = [s / b for res in runs for r in res.ranks
                  for s, b in zip(r["step_seconds"][mode], r["step_seconds"]["blocking"])]
        out[mode] = {"step_s": [s for res in runs for r in res.ranks for s in r["step_seconds"][mode]],
                     "vs_blocking": paired,
                     "wait_s": [exposed_wait_s(step[mode]) for res in runs for step in _recorded_steps(res)],
                     "waits": sum(e["kind"] == "wait" for e in first), "overlapped": len(overlapped(first))}
    return out


def chunks_under_transfer(runs) -> dict:
    """Seconds of each chunk the decomposed step multiplied while a transfer was in flight, next to the same chunk
    (same ring, same step) of the serialized step recorded alongside, where no transfer runs during a matmul:
    medians over every recorded step. On CPU ranks the transfer is a copy made by the same cores, which the chunks
    under it share."""
    under, alone = [], []
    for res in runs:
        for step in _recorded_steps(res):
            serialized = {(e["op"], e["pass"], e["step"]): e for e in step["serialized"] if e["kind"] == "compute"}
            for e in overlapped(step["decomposed"]):
                twin = serialized.get((e["op"], e["pass"], e["step"]))
                if twin is not None:
                    under.append(e["end"] - e["start"])
                    alone.append(twin["end"] - twin["start"])
    return {"chunks": len(under), "under_s": statistics.median(under) if under else float("nan"),
            "alone_s": statistics.median(alone) if alone else float("nan")}


def chunks_line(runs) -> str:
    c = chunks_under_transfer(runs)
    return (f"{c['chunks']} chunks multiplied during a transfer (decomposed): median {c['under_s'] * 1e3:.1f} ms; the "
            f"same chunks in the serialized step, no transfer running: median {c['alone_s'] * 1e3:.1f} ms (CPU)")


def typical_run(runs):
    """The run whose decomposed exposed wait (median over its recorded steps) is the median of the runs': the one
    to draw."""
    waits = [statistics.median(exposed_wait_s(step["decomposed"]) for step in _recorded_steps(res)) for res in runs]
    order = sorted(range(len(runs)), key=waits.__getitem__)
    return runs[order[(len(runs) - 1) // 2]]


def timing_table(runs) -> Table:
    summary = timing_summary(runs)
    r0 = runs[0][0]
    rows = []
    for mode, s in summary.items():
        steps = sorted(s["step_s"])
        rows.append({"mode": mode, "step ms": statistics.median(steps) * 1e3,
                     "range ms": f"{steps[0] * 1e3:.0f}-{steps[-1] * 1e3:.0f}",
                     "vs blocking": statistics.median(s["vs_blocking"]),
                     "exposed wait ms": statistics.median(s["wait_s"]) * 1e3, "waits": s["waits"],
                     "overlapped chunks": s["overlapped"]})
    caption = (f"tp {r0['tp']}, s={r0['seq']}, b={r0['batch']}, h={r0['config']['hidden']}, {r0['dtype']}, "
               f"{len(runs)} runs x {len(runs[0].ranks)} ranks: {len(summary['blocking']['step_s'])} timed steps per "
               f"mode, waits from {len(summary['blocking']['wait_s'])} recorded steps ({r0['timing_device']}; "
               f"{CPU_NOTE}).\nstep ms, exposed wait ms: medians; vs blocking: the median over rounds of each step over "
               f"the blocking step of the same round")
    return Table.of(rows, formats={"step ms": "{:.1f}", "exposed wait ms": "{:.1f}", "vs blocking": "{:.2f}"},
                    caption=caption)


# -- the figure -----------------------------------------------------------------------------------------------------

def timeline_figure(timelines: list[dict], title: str = "", modes=MODES, step_s: dict | None = None):
    """One step per rank for each mode: ``timelines[rank][mode]`` = that rank's events (from one barrier).

    Compute chunks are boxes coloured by ring (the block's source rank written inside when it fits); waits are grey
    hatched boxes; each transfer's flight (posted to received) is a line in its ring's colour above its row; a chunk multiplied while
    a transfer of its ring was in flight has a black edge. ``step_s[mode]``: a wall time per step to put in the panel's
    title (CPU)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    ranks = len(timelines)
    fig, axes = plt.subplots(len(modes), 1, figsize=(9.0, 0.55 + len(modes) * (0.45 + 0.42 * ranks)), sharex=True,
                             squeeze=False)
    span = max((e["end"] for line in timelines for mode in modes for e in line[mode]), default=1e-3) * 1e3
    for ax, mode in zip(axes[:, 0], modes):
        for rank, line in enumerate(timelines):
            events = line[mode]
            under = {id(e) for e in overlapped(events)}
            y = ranks - 1 - rank
            for e in events:
                start, width = e["start"] * 1e3, (e["end"] - e["start"]) * 1e3
                key = (e["op"], e["pass"])
                if e["kind"] == "compute":
                    ax.barh(y, width, left=start, height=0.6, color=RING_COLOURS[key],
                            edgecolor="black" if id(e) in under else "none", linewidth=1.6 if id(e) in under else 0)
                    if e["chunk"] >= 0 and width > 0.035 * span:
                        ax.text(start + width / 2, y, str(e["chunk"]), ha="center", va="center", fontsize=8,
                                color="white")
                else:
                    ax.barh(y, width, left=start, height=0.6, color=WAIT_COLOUR, hatch="///", edgecolor="0.3",
                            linewidth=0.5)
                    if e["bytes"] is not None:  # a ring's transfer: its flight from posted to received
                        ax.plot([e["posted"] * 1e3, e["end"] * 1e3], [y + 0.42, y + 0.42], color=RING_COLOURS[key],
                                linewidth=2.0, solid_capstyle="butt")
        ax.set_yticks(range(ranks), [f"rank {ranks - 1 - y}" for y in range(ranks)], fontsize=8)
        ax.set_ylim(-0.6, ranks - 0.2)
        ax.grid(axis="y", visible=False)
        waits = statistics.median(exposed_wait_s(line[mode]) for line in timelines) * 1e3
        label = f"{mode}: waits {waits:.1f} ms (median over ranks)"
        if step_s and mode in step_s:
            label += f", step {step_s[mode] * 1e3:.1f} ms"
        if mode == "blocking":
            label += "; its backward matmuls run in the unmarked gaps"
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_xlim(0, span * 1.01)
    axes[-1, 0].set_xlabel("ms since the step's barrier (" + CPU_NOTE + ")", fontsize=9)
    handles = [Patch(color=c, label=RINGS[k]) for k, c in RING_COLOURS.items()]
    handles += [Patch(facecolor=WAIT_COLOUR, hatch="///", edgecolor="0.3", label="waiting for a transfer"),
                Line2D([], [], color="0.2", linewidth=2.0, label="a transfer in flight, in its ring's colour"),
                Patch(facecolor="white", edgecolor="black", linewidth=1.6, label="chunk multiplied during a transfer")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.12 + 0.02 * (3 - len(modes)), 1, 1))
    return fig


def run_timelines(res, timed: bool = True) -> list[dict]:
    """``timelines[rank][mode]`` of one run: the float32 timed run's untimed round, or the float64 step's."""
    key = "timed_timelines"
    return [r[key] if timed else {m: r[m]["timeline"] for m in MODES} for r in res.ranks]


def live_figure(res, params: dict):
    """The widget's answer: the timelines of this run with each mode's median step time in its panel."""
    step = {m: statistics.median(s for r in res.ranks for s in r["step_seconds"][m]) for m in MODES}
    r0 = res[0]
    title = f"tp {r0['tp']}, s={r0['seq']}, b={r0['batch']}, h={r0['config']['hidden']}, {r0['dtype']} (CPU)"
    return timeline_figure(run_timelines(res), title, step_s=step)


# -- the planner: what overlap is worth on a GPU ----------------------------------------------------------------------

def planner_rows(model_key: str = "llama-3-70b", tp: int = 8, seq: int = 8192, cluster: str = "h100-ib") -> list[dict]:
    """One layer of a published model's shape, TP ``tp`` + SP inside one node, one micro-batch of ``seq`` tokens: the
    planner's TP time per layer (forward + backward) and the layer's GEMM time, without and with ``tp_overlap``, and
    the TP term of a whole step (every layer, one micro-batch)."""
    from course_utils.hardware import CLUSTERS
    from course_utils.model_shapes import MODEL_SHAPES
    from course_utils.planner import Layout, resolve_layout
    from course_utils.step_time import Practice, layer_seconds, step_time

    model, cl = MODEL_SHAPES[model_key], CLUSTERS[cluster]
    layout = resolve_layout(model, Layout(tp=tp, dp=1, micro_batches=1, seq=seq, sequence_parallel=True), tp)
    rows = []
    for overlap in (False, True):
        practice = Practice(tp_overlap=overlap)
        layer = layer_seconds(model, layout, cl, practice)
        step = step_time(model, layout, tp, cl, practice)
        rows.append({"practice": f"Practice(tp_overlap={overlap})",
                     "TP fwd ms": layer["forward"]["tp"] * 1e3, "TP bwd ms": layer["backward"]["tp"] * 1e3,
                     "GEMMs fwd+bwd ms": (layer["forward"]["matmul"] + layer["backward"]["matmul"]) * 1e3,
                     "step's TP term ms": step.terms["tp"] * 1e3, "step ms": step.total * 1e3})
    return rows


def planner_table(model_key: str = "llama-3-70b", tp: int = 8, seq: int = 8192, cluster: str = "h100-ib") -> Table:
    from course_utils.hardware import CLUSTERS
    from course_utils.model_shapes import MODEL_SHAPES

    model = MODEL_SHAPES[model_key]
    rows = planner_rows(model_key, tp, seq, cluster)
    fmt = {k: "{:.3f}" for k in rows[0] if k.endswith("ms") and k.startswith("TP")}
    fmt.update({k: "{:.1f}" for k in rows[0] if k.endswith("ms") and not k.startswith("TP")})
    return Table.of(rows, formats=fmt, caption=f"{model.name}'s layer (h={model.hidden}), TP {tp} + SP, 1 x {seq} tokens,"
                                               f" bf16, {CLUSTERS[cluster].name}: the planner's prices, per layer, "
                                               f"and for the {model.layers}-layer step")
