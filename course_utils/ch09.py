"""Chapter 09, notebook side: the signature plot of each fault, drawn from what the ranks measured.

Every function takes telemetry as it came back from ``workers/ch09_train.py`` (``res[0]["telemetry"]``: a
dict of per-step columns) and returns a matplotlib figure; nothing here recomputes what the ranks measured.
The tables (triage, Llama 3 interruptions) live in ``course_utils.ch09_tables``.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np

from course_utils.ch09_tables import LLAMA3_SOURCE, LLAMA3_TOTAL_UNEXPECTED, by_category
from course_utils.plots import CPU_NOTE

LOG_V_NOTE = "log V (uniform guessing)"


def telemetry(res, rank: int = 0) -> dict:
    return res[rank]["telemetry"]


def spike_steps(tel: dict, factor: float = 1.5, window: int = 10) -> list[int]:
    """Steps whose loss exceeds ``factor`` x the median of the previous ``window`` losses (what the worker's
    detector does, recomputed from the curve, for labelling figures)."""
    loss, out = tel["loss"], []
    for i in range(window, len(loss)):
        if not loss[i] <= factor * float(np.median(loss[i - window:i])):
            out.append(tel["step"][i])
    return out


def _mark(ax, step, label, colour="crimson"):
    ax.axvline(step, color=colour, ls=":", lw=1.2)
    ax.text(step, 0.98, f" {label}", transform=ax.get_xaxis_transform(), color=colour, fontsize=8, va="top")


# -- data: the garbage batch --------------------------------------------------------------------------------

def draw_garbage_batch(clean: dict, faulty: dict, at_step: int, recovered: dict | None = None,
                       executed: dict | None = None, rewinds=()):
    """Loss, global grad norm and update/param ratio of a clean run, the run with a garbage batch, and
    (optionally) the run that rewound and skipped it."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    series = [("clean", clean, "0.6", "-"), ("garbage batch", faulty, "crimson", "-")]
    if recovered is not None:
        series.append(("rewind + skip", recovered, "#3b75af", "--"))
    for ax, key, title in zip(axes, ("loss", "grad_norm", "update_ratio"),
                              ("loss", "global grad norm", "update / param ratio")):
        for label, tel, colour, ls in series:
            ax.plot(tel["step"], tel[key], color=colour, ls=ls, lw=1.2, label=label)
        _mark(ax, at_step, "bad batch")
        ax.set_title(title)
        ax.set_xlabel("step")
    if executed is not None:
        for rw in rewinds:
            axes[0].annotate(f"rewound to {rw['rewound_to']}", xy=(rw["spike_step"], rw["loss"]),
                             xytext=(rw["spike_step"] + 8, rw["loss"] * 0.9), fontsize=8,
                             arrowprops={"arrowstyle": "->", "color": "#3b75af"}, color="#3b75af")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Data fault: one batch of random tokens (world 1, CPU)", y=1.03)
    return fig


# -- numeric: high learning rate --------------------------------------------------------------------------

def draw_high_lr(runs: dict[str, dict], lr: float, vocab: int):
    """``runs``: label -> telemetry. Loss, max attention logit (log scale) and mean output log Z."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.3))
    for (label, tel), colour in zip(runs.items(), ("crimson", "#3b75af", "#e8a33d", "#2a9d5b")):
        axes[0].plot(tel["step"], tel["loss"], color=colour, lw=1.1, label=label)
        axes[1].plot(tel["step"], tel["max_attn_logit"], color=colour, lw=1.1, label=label)
        axes[2].plot(tel["step"], tel["log_z_mean"], color=colour, lw=1.1, label=label)
    axes[0].axhline(math.log(vocab), color="k", ls=":", lw=1, label=LOG_V_NOTE)
    axes[1].set_yscale("log")
    for ax, title in zip(axes, ("loss", "max attention logit q.k/sqrt(d)", "mean output log Z")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Numeric fault: learning rate {lr:g} (AdamW, warm-up then constant; world 1, CPU)", y=1.03)
    return fig


# -- numeric: fp16 underflow ------------------------------------------------------------------------------

def draw_fp16(runs: dict[str, dict]):
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for (label, tel), colour in zip(runs.items(), ("0.6", "crimson", "#3b75af")):
        axes[0].plot(tel["step"], tel["loss"], color=colour, lw=1.2, label=label)
        axes[1].plot(tel["step"], [100 * z for z in tel["zero_grad_frac"]], color=colour, lw=1.2, label=label)
        axes[2].plot(tel["step"], tel["loss_scale"], color=colour, lw=1.2, label=label)
    for ax, title in zip(axes, ("loss", "gradient elements exactly 0 (%)", "loss scale")):
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[2].set_yscale("log", base=2)
    axes[0].legend(fontsize=8)
    fig.suptitle("Numeric fault: fp16 backward with small gradients, with and without loss scaling", y=1.03)
    return fig


# -- communication and hardware: checksums and replay ------------------------------------------------------

def checksum_agreement(tel_by_rank: list[dict]) -> np.ndarray:
    """[world, steps]: 1 where a rank's parameter checksum equals rank 0's at that step."""
    ref = np.array(tel_by_rank[0]["param_checksum"], dtype=object)
    return np.stack([(np.array(t["param_checksum"], dtype=object) == ref).astype(float) for t in tel_by_rank])


def draw_checksums(res, title: str):
    """Each rank's local loss, and a strip per rank: does its parameter checksum match rank 0's?"""
    tels = [d["telemetry"] for d in res.ranks]
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for r, tel in enumerate(tels):
        ax0.plot(tel["step"], tel["local_loss"], lw=1.1, label=f"rank {r}: loss on its own rows")
    ax0.legend(fontsize=8)
    ax0.set_title(title)
    agree = checksum_agreement(tels)
    ax1.imshow(agree, aspect="auto", cmap="RdYlGn", vmin=0, vmax=1, interpolation="nearest",
               extent=(tels[0]["step"][0] - 0.5, tels[0]["step"][-1] + 0.5, len(tels) - 0.5, -0.5))
    ax1.set_yticks(range(len(tels)), [f"rank {r}" for r in range(len(tels))])
    ax1.set_xlabel("step (green: checksum equals rank 0's; red: differs)")
    ax1.grid(False)
    alarm = res[0].get("checksum_alarm")
    if alarm:
        for ax in (ax0, ax1):
            _mark(ax, alarm["step"], f"first disagreement, step {alarm['step']}")
    return fig


def draw_replay(res, title: str):
    """Per rank and step: did the replay reproduce the original run's fingerprints (gradient, parameters)?"""
    tels = [d["telemetry"] for d in res.ranks]
    rep = res[0]["replay"]
    steps = len(tels[0]["step"])
    grid = np.ones((len(tels), 2 * steps))
    for r, event in enumerate(rep["event_by_rank"]):
        if event is not None:
            grid[r, event:] = 0  # from the first differing event on, the traces have parted
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 4.2), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax0.plot(tels[0]["step"], tels[0]["loss"], color="crimson", lw=1.1, label="original run (bit flipped)")
    if rep.get("replayed_losses"):
        start = steps - len(rep["replayed_losses"])
        ax0.plot(tels[0]["step"][start:], rep["replayed_losses"], color="#3b75af", ls="--", lw=1.1, label="replay")
    ax0.legend(fontsize=8)
    ax0.set_title(title)
    ax1.imshow(grid, aspect="auto", cmap="RdYlGn", vmin=0, vmax=1, interpolation="nearest",
               extent=(-0.5, steps - 0.5, len(tels) - 0.5, -0.5))
    ax1.set_yticks(range(len(tels)), [f"rank {r}" for r in range(len(tels))])
    ax1.set_xlabel("step (green: replay reproduces the fingerprint bit for bit; red: it does not)")
    ax1.grid(False)
    if rep["diverged"]:
        for ax in (ax0, ax1):
            _mark(ax, rep["first_step"], f"first difference, step {rep['first_step']}")
    return fig


# -- per-layer view and the Llama 3 table ------------------------------------------------------------------

def draw_layer_grad_norms(tel: dict, at_step: int | None = None, title: str = "per-layer grad norms"):
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    for name, values in tel["layer_grad_norms"].items():
        ax.plot(tel["step"], values, lw=1.1, label=name)
    if at_step is not None:
        _mark(ax, at_step, "fault")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=4)
    return fig


def draw_interruptions():
    cats = by_category()
    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    names, counts = list(cats), list(cats.values())
    ax.barh(names[::-1], counts[::-1], color="#3b75af")
    for i, c in enumerate(counts[::-1]):
        ax.text(c + 2, i, f"{c} ({100 * c / LLAMA3_TOTAL_UNEXPECTED:.1f}%)", va="center", fontsize=8)
    ax.set_xlabel(f"unexpected interruptions (of {LLAMA3_TOTAL_UNEXPECTED})")
    ax.set_title("Llama 3 405B, 54 days on 16,384 H100s: root causes by category", fontsize=10)
    ax.text(0, -0.32, "Source: " + LLAMA3_SOURCE, transform=ax.transAxes, fontsize=6, wrap=True)
    return fig


def cpu_label(res) -> str:
    return f"{res.world_size} rank(s), {res.seconds:.1f} s; {CPU_NOTE}"
