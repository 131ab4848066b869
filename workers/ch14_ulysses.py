"""DeepSpeed-Ulysses on real ranks (context parallelism by all-to-all), alone or as Ulysses x ring (USP).

    torchrun --nproc-per-node 4 workers/ch14_ulysses.py --seq 64 --heads 8 --kv-heads 2 --causal true
    torchrun --nproc-per-node 4 workers/ch14_ulysses.py --ring 2 --split zigzag      # 2 Ulysses x 2 ring

Every rank derives the same whole-sequence q, dout ``[b, heads, seq, d]`` and k, v ``[b, kv_heads, seq, d]`` from
``seed`` (``workers/context_parallel/inputs.py``, the ring worker's inputs) and keeps its rows
(``ulysses.usp_positions``). ``cp`` (0: the whole world) is the context-parallel degree, ``ring`` how many of its
factors are a ring: cp = ulysses x ring, the Ulysses groups being consecutive ranks (ring 1: Ulysses alone; ring cp:
the ring alone, through the same code). ``split`` is the ring's (ignored at ring 1: Ulysses needs no balancing). A
world larger than cp runs world / cp identical copies side by side, so cp = 1, 2 and 4 all run on one set of 4 warm
ranks. Each rank returns its output rows and dq, dk, dv with the global position of each row (the notebook compares
them with ``context_parallel.reference.compare_to_reference``: float64 attention in one process), the bytes it
sent per phase against the formulas (``context_parallel/ulysses.py``) and what the ring alone would have sent.
"""
import math

import torch
import torch.distributed as dist

from workers.context_parallel.inputs import DTYPES, make_inputs
from workers.context_parallel.ring import Ring
from workers.context_parallel.ulysses import Ulysses, ring_bytes, ulysses_attention, usp_bytes, usp_positions
from workers.layout.grid import RankGrid, make_groups
from workers.layout.rules import SPLITS, Layout, num_chunks, problem
from workers.runtime import at_least, divides, entrypoint, one_of, refusal


def _listed(values) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def ulysses_heads_problem(heads: int, kv_heads: int, cp: int, ring: int, world_size: int) -> str | None:
    """Why the Ulysses ranks (cp / ring of them) cannot each hold whole heads, naming the values that work, or None."""
    ulysses = cp // ring
    name = f"cp={cp}" if ring == 1 else f"cp / ring = {cp} / {ring} = {ulysses}"
    if heads % ulysses:
        if ring == 1:
            works = "cp " + _listed(d for d in range(1, world_size + 1) if world_size % d == 0 and heads % d == 0)
        else:
            works = "ring " + _listed(r for r in range(1, cp + 1) if cp % r == 0 and heads % (cp // r) == 0)
        return (f"{name} does not divide heads={heads} (Ulysses gives each rank whole heads): choose {works}, "
                f"or heads a multiple of {ulysses}")
    if heads % kv_heads:
        return divides("kv_heads", kv_heads, "heads", heads)
    if kv_heads % ulysses and ulysses % kv_heads:
        works = [k for k in range(1, heads + 1) if heads % k == 0 and (k % ulysses == 0 or ulysses % k == 0)]
        return (f"{name} and kv_heads={kv_heads} do not divide one another (each rank holds whole KV heads, or a copy "
                f"of one): choose kv_heads {_listed(works)}")
    return None


def check_params(world_size, seq=64, heads=8, kv_heads=0, head_dim=16, batch=1, causal=True, cp=0, ring=1,
                 split="zigzag", dtype="float64", **_):
    basics = refusal(at_least("heads", heads), at_least("kv_heads", kv_heads, 0), at_least("head_dim", head_dim),
                     at_least("batch", batch), at_least("seq", seq), at_least("ring", ring),
                     one_of("split", split, SPLITS), one_of("dtype", dtype, DTYPES),
                     at_least("cp", cp, 0) and f"cp={cp!r} must be at least 0 (0: the whole world)")
    if basics:
        return basics
    size = cp or world_size
    degrees = refusal(problem(Layout(cp=size), world_size), divides("ring", ring, "cp", size))
    if degrees:
        return degrees
    # every rank holds seq/cp rows (contiguous pieces at ring 1); with a ring, its split cuts seq into chunks too
    rows = problem(Layout(cp=size, split="contiguous", seq=seq), world_size) if ring == 1 else None
    if ring > 1:
        needed = math.lcm(size, num_chunks(ring, split))
        if seq % needed and ring == size:
            rows = (f"ring={ring} cuts seq={seq} into {num_chunks(ring, split)} chunks ({split}), which does not "
                    f"divide it: choose seq divisible by {needed}")
        elif seq % needed:
            rows = (f"cp={size} as {size // ring} Ulysses ranks x ring={ring} ({split}) cuts seq={seq} into unequal "
                    f"pieces: choose seq divisible by {needed}")
    return refusal(rows, ulysses_heads_problem(heads, kv_heads or heads, size, ring, world_size))


def main(ctx, seq: int = 64, heads: int = 8, kv_heads: int = 0, head_dim: int = 16, batch: int = 1,
         causal: bool = True, cp: int = 0, ring: int = 1, split: str = "zigzag", seed: int = 0,
         dtype: str = "float64", backward: bool = True):
    """One Ulysses (x ring) attention forward and backward of a [batch, heads, seq, head_dim] problem over cp ranks."""
    size, kv_heads = cp or ctx.world_size, kv_heads or heads
    ulysses_size = size // ring
    grid = RankGrid.for_world(ctx.world_size, cp=size)  # the other ranks: copies side by side (dp)
    members = grid.group("cp", ctx.rank)
    index = members.index(ctx.rank)
    place, position = index % ulysses_size, index // ulysses_size  # Ulysses rank, ring position
    # every rank creates every Ulysses group (dist.new_group is collective over the world): consecutive ranks
    groups = [g[p * ulysses_size:(p + 1) * ulysses_size] for g in grid.groups("cp") for p in range(ring)]
    group, created = make_groups(groups, ctx.rank) if ulysses_size > 1 else (None, [])
    try:
        ulysses = Ulysses(place, members[position * ulysses_size:(position + 1) * ulysses_size], group, ctx.device,
                          ctx.comm_device("all_to_all"))
        ring_links = Ring(position, members[place::ulysses_size], ctx.device, ctx.comm_device("send")) \
            if ring > 1 else None
        positions = usp_positions(seq, ulysses_size, ring, index, split)  # [seq/cp]
        q, k, v, dout = (t[:, :, positions].to(ctx.device)  # [b, heads or kv_heads, seq/cp, d]
                         for t in make_inputs(batch, heads, seq, head_dim, seed, dtype, kv_heads=kv_heads))
        q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
        with ctx.timer("forward"):
            out = ulysses_attention(q, k, v, ulysses, causal, ring=ring_links, split=split)  # [b, heads, seq/cp, d]
        result = {"out": out.detach().cpu()}
        if backward:
            with ctx.timer("backward"):
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)  # through both all-to-alls, reversed
            result.update(dq=dq.cpu(), dk=dk.cpu(), dv=dv.cpu())
    finally:
        for pg in created:  # warm ranks outlive the run: its groups must not pile up
            dist.destroy_process_group(pg)
    ring_sent = ring_links.sent_bytes if ring_links else {"forward": 0, "backward": 0}
    element = q.element_size()
    return {**result, "positions": positions, "copy": grid.coords(ctx.rank)["dp"], "cp_index": index,
            "ulysses_index": place, "ring_position": position, "cp": size, "ulysses": ulysses_size, "ring": ring,
            "sent_bytes": {p: ulysses.sent_bytes[p] + ring_sent[p] for p in ("forward", "backward")},
            "ulysses_sent_bytes": dict(ulysses.sent_bytes), "ring_sent_bytes": dict(ring_sent),
            "messages": {"all_to_all": dict(ulysses.messages), "ring": dict(ring_links.messages) if ring_links else {}},
            "formula_bytes": usp_bytes(batch, heads, kv_heads, seq, head_dim, ulysses_size, ring, element),
            "ring_alone_bytes": ring_bytes(batch, kv_heads, seq, head_dim, size, element),  # the ring at the same cp
            "comm_wait_s": ulysses.wait_s + (ring_links.wait_s if ring_links else 0.0),
            "config": {"seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "batch": batch,
                       "causal": causal, "split": split, "seed": seed, "dtype": dtype}}


if __name__ == "__main__":
    entrypoint(main)
