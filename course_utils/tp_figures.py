"""Figures for chapters 04-06, each drawn from results measured on real ranks (or committed GPU data)."""
from __future__ import annotations

import json

from course_utils import reference_data
from course_utils.paths import DATA, ROOT
from course_utils.plots import CPU_NOTE, log2_axis

GPU_DATA = DATA / "gpu"


def equivalence_figure(reports: dict, title: str = "sharded vs dense: largest error of every tensor"):
    """``reports[label] = Comparison``: the largest error of each tensor, per run, against the tolerance."""
    import matplotlib.pyplot as plt

    from course_utils.tp_check import ATOL

    names = list(next(iter(reports.values())).errors)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(names) + 2), 3.6))
    width = 0.8 / len(reports)
    for i, (label, rep) in enumerate(reports.items()):
        xs = [j + (i - (len(reports) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, [max(rep.errors.get(n, 0.0), 1e-12) for n in names], width, label=label)
    ax.axhline(ATOL, color="black", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, ATOL * 1.3, "tolerance 1e-5", ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(1e-9, 1e1)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace("grads.", "d ") for n in names], rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("max |parallel - dense|")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=min(len(reports), 3), loc="upper left")
    fig.tight_layout()
    return fig


def comm_bytes_figure(measured: dict, message_bytes: float, title: str = ""):
    """``measured[t]`` = wire bytes per all-reduce seen by the ledger, next to 2(t-1)/t * message."""
    import matplotlib.pyplot as plt

    ts = list(range(1, 9))
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    ax.plot(ts, [2 * (t - 1) / t * message_bytes for t in ts], color="grey", label="2(t-1)/t x b*s*h*bytes")
    ax.axhline(2 * message_bytes, color="grey", linestyle=":", linewidth=1)
    ax.text(8, 2 * message_bytes * 0.96, "limit 2 x message", ha="right", va="top", fontsize=8)
    ax.scatter(list(measured), list(measured.values()), color="C3", zorder=3, label="counted on the ranks (ring)")
    ax.set_xlabel("tensor-parallel size t")
    ax.set_ylabel("bytes sent per rank per all-reduce")
    ax.set_title(title or f"one all-reduce of a {message_bytes:,.0f}-byte activation", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def fault_table(verdicts: dict) -> str:
    """``verdicts[fault] = Comparison``: one line each, the worst tensor and what went wrong."""
    lines = []
    for fault, rep in verdicts.items():
        if rep.ok:
            status = "passes"
        else:
            status = f"CAUGHT: {', '.join(n.replace('grads.', 'd ') for n in rep.failed)} wrong"
            if any("disagrees" in p for p in rep.problems):
                status += "; ranks disagree on a replicated tensor"
        lines.append(f"{fault or 'no fault':<26} {status}")
    return "\n".join(lines)


# -- chapter 06: profiles ----------------------------------------------------------------------------------

def profile_figure(profile: dict, predicted: dict, title: str = "", device_note: str | None = None):
    """Measured share of the forward time per segment (comm split out) next to the FLOPs-predicted share."""
    import matplotlib.pyplot as plt

    measured = profile["forward_share"]
    keys = [k for k in ("ln", "attention", "mlp", "communication", "other") if k in measured]
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4), gridspec_kw={"width_ratios": [1.3, 1]})
    ax = axes[0]
    ax.bar([k for k in keys], [measured[k] for k in keys], color="C0", label="measured (forward)")
    ax.bar(["attention", "mlp"], [predicted["attention"], predicted["mlp"]], width=0.35, color="none",
           edgecolor="C3", linewidth=1.5, label="FLOPs-predicted")
    ax.set_ylabel("share of forward time")
    ax.set_title(title or "where the forward time goes", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    fwd, bwd = profile["forward_s"], profile["backward_s"]
    ax.bar(["forward", "backward"], [fwd * 1e3, bwd * 1e3], color=["C0", "C1"])
    ax.bar(["forward", "backward"], [profile["comm_forward_s"] * 1e3, profile["comm_backward_s"] * 1e3],
           color="none", edgecolor="black", hatch="//", label="of which communication")
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"backward / forward = {bwd / fwd:.2f}", fontsize=10)
    ax.legend(fontsize=8)
    if device_note is None:
        device_note = CPU_NOTE if profile.get("device", "cpu") == "cpu" else profile.get("device", "")
    fig.text(0.5, -0.02, device_note, ha="center", fontsize=8, style="italic")
    fig.tight_layout()
    return fig


def attention_share_figure(seqs: list[int], measured: list[float], hidden: int, device_note: str = CPU_NOTE):
    """Attention's share of the forward time as the sequence grows, against (8h + 4s) / (24h + 4s)."""
    import matplotlib.pyplot as plt

    from course_utils.tp_check import attention_flop_share

    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    fine = [int(s) for s in range(min(seqs), max(seqs) + 1, max(1, (max(seqs) - min(seqs)) // 100))]
    ax.plot(fine, [attention_flop_share(s, hidden) for s in fine], color="grey",
            label="FLOPs: (8bsh² + 4bs²h) / (24bsh² + 4bs²h)")
    ax.plot(seqs, measured, "o-", color="C3", label="measured share of forward time")
    log2_axis(ax, label="sequence length s")
    ax.set_ylim(0, 1)
    ax.set_ylabel("attention share")
    ax.set_title(f"attention vs MLP as s grows (h = {hidden})", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.5, -0.02, device_note, ha="center", fontsize=8, style="italic")
    fig.tight_layout()
    return fig


def gpu_results(pattern: str = "tp_block_*.json") -> list[dict]:
    """Committed GPU measurements (``data/gpu``), newest first; empty when none has been measured yet."""
    files = sorted(GPU_DATA.glob(pattern), reverse=True)
    return [json.loads(f.read_text()) | {"file": str(f.relative_to(ROOT))} for f in files]


# -- chapter 05: the fused-QKV trap ------------------------------------------------------------------------

def qkv_split_figure(heads: int = 4, kv_heads: int = 4, head_dim: int = 2, tp: int = 2):
    """The rows of a fused [Q; K; V] weight coloured by the rank that gets them: by heads, and chunked naively."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    from course_utils.tp_viz import rank_colours
    from workers.parallel.attention import naive_qkv_rows, qkv_rows

    rows = (heads + 2 * kv_heads) * head_dim
    colours = rank_colours(tp)
    fig, axes = plt.subplots(1, 2, figsize=(7.0, 4.2))
    for ax, (title, fn) in zip(axes, (("by heads (right)", qkv_rows), ("w.chunk(t) (wrong)", naive_qkv_rows))):
        owners: dict[int, list[int]] = {}
        for r in range(tp):
            for row in fn(heads, kv_heads, head_dim, r, tp).tolist():
                owners.setdefault(row, []).append(r)
        for row in range(rows):
            ranks = owners.get(row, [])
            for i, r in enumerate(ranks):
                ax.add_patch(Rectangle((i / len(ranks), row), 1 / len(ranks), 1, facecolor=colours[r],
                                       edgecolor="white", linewidth=0.3))
        for h in range(heads + 2 * kv_heads):
            part, k = (("q", h) if h < heads else ("k", h - heads) if h < heads + kv_heads
                       else ("v", h - heads - kv_heads))
            ax.text(-0.05, (h + 0.5) * head_dim, f"{part}{k}", ha="right", va="center", fontsize=8)
        for boundary in (heads * head_dim, (heads + kv_heads) * head_dim):
            ax.axhline(boundary, color="black", linewidth=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(rows, 0)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"fused QKV weight, {heads} query heads, {kv_heads} KV heads, TP {tp}: rows held by each rank",
                 fontsize=10)
    fig.legend(handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(tp)], loc="lower center",
               ncol=tp, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    return fig


# -- chapter 06: training and GPU results ------------------------------------------------------------------

def training_figure(dense_losses: list[float], runs: dict):
    """The one-process GPT's losses and each parallel run's, and their relative difference per step."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from course_utils.tp_check import LOSS_RTOL

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4))
    steps = range(1, len(dense_losses) + 1)
    axes[0].plot(steps, dense_losses, "k-", linewidth=3, alpha=0.3, label="one process (float64)")
    for i, (label, losses) in enumerate(runs.items()):
        axes[0].plot(steps, losses, "o--", color=f"C{i}", markersize=4, label=label)
        rel = [max(abs(g - w) / abs(w), 1e-12) for g, w in zip(losses, dense_losses)]
        axes[1].plot(steps, rel, "o-", color=f"C{i}", markersize=4, label=label)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("loss")
    axes[0].legend(fontsize=7)
    axes[0].set_title("Adam on the GPT: cross-entropy", fontsize=10)
    axes[1].axhline(LOSS_RTOL, color="black", linestyle="--", linewidth=1)
    axes[1].set_yscale("log")
    axes[1].set_ylim(1e-10, 1e-3)
    axes[1].set_xlabel("optimizer step")
    axes[1].set_ylabel("|loss - dense loss| / dense loss")
    axes[1].set_title(f"relative difference (tolerance {LOSS_RTOL:g})", fontsize=10)
    for ax in axes:  # whole steps: no tick at step 1.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def gpu_profile_figures(result: dict) -> list:
    """The ``--profile`` part of a committed GPU run: one measured-vs-FLOPs figure per shape (CUDA events)."""
    from course_utils.tp_check import layer_forward_flops

    figures = []
    for prof in result.get("profile", []):
        hidden = next((row["hidden"] for row in result["shapes"] if row["seq"] == prof["seq"]), None)
        if hidden is None:
            continue
        flops = layer_forward_flops(prof["seq"], hidden, prof["batch"])
        predicted = {"attention": flops["attention"] / flops["total"], "mlp": flops["mlp"] / flops["total"]}
        title = f"TP 1, h={hidden}, s={prof['seq']}, b={prof['batch']}, {result.get('dtype', '')}"
        figures.append(profile_figure(prof, predicted, title, device_note=reference_data.label(result)))
    return figures


def gpu_table(result: dict) -> str:
    """The committed H200 run as text: course block, plain block and matmul, and activation memory."""
    lines = [reference_data.label(result), f"command: {reference_data.provenance_of(result)['command']}",
             f"bf16 matmul {result['matmul']['n']}^3: {result['matmul']['tflops']:.0f} TFLOP/s"]
    for row in result["shapes"]:
        c, p = row["course_block"], row["plain_block"]
        lines.append(f"s={row['seq']:>5} b={row['batch']}: course block {c['median_s'] * 1e3:.2f} ms = {c['tflops']:.0f} "
                     f"TFLOP/s ({row['course_fraction_of_matmul']:.0%} of matmul); plain block {p['median_s'] * 1e3:.2f} "
                     f"ms = {p['tflops']:.0f} TFLOP/s; course/plain time {row['course_vs_plain_time']:.3f}")
        m = row["activation_memory"]
        if m.get("measured_bytes"):
            lines.append(f"        activations kept: {m['measured_bytes'] / 2**20:.0f} MiB measured vs sbh(34 + 5as/h) = "
                         f"{m['korthikanti_none_bytes'] / 2**20:.0f} MiB, sbh*34 = {m['korthikanti_selective_bytes'] / 2**20:.0f}"
                         f" MiB; with recompute {m['measured_bytes_recompute'] / 2**20:.0f} MiB vs 2sbh = "
                         f"{m['korthikanti_full_bytes'] / 2**20:.0f} MiB")
    return "\n".join(lines)
