"""Chapter 12, notebook side: figures drawn from what the ranks measured (histories as the workers return
them: lists of per-step dicts) and from the memory ledger. Every function returns a matplotlib figure."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from course_utils.plots import CPU_NOTE


def column(history: list[dict], key: str) -> list:
    return [h[key] for h in history]


def moving_average(xs: list, window: int = 5) -> list:
    """Trailing mean over up to ``window`` values (the first points average what exists)."""
    return [float(np.mean(xs[max(0, i + 1 - window):i + 1])) for i in range(len(xs))]


def draw_ledger(rows: list[dict], limit_gb: float | None = 80.0):
    """Stacked bars per (model, method): base weights, adapters, grads, Adam state (GB, model states only)."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.4))
    axes = np.atleast_1d(axes)
    parts = (("base_weights", "base weights", "0.35"), ("adapter_weights", "adapter weights", "#e8a33d"),
             ("grads", "gradients", "#3b75af"), ("optimizer", "Adam state (fp32 m, v, master)", "crimson"))
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        bottom = np.zeros(len(mine))
        for key, label, colour in parts:
            vals = np.array([r[key] for r in mine])
            ax.bar([r["method"] for r in mine], vals, bottom=bottom, color=colour, label=label)
            bottom += vals
        for i, total in enumerate(bottom):
            ax.text(i, total, f"{total:.0f} GB" if total >= 10 else f"{total:.1f} GB", ha="center", va="bottom",
                    fontsize=9)
        if limit_gb:
            ax.axhline(limit_gb, color="k", ls=":", lw=1, label=f"one {limit_gb:g} GB GPU")
        # a linear axis: on a log one a stacked bar's segments have no honest height (its base is cut at the floor)
        ax.set_ylim(0, max(bottom.max(), limit_gb or 0) * 1.12)
        ax.set_title(model)
    axes[0].set_ylabel("GB per GPU (1e9 bytes)")
    fig.subplots_adjust(wspace=0.3)
    axes[-1].legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    fig.suptitle("Model states for fine-tuning: full vs LoRA vs QLoRA (activations not counted)", y=1.03)
    return fig


def draw_sft_masking(masked: list[dict], unmasked: list[dict]):
    """Left: the loss each run optimises. Right: the answer-token loss of both (the one that matters)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.3))
    for hist, label, colour in ((masked, "prompt masked", "#3b75af"), (unmasked, "every token", "crimson")):
        axes[0].plot(column(hist, "step"), column(hist, "loss"), color=colour, lw=1.1, label=label)
        axes[1].plot(column(hist, "step"), column(hist, "answer_loss"), color=colour, lw=1.1, label=label)
    axes[0].set_title("training loss (what each run minimises)")
    axes[1].set_title("loss on answer tokens only")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"SFT with and without prompt masking (world 1; {CPU_NOTE})", y=1.03, fontsize=9)
    return fig


def draw_dpo(history: list[dict], beta: float):
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    steps = column(history, "step")
    axes[0].plot(steps, column(history, "loss"), color="k", lw=1.1)
    axes[0].axhline(np.log(2), color="0.5", ls=":", lw=1)
    axes[0].text(0, np.log(2), " log 2 (margin 0)", fontsize=8, va="bottom")
    axes[0].set_title("DPO loss")
    axes[1].plot(steps, column(history, "chosen_reward"), color="#2a9d5b", label="chosen")
    axes[1].plot(steps, column(history, "rejected_reward"), color="crimson", label="rejected")
    axes[1].axhline(0, color="0.5", lw=0.8)
    axes[1].set_title(f"implicit reward (beta={beta:g})")
    axes[1].legend(fontsize=8)
    axes[2].plot(steps, column(history, "margin"), color="#3b75af")
    axes[2].set_title("margin: chosen - rejected")
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(f"DPO on the toy task (world 1; {CPU_NOTE})", y=1.04, fontsize=9)
    return fig


def draw_grpo(runs: dict[str, list[dict]]):
    """``runs``: label -> GRPO history. Mean reward of the sampled answers, and KL to the reference."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.3))
    for (label, hist), colour in zip(runs.items(), ("#3b75af", "crimson", "#e8a33d", "#2a9d5b")):
        steps, reward = column(hist, "step"), column(hist, "reward")
        axes[0].plot(steps, reward, color=colour, lw=0.6, alpha=0.5)
        axes[0].plot(steps, moving_average(reward), color=colour, lw=1.6, label=f"{label} (5-step mean)")
        axes[1].plot(column(hist, "step"), column(hist, "kl"), color=colour, lw=1.1, label=label)
    axes[0].set_title("mean reward of sampled answers")
    axes[1].set_title("KL to the reference (per token)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"GRPO on the toy task ({CPU_NOTE})", y=1.03, fontsize=9)
    return fig


STATE_PARTS = (("frozen_weight_bytes", "frozen weights", "0.35"), ("trained_weight_bytes", "trained weights", "#e8a33d"),
               ("grad_bytes", "gradients", "#3b75af"), ("optimizer_bytes", "AdamW state (m, v, step)", "crimson"))


def draw_full_vs_lora(runs: dict[str, dict]):
    """``runs``: label -> a ``workers.ch12_sft`` result. Left: answer-token loss per step. Right: the model
    states each run held after its last step, as counted on the rank (``state_bytes``), stacked, in kB."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.3), gridspec_kw={"width_ratios": [1.6, 1]})
    colours = ("0.45", "#3b75af", "#e8a33d", "#2a9d5b")
    for (label, res), colour in zip(runs.items(), colours):
        hist = res["history"]
        axes[0].plot(column(hist, "step"), column(hist, "answer_loss"), color=colour, lw=1.1, label=label)
    axes[0].set_title("loss on answer tokens (same data, same steps)")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=8)
    labels = list(runs)
    bottom = np.zeros(len(labels))
    for key, name, colour in STATE_PARTS:
        vals = np.array([runs[label]["state_bytes"][key] / 1e3 for label in labels])
        axes[1].bar(labels, vals, bottom=bottom, color=colour, label=name)
        bottom += vals
    for i, total in enumerate(bottom):
        axes[1].text(i, total, f"{total:.0f} kB", ha="center", va="bottom", fontsize=8)
    axes[1].set_title("model states held, counted on the rank")
    axes[1].set_ylabel("kB (1e3 bytes)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the bars, not on them
    fig.suptitle(f"Full fine-tuning vs LoRA on the tiny GPT (world 1; {CPU_NOTE})", y=1.03, fontsize=9)
    return fig
