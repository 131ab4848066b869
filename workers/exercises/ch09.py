"""Rank-side check for chapter 09's cross-rank checksum exercise, on real ranks.

The learner writes ``cross_rank_checksum(params) -> list``: every rank's checksum of its parameters, by rank,
the same list on every rank. Every rank builds the same tiny GPT (``workers/gpt``), then the check runs the
learner's function on these situations: all ranks equal; a second call on unchanged weights (a checksum must
be deterministic); the last rank with one element of its last parameter changed by 1.0 (a checksum that
reads only some parameters misses it); the last rank with the lowest mantissa bit of one element flipped
(what a plain float sum rounds away; when missed, the same element changed by 1.0 tells a float sum from a
parameter never read); the last rank with the lowest bit of a weight of 1.5e-12 flipped (what even a float64 sum
rounds away) and with -0.0 where the others hold 0.0 (equal values, other bits: what any checksum of values
misses); and rank 0 with two elements swapped (what any order-blind sum misses). Every checksum must be a finite
number if it is a float (inf and nan compare meaninglessly), and the parameters must be unchanged. Ranks
agree on a verdict before anyone raises (``agree``), so a wrong answer never turns into a hang.
"""
from __future__ import annotations

import math

import torch

from workers.exercises.support import Wrong, agree, run_exercise
from workers.gpt.reduce import gather_objects
from workers.gpt.telemetry import flat_params, flip_bit_
from workers.model import GPTConfig, make_model

CFG = GPTConfig(vocab=16, seq=8, hidden=32, heads=2, layers=1)
FLIP_AT = (4, 5)  # (parameter index, element) whose lowest mantissa bit the last rank flips
SWAP_IN = 4  # parameter whose first two (different) elements rank 0 swaps
BUMP = 1.0  # added to one element in the coverage stages: a change no checksum, float sum included, may miss
# A weight decayed to almost nothing in the largest tensor (mlp.fc1.weight, 4096 values of order 0.02): its lowest
# mantissa bit is worth ~1e-19, far below half a float64 ulp of the sums it is added into, so even a float64 sum of
# the values rounds its flip away.
TINY_AT, TINY = (10, 7), 1.5e-12
ZERO_AT = (3, 2)  # (parameter index, element): a LayerNorm bias, 0.0 at init; the last rank holds -0.0 there


def _params():
    return list(make_model(CFG, seed=0).parameters())


def _not_finite(checksum) -> bool:
    """A float checksum (or a one-element float tensor) that is nan or infinite; ints, strings and bytes are fine."""
    if isinstance(checksum, torch.Tensor) and checksum.numel() == 1 and checksum.is_floating_point():
        checksum = checksum.item()
    return isinstance(checksum, float) and not math.isfinite(checksum)


def _call(answer, params, where: str) -> list:
    before = flat_params(params)
    got = answer(params)
    after = flat_params(params)
    everyone = gather_objects(got if isinstance(got, (list, tuple)) else repr(got))

    def shape_right():
        n = len(everyone)
        if not isinstance(got, (list, tuple)):
            raise Wrong(f"{where}: return a list with one checksum per rank (dist.all_gather_object), "
                        f"not a {type(got).__name__}")
        if len(got) != n:
            raise Wrong(f"{where}: the list has {len(got)} entries at world size {n}: return one checksum per rank "
                        "(dist.all_gather_object), not only your own")
        odd = [(r, c) for r, c in enumerate(got) if _not_finite(c)]
        if odd:
            raise Wrong(f"{where}: rank {odd[0][0]}'s checksum is {odd[0][1]!r}, not a finite number: inf absorbs "
                        "every change (inf + x = inf) and nan never equals itself, so no comparison of such "
                        "checksums means anything. Checksum the bits (t.view(torch.int32)), in integer arithmetic")
        if any(list(e) != list(got) for e in everyone):
            raise Wrong(f"{where}: the ranks returned different lists: every rank must return every rank's "
                        "checksum, in rank order")
        if not torch.equal(before, after):
            raise Wrong(f"{where}: the parameters changed during the call: a checksum must only read them "
                        "(p.detach() and p.view(torch.int32) share the parameter's memory: an in-place operation "
                        "on them rewrites the weights)")

    agree(shape_right)
    return list(got)


def check_cross_rank_checksum(ctx, answer) -> None:
    n, last = ctx.world_size, ctx.world_size - 1
    params = _params()
    equal = _call(answer, params, "all ranks equal")

    def equal_right():
        if len(set(map(repr, equal))) != 1:
            raise Wrong(f"all ranks hold the same parameters but the checksums differ ({equal}): the checksum must "
                        "depend only on the values, never on the rank")

    agree(equal_right)

    again = _call(answer, params, "the same parameters, a second time")

    def deterministic():
        if again != equal:
            raise Wrong("two calls on unchanged parameters gave different checksums: use no randomness and no "
                        "ids of objects, only the values")

    agree(deterministic)

    # Every parameter must count: the last one changed by a whole 1.0 on the last rank (a checksum that reads
    # only params[0], or stops early, misses it; a float sum does not).
    bumped = _params()
    if ctx.rank == last:
        bumped[-1].data.view(-1)[0] += BUMP
    after_bump = _call(answer, bumped, f"rank {last} with one element of its last parameter changed by {BUMP:g}")

    def bump_seen():
        if after_bump[last] == after_bump[0] and n > 1:
            raise Wrong(f"rank {last} added {BUMP:g} to one element of its last parameter (params[-1]) and its checksum "
                        "did not change: your checksum does not read every parameter (only the first? a loop that "
                        "returns early?). Every tensor in params must count")

    agree(bump_seen)

    flipped = _params()
    if ctx.rank == last:
        flip_bit_(flipped[FLIP_AT[0]].data, FLIP_AT[1], 0)  # the lowest mantissa bit: a change of ~1e-8 relative
    after_flip = _call(answer, flipped, f"rank {last} with one low bit flipped")
    missed = after_flip[last] == after_flip[0] and n > 1  # the same on every rank: the lists agree
    if missed:
        # Which mistake? The same element changed by a whole 1.0: a float sum sees that, a checksum that never
        # reads this parameter does not.
        big = _params()
        if ctx.rank == last:
            big[FLIP_AT[0]].data.view(-1)[FLIP_AT[1]] += BUMP
        after_big = _call(answer, big, f"rank {last} with one element of parameter {FLIP_AT[0]} changed by {BUMP:g}")
        big_missed = after_big[last] == after_big[0]

    def flip_seen():
        if missed and big_missed:
            raise Wrong(f"rank {last} changed element {FLIP_AT[1]} of parameter {FLIP_AT[0]} (by one low bit, then by "
                        f"{BUMP:g}) and its checksum never changed: your checksum does not read params[{FLIP_AT[0]}] "
                        "(only some of the parameters?). Every tensor in params must count")
        if missed:
            raise Wrong(f"rank {last} has one element whose lowest mantissa bit flipped, and its checksum still equals "
                        f"rank 0's, though a change of {BUMP:g} in the same element shows: a float sum rounds such a "
                        "change away. Checksum the bits (t.view(torch.int32)), in integer arithmetic")
        others = [c for r, c in enumerate(after_flip) if r != last]
        if len(set(map(repr, others))) > 1:
            raise Wrong("only the last rank changed, but the other ranks' checksums now differ from each other")

    agree(flip_seen)

    # Bits a sum of values cannot see in any precision: a low bit of a nearly-zero weight, and a zero's sign.
    tiny = _params()
    tiny[TINY_AT[0]].data.view(-1)[TINY_AT[1]] = TINY
    if ctx.rank == last:
        flip_bit_(tiny[TINY_AT[0]].data, TINY_AT[1], 0)
    after_tiny = _call(answer, tiny, f"rank {last} with the lowest bit of a weight of {TINY:g} flipped")

    def tiny_seen():
        if after_tiny[last] == after_tiny[0] and n > 1:
            raise Wrong(f"rank {last} flipped the lowest mantissa bit of a weight of {TINY:g} in a tensor of values "
                        f"of order 0.02 (element {TINY_AT[1]} of params[{TINY_AT[0]}]) and its checksum still equals "
                        "rank 0's: a sum of values, even in float64, rounds a change of ~1e-19 away. Checksum the "
                        "bits (t.view(torch.int32)), in integer arithmetic")

    agree(tiny_seen)

    signed = _params()
    if ctx.rank == last:
        signed[ZERO_AT[0]].data.view(-1)[ZERO_AT[1]] = -0.0
    after_signed = _call(answer, signed, f"rank {last} with -0.0 where the others hold 0.0")

    def sign_seen():
        if after_signed[last] == after_signed[0] and n > 1:
            raise Wrong(f"rank {last} holds -0.0 where every other rank holds 0.0 (element {ZERO_AT[1]} of "
                        f"params[{ZERO_AT[0]}]) and its checksum still equals rank 0's: the two are equal as values "
                        "(-0.0 == 0.0, hash(-0.0) == hash(0.0)) but differ in the sign bit, so a checksum of values "
                        "cannot tell them apart. Checksum the bits (t.view(torch.int32)), in integer arithmetic")

    agree(sign_seen)

    swapped = _params()
    if ctx.rank == 0:
        w = swapped[SWAP_IN].data.view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()
    after_swap = _call(answer, swapped, "rank 0 with two elements swapped")

    def swap_seen():
        if after_swap[0] == after_swap[-1] and n > 1:
            raise Wrong("rank 0 swapped two elements of one parameter and its checksum did not change: a sum of the "
                        "bits ignores positions. Weight each element by its position (sum of bits_i * (i + 1))")

    agree(swap_seen)


CHECKS = {"cross_rank_checksum": check_cross_rank_checksum}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
