"""Rank-side checks for chapter 02's exercises: DDP by hand, bucketed averaging, sampler sharding.

Each check runs the learner's function on every rank of a real process group and compares with the
single-process reference of ``workers/data_parallel/model.py``. Ranks agree on a verdict before anyone raises
(``agree``): a rank that stopped early while the others went on into the learner's collectives would
turn a wrong answer into a hang.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workers.data_parallel.buckets import bucket_assignment
from workers.data_parallel.model import (FP32_TOL, Setup, flat, flat_grads, grads_on, loss_fn, make_batches,
                                         make_model, shard, train_single)
from workers.exercises.support import Wrong, agree, expect_close, run_exercise, scaled_by

STEPS = 3
START_SEED_OFFSET = 1000  # rank r starts from seed + 1000 r: different weights until someone broadcasts


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.double(), b.double(), **FP32_TOL)


# -- exercise 1: DDP by hand --------------------------------------------------------------------------------

def check_ddp_by_hand(ctx, answer) -> None:
    setup = Setup(steps=STEPS)
    n, rank = ctx.world_size, ctx.rank
    own_seed = setup.seed + START_SEED_OFFSET * rank
    model = make_model(setup, seed=own_seed).to(ctx.device)  # rank 0's is the baseline's starting point
    start = make_model(setup)  # rank 0's initial model, built here independently
    answer(model)

    def broadcast_done():
        params = flat(model.parameters())
        if rank != 0 and torch.equal(params, flat(make_model(setup, seed=own_seed).parameters())):
            raise Wrong(f"after ddp_by_hand, rank {rank} still has its own initial weights: broadcast every "
                        "parameter from rank 0 (dist.broadcast(p.data, src=0)) so that all ranks start equal")
        expect_close(params, flat(start.parameters()), "parameters right after ddp_by_hand (they must be rank 0's)",
                     atol=0, rtol=0)
        if not torch.equal(model.in_scale.cpu(), start.in_scale):
            raise Wrong(f"rank {rank}'s buffer in_scale differs from rank 0's: broadcast the buffers too "
                        "(model.buffers()), as DDP does, or ranks compute different forwards")

    agree(broadcast_done)

    baseline = train_single(setup)
    opt = torch.optim.SGD(model.parameters(), lr=setup.lr)
    for step, batch in enumerate(make_batches(setup)):
        x, y = (t.to(ctx.device) for t in shard(batch, rank, n))  # [B/n, d_in], [B/n, d_out]
        alone = make_model(setup)  # a hook-free copy at the current weights: what this rank computes by itself
        alone.load_state_dict(model.state_dict())
        local = grads_on(alone.to(ctx.device), x, y)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()  # your hooks must do all the work during this call

        def gradients_right():
            if any(p.grad is None for p in model.parameters()):
                raise Wrong(f"after backward at step {step + 1} some .grad is None: do not set param.grad to None "
                            "in a hook; all-reduce it in place")
            expect_close(flat_grads(model), baseline["grads"][step], f"gradients after backward at step {step + 1}",
                         **FP32_TOL, hints=[
                             (scaled_by(n), f"they are {n} times too large at world size {n}: all_reduce sums over "
                                            "the ranks; divide by the world size to average"),
                             (lambda got, want: _close(got, local),
                              "your hooks did not change the gradients: each rank kept its own local gradient. "
                              "A hook registered with register_post_accumulate_grad_hook receives the parameter, "
                              "not the gradient: all-reduce param.grad, not its argument"),
                         ])

        agree(gradients_right)
        opt.step()

        def weights_right():
            expect_close(flat(model.parameters()), baseline["weights"][step + 1],
                         f"weights after SGD step {step + 1}", **FP32_TOL)

        agree(weights_right)

    mine = flat(model.parameters()).to(ctx.device)
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)

    def ranks_equal():
        if not torch.equal(mine, rank0):
            raise Wrong(f"after {STEPS} steps rank {rank}'s weights differ from rank 0's by "
                        f"{(mine - rank0).abs().max().item():.3g}: every rank must apply the same averaged gradient")

    agree(ranks_equal)


# -- exercise 2: bucketed averaging -------------------------------------------------------------------------

GRAD_SHAPES = [(64,), (32, 16), (16,), (128, 8), (8,), (200,), (10, 10)]
BUCKET_BYTES = (1, 1024, 2048, 4096, 1 << 30)


def _grads_of(rank: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(*s, generator=g).to(device) for s in GRAD_SHAPES]


def _close_before_exceeding(sizes: list[int], limit: int) -> int:
    """The other plausible rule (start a new bucket rather than exceed the limit): for the hint only."""
    count, filled = 0, 0
    for s in sizes:
        if filled and filled + s > limit:
            count, filled = count + 1, 0
        filled += s
    return count + (1 if filled else 0)


def check_bucketed_average(ctx, answer) -> None:
    n = ctx.world_size
    sizes = [math.prod(s) * 4 for s in GRAD_SHAPES]
    want = [sum(_grads_of(r, "cpu")[i] for r in range(n)) / n for i in range(len(GRAD_SHAPES))]
    for bucket_bytes in BUCKET_BYTES:
        grads = _grads_of(ctx.rank, ctx.device)
        before = [g.clone() for g in grads]
        calls = []
        original = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            calls.append(tensor.numel())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        try:
            answer(grads, bucket_bytes)
        finally:
            dist.all_reduce = original

        buckets = bucket_assignment(sizes, [bucket_bytes])
        expected = [sum(sizes[i] for i in b) // 4 for b in buckets]

        def right():
            what = f"with bucket_bytes={bucket_bytes}"
            if len(grads) != len(GRAD_SHAPES) or any(g.shape != b.shape for g, b in zip(grads, before)):
                raise Wrong(f"{what} the list of gradients changed shape: average them in place")
            for i, (g, w) in enumerate(zip(grads, want)):
                expect_close(g, w, f"{what}, gradient {i}", **FP32_TOL, hints=[
                    (scaled_by(n), f"it is {n} times the average at world size {n}: divide the summed bucket by "
                                   "the world size"),
                    (lambda got, _w, i=i: torch.equal(got, before[i].cpu().double()),
                     "it did not change: torch.cat makes a copy, so after all-reducing the flat bucket copy each "
                     "slice back into its gradient (g.copy_(flat[offset:offset + g.numel()].view_as(g)))"),
                ])
            if calls == expected:
                return
            if len(calls) == len(GRAD_SHAPES) and len(expected) != len(GRAD_SHAPES):
                raise Wrong(f"{what} you made {len(calls)} all_reduce calls, one per gradient; DDP's rule packs "
                            f"these {len(GRAD_SHAPES)} gradients into {len(expected)} buckets: flatten each bucket "
                            "into one tensor and all-reduce it once")
            if len(calls) == _close_before_exceeding(sizes, bucket_bytes) != len(expected):
                raise Wrong(f"{what} you made {len(calls)} all_reduce calls where DDP's rule makes {len(expected)}: "
                            "you start a new bucket before the limit is reached; DDP keeps adding to a bucket and "
                            "closes it as soon as it holds at least bucket_bytes")
            raise Wrong(f"{what} your all_reduce calls had {calls} elements; DDP's rule (fill in order, close a "
                        f"bucket once it holds at least bucket_bytes) gives buckets of {expected} elements")

        agree(right)


# -- exercise 3: sampler sharding ---------------------------------------------------------------------------

SAMPLER_CASES = ((12, 3), (10, 2), (7, 2))  # (dataset_size, epochs); 10 and 7 need padding at world 4


def check_shard_indices(ctx, answer) -> None:
    n_ranks, rank, seed = ctx.world_size, ctx.rank, 5
    for size, epochs in SAMPLER_CASES:
        per_rank = math.ceil(size / n_ranks)
        orders = []
        for epoch in range(epochs):
            mine = answer(size, rank, n_ranks, epoch, seed)
            again = answer(size, rank, n_ranks, epoch, seed)
            other_seed = answer(size, rank, n_ranks, epoch, seed + 1)
            shards = [None] * n_ranks
            dist.all_gather_object(shards, mine)
            where = f"dataset_size={size}, world_size={n_ranks}, epoch={epoch}"

            def right():
                for r, s in enumerate(shards):
                    if not isinstance(s, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < size for i in s):
                        raise Wrong(f"{where}: rank {r} returned {s!r}: return a list of ints from range(dataset_size)")
                if list(again) != list(mine):
                    raise Wrong(f"{where}: two calls with the same arguments gave different indices: shuffle with a "
                                "torch.Generator seeded from seed and epoch, not the global random state")
                lengths = [len(s) for s in shards]
                if any(L != per_rank for L in lengths):
                    raise Wrong(f"{where}: the ranks got {lengths} indices; each must get ceil(dataset_size / "
                                f"world_size) = {per_rank}, so that all ranks run the same number of steps "
                                "(pad by repeating indices from the start, as DistributedSampler does)")
                seen = [i for s in shards for i in s]
                missing = sorted(set(range(size)) - set(seen))
                repeats = len(seen) - len(set(seen))
                if missing or repeats > per_rank * n_ranks - size:
                    raise Wrong(f"{where}: samples {missing[:5]} are on no rank and {repeats} are on several: shuffle "
                                "with the same seed on every rank (seed + epoch, never + rank), then give each rank "
                                "a different slice (indices[rank::world_size])")
                if list(other_seed) == list(mine) and size > 6:
                    raise Wrong(f"{where}: the indices do not depend on seed: seed the shuffle with seed + epoch")

            agree(right)
            orders.append([i for s in shards for i in s])

        def epochs_differ():
            if size > 6 and all(o == orders[0] for o in orders[1:]):
                raise Wrong(f"dataset_size={size}: every epoch gives the same order on every rank; the shuffle must "
                            "depend on the epoch (seed + epoch), which is what DistributedSampler.set_epoch does")
            if size > 6 and orders[0] == list(range(per_rank * n_ranks))[:len(orders[0])]:
                raise Wrong(f"dataset_size={size}: the indices are not shuffled: permute range(dataset_size) with "
                            "torch.randperm and a seeded generator")

        agree(epochs_differ)


CHECKS = {"ddp_by_hand": check_ddp_by_hand, "bucketed_average": check_bucketed_average,
          "shard_indices": check_shard_indices}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
