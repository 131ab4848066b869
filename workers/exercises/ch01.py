"""Rank-side checks for chapter 01: collectives built from smaller pieces, run on real ranks.

Every rank builds every rank's input locally (deterministic, integer-valued float32, so sums are exact
whatever the order), runs the learner's function on its own input, and compares with a single-process
reference. While the learner's function runs, the ready-made collectives are replaced by a stub that
says which piece to use instead, and bytes sent with send/isend are counted.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from workers.exercises.support import Wrong, agree, expect_close, run_exercise
from workers.runtime import entrypoint

READY_MADE = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
              "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
              "all_to_all_single", "gather", "scatter", "all_gather_object", "broadcast_object_list")


def rank_values(rank: int, shape: tuple, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input: small integers as float32 (exact sums), different on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-9, 10, shape, generator=g).to(torch.float32)


@contextlib.contextmanager
def only_point_to_point(allowed: tuple = (), used: list | None = None):
    """Replace the ready-made collectives (except ``allowed``) and count bytes sent with send/isend.

    ``dist.send`` calls ``isend`` internally, and ``P2POp``/``batch_isend_irecv`` compare against the module's
    ``isend``, so one counting wrapper installed in both namespaces sees every byte that leaves this rank.
    """
    sent = {"bytes": 0}
    saved = {}

    def forbid(name):
        def stub(*args, **kwargs):
            raise Wrong(f"your function called dist.{name}; build it from "
                        f"{' and '.join(allowed) if allowed else 'send/recv (or isend/irecv)'} instead")
        return stub

    original_isend = c10d.isend

    def counting_isend(tensor, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return original_isend(tensor, *args, **kwargs)

    def counting_broadcast(tensor, *args, **kwargs):
        if used is not None:
            used.append("broadcast")
        return original_broadcast(tensor, *args, **kwargs)

    original_broadcast = c10d.broadcast
    replacements = {name: forbid(name) for name in READY_MADE + ("broadcast",) if name not in allowed}
    replacements["isend"] = counting_isend
    if "broadcast" in allowed:
        replacements["broadcast"] = counting_broadcast
    for module in (dist, c10d):
        for name, fn in replacements.items():
            if hasattr(module, name):
                saved[(module, name)] = getattr(module, name)
                setattr(module, name, fn)
    try:
        yield sent
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


# -- ring all-reduce ------------------------------------------------------------------------------

def _explain_ring_mistake(got, want, inputs, r) -> None:
    """Name the classic ring bugs from the shape of the error (raise Wrong), or return to report numbers."""
    n = len(inputs)
    own = inputs[r]
    if torch.equal(got, own):
        raise Wrong("your result is your own input: nothing received was added in")
    got_c, want_c = got.chunk(n), want.chunk(n)
    right = [torch.equal(g, w) for g, w in zip(got_c, want_c)]
    # A partial sum of a ring segment ending at this rank (r, r-1, ..., r-m) added on top of the full sum:
    # the all-gather phase added the finished chunk to the local partial sum instead of replacing it.
    for k in range(n):
        if right[k]:
            continue
        extra = got_c[k] - want_c[k]
        partial = torch.zeros_like(extra)
        for m in range(n):
            partial = partial + inputs[(r - m) % n].chunk(n)[k]
            if torch.equal(extra, partial):
                raise Wrong(f"chunk {k} holds the full sum plus a partial sum again, so values are counted twice: "
                            "in the all-gather phase replace the chunk with the one you receive; do not add it")
    if sum(right) == 1:
        raise Wrong(f"only chunk {right.index(True)} of {n} holds the full sum: after the reduce-scatter phase "
                    "each rank owns one finished chunk; did you forget the all-gather phase that passes them around?")


def check_ring_all_reduce(ctx, answer) -> None:
    n, r = ctx.world_size, ctx.rank
    length = 3 * n  # a multiple of the world size: n chunks of 3
    inputs = [rank_values(k, (length,), seed=1) for k in range(n)]
    want = torch.stack(inputs).sum(0)
    x = inputs[r].clone().to(ctx.comm_device("send"))  # gloo sends CPU tensors only
    with only_point_to_point() as sent:
        got = answer(x)
    if got is None:
        got = x  # in place is fine too
    if not isinstance(got, torch.Tensor):
        raise Wrong(f"ring_all_reduce should return a tensor, not {type(got).__name__}")
    got = got.detach().to("cpu", torch.float32)
    if not torch.isfinite(got).all():
        raise Wrong(f"rank {r}'s sum holds NaN or inf: a sum of finite inputs is finite (a receive buffer read "
                    "before anything arrived in it?)")
    if got.shape == want.shape and not torch.equal(got, want) and n > 1:
        _explain_ring_mistake(got, want, inputs, r)
    expect_close(got, want, f"rank {r}'s sum", atol=0, rtol=0)
    ring_bytes = 2 * (n - 1) * (length // n) * 4  # 2(n-1) steps, one chunk each
    if n > 1 and sent["bytes"] == 0:
        raise Wrong("the sum is right but this rank sent nothing with send/isend: build the ring from point-to-point")
    if sent["bytes"] > ring_bytes:
        raise Wrong(f"the sum is right, but rank {r} sent {sent['bytes']} bytes where a ring sends "
                    f"2(n-1)/n x S = {ring_bytes}: send one chunk (S/n) per step, 2(n-1) steps")


# -- all_gather from broadcast -------------------------------------------------------------------

GATHER_DTYPES = (torch.float32, torch.bfloat16, torch.int64)  # buffers must follow x's dtype, not default to fp32


def check_all_gather_from_broadcast(ctx, answer) -> None:
    n, r = ctx.world_size, ctx.rank
    shape = (3, 2)
    for dtype in GATHER_DTYPES:
        inputs = [rank_values(k, shape, seed=2).to(dtype) for k in range(n)]
        want = torch.stack(inputs)  # [n, 3, 2]: row k is rank k's tensor
        x = inputs[r].clone().to(ctx.device)
        used: list[str] = []
        with only_point_to_point(allowed=("broadcast",), used=used):
            got = answer(x)
        agree(lambda: _input_unchanged(x, inputs[r]))  # first: a changed x also garbles the other ranks' rows
        agree(lambda: _gathered_right(got, x, want, inputs, used, n, r, dtype))


def _input_unchanged(x, mine) -> None:
    if not torch.equal(x.to("cpu"), mine):
        raise Wrong("your function changed its input x: did you broadcast into x itself? By your turn to send, "
                    "x holds another rank's data; broadcast into a new buffer")


def _gathered_right(got, x, want, inputs, used, n: int, r: int, dtype) -> None:
    name = str(dtype).replace("torch.", "")
    if isinstance(got, (list, tuple)):
        raise Wrong(f"return one tensor of shape {tuple(want.shape)}: torch.stack your {len(got)} pieces")
    if not isinstance(got, torch.Tensor):
        raise Wrong(f"all_gather_from_broadcast should return a tensor, not {type(got).__name__}")
    if got.dtype != dtype:
        raise Wrong(f"for a {name} x your result is {str(got.dtype).replace('torch.', '')}: the receive buffers "
                    f"must have x's dtype (torch.empty(shape) is float32 whatever x is, and a {name} value "
                    "received into it is converted or garbled); allocate them with torch.empty_like(x)")
    if got.device.type != x.device.type:
        raise Wrong(f"x is on {x.device} but your result is on {got.device}: allocate the buffers on x's device "
                    "(torch.empty_like(x)); NCCL cannot broadcast CPU tensors")
    got = got.detach().to("cpu")
    if not torch.isfinite(got).all():
        raise Wrong(f"rank {r}'s gathered {name} tensor holds NaN or inf where every rank sent finite values: "
                    "a row that was never received into (torch.empty holds whatever was in memory)?")
    if got.shape == want.shape and not torch.equal(got, want) and n > 1 and all(torch.equal(row, got[0]) for row in got):
        if torch.equal(got[0], inputs[0]):
            raise Wrong("every row holds rank 0's tensor: did you broadcast into x itself? After rank 0's turn "
                        "every x holds rank 0's data, and that is all anyone sends later; use a new buffer per broadcast")
        raise Wrong("every row holds the same tensor (the last one broadcast): the rows share one buffer; "
                    "give each broadcast its own buffer (torch.empty_like(x), or x.clone() on the sender)")
    expect_close(got, want, f"rank {r}'s gathered tensor ({name})", atol=0, rtol=0)
    if n > 1 and len(used) != n:
        raise Wrong(f"the result is right but took {len(used)} broadcasts: all_gather from broadcast needs exactly "
                    f"{n}, one from each rank")


CHECKS = {"ring_all_reduce": check_ring_all_reduce, "all_gather_from_broadcast": check_all_gather_from_broadcast}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    entrypoint(main)
