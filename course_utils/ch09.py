"""Chapter 09, notebook side: the signature plot of each fault, drawn from what the ranks measured.

Every function takes telemetry as it came back from ``workers/ch09_train.py`` (``res[0]["telemetry"]``: a
dict of per-step columns) and returns a matplotlib figure; nothing here recomputes what the ranks measured.
The spike labels come from the ranks' own detector class (``workers.gpt.detect.SpikeDetector``), run over
the curve. The tables (triage, Llama 3 interruptions) live in ``course_utils.ch09_tables``.
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np

from course_utils.ch09_tables import LLAMA3_SOURCE, LLAMA3_TOTAL_UNEXPECTED, by_category
from course_utils.plots import log2_axis
from workers.gpt.config import TrainConfig
from workers.gpt.detect import SpikeDetector

LOG_V_NOTE = "log V (uniform guessing)"


def telemetry(res, rank: int = 0) -> dict:
    return res[rank]["telemetry"]


def spike_steps(tel: dict, factor: float = TrainConfig.spike_factor,
                window: int = TrainConfig.spike_window) -> list[int]:
    """The steps the training loop's loss-spike detector flags on this curve: the same ``SpikeDetector``,
    fed every loss in turn, as it is fed during a run without recovery."""
    detector, out = SpikeDetector(window, factor), []
    for step, loss in zip(tel["step"], tel["loss"]):
        if detector.is_spike(loss):
            out.append(step)
        detector.accept(loss)
    return out


def adam_steps_after_one_gradient(first_step: int, n_steps: int, betas=(0.9, 0.95)) -> list[float]:
    """The steps, in units of lr, that Adam takes on a weight whose gradient is 0 at every step except the
    one at index ``first_step`` (0-based), for that step and the ``n_steps - 1`` after it.

    Its moments start at m = v = 0, so after the gradient g at step t = first_step + 1 (Adam counts from 1),
    k steps later m = (1 - b1) b1^k g and v = (1 - b2) b2^k g^2: with the bias corrections the step is
    (1 - b1) b1^k / (1 - b1^(t+k)) / sqrt((1 - b2) b2^k / (1 - b2^(t+k))), independent of g's size (eps aside).
    """
    b1, b2 = betas
    t = first_step + 1
    return [(1 - b1) * b1 ** k / (1 - b1 ** (t + k)) / math.sqrt((1 - b2) * b2 ** k / (1 - b2 ** (t + k)))
            for k in range(n_steps)]


# -- all the telemetry of one run ---------------------------------------------------------------------------

TELEMETRY_PANELS = (("loss", "loss", "linear"), ("grad_norm", "global grad norm", "log"),
                    ("update_ratio", "update / param ratio", "log"),
                    ("max_attn_logit", "max attention logit q.k/sqrt(d)", "log"),
                    ("log_z_mean", "mean output log Z", "linear"), ("loss_scale", "loss scale", "log"))


def telemetry_panels(tel: dict) -> list[tuple[str, str, str]]:
    """(key, title, y scale) of each series ``draw_telemetry`` draws: those the run recorded; the loss scale
    only if loss scaling was on (it is 1.0 at every step otherwise)."""
    return [(key, title, scale) for key, title, scale in TELEMETRY_PANELS if key in tel
            and not (key == "loss_scale" and all(v == 1.0 for v in tel[key]))]


def draw_telemetry(tel: dict, title: str = "", vocab: int | None = None):
    """One panel per recorded series of one run: loss, global grad norm, update/param ratio, max attention
    logit, mean output log Z and (if any) the loss scale, against the step."""
    panels = telemetry_panels(tel)
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        fig.delaxes(ax)
    for ax, (key, name, scale) in zip(axes.flat, panels):
        ax.plot(tel["step"], tel[key], color="#3b75af", lw=1.1)
        ax.set_yscale(scale)
        ax.set_title(name)
        ax.set_xlabel("step")
    if vocab is not None and panels and panels[0][0] == "loss":
        axes.flat[0].axhline(math.log(vocab), color="k", ls=":", lw=1, label=LOG_V_NOTE)
        axes.flat[0].legend(fontsize=8.5)
    if title:
        fig.suptitle(title, y=1.02, fontsize=9)
    fig.tight_layout()
    return fig


def _mark(ax, step, label=None, colour="crimson"):
    """A dotted line at ``step``, labelled at the top unless ``label`` is None."""
    ax.axvline(step, color=colour, ls=":", lw=1.2)
    if label is not None:
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
    # under the panels, not inside the first: long run labels would run into the next panel
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, -0.02),
               ncol=min(3, len(runs) + 1), fontsize=8, frameon=False)
    fig.suptitle(f"Numeric fault: learning rate {lr:.2g} (AdamW, warm-up then constant; world 1, CPU)", y=1.03)
    return fig


# -- numeric: fp16 underflow ------------------------------------------------------------------------------

def draw_fp16(runs: dict[str, dict], vocab: int | None = None):
    """``runs``: label -> telemetry. Loss, the share of exactly-zero gradient elements, the elements whose
    gradient is nonzero for the first time (a dot per step that has any), and the loss scale."""
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.2))
    for (label, tel), colour in zip(runs.items(), ("0.6", "crimson", "#3b75af", "#2a9d5b")):
        axes[0].plot(tel["step"], tel["loss"], color=colour, lw=1.2, label=label)
        axes[1].plot(tel["step"], [100 * z for z in tel["zero_grad_frac"]], color=colour, lw=1.2, label=label)
        woken = [(s, n) for s, n in zip(tel["step"], tel["woken_elements"]) if n]
        axes[2].plot([s for s, _ in woken], [n for _, n in woken], ".", color=colour, ms=5, label=label)
        axes[3].plot(tel["step"], tel["loss_scale"], color=colour, lw=1.2, label=label)
    if vocab is not None:
        axes[0].axhline(math.log(vocab), color="k", ls=":", lw=1, label=LOG_V_NOTE)
    for ax, title in zip(axes, ("loss", "gradient elements exactly 0 (%)",
                                "elements with a first nonzero gradient", "loss scale")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes[2].set_yscale("log")
    log2_axis(axes[3], axis="y")
    # under the panels, not inside the first: there it covered the loss-scaled run's curve
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, -0.02),
               ncol=min(4, len(runs) + 1), fontsize=8.5, frameon=False)
    fig.suptitle("Numeric fault: fp16 backward with small gradients, with and without loss scaling", y=1.03)
    return fig


def draw_dormant(runs: dict[str, dict], wake: int, vocab: int | None = None):
    """``runs``: label -> telemetry of fp16 runs without loss scaling. Left: their losses, with the step at
    which gradients first reach the body marked. Right: the steps Adam takes on a weight whose only nonzero
    gradient arrives at that step (``adam_steps_after_one_gradient``), and their running total."""
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.3))
    for (label, tel), colour in zip(runs.items(), ("crimson", "#2a9d5b", "#3b75af")):
        ax0.plot(tel["step"], tel["loss"], color=colour, lw=1.2, label=label)
    if vocab is not None:
        ax0.axhline(math.log(vocab), color="k", ls=":", lw=1, label=LOG_V_NOTE)
    _mark(ax0, wake, f"first gradient in the body, step {wake}")
    ax0.set_title("loss")
    ax0.set_xlabel("step")
    # under the panel: the two runs part at the bottom left, where a legend inside would sit on them
    ax0.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    n = max(len(tel["step"]) for tel in runs.values()) - wake
    steps = adam_steps_after_one_gradient(wake, n)
    ax1.bar(range(wake, wake + n), steps, color="#3b75af", label="step at each step (units of lr)")
    ax1.plot(range(wake, wake + n), np.cumsum(steps), color="k", lw=1.2, label="total distance moved (units of lr)")
    ax1.set_title(f"Adam on a weight whose one nonzero gradient comes at step {wake}", fontsize=9)
    ax1.set_xlabel("step")
    ax1.legend(fontsize=8, loc="center right")  # between the total's plateau and the bars along the bottom
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
    if alarm:  # labelled once, above: on the strip the red text would sit on red and green
        _mark(ax0, alarm["step"], f"first disagreement, step {alarm['step']}")
        _mark(ax1, alarm["step"])
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
    if rep["diverged"]:  # labelled once, above: on the strip the red text would sit on red and green
        _mark(ax0, rep["first_step"], f"first difference, step {rep['first_step']}")
        _mark(ax1, rep["first_step"])
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
