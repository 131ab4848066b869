"""Rank-side checks for chapter 05: the head-aware split of a fused QKV weight, and which KV heads a rank holds.

The QKV check builds the parallel attention with the learner's shard on every rank, runs forward and
backward against the dense attention, and only then judges (all collectives done first; the ranks agree
on one verdict). Configurations cover multi-head attention, GQA with the KV heads split, and GQA with
them replicated (TP larger than the number of KV heads).
"""
from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from workers.exercises.support import Wrong, agree, run_exercise
from workers.parallel.attention import (ParallelAttention, destroy_owned_groups, kv_heads_for_rank, naive_qkv_rows,
                                        qkv_rows)
from workers.model.dense import BlockConfig, build, inputs

SEQ, BATCH = 6, 2


def configs(world_size: int) -> list[BlockConfig]:
    """MHA; GQA with KV heads split over the ranks; GQA with KV heads replicated (tp > kv_heads)."""
    out = [BlockConfig(hidden=32, heads=4), BlockConfig(hidden=32, heads=8, kv_heads=world_size)]
    out.append(BlockConfig(hidden=32, heads=8, kv_heads=1 if world_size == 2 else 2))
    return out


def _describe(rows: torch.Tensor, cfg: BlockConfig) -> str:
    """Which heads the given rows of [Q; K; V] belong to: 'q0 q1 k0 v0'."""
    d, hq, hk = cfg.head_dim, cfg.heads, cfg.kv_heads
    names = []
    for start in rows[::d].tolist():
        if start < hq * d:
            names.append(f"q{start // d}")
        elif start < (hq + hk) * d:
            names.append(f"k{(start - hq * d) // d}")
        else:
            names.append(f"v{(start - (hq + hk) * d) // d}")
    return " ".join(names)


def check_split_fused_qkv(ctx, answer) -> None:
    t, r = ctx.world_size, ctx.rank
    for i, cfg in enumerate(configs(t)):
        dense = build("attention", cfg, seed=20 + i)
        w, b = dense.qkv.weight.detach(), dense.qkv.bias.detach()
        want_rows = qkv_rows(cfg.heads, cfg.kv_heads, cfg.head_dim, r, t)
        # positionally (w, heads, kv_heads, head_dim, rank, tp): a saved answer with other parameter names still runs
        got_w = answer(w.clone(), cfg.heads, cfg.kv_heads, cfg.head_dim, r, t)
        got_b = answer(b.clone(), cfg.heads, cfg.kv_heads, cfg.head_dim, r, t)
        shape_ok = (isinstance(got_w, torch.Tensor) and got_w.shape == w[want_rows].shape
                    and isinstance(got_b, torch.Tensor) and got_b.shape == b[want_rows].shape)
        # every rank agrees on the shapes first: only then do all of them enter the attention's collectives
        flags = [None] * t
        dist.all_gather_object(flags, shape_ok)
        error = None
        if all(flags):
            attn = ParallelAttention.from_dense(dense).to(ctx.device)
            try:
                with torch.no_grad():
                    attn.qkv.weight.copy_(got_w)
                    attn.qkv.bias.copy_(got_b)
                x, _ = inputs("attention", cfg, SEQ, BATCH, seed=20 + i)
                with torch.no_grad():
                    error = (attn(x.to(ctx.device)).cpu() - dense(x)).abs().max().item()
            finally:
                destroy_owned_groups(attn)
        label = f"heads={cfg.heads}, kv_heads={cfg.kv_heads}, tp={t}"
        want_heads = _describe(want_rows, cfg)

        off = f"{error:.3g}" if error is not None else "not measured"

        def verdict():
            for got, what in ((got_w, "weight"), (got_b, "bias")):
                if not isinstance(got, torch.Tensor):
                    raise Wrong(f"split_fused_qkv should return a tensor (the {what}'s rows), not {type(got).__name__}")
            for got, what in ((got_w, "weight"), (got_b, "bias")):
                bad = int((~torch.isfinite(got.float())).sum()) if got.is_floating_point() else 0
                if bad:
                    raise Wrong(f"{label}: rank {r}'s {what} shard holds {bad} NaN or infinite value(s), where w holds "
                                "none: the shard is rows of w, taken, not computed")
            if not shape_ok:
                hint = ""
                if t > cfg.kv_heads:
                    hint = (f" With {cfg.kv_heads} KV head(s) and tp={t}, a KV head cannot be split: each rank keeps a "
                            f"whole KV head (the one its query heads read), replicated on {t // cfg.kv_heads} ranks.")
                elif cfg.kv_heads != cfg.heads and got_w.shape[0] == 3 * (cfg.heads // t) * cfg.head_dim:
                    hint = (f" That is as many K and V rows as Q rows: K and V hold {cfg.kv_heads} heads each, not "
                            f"{cfg.heads}, so rank {r} takes {max(cfg.kv_heads // t, 1)} KV head(s) from each.")
                raise Wrong(f"{label}: rank {r}'s shard has shape {tuple(got_w.shape)}, expected "
                            f"{tuple(w[want_rows].shape)} (heads {want_heads}).{hint}")
            if t > 1 and torch.equal(got_w.cpu(), w[naive_qkv_rows(cfg.heads, cfg.kv_heads, cfg.head_dim, r, t)]):
                got_heads = _describe(naive_qkv_rows(cfg.heads, cfg.kv_heads, cfg.head_dim, r, t), cfg)
                raise Wrong(f"{label}: that is the contiguous chunk w.chunk({t})[{r}], rows of heads {got_heads}; "
                            f"rank {r} needs {want_heads}: its query heads from Q, and their KV heads from K and V "
                            f"(attention output off by {off})")
            if error is not None and not error <= 1e-5:
                raise Wrong(f"{label}: with your shard rank {r}'s attention output is off by {off}; it should "
                            f"hold the rows of heads {want_heads}, in that order")
            if not torch.equal(got_w.cpu(), w[want_rows]) or not torch.equal(got_b.cpu(), b[want_rows]):
                raise Wrong(f"{label}: the output is right but the rows are not exactly those of heads {want_heads}")

        agree(verdict)

    # Checkpoints hold bf16 weights: the shard is rows of w, in w's dtype, not a float32 copy of them.
    cfg = configs(t)[0]
    w16 = build("attention", cfg, seed=20).qkv.weight.detach().to(torch.bfloat16)
    got16 = answer(w16.clone(), cfg.heads, cfg.kv_heads, cfg.head_dim, r, t)
    want16 = w16[qkv_rows(cfg.heads, cfg.kv_heads, cfg.head_dim, r, t)]

    def dtype_verdict():
        if not isinstance(got16, torch.Tensor):
            raise Wrong(f"split_fused_qkv should return a tensor, not {type(got16).__name__}")
        if got16.dtype != torch.bfloat16:
            raise Wrong(f"given a bfloat16 weight, your shard is {got16.dtype}: it must keep w's dtype (take rows "
                        "of w with indexing or torch.cat of slices; a buffer from torch.empty/zeros without "
                        "dtype=w.dtype is float32, doubling the memory of every shard)")
        if not torch.equal(got16.cpu(), want16):
            raise Wrong("given a bfloat16 weight, your shard's rows differ from the float32 case's: take rows of w, "
                        "do not compute with them")

    agree(dtype_verdict)


def check_kv_heads_for_rank(ctx, answer) -> None:
    t, r = ctx.world_size, ctx.rank
    cases = [(8, 8), (8, 4), (8, 2), (8, 1), (16, 4)]
    problems = []
    for heads, kv_heads in cases:
        if heads % t:
            continue
        got = answer(heads, kv_heads, t, r)  # positionally: a saved answer with other parameter names still runs
        want = kv_heads_for_rank(heads, kv_heads, t, r)
        try:
            items = [k.item() if isinstance(k, torch.Tensor) else k for k in got]
        except (TypeError, RuntimeError, ValueError):
            problems.append(f"kv_heads_for_rank should return a list of KV head numbers, not {type(got).__name__}")
            break
        odd = [k for k in items if isinstance(k, bool) or not isinstance(k, numbers.Integral)]
        if odd:
            k = odd[0]
            why = ("NaN or infinite" if isinstance(k, float) and not math.isfinite(k) else
                   "a float: heads / kv_heads is a true division; use //" if isinstance(k, float) else
                   f"a {type(k).__name__}")
            problems.append(f"heads={heads}, kv_heads={kv_heads}, tp={t}: KV head numbers must be ints (they index "
                            f"heads), got {k!r}, {why}")
            break
        got_list = [int(k) for k in items]
        if got_list != want:
            q = list(range(r * heads // t, (r + 1) * heads // t))
            group = heads // kv_heads
            if len(got_list) > len(set(got_list)) and sorted(set(got_list)) == want:
                problems.append(f"heads={heads}, kv_heads={kv_heads}, tp={t}: rank {r} needs KV heads {want}, "
                                f"each once; {got_list} repeats some (one entry per query head: several query heads "
                                "share a KV head, and the rank holds it once)")
                break
            problems.append(f"heads={heads}, kv_heads={kv_heads}, tp={t}: rank {r} holds query heads {q}; query "
                            f"head j reads KV head j // {group} (heads / kv_heads), so the rank needs KV heads "
                            f"{want}, not {got_list}")
            break

    def verdict():
        if problems:
            raise Wrong(problems[0])

    agree(verdict)


CHECKS = {"split_fused_qkv": check_split_fused_qkv, "kv_heads_for_rank": check_kv_heads_for_rank}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    from workers.runtime import entrypoint

    entrypoint(main)
