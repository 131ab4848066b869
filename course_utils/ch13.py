"""Chapter 13, notebook side: check pipeline runs against the single-process reference, measure the bubble
from the ranks' timelines, draw the schedule as a Gantt chart.

Everything here reads a ``RunResult`` of ``workers/ch13_pipeline.py``; the ground truth is
``workers/pipeline/reference.py``; the formulas are the ledger's ``pipeline_bubble_fraction``.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils import timelines
from course_utils.ledger import pipeline_bubble_fraction
from course_utils.plots import CPU_NOTE, log2_axis
from course_utils.tables import Table
from workers.pipeline.model import FP32_TOL, PipelineConfig
from workers.pipeline.reference import reference_step_in
from workers.pipeline.schedules import ideal_bubble
from workers.pipeline.validity import peak_stashes, simulate_split

HATCHES = ("", "//", "xx", "..", "\\\\", "++")  # model chunk 0, 1, 2, ... of a rank (interleaved schedule)


def pipeline_ranks(res, pipeline: int = 0) -> list[dict]:
    """The rank dicts of one pipeline, in stage order."""
    rows = [d for d in res.ranks if d["pipeline"] == pipeline]
    return sorted(rows, key=lambda d: d["stage"])


def merged(res, key: str, pipeline: int = 0) -> dict[str, torch.Tensor]:
    """``grads`` or ``weights`` of all stages of one pipeline, under the whole model's names."""
    out = {}
    for d in pipeline_ranks(res, pipeline):
        out.update(d[key])
    return out


F64_TOL = {"atol": 1e-12, "rtol": 1e-12}  # float64 pipeline vs one process: only the order of the additions differs


def compare_to_reference(res, steps: int = 1, lr: float = 0.1) -> dict:
    """Every parameter's gradient (last step) and weight (after ``steps`` SGD steps), and every step's loss,
    against the single-process reference on the same global batch, in the run's dtype (float32 within 1e-6,
    float64 within 1e-12); every pipeline copy checked. The losses come from the rank holding the last virtual
    stage (the last stage, or stage 0 when the chunks sit in a V)."""
    first = res[0]
    cfg = PipelineConfig(**first["config"])
    dtype = first.get("dtype", "float32")
    ref = reference_step_in(cfg, getattr(torch, dtype), steps=steps, lr=lr)
    tol = F64_TOL if dtype == "float64" else FP32_TOL
    n_pipes = len(res.ranks) // first["pp"]
    report = {"grad_max_abs": 0.0, "weight_max_abs": 0.0, "loss_max_abs": 0.0, "within_tol": True,
              "parameters": len(ref["grads"]), "dtype": dtype, "tolerance": tol["atol"]}
    for pipe in range(n_pipes):
        for key, what in (("grads", "grad_max_abs"), ("weights", "weight_max_abs")):
            got = merged(res, key, pipe)
            if sorted(got) != sorted(ref[key]):  # a missing parameter is a failure, not a smaller error
                report["within_tol"] = False
                continue
            for name, want in ref[key].items():
                report[what] = max(report[what], (got[name] - want).abs().max().item())
                report["within_tol"] &= torch.allclose(got[name].double(), want.double(), **tol)
        rows = pipeline_ranks(res, pipe)
        losses = rows[first.get("loss_stage", len(rows) - 1)]["losses"]
        report["loss_max_abs"] = max(report["loss_max_abs"], float(np.max(np.abs(np.subtract(losses, ref["losses"])))))
    report["within_tol"] &= report["loss_max_abs"] < tol["atol"]
    report["reference_losses"] = ref["losses"]
    return report


def idle_fractions(res, pipeline: int = 0) -> list[float]:
    """Per stage: 1 - (time inside F and B boxes) / (first start to last end over the whole pipeline).

    This is idle / total, the quantity (p-1)/(m+p-1) predicts (the ledger's ``denominator="total"``).
    """
    return timelines.idle_fractions([d["timeline"] for d in pipeline_ranks(res, pipeline)])


def measured_bubble(res, pipeline: int = 0) -> float:
    """The pipeline's idle / total, averaged over its stages (all stages idle the same time in theory)."""
    return float(np.mean(idle_fractions(res, pipeline)))


def bubble_formulas(p: int, m: int) -> dict:
    """Both conventions of Narayanan et al. 2021 section 2.2.1, from the ledger: idle/total and bubble/ideal."""
    return {"idle/total (p-1)/(m+p-1)": pipeline_bubble_fraction(p, m, denominator="total"),
            "bubble/ideal (p-1)/m": pipeline_bubble_fraction(p, m, denominator="ideal")}


def formula_bubble(res, pipeline: int = 0) -> float:
    """What the ledger predicts for this run, idle / total: (p-1)/(v m + p-1)."""
    rows = pipeline_ranks(res, pipeline)
    return pipeline_bubble_fraction(len(rows), rows[0]["config"]["micro_batches"], rows[0].get("virtual_stages", 1),
                                    denominator="total")


def simulated_bubble(res, message_ms: float, pipeline: int = 0) -> float:
    """The ranks' own action lists replayed in ideal time with their padded action times and a latency of
    ``message_ms`` per message (``schedules.simulate``)."""
    rows = pipeline_ranks(res, pipeline)
    schedules = [[tuple(a) for a in d["actions"]] for d in rows]
    return ideal_bubble(schedules, rows[0]["forward_ms"], rows[0]["backward_ms"], message_time=message_ms)


def fit_message_time(runs: list, grid_ms=np.arange(0.0, 10.0001, 0.05)) -> dict:
    """The one per-message latency (ms) that best explains the measured bubbles of ``runs`` (least squares
    over a grid), with each run's measured, simulated-at-that-latency and formula bubble. A fit, not a
    measurement of latency: it says how much per message the gap between formula and timeline amounts to."""
    measured = np.array([measured_bubble(r) for r in runs])
    errors = [float(np.sum((np.array([simulated_bubble(r, a) for r in runs]) - measured) ** 2)) for a in grid_ms]
    best = float(grid_ms[int(np.argmin(errors))])
    return {"message_ms": best, "measured": measured.tolist(),
            "simulated": [simulated_bubble(r, best) for r in runs], "formula": [formula_bubble(r) for r in runs]}


def gantt_figure(res, title: str = "", pipeline: int = 0, ax=None):
    """One row per stage; F boxes (light) and B boxes (dark) coloured by micro-batch, hatched by model chunk
    (interleaved schedule, and chunk 1 of a V); a schedule that splits the backward draws its W boxes (the weight
    gradient) half as tall; white is idle."""
    rows = pipeline_ranks(res, pipeline)
    m, v = rows[0]["config"]["micro_batches"], rows[0].get("virtual_stages", 1)
    cmap = plt.get_cmap("tab10" if m <= 10 else "tab20")
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.4))
    span = max(e["end"] for d in rows for e in d["timeline"]) - min(e["start"] for d in rows for e in d["timeline"])
    for d in rows:
        y = d["stage"]
        for e in d["timeline"]:
            colour = cmap(e["micro"] % cmap.N)
            light = e["kind"] == "F"
            hatch = HATCHES[e.get("chunk", 0) % len(HATCHES)]
            weight = e["kind"] == "W"  # a weight gradient: nobody waits for it, so a schedule moves it into gaps
            bars = ax.barh(y + (0.2 if weight else 0.0), (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3,
                           height=0.4 if weight else 0.8, color=colour, alpha=0.45 if light else 1.0,
                           edgecolor="k", lw=0.4, hatch=hatch)
            if hatch:  # thin grey hatching: it marks the chunk without drowning the box's label
                for bar in bars:
                    bar.set_hatchcolor("0.3"), bar.set_hatch_linewidth(0.6)
            if (e["end"] - e["start"]) > 0.025 * span:  # label only boxes wide enough to hold it
                ax.text((e["start"] + e["end"]) / 2 * 1e3, y + (0.2 if weight else 0.0), f"{e['kind']}{e['micro']}",
                        ha="center", va="center",
                        fontsize=7, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 0.8}
                        if hatch else None)
    ax.set_yticks([d["stage"] for d in rows], [f"stage {d['stage']}\n(rank {i + pipeline * len(rows)})"
                                               for i, d in enumerate(rows)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time since the barrier (ms); {CPU_NOTE}")
    idle = idle_fractions(res, pipeline)
    chunks = f", v={v} (chunk 1+ hatched)" if v > 1 else ""
    split = any(e["kind"] == "W" for d in rows for e in d["timeline"])
    ideal = (f"free messages {replayed(res, pipeline)['step_idle']:.0%}" if split
             else f"formula {formula_bubble(res, pipeline):.0%}")
    ax.set_title(title or f"{rows[0]['schedule']}, p={len(rows)}, m={m}{chunks}: measured idle {np.mean(idle):.0%} "
                          f"({ideal}); F light, B dark{', W half height' if split else ''}, white = idle",
                 fontsize=9)
    ax.grid(axis="y", visible=False)
    return fig if fig is not None else ax.figure


def padded_times(row: dict) -> tuple[float, float, float]:
    """A run's padded F, B and W times per micro-batch through a rank's share (ms): without a split backward B is
    the whole of it and W is 0 (``workers/ch13_pipeline.py``: B is padded to (1 - w_share), W to w_share of it)."""
    split = any(a[0] == "W" for a in row["actions"])
    w = row.get("w_share", 0.5) if split else 0.0
    return row["forward_ms"], row["backward_ms"] * (1 - w), row["backward_ms"] * w


def replay(table, forward: float = 1.0, backward: float = 1.0, weight: float = 1.0, message: float = 0.0,
           placement: str = "loop") -> dict:
    """A schedule table replayed in ideal time (``validity.simulate_split``): ``step_idle``, idle / total over the step
    averaged over the ranks, as the Gantt chart measures it (every rank waits for the last before the optimizer
    step), ``span_idle``, the largest idle of a rank between its own first and last action over the step, the bubble
    the zero-bubble paper counts (a rank that starts the next step as soon as it is free), and ``makespan``."""
    sim = simulate_split(table, forward, backward, weight, message_time=message, placement=placement)
    busy = [sum(e["end"] - e["start"] for e in line) for line in sim["timeline"]]
    return {"step_idle": float(np.mean([1 - x / sim["makespan"] for x in busy])),
            "span_idle": max(sim["span_idle"]) / sim["makespan"], "makespan": sim["makespan"]}


def replayed(res, pipeline: int = 0, message_ms: float = 0.0) -> dict:
    """``replay`` of the ranks' own action tables at their padded F, B and W times, ``message_ms`` per message."""
    rows = pipeline_ranks(res, pipeline)
    table = [[tuple(a) for a in d["actions"]] for d in rows]
    return replay(table, *padded_times(rows[0]), message_ms, rows[0].get("placement", "loop"))


def zero_bubble_table(runs: dict) -> Table:
    """``runs[name]`` = a timed run of each schedule: the measured idle share against the replay with free messages,
    the paper's own-span count, the step, and what each rank holds (activations from F to B, and from B to W)."""
    out = []
    for name, res in runs.items():
        rows = pipeline_ranks(res)
        ideal = replayed(res)
        step = np.median([max(d["step_s"][-1] for d in rows)]) * 1e3
        out.append([name, f"{measured_bubble(res):.3f}", f"{ideal['step_idle']:.3f}", f"{ideal['span_idle']:.3f}",
                    f"{step:.0f}", " ".join(str(d["peak_stash"]) for d in rows),
                    " ".join(str(d.get("peak_weight_stash", 0)) for d in rows)])
    return Table(["schedule", "idle/total measured", "free messages", "paper's count", "step ms",
                  "F->B held per stage", "B->W held per stage"], out,
                 caption=f"timed runs at T_F = T_B = T_W (padded); {CPU_NOTE}; held: micro-batch chunks (a V's chunk is half a stage)")


def zero_bubble_figure(runs: dict):
    """Per schedule: idle / total measured on the ranks against the same tables replayed with free messages, and
    the most micro-batch-chunks each stage holds between F and its W."""
    names = list(runs)
    measured = [measured_bubble(runs[n]) for n in names]
    ideal = [replayed(runs[n])["step_idle"] for n in names]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    x = np.arange(len(names))
    ax.bar(x - 0.2, measured, 0.4, label="measured on the ranks", color="C0")
    ax.bar(x + 0.2, ideal, 0.4, label="the same tables, free messages", color="C1")
    ax.set_xticks(x, names)
    ax.set_ylabel("idle / total of the step")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(measured + ideal) * 1.35)
    ax.set_title(f"Bubble by schedule ({CPU_NOTE})", fontsize=9)
    for j, n in enumerate(names):
        # from each rank's own list: micro-batches whose F ran and whose backward (B and W) is not done, at most;
        # a chunk is 1/v of the rank's layers, so v of them are one micro-batch's worth
        held = [peak_stashes(d["actions"])["held"] / d.get("virtual_stages", 1) for d in pipeline_ranks(runs[n])]
        bx.plot(range(len(held)), held, "o-", label=n)
    bx.set_xlabel("stage")
    bx.set_xticks(range(len(held)))
    bx.set_ylabel("micro-batches' worth held, at most")
    bx.set_title("Memory: what each stage holds at most", fontsize=9)
    bx.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


# Exercise 4's table: ZB-H1 for p = 4, m = 6, with two actions out of place (the check in course_utils/catalogue)
FIX_STAGES, FIX_MICRO_BATCHES = 4, 6


def broken_schedule() -> list[list[tuple]]:
    """Exercise 4's table: ZB-H1 for p = 4 stages and m = 6 micro-batches as written by hand, with two actions out of
    place (the W's after each rank's last B run newest first, which costs nothing)."""
    from workers.pipeline.zero_bubble import zb_h1_schedule

    table = []
    for stage in range(FIX_STAGES):
        row = zb_h1_schedule(FIX_STAGES, FIX_MICRO_BATCHES, stage)
        last_b = max(n for n, a in enumerate(row) if a[0] == "B")
        table.append(row[:last_b + 1] + row[last_b + 1:][::-1])
    for rank, action, before in ((2, ("W", 1), ("B", 1)), (1, ("B", 2), ("F", 3))):
        table[rank].remove(action)
        table[rank].insert(table[rank].index(before), action)
    return table


def bubble_figure(sweep: dict, p: int):
    """``sweep[schedule] = [(m, measured idle/total)]``: points on the two formula curves."""
    fig, ax = plt.subplots()
    ms = sorted({m for rows in sweep.values() for m, _ in rows})
    grid = np.arange(1, max(ms) + 1)
    ax.plot(grid, [pipeline_bubble_fraction(p, int(m), denominator="total") for m in grid], "k-",
            label="(p-1)/(m+p-1): idle / total")
    ax.plot(grid, [min(pipeline_bubble_fraction(p, int(m)), 1.2) for m in grid], "k:",
            label="(p-1)/m: bubble / ideal time (clipped)")
    for (name, rows), marker in zip(sweep.items(), ("o", "s", "^")):
        ax.plot([m for m, _ in rows], [v for _, v in rows], marker, ms=7, label=f"{name}, measured")
    log2_axis(ax, ms, "micro-batches m")
    ax.set_ylabel("bubble fraction")
    ax.set_title(f"Pipeline bubble at p={p}: {CPU_NOTE}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def side_by_side(rank: dict) -> str:
    """A ``workers/ch13_native.py`` rank's view of PyTorch's table against the course's, rank by rank: PyTorch's own
    spelling (``3I0``: virtual stage 3, input gradient of micro-batch 0; ``-`` an idle slot), the same actions as the
    course's tuples (``B0.1``: micro-batch 0 through the rank's chunk 1), and the course's table."""
    def label(a):
        return f"{a[0]}{a[1]}" + (f".{a[2]}" if len(a) > 2 else "")
    lines = []
    for r, (raw, mine, ours) in enumerate(zip(rank["torch_table"], rank["table"], rank["course_table"])):
        lines += [f"rank {r} PyTorch: " + " ".join("-" if a is None else a for a in raw),
                  f"rank {r} as ours: " + " ".join(label(a) for a in mine),
                  f"rank {r} course : " + " ".join(label(a) for a in ours)]
    return "\n".join(lines)


def schedule_text(actions_per_stage: list[list]) -> str:
    """The per-stage action lists as lines: ``stage 0: F0 F1 F2 B0 ...``; with chunks ``F0c1`` is micro-batch 0
    through the rank's chunk 1."""
    def label(a):
        return f"{a[0]}{a[1]}" + (f"c{a[2]}" if len(a) > 2 else "")
    return "\n".join(f"stage {s}: " + " ".join(label(a) for a in acts) for s, acts in enumerate(actions_per_stage))


def chunks_crossover(p: int, m: int, v_low: int, v_high: int, forward: float = 1.0, backward: float = 2.0,
                     step: float = 0.005) -> float:
    """The smallest per-message latency (in units of ``forward``, a stage's forward) at which ``v_high``
    chunks per rank idle more than ``v_low``: where more interleaving stops paying (replayed schedules)."""
    from workers.pipeline.schedules import all_stages

    def bubble(v, a):
        return ideal_bubble(all_stages("1f1b" if v == 1 else "interleaved", p, m, v), forward, backward,
                            message_time=a * forward)

    a = 0.0
    while bubble(v_high, a) <= bubble(v_low, a):
        a += step
        if a > 10:
            raise ValueError(f"v={v_high} idles no more than v={v_low} for any latency up to 10 forwards")
    return round(a, 6)


def interleave_figure(runs: dict, message_ms: float, p: int, m: int, forward_ms: float, backward_ms: float):
    """``runs[v]`` = a timed run with v chunks per rank (v = 1: plain 1F1B). Measured idle / total against the
    formula (p-1)/(v m + p-1) and against the schedules replayed with ``message_ms`` per message."""
    from workers.pipeline.schedules import all_stages

    fig, ax = plt.subplots()
    grid = [v for v in range(1, 9) if m % p == 0 or v == 1]
    ax.plot(grid, [pipeline_bubble_fraction(p, m, v, denominator="total") for v in grid], "k-",
            label="(p-1)/(v m + p-1): free messages")
    sim = [ideal_bubble(all_stages("1f1b" if v == 1 else "interleaved", p, m, v), forward_ms, backward_ms,
                        message_time=message_ms) for v in grid]
    ax.plot(grid, sim, "C1--", label=f"schedules replayed, {message_ms:g} ms per message (fitted)")
    ax.plot(sorted(runs), [measured_bubble(runs[v]) for v in sorted(runs)], "o", ms=8, color="C0",
            label="measured on the ranks")
    ax.set_xlabel("model chunks per rank v")
    ax.set_ylabel("idle / total")
    ax.set_title(f"Interleaved 1F1B at p={p}, m={m}: {CPU_NOTE}", fontsize=9)
    ax.legend(fontsize=8)
    return fig
