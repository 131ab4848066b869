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

def _every_parameter_averaged(model, want_flat, local_flat, step: int, n: int) -> None:
    """Name the parameters whose gradient is wrong when only some are (a hook on the weight matrices only):
    the flat comparison would show the first values, which belong to a parameter that is right."""
    got_flat = flat_grads(model)
    offset, kept_local, wrong = 0, [], []
    for name, p in model.named_parameters():
        size = p.numel()
        got, want, local = (t[offset:offset + size] for t in (got_flat, want_flat, local_flat))
        offset += size
        if _close(got, want):
            continue
        wrong.append(name)
        if _close(got, local):
            kept_local.append(name)
    if not wrong or len(wrong) == len(list(model.parameters())):
        return  # all right, or all wrong: the flat comparison and its hints say more
    if kept_local == wrong:
        raise Wrong(f"after backward at step {step + 1} the gradients of {', '.join(wrong)} are this rank's own, "
                    f"never averaged, while the other parameters' are right: register the hook on every parameter "
                    "in model.parameters() (biases too), not only on the weight matrices")
    raise Wrong(f"after backward at step {step + 1} the gradients of {', '.join(wrong)} differ from the average over "
                f"the {n} ranks while the other parameters' are right: every parameter needs the same hook")


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
            bad = [name for name, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
            if bad:
                raise Wrong(f"after backward at step {step + 1} the gradient of {', '.join(bad)} holds NaN or inf: "
                            "an average of finite gradients is finite")
            _every_parameter_averaged(model, baseline["grads"][step], local, step, n)
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
# (dtype, bucket_bytes): 256 and 2304 bytes end exactly at the first and second fp32 gradients (a full bucket
# holds exactly bucket_bytes); float64 and bfloat16 buckets differ from ones counted at 4 bytes an element.
BUCKET_CASES = [(torch.float32, b) for b in (1, 256, 1024, 2048, 2304, 4096, 1 << 30)] + [
    (torch.float64, 4096), (torch.float64, 4608), (torch.bfloat16, 2048)]
TOLERANCE = {torch.float32: FP32_TOL, torch.float64: FP32_TOL, torch.bfloat16: {"atol": 3e-2, "rtol": 1e-2}}


def _grads_of(rank: int, device, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(*s, generator=g).to(device, dtype) for s in GRAD_SHAPES]


def _buckets(sizes: list[int], limit: int, *, strict: bool = False, close_before: bool = False) -> list[int]:
    """Bytes per bucket under the two other plausible rules, for the hints only (DDP's own rule is
    ``bucket_assignment``): ``strict`` closes a bucket only once it holds more than the limit, ``close_before`` starts a new bucket
    rather than exceed it."""
    out, filled = [], 0
    for s in sizes:
        if close_before and filled and filled + s > limit:
            out, filled = out + [filled], 0
        filled += s
        if not close_before and (filled > limit if strict else filled >= limit):
            out, filled = out + [filled], 0
    return out + ([filled] if filled else [])


def check_bucketed_average(ctx, answer) -> None:
    n = ctx.world_size
    numels = [math.prod(s) for s in GRAD_SHAPES]
    for dtype, bucket_bytes in BUCKET_CASES:
        item = torch.empty((), dtype=dtype).element_size()
        want = [sum(_grads_of(r, "cpu", dtype)[i].double() for r in range(n)) / n for i in range(len(GRAD_SHAPES))]
        grads = _grads_of(ctx.rank, ctx.device, dtype)
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

        sizes = [k * item for k in numels]
        expected = [sum(sizes[i] for i in b) // item for b in bucket_assignment(sizes, [bucket_bytes])]
        as_fp32 = [b // 4 for b in _buckets([k * 4 for k in numels], bucket_bytes)]
        strict = [b // item for b in _buckets(sizes, bucket_bytes, strict=True)]
        close_before = [b // item for b in _buckets(sizes, bucket_bytes, close_before=True)]
        name = str(dtype).replace("torch.", "")

        def unchanged_hint() -> str:
            if calls and calls == expected[:-1]:
                return ("it was never all-reduced: it sits in the last bucket, and your loop all-reduced only the "
                        f"buckets it closed ({len(calls)} of {len(expected)}); after the loop, the bucket still "
                        "being filled needs its all_reduce too (if current: buckets.append(current))")
            if calls == expected:
                return ("it did not change although every bucket was all-reduced: torch.cat makes a copy, so copy "
                        "each averaged slice back into its gradient (g.copy_(flat[offset:offset + g.numel()]"
                        ".view_as(g)))")
            return ("it did not change: either its bucket was never all-reduced (the last, unfinished bucket "
                    "forgotten after the loop?) or the averaged bucket was not copied back (torch.cat makes a copy)")

        def right():
            what = f"with {name} gradients and bucket_bytes={bucket_bytes}"
            if len(grads) != len(GRAD_SHAPES) or any(g.shape != b.shape for g, b in zip(grads, before)):
                raise Wrong(f"{what} the list of gradients changed shape: average them in place")
            for i, (g, w) in enumerate(zip(grads, want)):
                if g.dtype != dtype:
                    raise Wrong(f"{what}, gradient {i} came back as {g.dtype}: average in place, keeping its dtype")
                if not torch.isfinite(g).all():
                    raise Wrong(f"{what}, gradient {i} holds NaN or inf after averaging: an average of finite "
                                "gradients is finite")
                expect_close(g, w, f"{what}, gradient {i}", **TOLERANCE[dtype], hints=[
                    (scaled_by(n), f"it is {n} times the average at world size {n}: divide the summed bucket by "
                                   "the world size"),
                    (lambda got, _w, i=i: torch.equal(got, before[i].cpu().double()), unchanged_hint()),
                ])
            if calls == expected:
                return
            if item != 4 and calls == as_fp32:
                raise Wrong(f"{what} your buckets hold {calls} elements, as if every element took 4 bytes; {name} "
                            f"takes {item}: count a gradient's bytes as g.numel() * g.element_size(), which gives "
                            f"buckets of {expected} elements")
            if calls == strict:
                raise Wrong(f"{what} your buckets hold {calls} elements where DDP's rule gives {expected}: a bucket "
                            "that holds exactly bucket_bytes is full; close it when filled >= bucket_bytes, not only "
                            "once it exceeds the limit (>)")
            per_gradient = len(calls) == len(GRAD_SHAPES) and len(expected) != len(GRAD_SHAPES)
            if calls == close_before and per_gradient:
                raise Wrong(f"{what} you made {len(calls)} all_reduce calls, one per gradient, where DDP's rule makes "
                            f"{len(expected)}: either you all-reduce each gradient on its own, or you start a new "
                            "bucket rather than exceed the limit (here both give one gradient per bucket); DDP keeps "
                            "adding to a bucket and closes it as soon as it holds at least bucket_bytes")
            if calls == close_before:
                raise Wrong(f"{what} you made {len(calls)} all_reduce calls where DDP's rule makes {len(expected)}: "
                            "you start a new bucket before the limit is reached; DDP keeps adding to a bucket and "
                            "closes it as soon as it holds at least bucket_bytes")
            if per_gradient:
                raise Wrong(f"{what} you made {len(calls)} all_reduce calls, one per gradient; DDP's rule packs "
                            f"these {len(GRAD_SHAPES)} gradients into {len(expected)} buckets: flatten each bucket "
                            "into one tensor and all-reduce it once")
            raise Wrong(f"{what} your all_reduce calls had {calls} elements; DDP's rule (fill in order, close a "
                        f"bucket once it holds at least bucket_bytes) gives buckets of {expected} elements")

        agree(right)


# -- exercise 3: sampler sharding ---------------------------------------------------------------------------

SAMPLER_CASES = ((12, 3), (10, 2), (7, 2), (1, 1))  # (dataset_size, epochs); 10 and 7 need padding at world 4,
# and 1 sample on 4 ranks must be repeated three times


def _global_rng_states() -> dict:
    import random

    import numpy as np

    return {"torch": torch.get_rng_state(), "random": random.getstate(), "numpy": np.random.get_state()}


def _rng_unchanged(before: dict) -> str | None:
    """Which global random state the answer moved, if any (None: all untouched)."""
    import numpy as np

    after = _global_rng_states()
    if not torch.equal(before["torch"], after["torch"]):
        return "torch's global random state (torch.manual_seed, or torch.randperm without a generator)"
    if before["random"] != after["random"]:
        return "Python's global random state (random.seed / random.shuffle)"
    b, a = before["numpy"], after["numpy"]
    if not (np.array_equal(b[1], a[1]) and b[2:] == a[2:]):
        return "NumPy's global random state (np.random.seed / np.random.permutation)"
    return None


def check_shard_indices(ctx, answer) -> None:
    n_ranks, rank, seed = ctx.world_size, ctx.rank, 5
    for size, epochs in SAMPLER_CASES:
        per_rank = math.ceil(size / n_ranks)
        orders = []
        for epoch in range(epochs):
            rng_before = _global_rng_states()
            mine = answer(size, rank, n_ranks, epoch, seed)
            moved = _rng_unchanged(rng_before)
            again = answer(size, rank, n_ranks, epoch, seed)
            other_seed = answer(size, rank, n_ranks, epoch, seed + 1)
            shards = [None] * n_ranks
            dist.all_gather_object(shards, mine)
            where = f"dataset_size={size}, world_size={n_ranks}, epoch={epoch}"

            def right():
                for r, s in enumerate(shards):
                    if not isinstance(s, (list, tuple)) or not all(isinstance(i, int) and 0 <= i < size for i in s):
                        raise Wrong(f"{where}: rank {r} returned {s!r}: return a list of ints from range(dataset_size)")
                if moved:
                    raise Wrong(f"{where}: your sampler changed {moved}. A sampler runs inside the training script: "
                                "reseeding or drawing from the global generator changes every later random draw "
                                "(dropout, initialisation, augmentation) and makes them repeat each epoch; shuffle "
                                "with a private torch.Generator().manual_seed(seed + epoch)")
                if list(again) != list(mine):
                    raise Wrong(f"{where}: two calls with the same arguments gave different indices: shuffle with a "
                                "torch.Generator seeded from seed and epoch, not the global random state")
                lengths = [len(s) for s in shards]
                if any(L != per_rank for L in lengths):
                    more = (f" here the dataset ({size} samples) must be repeated more than once to reach "
                            f"{per_rank * n_ranks} indices (repeat the list, then cut)," if per_rank * n_ranks > 2 * size else "")
                    raise Wrong(f"{where}: the ranks got {lengths} indices; each must get ceil(dataset_size / "
                                f"world_size) = {per_rank}, so that all ranks run the same number of steps "
                                f"(pad by repeating indices from the start, as DistributedSampler does;{more} "
                                "never drop samples)")
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


# -- exercise 4: overlap ------------------------------------------------------------------------------------

def _normed_mlp(setup: Setup) -> torch.nn.Module:
    """TinyMLP's shape with a LayerNorm after fc1: LayerNorm's backward gives its weight's gradient before its
    bias's, the reverse of the order in which buckets list them (last parameter first)."""
    from collections import OrderedDict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(setup.seed)
        return torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(setup.d_in, setup.d_hidden),
                                               norm=torch.nn.LayerNorm(setup.d_hidden), act=torch.nn.Tanh(),
                                               fc2=torch.nn.Linear(setup.d_hidden, setup.d_out)))


# (what, model, bucket bytes, micro-batches). TinyMLP's 848 gradient bytes in two buckets, fc2 (16 + 256 bytes) then
# fc1 (64 + 512), into an empty .grad, gradients arriving in the listed order. The LayerNorm model's buckets are
# [fc2.bias, fc2.weight, norm.bias, norm.weight] (400 bytes) and [fc1.bias, fc1.weight]: norm.weight's gradient
# lands before norm.bias's, and a first micro-batch, run before the hooks exist, leaves a gradient in .grad for the
# second one to accumulate into (gradient accumulation under no_sync).
OVERLAP_CASES = (("TinyMLP, .grad empty", lambda setup: make_model(setup), 256, 1),
                 ("fc1, LayerNorm, fc2, second micro-batch accumulating into .grad", _normed_mlp, 400, 2))


class _WatchedWork:
    """A collective's handle that notes when the learner waits on it (inside backward or after)."""

    def __init__(self, work, log: list, phase: dict):
        self._work, self._log, self._phase = work, log, phase

    def wait(self, *args, **kwargs):
        self._log.append(("wait", self._phase["now"]))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _error(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__} ({text[:160]})" if text else type(exc).__name__


def check_overlapped_hooks(ctx, answer) -> None:
    """DDP's overlap by hand: every bucket's all-reduce launched asynchronously from inside backward as soon as its
    last gradient lands, waited for after backward; on two models, the second accumulating into .grad."""
    for case in OVERLAP_CASES:
        _overlap_case(ctx, answer, *case)


def _overlap_case(ctx, answer, what: str, build, bucket_bytes: int, micro_batches: int) -> None:
    n, rank = ctx.world_size, ctx.rank
    setup = Setup()
    batches = make_batches(setup, steps=micro_batches)
    reference = build(setup)
    want = sum(grads_on(reference, *b) for b in batches)  # one process, every micro-batch's whole batch
    this_backward = grads_on(reference, *batches[-1])  # the last micro-batch's alone
    local = sum(grads_on(reference, *shard(b, rank, n)) for b in batches)  # this rank's rows alone
    model = build(setup).to(ctx.device)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    for batch in batches[:-1]:  # earlier micro-batches, before any hook: their gradients wait in .grad
        x, y = (t.to(ctx.device) for t in shard(batch, rank, n))
        loss_fn(model(x), y).backward()
    listed = list(reversed(range(len(params))))  # DDP lists gradients last layer first
    sizes = [params[i].numel() * params[i].element_size() for i in listed]
    buckets = [[listed[j] for j in b] for b in bucket_assignment(sizes, [bucket_bytes])]
    numels = [sum(params[i].numel() for i in b) for b in buckets]  # distinct: a launch's size names its bucket
    arrived: list[int] = []  # parameter indices, in the order backward computes their gradients
    # Registered before the answer's hooks, so each of these runs before any of the answer's on the same parameter.
    for i, p in enumerate(params):
        p.register_hook(lambda _grad, i=i: arrived.append(i))
    log: list = []
    phase = {"now": "before backward"}
    original = dist.all_reduce

    def watched_all_reduce(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        log.append(("launch", phase["now"], bool(kwargs.get("async_op", False)), tensor.numel(), len(arrived)))
        return _WatchedWork(work, log, phase) if work is not None else None

    dist.all_reduce = watched_all_reduce
    finish, crashed = None, None
    try:
        finish = answer(params, buckets)
        x, y = (t.to(ctx.device) for t in shard(batches[-1], rank, n))
        loss = loss_fn(model(x), y)
        phase["now"] = "backward"
        loss.backward()
        phase["now"] = "finish"
        if callable(finish):
            finish()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the answer's own error, told as a sentence
        crashed = exc
    finally:
        dist.all_reduce = original
    launched = [e for e in log if e[0] == "launch" and e[1] == "backward"]
    waited_early = [e for e in log if e[0] == "wait" and e[1] == "backward"]
    got = flat_grads(model).cpu()
    where = f"{what} (buckets {[[names[i] for i in b] for b in buckets]})"

    def ran():
        if crashed is not None:
            raise Wrong(f"{where}: {phase['now']} raised {_error(crashed)} in your code: a hook runs inside "
                        "backward, with only the gradients computed so far")
        if not callable(finish):
            raise Wrong(f"return a function (finish) that waits for the buckets' all-reduces and writes the averages "
                        f"into .grad; you returned {type(finish).__name__}")
    agree(ran)

    def every_bucket_fired():
        if len(launched) < len(buckets):
            raise Wrong(f"{where}: only {len(launched)} of the {len(buckets)} buckets' all-reduces were launched "
                        "during backward: a bucket whose count never reaches zero never fires. Count each bucket's "
                        f"own parameters (bucket sizes here: {[len(b) for b in buckets]}) and launch when its last "
                        "gradient lands")
        if len(launched) > len(buckets):
            raise Wrong(f"{where}: {len(launched)} all-reduces were launched during backward for {len(buckets)} "
                        "buckets: launch one per bucket, once, when its last gradient lands")
    agree(every_bucket_fired)

    def asynchronous():
        blocking = [e for e in launched if not e[2]]
        if blocking:
            raise Wrong(f"{len(blocking)} all-reduce(s) were launched with async_op=False inside backward: backward "
                        "stood still until each finished, so nothing overlapped. Pass async_op=True, keep the "
                        "handle, and wait in finish()")
        if waited_early:
            raise Wrong(f"you waited for an all-reduce {len(waited_early)} time(s) inside backward (work.wait() in "
                        "the hook): backward stopped until the bucket had travelled, so nothing overlapped. Keep "
                        "the handles and wait for them in finish(), after backward")
    agree(asynchronous)

    def launched_as_soon_as_full():
        order = ", ".join(names[i] for i in arrived)
        for _, _, _, numel, seen in launched:
            if numel not in numels:
                continue  # not one bucket's size: the values below say what went wrong
            k = numels.index(numel)
            missing = [names[i] for i in buckets[k] if i not in arrived[:seen]]
            if missing:
                raise Wrong(f"{where}: bucket {k} was launched before the gradient of {', '.join(missing)} had "
                            f"landed. Gradients do not always arrive in the order a bucket lists them (here: {order}"
                            "); count each bucket's gradients down as they land, in whatever order, and launch it "
                            "when its count reaches zero, not when its last listed parameter's hook runs")
            full = max(arrived.index(i) for i in buckets[k]) + 1  # gradients computed when the bucket was full
            if seen > full:
                later = ", ".join(names[i] for i in arrived[full:seen])
                how = ("only after the last gradient of backward: nothing overlapped with backward"
                       if seen == len(arrived) else "late: it overlapped less of backward than it could")
                raise Wrong(f"{where}: bucket {k} was full once {names[arrived[full - 1]]}'s gradient landed, but "
                            f"its all-reduce was launched after {later} too, {how}. Launch each bucket from the hook "
                            "that brings its own count to zero, while backward goes on computing the others")
    agree(launched_as_soon_as_full)

    def averaged():
        if not torch.isfinite(got).all():
            bad = [names[i] for i, p in enumerate(params) if p.grad is not None and not torch.isfinite(p.grad).all()]
            raise Wrong(f"{where}: after finish() the .grad of {', '.join(bad)} holds NaN or inf: an average of "
                        "finite gradients is finite")
        if _close(got, want):
            return
        if n > 1 and _close(got, local):
            raise Wrong(f"{where}: .grad still holds this rank's own gradient after finish(): the averaged buckets "
                        "never reached .grad. In finish(), wait for each handle, then copy the bucket's slices back "
                        "into its parameters' .grad")
        if n > 1 and _close(got, want * n):
            raise Wrong(f"{where}: .grad is {n} times the mean gradient: all_reduce SUMs over the ranks; divide the "
                        f"bucket by the world size ({n})")
        if micro_batches > 1 and _close(got, this_backward):
            raise Wrong(f"{where}: .grad holds the mean of this backward's gradients only: it already held an "
                        "earlier micro-batch's gradient, which backward adds the new one to, and that sum is lost. "
                        "Average param.grad as it is after accumulation (the post-accumulate-grad hook's parameter), "
                        "not the gradient a tensor hook receives")
        err = (got - want).abs().max().item()
        raise Wrong(f"{where}: .grad after finish() differs from the mean gradient by up to {err:.3g}: flatten each "
                    "bucket in its order, all-reduce it, divide by the world size, copy the slices back")
    agree(averaged)


CHECKS = {"ddp_by_hand": check_ddp_by_hand, "bucketed_average": check_bucketed_average,
          "shard_indices": check_shard_indices, "overlapped_hooks": check_overlapped_hooks}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
