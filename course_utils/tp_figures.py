"""Figures for chapters 04-06, each drawn from results measured on real ranks (or committed GPU data)."""
from __future__ import annotations

import json
from pathlib import Path

from course_utils.plots import CPU_NOTE

ROOT = Path(__file__).resolve().parent.parent
GPU_DATA = ROOT / "data" / "gpu"


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
    ax.legend(fontsize=8, ncol=len(reports))
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

SEGMENTS = ("ln1", "attention", "residual1", "ln2", "mlp", "residual2")


def profile_figure(profile: dict, predicted: dict, title: str = ""):
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
    fig.text(0.5, -0.02, CPU_NOTE if profile.get("device", "cpu") == "cpu" else profile.get("device", ""),
             ha="center", fontsize=8, style="italic")
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
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1)
    ax.set_xlabel("sequence length s")
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
