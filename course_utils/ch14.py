"""Chapter 14, notebook side: check ring-attention runs against one-process attention, draw which blocks
each rank computes at each ring step, the work per rank, and a small memory-vs-communication model.

Everything here reads a ``RunResult`` of ``workers/ch14_ring_attention.py``; the ground truth is
``workers/attention/reference.attention_reference_grads`` (float64) on the whole sequence.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from workers.attention.reference import LSE_TOLERANCE, RELATIVE_TOLERANCE, attention_reference_grads, relative_error
from workers.context_parallel.inputs import DTYPES, make_inputs
from workers.context_parallel.split import chunk_ids, num_chunks

GRADS = ("dq", "dk", "dv")


def ring_ranks(res, ring: int = 0) -> list[dict]:
    """The rank dicts of one ring, in ring order."""
    return sorted((d for d in res.ranks if d["ring"] == ring), key=lambda d: d["ring_index"])


def assemble(rows: list[dict], key: str, seq: int) -> torch.Tensor:
    """Put each rank's rows of ``key`` back at their global positions: ``[b, h, seq(, d)]``."""
    first = rows[0][key]
    full = torch.empty((*first.shape[:2], seq, *first.shape[3:]), dtype=first.dtype)
    for d in rows:
        full[:, :, d["positions"]] = d[key]
    return full


def compare_to_reference(res) -> dict:
    """Largest error of out, lse (and dq, dk, dv) of every ring copy against float64 one-process attention."""
    cfg = res[0]["config"]
    q, k, v, dout = make_inputs(cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"], cfg["seed"], cfg["dtype"])
    ref = dict(zip(("out", "lse", *GRADS), attention_reference_grads(q, k, v, dout, causal=cfg["causal"])))
    tol, lse_tol = RELATIVE_TOLERANCE[DTYPES[cfg["dtype"]]], LSE_TOLERANCE[DTYPES[cfg["dtype"]]]
    report = {"tolerance": tol, "lse_tolerance": lse_tol, "errors": {}}
    keys = [name for name in ("out", *GRADS) if name in res[0]]
    for ring in range(len(res.ranks) // res[0]["cp"]):
        rows = ring_ranks(res, ring)
        for name in keys:
            err = relative_error(assemble(rows, name, cfg["seq"]), ref[name])
            report["errors"][name] = max(report["errors"].get(name, 0.0), err)
        lse_err = (assemble(rows, "lse", cfg["seq"]) - ref["lse"]).abs().max().item()
        report["errors"]["lse"] = max(report["errors"].get("lse", 0.0), lse_err)
    report["within_tol"] = all(e <= (lse_tol if n == "lse" else tol) for n, e in report["errors"].items())
    report["max_error"] = max(report["errors"].values())
    return report


def work_table(res) -> list[dict]:
    """Blocks and score entries each rank of ring 0 computed, as the ranks counted them."""
    return [{"rank": d["ring_index"], "chunks": chunk_ids(d["cp"], d["ring_index"], d["config"]["split"]),
             "blocks": d["work_blocks"], "diagonal": d["work_diagonal"], "score_entries": d["score_entries"]}
            for d in ring_ranks(res)]


def block_grid_figure(res, title: str | None = None):
    """The (query chunk, key chunk) grid: each computed block coloured by the rank that computed it, labelled
    with the ring step; skipped blocks blank; diagonal blocks hatched (masked inside)."""
    rows = ring_ranks(res)
    cp, split = rows[0]["cp"], rows[0]["config"]["split"]
    n = num_chunks(cp, split)
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(4.6, 4.6))
    size = 11 if n <= 4 else 9 if n <= 8 else 7  # the labels as large as a block allows
    for d in rows:
        for step, qc, kc, kind in d["blocks"]:
            if kind == "skip":
                continue
            # light hatching, so the label on top stays readable
            ax.add_patch(plt.Rectangle((kc, qc), 1, 1, facecolor=colors(d["ring_index"]), alpha=0.55,
                                       hatch="//" if kind == "diagonal" else None, edgecolor="white", lw=1.5))
            ax.text(kc + 0.5, qc + 0.5, f"r{d['ring_index']}\ns{step}", ha="center", va="center", fontsize=size,
                    fontweight="bold", bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.8,
                                             "linewidth": 0})
    ax.set_xlim(0, n), ax.set_ylim(n, 0), ax.set_aspect("equal")
    ax.set_xticks(np.arange(n) + 0.5, range(n)), ax.set_yticks(np.arange(n) + 0.5, range(n))
    ax.set_xlabel("key chunk"), ax.set_ylabel("query chunk"), ax.grid(False)
    causal = rows[0]["config"]["causal"]
    ax.set_title(title or f"cp = {cp}, {split}, {'causal' if causal else 'no mask'}", fontsize=9)
    fig.text(0.02, -0.02, "r0 s1: computed by rank 0 at ring step 1 (colour: the rank). Hatched: a diagonal block,\n"
             "masked inside (causal). Blank: a block entirely above the diagonal, skipped.", fontsize=8, va="top")
    return fig


def work_bars_figure(results: dict):
    """Score entries computed per rank for each split (``results``: split -> RunResult), from the ranks' counts."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    width = 0.8 / len(results)
    for i, (split, res) in enumerate(results.items()):
        table = work_table(res)
        ax.bar(np.arange(len(table)) + i * width, [t["score_entries"] for t in table], width, label=split)
    ax.set_xticks(np.arange(len(table)) + width * (len(results) - 1) / 2, [f"rank {t['rank']}" for t in table])
    ax.set_ylabel("score entries computed"), ax.legend(), ax.set_title("causal attention: work per rank", fontsize=9)
    return fig


def memory_vs_communication(seq: int, cp: int, heads: int, kv_heads: int, head_dim: int,
                            bytes_per_element: int = 2) -> dict:
    """Per rank, per attention layer: K/V bytes held (seq/cp tokens) and sent in forward (2*(cp-1) chunks),
    and one ring step's compute against the bytes it must receive.

    The activations a rank keeps scale as seq/cp; what it sends does not shrink with cp (the whole
    sequence's K/V, less its own, passes through every rank). A step's FLOPs count the *query* heads
    (Q K^T and P V for every head, 2 FLOPs per multiply-add; non-causal, no skipping); its bytes are the
    *K/V* heads' (grouped-query attention sends kv_heads, not heads).
    """
    tokens = seq // cp
    chunk = tokens * kv_heads * head_dim * bytes_per_element  # one of K or V for seq/cp tokens
    step_flops = 2 * 2 * tokens * tokens * heads * head_dim  # [t, d] x [d, t] and [t, t] x [t, d], every head
    return {"cp": cp, "tokens_per_rank": tokens, "kv_held_bytes": 2 * chunk, "kv_sent_bytes": 2 * (cp - 1) * chunk,
            "kv_chunks_sent": 2 * (cp - 1), "step_flops": step_flops, "step_bytes": 2 * chunk if cp > 1 else 0,
            "flops_per_byte": step_flops / (2 * chunk) if cp > 1 else None}


def min_tokens_to_hide(heads: int, kv_heads: int, head_dim: int, peak_flops: float, link_bytes_per_s: float,
                       bytes_per_element: int = 2, causal: bool = False) -> float:
    """The chunk length t = seq/cp above which a ring step's compute outlasts its transfer:
    4 t^2 heads d / F >= 2 t kv_heads d b / B, so t >= F kv_heads b / (2 heads B). At the GPU's peak FLOP/s
    (the hardest case: a real kernel is slower, which helps the hiding); causal skipping (balanced by the
    zigzag split) halves the work per step on average, which doubles it. ``head_dim`` cancels."""
    return (2 if causal else 1) * peak_flops * kv_heads * bytes_per_element / (2 * heads * link_bytes_per_s)


def largest_hidden_cp(seq: int, heads: int, kv_heads: int, head_dim: int, peak_flops: float,
                      link_bytes_per_s: float, bytes_per_element: int = 2, causal: bool = False) -> int:
    """The largest power-of-two cp whose chunks are still long enough for the ring to hide its transfers."""
    t_min = min_tokens_to_hide(heads, kv_heads, head_dim, peak_flops, link_bytes_per_s, bytes_per_element, causal)
    cp = 1
    while seq / (2 * cp) >= t_min and seq % (2 * cp) == 0:
        cp *= 2
    return cp
