"""Chapter 02, notebook side: compare DDP's ranks with the single-process baseline, and draw what they did.

Everything here reads a ``RunResult`` from ``workers/ch02_*.py`` and the baseline from
``workers/data_parallel/model.py``; nothing here computes what the ranks should have computed, except the
single-process reference.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils.plots import log2_axis
from workers.data_parallel.model import FP32_TOL, Setup, grads_on, make_batches, make_model

FLOOR = 1e-10  # where "exactly 0" is drawn on a log axis


# -- DDP vs the baseline --------------------------------------------------------------------------------

def compare_to_baseline(res, baseline: dict) -> dict:
    """DDP's ranks against the single-process baseline, step by step, with ``FP32_TOL``.

    Three quantities per step: the gradient DDP left in ``.grad`` (after its all-reduce, before the step),
    the loss (the mean of the ranks' local losses: equal shards, so the mean of their means is the
    global-batch mean), and the weights after the step (index 0: the initial weights). For each, the
    largest |DDP - single| per rank and step, and whether all of it is within ``FP32_TOL``; ``within_tol``
    holds only if all three are. ``ranks_identical``: every rank holds the same gradient and weight bits.
    """
    weights, grads = res.gather("weights"), res.gather("grads")  # world x [steps + 1, P], world x [steps, P]
    want_w, want_g = baseline["weights"], baseline["grads"]

    def per_step(got, want):  # [world, rows]: max |got - want| over the parameters, per rank and row
        return torch.stack([(g - want).abs().max(dim=1).values for g in got])

    def close(got, want):
        return got.shape == want.shape and torch.allclose(got.double(), want.double(), **FP32_TOL)

    global_loss = torch.stack(res.gather("local_losses")).mean(dim=0)  # [steps]
    c = {"max_abs": per_step(weights, want_w), "grad_max_abs": per_step(grads, want_g),
         "loss_abs": (global_loss.double() - baseline["losses"].double()).abs(),
         "weights_within_tol": all(close(w, want_w) for w in weights),
         "grads_within_tol": all(close(g, want_g) for g in grads),
         "loss_within_tol": close(global_loss, baseline["losses"]),
         "ranks_identical": all(torch.equal(w, weights[0]) for w in weights)
         and all(torch.equal(g, grads[0]) for g in grads),
         "global_loss": global_loss}
    c["within_tol"] = c["weights_within_tol"] and c["grads_within_tol"] and c["loss_within_tol"]
    c["loss_diff"] = c["loss_abs"].max().item()
    return c


def draw_ddp_vs_baseline(comparisons: dict[int, dict], baseline: dict):
    """Two panels, worst rank per step: |g_DDP - g_single| (steps 1..S) and |w_DDP - w_single| (0..S)."""
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.6), sharey=True)
    styles = ["o-", "s--", "^:", "D-."]
    panels = ((axes[0], "grad_max_abs", baseline["grads"], 1, "gradient", "max |g_DDP - g_single|"),
              (axes[1], "max_abs", baseline["weights"], 0, "weights after the step", "max |w_DDP - w_single|"))
    for ax, key, want, first_step, what, ylabel in panels:
        for k, (world, c) in enumerate(comparisons.items()):
            worst = c[key].max(dim=0).values.clamp_min(FLOOR).numpy()  # worst rank, per step
            steps = np.arange(len(worst)) + first_step + 0.06 * (k - (len(comparisons) - 1) / 2)  # side by side
            ax.plot(steps, worst, styles[k % len(styles)], ms=6, label=f"DDP, world {world}")
        ax.axhline(FP32_TOL["atol"], color="k", ls="--", lw=1, label=f"tolerance atol={FP32_TOL['atol']:g}")
        largest = float(want.abs().max())
        ax.axhline(float(np.spacing(np.float32(largest))), color="grey", ls=":", lw=1,
                   label=f"1 fp32 ulp of the largest value ({largest:.2f})")
        ax.set_yscale("log")
        ax.set_ylim(FLOOR / 3, 1e-4)
        ax.set_yticks([FLOOR, 1e-8, 1e-6, 1e-4], ["0 (bit-identical)", "1e-8", "1e-6", "1e-4"])
        ax.set_xlabel("SGD step" + (" (0 = initial weights)" if first_step == 0 else ""))
        ax.set_ylabel(ylabel)
        ax.set_title(what, fontsize=10)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle("DDP vs the single-process baseline, after every step (worst rank)", y=1.0)
    return fig


# -- broadcast ------------------------------------------------------------------------------------------

def draw_broadcast(res, shown: int = 8):
    before = np.stack([d["before"]["params"][:shown].numpy() for d in res.ranks])  # [world, shown]
    after = np.stack([d["after"]["params"][:shown].numpy() for d in res.ranks])
    lim = float(np.abs(np.concatenate([before, after])).max())
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.6), sharey=True)
    for ax, data, title in zip(axes, (before, after), ("before DDP(model)", "after DDP(model)")):
        im = ax.imshow(data, cmap="coolwarm", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_title(title)
        ax.set_xlabel(f"first {shown} weights of fc1")
        ax.set_yticks(range(len(res.ranks)), [f"rank {r}" for r in range(len(res.ranks))])
        ax.grid(False)
    fig.colorbar(im, ax=axes, shrink=0.8)
    return fig


# -- buckets --------------------------------------------------------------------------------------------

def bucket_table(runs: dict) -> str:
    """``runs``: label -> RunResult of part="buckets". Measured all-reduces (rank 0) next to the prediction."""
    lines = [f"{'bucket_cap_mb':>14} | {'step 1: all-reduces':>20} | {'step 2+: measured':>18} | {'predicted':>9} | "
             "bucket sizes (KiB), step 2"]
    for label, res in runs.items():
        d = res[0]
        measured = d["all_reduce_bytes"]
        pred = d["predicted"]
        lines.append(f"{label:>14} | {len(measured[0]):>20} | {len(measured[1]):>18} | {len(pred['rebuilt']):>9} | "
                     + ", ".join(f"{b / 1024:.0f}" for b in measured[1]))
    return "\n".join(lines)


def draw_bucket_counts(runs: dict):
    labels = list(runs)
    first = [len(r[0]["all_reduce_bytes"][0]) for r in runs.values()]
    later = [len(r[0]["all_reduce_bytes"][1]) for r in runs.values()]
    pred = [len(r[0]["predicted"]["rebuilt"]) for r in runs.values()]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ax.bar(x - 0.2, first, 0.4, label="measured, step 1", color="#bbb")
    ax.bar(x + 0.2, later, 0.4, label="measured, step 2 and after", color="#3b75af")
    ax.scatter(x + 0.2, pred, color="k", marker="_", s=400, zorder=3, label="predicted (DDP's packing rule)")
    ax.set_xticks(x, labels)
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("all-reduces per backward")
    ax.set_title("Buckets: one all-reduce per bucket, rebuilt after the first backward")
    ax.legend(fontsize=8)
    return fig


def _label_rows(xs: list[int], min_gap: float) -> list[int]:
    """A row for each label at x (in order) so that labels in one row are at least ``min_gap`` apart."""
    last: list[float] = []  # the x of each row's latest label
    rows = []
    for x in xs:
        row = next((i for i, seen in enumerate(last) if x - seen >= min_gap), len(last))
        if row == len(last):
            last.append(x)
        else:
            last[row] = x
        rows.append(row)
    return rows


def draw_bucket_timeline(res, step: int = 1, ax=None):
    """The order of events in one backward: each gradient landing in .grad, and each all-reduce DDP launches.

    Each all-reduce is labelled above the dots; labels closer than a label's width (a bucket per layer at 12
    layers) are staggered into rows instead of covering each other and the dots."""
    d = res[0]
    events = [e for e in d["events"] if e["step"] == step]
    n_params = len(d["param_names"])
    reduces = [(t, e) for t, e in enumerate(events) if e["kind"] != "grad"]
    # A label ("bucket 11" / "1028 KiB" at 7 pt) is about 1/9 of the plot's width wide: in event units, that.
    rows = _label_rows([t for t, _ in reduces], min_gap=max(len(events), 1) / 9)
    n_rows = max(rows, default=0) + 1
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 3.0 + 0.3 * (n_rows - 1)))  # a little taller per extra row of labels
    else:
        fig = ax.figure
    colours = plt.cm.tab10.colors
    bucket_of = {}
    for _, e in reduces:
        for p in e["params"]:
            bucket_of[p] = e["bucket"]
    for t, e in enumerate(events):
        if e["kind"] == "grad":
            ax.scatter(t, e["param"], color=colours[bucket_of.get(e["param"], 0) % 10], s=30, zorder=3)
    # The labels take the top of the axes (a band of `band` per row, in axes fractions); the dots stay below it.
    band = 0.6 / fig.get_figheight()  # two 7-pt lines (about 0.25 in) and the axes' share of the figure
    top = n_params / (1 - band * n_rows) - 1  # y limit that leaves that band empty above the last dot
    for (t, e), row in zip(reduces, rows):
        colour = colours[e["bucket"] % 10]
        ax.axvline(t, color=colour, lw=2, alpha=0.8, ymax=1 - band * (n_rows - row - 1) - 0.02)
        ax.text(t, 1 - band * (n_rows - row) + 0.01, f"bucket {e['bucket']}\n{e['bytes'] / 1024:.0f} KiB",
                transform=ax.get_xaxis_transform(), fontsize=8, ha="center", va="bottom", color=colour,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9, "pad": 0.5})
    ax.set_ylim(-1, top)
    every = 1 if n_params <= 14 else 2  # past 7 layers, every other name (the ticks between are their biases)
    ax.set_yticks(range(n_params), minor=True)
    ax.set_yticks(range(0, n_params, every), d["param_names"][::every], fontsize=7.5)
    ax.set_xlabel("order of events during backward (vertical lines: an all-reduce launched)")
    ax.set_title(f"Backward of step {step + 1}: gradients ready (dots) and all-reduces launched (lines)")
    return fig


# -- pitfalls -------------------------------------------------------------------------------------------

def draw_sampler(res):
    modes = ("without_set_epoch", "with_set_epoch")
    world = len(res.ranks)
    epochs = len(res[0][modes[0]])
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.8), sharey=True)
    for ax, mode in zip(axes, modes):
        grid = np.array([[i for r in range(world) for i in res[r][mode][e]] for e in range(epochs)])
        ax.imshow(grid, cmap="viridis", aspect="auto")
        per_rank = len(res[0][mode][0])
        for e in range(epochs):
            for k, v in enumerate(grid[e]):
                bright = v > 0.6 * grid.max()
                ax.text(k, e, str(v), ha="center", va="center", fontsize=7, color="k" if bright else "w")
        for r in range(1, world):
            ax.axvline(r * per_rank - 0.5, color="w", lw=2)
        ax.set_xticks([r * per_rank + (per_rank - 1) / 2 for r in range(world)], [f"rank {r}" for r in range(world)])
        ax.set_yticks(range(epochs), [f"epoch {e}" for e in range(epochs)])
        ax.set_title({"without_set_epoch": "set_epoch never called",
                      "with_set_epoch": "sampler.set_epoch(epoch) every epoch"}[mode], fontsize=10)
        ax.grid(False)
    fig.suptitle("Which samples each rank reads, in order (DistributedSampler, shuffle=True)", y=1.04)
    return fig


def reduction_reference(setup: Setup = Setup()) -> dict:
    """Single-process gradients of the first global batch with reduction 'mean' and 'sum'."""
    x, y = make_batches(setup, steps=1)[0]
    model = make_model(setup)
    return {how: grads_on(model, x, y, how) for how in ("mean", "sum")}


def reduction_ratios(runs: dict, reference: dict) -> dict:
    """world -> {"mean": ratio to the single-process mean gradient, "sum": ratio to the single-process sum gradient}.
    The ratio is a least-squares scale factor <g, ref> / <ref, ref>, with the residual to show it is exact."""
    out = {}
    for world, res in runs.items():
        row = {}
        for how in ("mean", "sum"):
            g, ref = res[0]["grads"][how].double(), reference[how].double()
            scale = (g @ ref / (ref @ ref)).item()
            row[how] = scale
            row[how + "_residual"] = (g - scale * ref).abs().max().item()
        out[world] = row
    return out


def draw_reduction(ratios: dict):
    worlds = list(ratios)
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ax.plot(worlds, [ratios[w]["mean"] for w in worlds], marker="o", label="reduction='mean': DDP / single")
    ax.plot(worlds, [ratios[w]["sum"] for w in worlds], marker="s", label="reduction='sum': DDP / single")
    ax.plot(worlds, [1 / w for w in worlds], ls=":", color="k", label="1 / world size")
    log2_axis(ax, worlds, "world size")
    ax.set_ylabel("gradient scale vs one process")
    ax.set_title("DDP averages over ranks: right for a mean loss, not for a sum")
    ax.legend(fontsize=8)
    return fig


def draw_no_sync(rows: list[dict]):
    ks = [r["k"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    ax.plot(ks, [r["without"] for r in rows], marker="s", label="without no_sync")
    ax.plot(ks, [r["with"] for r in rows], marker="o", label="with no_sync")
    ax.set_xlabel("micro-batches accumulated per optimizer step (k)")
    ax.set_ylabel("all-reduces per optimizer step")
    ax.set_xticks(ks)
    ax.set_title("Gradient accumulation: the same gradient, k times the messages")
    ax.legend(fontsize=8)
    return fig


# -- overlap ----------------------------------------------------------------------------------------------------

def draw_overlap(runs: dict, step: int = 1):
    """``runs``: {label: RunResult of workers.ch02_overlap}. One row per run, on one time axis (rank 0, CPU clock,
    from the start of that step's backward): each gradient landing (dots), each bucket's all-reduce launched
    (triangles) and the wait for it before the step (bars). With overlap the first bucket leaves while backward
    still has gradients to compute; without it, everything leaves after the last gradient."""
    fig, ax = plt.subplots(figsize=(8, 1.2 + 1.1 * len(runs)))
    colours = plt.cm.tab10.colors
    labels = []
    for row, (label, res) in enumerate(runs.items()):
        events = res[0]["timeline"][step]
        bucket_of = {i: k for k, b in enumerate(res[0]["buckets"]) for i in b}
        y = len(runs) - 1 - row
        labels.append((y, label))
        begin = {}
        for e in events:
            t = e["t"] * 1e3
            if e["kind"] == "grad":
                ax.scatter(t, y + 0.25, s=18, color=colours[bucket_of.get(e["param"], 0) % 10], zorder=3)
            elif e["kind"] == "launch":
                ax.scatter(t, y, marker="^", s=60, color=colours[e["bucket"] % 10], zorder=3)
            elif e["kind"] == "wait_begin":
                begin[e["bucket"]] = t
            elif e["kind"] == "wait_end":
                k = e["bucket"]
                ax.plot([begin[k], t], [y - 0.25, y - 0.25], lw=4, color=colours[k % 10], solid_capstyle="butt")
        last = max(e["t"] for e in events if e["kind"] == "grad") * 1e3
        ax.axvline(last, ymin=(y + 0.05) / len(runs), ymax=(y + 0.95) / len(runs), color="grey", ls=":", lw=1)
    ax.set_yticks([y for y, _ in labels], [label for _, label in labels], fontsize=8)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel(f"ms since step {step + 1}'s backward began (CPU, gloo, rank 0)")
    ax.set_title("dots: a gradient lands (colour = bucket); triangles: its bucket's all-reduce has been launched;\n"
                 "bars: the step waiting for it; dotted: backward's last gradient", fontsize=8)
    fig.tight_layout()
    return fig
