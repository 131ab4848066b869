"""Chapter 16's notebook glue: the expert-parallel layer against one process, the faults, split sizes and bytes,
the imbalance, the MoE GPT's training figures, and the explorer widget.

The rank side is ``workers/moe/`` (``layer.py``: the layer and the reference; ``equivalence.py``: the check) and
the workers ``workers/ch16_moe.py`` (one layer, forward and backward) and ``workers/ch16_moe_train.py`` (chapter
09's GPT with an MoE FFN). Everything printed in a checked cell is exact (counts, bytes, verdicts); timings and
float errors go to cells nbval does not compare.
"""
from __future__ import annotations

import statistics

import course_utils as cu
from course_utils.planner import all_to_all_bytes
from course_utils.plots import CPU_NOTE
from course_utils.tables import Table
from course_utils.widgets import LiveRun
from workers.moe.batch import SWEEP
from workers.moe.config import MoEConfig
from workers.moe.equivalence import TOLERANCE, compare, reference
from workers.moe.faults import FAULTS

WORKER, TRAIN = "workers.ch16_moe", "workers.ch16_moe_train"
LAYOUTS = ((1, 1), (2, 2), (4, 4), (4, 2))  # (world, ep): EP 1, 2, 4, and EP 2 x expert-DP 2
FAULT_LAYOUT = (4, 2)
FAULT_CASE = {"experts": 8, "top_k": 2, "capacity_factor": 1.0}
# chapter 09's tiny GPT with an MoE FFN: what the training figures and the widget run
TRAIN_STEPS, TRAIN_WORLD, AUX = 150, 2, 0.01
WIDGET_STEPS = 40


def layout_name(world: int, ep: int) -> str:
    return f"EP {ep}" + (f" x DP {world // ep}" if world > ep else "") + f" ({world} rank{'s' if world > 1 else ''})"


def _cases(res, i: int) -> list[dict]:
    return [res[r]["cases"][i] for r in range(len(res.ranks))]


def max_errors(cases: list[dict], ref: dict) -> tuple[float, float]:
    """(largest |output - reference|, largest |gradient - reference| over every parameter, the input included)."""
    import torch

    y = torch.cat([c["y"] for c in cases])
    out = float((y - ref["y"]).abs().max())
    # torch's max, not Python's: a NaN anywhere is the error (max(1.0, nan) is 1.0)
    errors = [(torch.cat([c["input_grad"] for c in cases]) - ref["input_grad"]).abs().max()]
    errors += [(g - ref["grads"][name]).abs().max() for c in cases for name, g in c["grads"].items()]
    return out, float(torch.stack(errors).max())


def equivalence_rows(res, world: int, ep: int) -> list[dict]:
    """One row per case of a sweep run: the case, what it dropped, and whether it equals one process."""
    rows = []
    for i in range(len(SWEEP)):
        cases = _cases(res, i)
        cfg = MoEConfig(**cases[0]["config"])
        ref = reference(cfg, res[0])
        found = compare(cases, ref, world, ep)
        out, grad = max_errors(cases, ref)
        rows.append({"layout": layout_name(world, ep), "experts": cfg.experts, "top-k": cfg.top_k,
                     "capacity": cfg.capacity_factor or "dropless", "shared": cfg.shared_experts,
                     "dropped": sum(c["dropped"] for c in cases), "choices": sum(c["experts"].numel() for c in cases),
                     "output err": out, "grad err": grad,
                     "equal": "yes" if not found else "NO: " + found[0]})
    return rows


def equivalence_table(rows: list[dict], errors: bool = False) -> Table:
    columns = ["layout", "experts", "top-k", "capacity", "shared", "dropped", "choices"]
    columns += ["output err", "grad err"] if errors else ["equal"]
    return Table.of(rows, columns, formats={"output err": "{:.1e}", "grad err": "{:.1e}"},
                    caption=f"float64, tolerance {TOLERANCE:g}" if not errors else "max |difference| (varies by CPU)")


def run_fault(fault: str):
    world, ep = FAULT_LAYOUT
    res = cu.run(WORKER, world, timeout=180, ep=ep, fault=fault, **FAULT_CASE)
    cases = _cases(res, 0)
    return compare(cases, reference(MoEConfig(**cases[0]["config"]), res[0]), world, ep)


def fault_rows() -> list[dict]:
    return [{"fault": d, "caught": "yes" if found else "NO", "what the check says first": found[0] if found else ""}
            for d in FAULTS if d != "none" for found in [run_fault(d)]]


def split_rows(res) -> list[dict]:
    """Per rank of one case: the experts it holds, rows sent to / received from each EP rank, rows per local expert,
    and the bytes its dispatch sent to other ranks and its combine sent back."""
    out = []
    for rank, r in enumerate(res.ranks):
        c = r["cases"][0]
        out.append({"rank": rank, "experts": ",".join(map(str, c["local_experts"])),
                    "tokens": c["rows"][1] - c["rows"][0], "kept": c["kept"],
                    "send splits": c["send_splits"], "recv splits": c["recv_splits"],
                    "rows per expert": c["tokens_per_local_expert"],
                    "bytes out": c["dispatch_bytes"], "bytes back": c["combine_bytes"]})
    return out


SPLIT_FORMATS = {"bytes out": "{:,}", "bytes back": "{:,}"}


def bytes_rows(runs: dict, hidden: int, top_k: int, element_bytes: int) -> list[dict]:
    """Measured dispatch bytes per rank against the model ``tokens h bytes k (n-1)/n`` (planner.all_to_all_bytes),
    both whole numbers of bytes."""
    rows = []
    for label, res in runs.items():
        world, ep = len(res.ranks), res[0]["ep"]
        tokens = res[0]["tokens"] // world
        model = all_to_all_bytes(tokens, hidden, top_k, ep, element_bytes)
        for rank, r in enumerate(res.ranks):
            got = r["cases"][0]["dispatch_bytes"]
            rows.append({"batch": label, "rank": rank, "measured": got, "model": round(model),
                         "measured / model": round(got / model, 3) if model else 1.0})
    return rows


BYTES_FORMATS = {"measured": "{:,}", "model": "{:,}", "measured / model": "{:.3f}"}


# -- imbalance: the busiest rank sets the pace ------------------------------------------------------------------------

# Wide SwiGLU experts on few tokens, so the experts are most of the forward (an expert row costs 6 h ffn flops):
# 2,048 tokens of hidden 128, experts 2,048 wide, float32, on 4 ranks (EP 4); the skew sends ~2.1x an even share
# to the rank holding expert 0. Four forwards and backwards per batch, each started at a barrier; the first is a
# warm-up, the rows give the median of the other three.
IMBALANCE_WORLD = 4
IMBALANCE = {"ep": 4, "experts": 8, "top_k": 2, "tokens": 2048, "hidden": 128, "ffn": 2048, "dtype": "float32",
             "repeats": 4, "report": False}
SKEW = 4.0
TIMINGS = {"dispatch ms": "dispatch_s", "expert ms": "expert_s", "expert CPU ms": "expert_cpu_s",
           "combine wait ms": "combine_s", "forward ms": "forward_s", "step ms": "step_s"}


def imbalance_runs(seed: int = 0) -> dict:
    """The even and the skewed batch through the same layer (``seed``: the weights; ``seed + 1``: the batch)."""
    return {label: cu.run(WORKER, IMBALANCE_WORLD, timeout=300, seed=seed, data_seed=seed + 1, skew=skew,
                          **IMBALANCE) for label, skew in (("even", 0.0), ("skewed", SKEW))}


def imbalance_rows(runs: dict) -> list[dict]:
    """Per batch and rank: the rows its experts computed, and the median over the timed repeats (the first is a
    warm-up) of where its forward went: routing and the dispatch all-to-all, its experts (wall and CPU seconds:
    ``time.process_time``, the rank's own CPU, which another process busy on the same cores does not inflate), the
    wait in the combine's all-to-all, the whole forward and the whole step (forward, backward, gradient
    all-reduce)."""
    rows = []
    for label, res in runs.items():
        for rank, r in enumerate(res.ranks):
            c = r["cases"][0]
            timed = c["timings"][1:] or c["timings"]
            row = {"batch": label, "rank": rank, "experts": ",".join(map(str, c["local_experts"])),
                   "rows computed": sum(c["tokens_per_local_expert"])}
            row.update({name: 1e3 * statistics.median(t[key] for t in timed) for name, key in TIMINGS.items()})
            rows.append(row)
    return rows


def slowest(rows: list[dict], label: str) -> dict:
    """The rank of batch ``label`` that computed the most rows."""
    mine = [r for r in rows if r["batch"] == label]
    return max(mine, key=lambda r: r["rows computed"])


def imbalance_measures(rows: list[dict]) -> dict[str, float]:
    """What the chapter's claim rests on, from one even and one skewed run (``course_utils/cpu_spread.py``'s
    ``ch16_imbalance`` measures their spread):

    - ``busy_share``: the busiest rank's rows over an even share (exact given the routing);
    - ``busy_cpu_over_others``: its experts' CPU seconds over the mean of the other ranks';
    - ``others_wait_over_busy``: the shortest combine wait of the other ranks over the busiest rank's own;
    - ``others_wait_skewed_over_even``: the other ranks' mean combine wait, skewed batch over even batch;
    - ``busiest_cpu_skewed_over_even``: the busiest rank's expert CPU seconds, skewed over even: what the experts'
      part of the step grows by where every rank has a core (a GPU) of its own;
    - ``forward_skewed_over_even`` and ``step_skewed_over_even``: the slowest rank's forward (step), skewed over
      even: how much longer the whole group took. Wall times of two runs, so they depend on the machine's cores
      and load (4 ranks on 2 cores: while 3 ranks wait, the busy one has a core to itself)."""
    even = [r for r in rows if r["batch"] == "even"]
    skewed = [r for r in rows if r["batch"] == "skewed"]
    busy = slowest(rows, "skewed")
    others = [r for r in skewed if r is not busy]
    mean = statistics.fmean
    return {"busy_rank": busy["rank"],
            "busy_share": busy["rows computed"] / (sum(r["rows computed"] for r in skewed) / len(skewed)),
            "busy_cpu_over_others": busy["expert CPU ms"] / mean(r["expert CPU ms"] for r in others),
            "others_wait_over_busy": min(r["combine wait ms"] for r in others) / busy["combine wait ms"],
            "others_wait_skewed_over_even": mean(r["combine wait ms"] for r in others)
            / mean(r["combine wait ms"] for r in even),
            "busiest_cpu_skewed_over_even": busy["expert CPU ms"] / max(r["expert CPU ms"] for r in even),
            "forward_skewed_over_even": max(r["forward ms"] for r in skewed) / max(r["forward ms"] for r in even),
            "step_skewed_over_even": max(r["step ms"] for r in skewed) / max(r["step ms"] for r in even)}


# What the printed verdicts rest on, measured by ``imbalance_measures`` over 18 runs: seeds 0-5 (weights and batch)
# x native (AVX-512), AVX2 and plain (ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE) kernels, on a 2-core machine
# that other jobs loaded to 6-11 runnable processes (2026-12-05; the same 18 with six repeats instead of four: CPU
# 3.11-4.71x, waits 3.71-42.4x). Within one run the ranks share whatever load there is, so comparing them holds;
# comparing two runs' wall times does not (printed, never asserted).
IMBALANCE_SPREAD = {
    "busy_share": (2.14, 2.46),  # exact counts, identical under every kernel for each seed
    "busy_cpu_over_others": (3.24, 4.70),  # bound 1.5: margin 116%
    "others_wait_over_busy": (5.30, 24.5),  # printed, not asserted: 0.51 once with a browser and a test run beside
    "others_wait_skewed_over_even": (0.60, 14.4),  # two runs: not asserted
    "busiest_cpu_skewed_over_even": (1.63, 2.52),  # two runs: not asserted
    "forward_skewed_over_even": (0.62, 1.98),  # two runs' wall times: not asserted
    "step_skewed_over_even": (0.91, 2.11),  # two runs' wall times: not asserted
}
BUSY_CPU_BOUND = 1.5
WAIT_BOUND = 2.0  # what the waits show when the ranks are not fighting for cores (imbalance_waits says it)


def imbalance_verdict(rows: list[dict]) -> str:
    """What holds on every CPU (``IMBALANCE_SPREAD``): the busiest rank's share (exact), and its experts' CPU time
    against the other ranks' (CPU time: a rank's own, which other processes on the cores do not inflate)."""
    m = imbalance_measures(rows)
    busy = slowest(rows, "skewed")
    cpu = m["busy_cpu_over_others"] > BUSY_CPU_BOUND  # not <=: a NaN fails
    return (f"skewed batch: rank {busy['rank']} (experts {busy['experts']}) computes the most rows, "
            f"{m['busy_share']:.1f}x an even share\n"
            f"its experts take over {BUSY_CPU_BOUND:g}x the mean CPU time of the other ranks' experts: "
            f"{'yes' if cpu else 'NO'}")


def imbalance_waits(rows: list[dict]) -> str:
    """The other ranks' combine waits against the busiest rank's, as measured: wall times, printed, never a verdict.
    Over 18 runs on a loaded 2-core machine they were 5.3-25x (``IMBALANCE_SPREAD``); with the cores shared by yet
    more processes (a browser and a second test run beside this one) a run measured 0.5x: when four ranks share two
    cores, who waits is also decided by the scheduler."""
    m = imbalance_measures(rows)
    busy = slowest(rows, "skewed")
    return (f"every other rank waited at the combine at least {m['others_wait_over_busy']:.1f}x as long as rank "
            f"{busy['rank']} (wall time: {WAIT_BOUND:g}x or more when the ranks have cores to themselves; with four "
            "ranks on two cores the scheduler has a say)")


def imbalance_sentence(rows: list[dict], cores: int | None = None) -> str:
    """This machine's numbers (they vary by CPU, core count and load): the skewed run's expert CPU times and
    waits, and how much longer the skewed batch took than the even one."""
    import os

    m = imbalance_measures(rows)
    busy = slowest(rows, "skewed")
    others = [r for r in rows if r["batch"] == "skewed" and r is not busy]
    span = lambda key: f"{min(r[key] for r in others):.1f}-{max(r[key] for r in others):.1f} ms"  # noqa: E731
    cores = cores or os.cpu_count()
    return (f"skewed batch: rank {busy['rank']}'s experts took {busy['expert CPU ms']:.1f} ms of CPU time, the other "
            f"ranks' {span('expert CPU ms')};\n"
            f"at the combine the other ranks waited {span('combine wait ms')}, rank {busy['rank']} "
            f"{busy['combine wait ms']:.1f} ms.\n"
            f"skewed over even: the busiest rank's expert CPU time {m['busiest_cpu_skewed_over_even']:.2f}x (the "
            f"experts' part of a step with a core or a GPU per rank);\n"
            f"wall time of the slowest rank's forward {m['forward_skewed_over_even']:.2f}x, of its step "
            f"{m['step_skewed_over_even']:.2f}x ({IMBALANCE_WORLD} ranks on {cores} CPU cores, shared with whatever "
            "else runs)")


def draw_imbalance(rows: list[dict]):
    """Per rank, where its forward went (median wall ms): routing and dispatch, its experts, the wait in the
    combine's all-to-all; the even batch on the left, the skewed one on the right, on one time axis."""
    import matplotlib.pyplot as plt

    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(10.5, 3.6), sharex=True, sharey=True, squeeze=False)
    axes = axes[0]
    parts = (("dispatch ms", "routing + dispatch", "0.75", None), ("expert ms", "experts", "C0", None),
             ("combine wait ms", "waiting at the combine", "C1", "//"))
    longest = max(sum(r[k] for k, *_ in parts) for r in rows)
    for ax, label in zip(axes, batches):
        mine = [r for r in rows if r["batch"] == label]
        share = sum(r["rows computed"] for r in mine) / len(mine)
        left = [0.0] * len(mine)
        for key, name, color, hatch in parts:
            widths = [r[key] for r in mine]
            ax.barh([r["rank"] for r in mine], widths, left=left, color=color, hatch=hatch, edgecolor="white",
                    label=name)
            left = [a + b for a, b in zip(left, widths)]
        for r, end in zip(mine, left):
            ax.text(end + 0.01 * longest, r["rank"], f"{r['rows computed']:,} rows ({r['rows computed'] / share:.1f}x)",
                    va="center", fontsize=9)
        ax.set_yticks([r["rank"] for r in mine], [f"rank {r['rank']}\nexperts {r['experts']}" for r in mine])
        ax.set(title=f"{label} batch", xlabel=f"ms of the forward (median of {IMBALANCE['repeats'] - 1})")
        ax.grid(axis="y", visible=False)
    axes[0].set_xlim(0, 1.3 * longest)
    axes[0].invert_yaxis()  # rank 0 on top (the axes share y: once inverts both)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle(f"EP {IMBALANCE['ep']}, {IMBALANCE['experts']} experts, top-{IMBALANCE['top_k']}: every rank leaves "
                 f"the combine when the busiest one arrives ({CPU_NOTE})", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


# -- training: chapter 09's GPT with an MoE FFN ---------------------------------------------------------------------

def train(aux_coeff: float, **kw):
    return cu.run(TRAIN, kw.pop("world", TRAIN_WORLD), timeout=600, aux_coeff=aux_coeff,
                  steps=kw.pop("steps", TRAIN_STEPS), **kw)


def last_mean(values, n: int = 50) -> float:
    return statistics.fmean(values[-n:])


def training_summary(runs: dict) -> list[dict]:
    """Per run: loss over the last 20 steps, the busiest expert's load over an even one (mean of the last 50 steps,
    and the peak over the run; worst layer), the share of choices that a capacity factor of 1 would drop (percent,
    last 50 steps), and the aux loss."""
    out = []
    for label, res in runs.items():
        r = res[0]
        out.append({"run": label, "loss (last 20)": last_mean(r["loss"], 20),
                    "max load (last 50)": last_mean([max(m) for m in r["max_load"]]),
                    "peak load": max(max(m) for m in r["max_load"]),
                    "% dropped at capacity 1.0": 100 * last_mean([max(w[0] for w in d) for d in r["would_drop"]]),
                    "aux loss (last 50)": last_mean([statistics.fmean(a) for a in r["aux"]])})
    return out


SUMMARY_FORMATS = {"loss (last 20)": "{:.3f}", "max load (last 50)": "{:.2f}x", "peak load": "{:.2f}x",
                   "% dropped at capacity 1.0": "{:.1f}%", "aux loss (last 50)": "{:.3f}"}

# The busiest expert's load over an even share (last 50 of 150 steps, worst layer) with the aux loss stays under it,
# without goes over: measured 1.48-1.69 and 1.95-2.64 over native, AVX2 and plain kernels x seeds 0-3 (cpu_spread
# ch16_moe_train), so 1.8 leaves 6% and 8% on either side.
BALANCE_BOUND = 1.8
FEWER_DROPS_PERCENT = 5.0  # no aux minus aux, % of choices a capacity factor of 1 would drop: 12.8-22.0 measured


def aux_verdict(summary: list[dict], with_aux: str, without: str) -> str:
    """The chapter's claim, with the margins cpu_spread measured (``course_utils/cpu_spread.py: ch16_moe_train``)."""
    a = next(s for s in summary if s["run"] == with_aux)
    b = next(s for s in summary if s["run"] == without)
    balanced = a["max load (last 50)"] < BALANCE_BOUND < b["max load (last 50)"]
    fewer = b["% dropped at capacity 1.0"] - a["% dropped at capacity 1.0"] > FEWER_DROPS_PERCENT
    learned = all(s["loss (last 20)"] < 2.0 for s in (a, b))  # not max(...): max(1.5, nan) is 1.5
    return (f"with the aux loss the busiest expert stays under {BALANCE_BOUND}x an even share and without it goes over: "
            f"{'yes' if balanced else 'NO'}\n"
            f"with the aux loss a capacity factor of 1.0 drops fewer choices, by over {FEWER_DROPS_PERCENT:g}% of all "
            f"choices: {'yes' if fewer else 'NO'}\n"
            f"both learn (loss < 2.0): {'yes' if learned else 'NO'}")


def load_sentence(summary: list[dict], with_aux: str, without: str) -> str:
    """What the training figure shows, in numbers read from the run (they vary by machine)."""
    a = next(s for s in summary if s["run"] == with_aux)
    b = next(s for s in summary if s["run"] == without)
    return (f"busiest expert / an even share (worst layer), mean of the last 50 steps: {a['max load (last 50)']:.2f}x "
            f"with the aux loss, {b['max load (last 50)']:.2f}x without;\n"
            f"highest over the run: {a['peak load']:.2f}x and {b['peak load']:.2f}x; "
            f"choices a capacity factor of 1.0 would drop: {a['% dropped at capacity 1.0']:.1f}% and "
            f"{b['% dropped at capacity 1.0']:.1f}%;\n"
            f"loss over the last 20 steps: {a['loss (last 20)']:.3f} and {b['loss (last 20)']:.3f} "
            f"(difference {b['loss (last 20)'] - a['loss (last 20)']:+.3f})")


STYLES = ({"color": "C0", "ls": "-", "marker": "o"}, {"color": "C3", "ls": "--", "marker": "s"})


def _style(i: int, steps: int) -> dict:
    """Run i's line: its own colour, dash and marker (every ~12th step), so the two curves read apart in grey too."""
    return {**STYLES[i % len(STYLES)], "markevery": max(steps // 12, 1), "ms": 4, "lw": 1.4}


def draw_training(runs: dict, layer: int = 0):
    """Top: the loss of each run, their difference, and the busiest expert's load over training (worst layer).
    Bottom: each run's tokens per expert over an even share at every step, for one layer (the load histogram of
    every step, as a heat map)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplot_mosaic([["loss", "loss", "diff", "diff", "load", "load"],
                                  ["heat0", "heat0", "heat0", "heat1", "heat1", "heat1"]],
                                 figsize=(10.5, 6.6), gridspec_kw={"height_ratios": [1, 1.05]})
    labels = list(runs)
    for i, (label, res) in enumerate(runs.items()):
        r = res[0]
        style = _style(i, len(r["loss"]))
        ax["loss"].plot(r["loss"], label=label, **style)
        ax["load"].plot([max(m) for m in r["max_load"]], label=label, **style)
    ax["loss"].set(title="loss", xlabel="step", ylabel="cross-entropy")
    if len(labels) == 2:
        a, b = (runs[k][0]["loss"] for k in labels)
        ax["diff"].plot([y - x for x, y in zip(a, b)], color="k", lw=1.0)
        ax["diff"].axhline(0.0, color="gray", lw=0.8, ls=":")
        ax["diff"].set(title=f"loss: {labels[1]} minus {labels[0]}", xlabel="step")
    else:
        ax["diff"].set_visible(False)
    ax["load"].axhline(1.0, color="gray", lw=0.8, ls=":")
    ax["load"].text(0, 1.02, "even", color="gray", fontsize=9, va="bottom")
    ax["load"].set(title="busiest expert / even share", xlabel="step")
    ax["load"].set_ylim(bottom=0.8)
    handles, names = ax["loss"].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(names), frameon=False, bbox_to_anchor=(0.5, 1.0))
    for i, (label, res) in enumerate(runs.items()):
        heat = ax[f"heat{i}"] if i < 2 else None
        if heat is None:
            break
        counts = np.array([step[layer] for step in res[0]["counts"]], dtype=float)  # [steps, E]
        share = counts / counts.sum(axis=1, keepdims=True) * counts.shape[1]  # 1 = an even share
        im = heat.imshow(share.T, aspect="auto", cmap="viridis", vmin=0, vmax=3, interpolation="nearest")
        heat.set(title=f"{label}: load per expert, layer {layer}", xlabel="step", ylabel="expert")
        heat.set_yticks(range(counts.shape[1]))
        heat.grid(False)
        fig.colorbar(im, ax=heat, fraction=0.05, label="tokens / even share")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def draw_drops(runs: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (label, res) in enumerate(runs.items()):
        r = res[0]
        factors = r["capacity_factors"]
        means = [last_mean([max(layer[f] for layer in step) for step in r["would_drop"]]) for f in range(len(factors))]
        ax.plot(factors, [100 * m for m in means], label=label, **{**_style(i, 1), "markevery": 1, "ms": 6})
    ax.set(xlabel="capacity factor", ylabel="% of choices dropped", title="drops vs capacity (last 50 steps, worst layer)")
    ax.set_xticks(factors)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=9, loc="upper right")
    fig.tight_layout()
    return fig


# -- the explorer widget --------------------------------------------------------------------------------------------

def draw_explorer(res, params: dict):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import StrMethodFormatter

    r = res[0]
    experts, ep, k = params["experts"], params["ep"], params["top_k"]
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.9), gridspec_kw={"width_ratios": [1.3, 1, 0.8]})
    counts = r["counts"][-1]  # [layers][experts]
    width = 0.8 / len(counts)
    for layer, c in enumerate(counts):
        axes[0].bar([e - 0.4 + width * (layer + 0.5) for e in range(experts)], c, width=width, label=f"layer {layer}")
    axes[0].axhline(sum(counts[0]) / experts, color="gray", lw=0.8, ls=":", label="even share")
    for rank in range(1, ep):
        axes[0].axvline(rank * experts / ep - 0.5, color="k", lw=1.0)
    axes[0].set_xticks(range(experts))
    if experts > 8:
        axes[0].set_xticklabels([str(e) if e % 2 == 0 else "" for e in range(experts)])
    axes[0].set(title=f"tokens per expert, step {len(r['loss']) - 1}", xlabel="expert (| : EP rank boundary)")
    axes[0].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(counts) + 1, frameon=False)
    load = axes[1]
    load.plot([max(m) for m in r["max_load"]], color="C1", label="busiest expert / even share")
    load.axhline(1.0, color="gray", lw=0.8, ls=":")
    load.set(title="over training (worst layer)", xlabel="step")
    load.set_ylabel("busiest expert / even share", color="C1")
    load.set_ylim(bottom=0)
    if params["capacity_factor"]:
        drops = load.twinx()
        drops.plot([100 * max(d) for d in r["dropped"]], color="C0", ls="--", label="% of choices dropped")
        drops.set_ylim(0, max(5.0, 1.2 * max(100 * max(d) for d in r["dropped"])))
        drops.set_ylabel("% of choices dropped", color="C0")
        drops.grid(False)
        lines = load.get_lines()[:1] + drops.get_lines()
    else:
        load.text(0.5, 0.06, "dropless: no token dropped", transform=load.transAxes, ha="center", fontsize=9,
                  color="C0")
        lines = load.get_lines()[:1]
    load.legend(lines, [line.get_label() for line in lines], fontsize=9, loc="upper center",
                bbox_to_anchor=(0.5, -0.2), frameon=False)
    tokens = r["global_batch"] // ep * r["model"]["seq"]
    model = len(counts) * all_to_all_bytes(tokens, r["model"]["hidden"], k, ep, 4)
    sent = r["dispatch_bytes"][-1]
    axes[2].bar(range(len(sent)), sent, color="C2", label="measured")
    axes[2].axhline(model, color="C3", ls="--", label=f"model: {model:,.0f} B")
    axes[2].set_xticks(range(len(sent)))
    axes[2].set(title="dispatch bytes, last step", xlabel="rank", ylim=(0, 1.35 * max([model, *sent, 1])))
    axes[2].yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    axes[2].legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    fig.suptitle(f"{experts} experts, top-{k}, capacity {params['capacity_factor'] or 'dropless'}, "
                 f"aux {params['aux_coeff']}, EP {ep}; {CPU_NOTE}", fontsize=10)
    fig.tight_layout()
    return fig


# The explorer's controls: name -> (label, options, first value). 6 experts on EP 4 and top-k 8 with 4 or 6 experts
# are there so that a learner meets the layer's refusals (``MoEConfig.problem``), which come before any rank starts.
EXPLORER_CONTROLS = {"experts": ("experts", [4, 6, 8, 16], 8), "top_k": ("top-k", [1, 2, 4, 8], 2),
                     "capacity_factor": ("capacity", [0.0, 1.0, 1.25, 2.0], 1.0),
                     "aux_coeff": ("aux", [0.0, 0.001, 0.01, 0.1], 0.01), "ep": ("EP", [1, 2, 4], 2)}


class MoEExplorer(LiveRun):
    """``LiveRun`` of the MoE GPT on ``ep`` ranks for ``WIDGET_STEPS`` steps. A combination the layer cannot take
    (experts not divisible by ep, top-k above experts) is refused by the worker's ``check_params`` before a rank
    starts, in one sentence, in the status line."""

    def __init__(self, controls: dict, *, timeout: float = 180, **kw):
        kw.setdefault("progress_total", lambda p: p.get("steps", WIDGET_STEPS))
        super().__init__(TRAIN, controls, draw_explorer, params={"steps": WIDGET_STEPS}, timeout=timeout, **kw)

    def settings(self) -> dict:
        s = super().settings()
        return {**s, "world_size": s["ep"]}
