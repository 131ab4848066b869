"""Chapter 02, notebook side: compare DDP's ranks with the single-process baseline, and draw what they did.

Everything here reads a ``RunResult`` from ``workers/ch02_*.py`` and the baseline from ``workers/ch02_model``;
nothing here computes what the ranks should have computed, except the single-process reference.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from workers.ch02_model import FP32_TOL, Setup, grads_on, make_batches, make_model

FLOOR = 1e-10  # where "exactly 0" is drawn on a log axis


# -- DDP vs the baseline --------------------------------------------------------------------------------

def compare_to_baseline(res, baseline: dict) -> dict:
    """Per rank and step, max |w_rank - w_single|; whether all of it is within FP32_TOL; whether ranks agree bitwise."""
    weights = res.gather("weights")  # world_size x [steps + 1, P]
    want = baseline["weights"]
    max_abs = torch.stack([(w - want).abs().max(dim=1).values for w in weights])  # [world, steps + 1]
    within = all(torch.allclose(w.double(), want.double(), **FP32_TOL) for w in weights)
    identical = all(torch.equal(w, weights[0]) for w in weights)
    global_loss = torch.stack(res.gather("local_losses")).mean(dim=0)  # equal shards: mean of the ranks' means
    return {"max_abs": max_abs, "within_tol": within, "ranks_identical": identical,
            "global_loss": global_loss, "loss_diff": (global_loss - baseline["losses"]).abs().max().item()}


def draw_ddp_vs_baseline(comparisons: dict[int, dict], baseline: dict):
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    styles = ["o-", "s--", "^:", "D-."]
    for k, (world, c) in enumerate(comparisons.items()):
        worst = c["max_abs"].max(dim=0).values.clamp_min(FLOOR).numpy()  # worst rank, per step
        steps = np.arange(len(worst)) + 0.06 * (k - (len(comparisons) - 1) / 2)  # side by side, not on top
        ax.plot(steps, worst, styles[k % len(styles)], ms=6, label=f"DDP, world {world}")
    ax.axhline(FP32_TOL["atol"], color="k", ls="--", lw=1, label=f"tolerance atol={FP32_TOL['atol']:g}")
    largest = float(baseline["weights"].abs().max())
    ax.axhline(float(np.spacing(np.float32(largest))), color="grey", ls=":", lw=1,
               label=f"1 fp32 ulp of the largest weight ({largest:.2f})")
    ax.set_yscale("log")
    ax.set_ylim(FLOOR / 3, 1e-4)
    ax.set_yticks([FLOOR, 1e-8, 1e-6, 1e-4], ["0 (bit-identical)", "1e-8", "1e-6", "1e-4"])
    ax.set_xlabel("SGD step (0 = initial weights)")
    ax.set_ylabel("max |w_DDP - w_single|")
    ax.set_title("DDP weights vs the single-process baseline, after every step")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
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


def draw_bucket_timeline(res, step: int = 1, ax=None):
    """The order of events in one backward: each gradient landing in .grad, and each all-reduce DDP launches."""
    d = res[0]
    events = [e for e in d["events"] if e["step"] == step]
    n_params = len(d["param_names"])
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 3.0))
    else:
        fig = ax.figure
    colours = plt.cm.tab10.colors
    bucket_of = {}
    for e in events:
        if e["kind"] == "all_reduce":
            for p in e["params"]:
                bucket_of[p] = e["bucket"]
    for t, e in enumerate(events):
        if e["kind"] == "grad":
            b = bucket_of.get(e["param"], 0)
            ax.scatter(t, e["param"], color=colours[b % 10], s=30)
        else:
            ax.axvline(t, color=colours[e["bucket"] % 10], lw=2, alpha=0.8)
            ax.text(t, n_params - 0.5, f"all-reduce\nbucket {e['bucket']}\n{e['bytes'] / 1024:.0f} KiB",
                    fontsize=7, ha="center", va="top", color=colours[e["bucket"] % 10],
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8})
    ax.set_ylim(-1, n_params + 1.5)
    ax.set_yticks(range(n_params), d["param_names"], fontsize=6)
    ax.set_xlabel("order of events during backward")
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
    ax.set_xscale("log", base=2)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.set_xlabel("world size")
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
