"""Plausible wrong answers for chapter 14, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def zigzag_contiguous(seq, cp, rank):
    per = seq // cp
    return [(rank * per, (rank + 1) * per)]  # the plain split: causal work grows with the rank


def zigzag_shifted_pairing(seq, cp, rank):
    size = seq // (2 * cp)
    return [(rank * size, (rank + 1) * size), ((cp + rank) * size, (cp + rank + 1) * size)]  # shift, not mirror


def zigzag_mirror_off_by_one(seq, cp, rank):
    size = seq // (2 * cp)
    mirror = 2 * cp - rank  # counted from 2*cp, not from the last chunk 2*cp-1
    return [(rank * size, (rank + 1) * size), (mirror * size, (mirror + 1) * size)]


def zigzag_float_bounds(seq, cp, rank):
    size = seq / (2 * cp)  # a float: 2.0, and every bound after it
    mirror = 2 * cp - 1 - rank
    return [(rank * size, (rank + 1) * size), (mirror * size, (mirror + 1) * size)]


def zigzag_mirror_from_cp(seq, cp, rank):
    size = seq // (2 * cp)
    mirror = cp + 1 - rank  # equals 2*cp-1-rank at cp = 2 only
    return [(rank * size, (rank + 1) * size), (mirror * size, (mirror + 1) * size)]


def zigzag_nan_bound(seq, cp, rank):
    from solutions.ch14 import zigzag_chunks

    (a, b), (c, _) = zigzag_chunks(seq, cp, rank)
    return [(a, b), (c, float("nan"))]  # one bound NaN


def zigzag_late_chunk_first(seq, cp, rank):
    size = seq // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return [(mirror * size, (mirror + 1) * size), (rank * size, (rank + 1) * size)]


def block_kind_swapped(q_chunk, k_chunk):
    if k_chunk > q_chunk:
        return "full"  # the roles of queries and keys exchanged
    if q_chunk == k_chunk:
        return "diagonal"
    return "skip"


def block_kind_diagonal_skipped(q_chunk, k_chunk):
    return "full" if q_chunk > k_chunk else "skip"  # the diagonal masked fully: no query sees its own chunk


def block_kind_diagonal_unmasked(q_chunk, k_chunk):
    return "full" if q_chunk >= k_chunk else "skip"  # the diagonal computed without its mask


def block_kind_no_future_skip(q_chunk, k_chunk):
    return "diagonal" if q_chunk == k_chunk else "full"  # future blocks computed: queries see later keys


def block_kind_a_mask(q_chunk, k_chunk):
    return q_chunk >= k_chunk  # whether the block is visible at all, not how: the diagonal needs its own mask


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("output")(zigzag_float_bounds)
tries("layouts")(zigzag_mirror_from_cp)
tries("non-finite")(zigzag_nan_bound)
tries("output")(block_kind_a_mask)


WRONG = [
    ("zigzag_chunks", zigzag_contiguous, "that is the contiguous split"),
    ("zigzag_chunks", zigzag_shifted_pairing, "a shift, not a mirror"),
    ("zigzag_chunks", zigzag_mirror_off_by_one, "the mirror is off by one"),
    ("zigzag_chunks", zigzag_float_bounds, "not ints"),
    ("zigzag_chunks", zigzag_late_chunk_first, "the wrong order"),
    ("zigzag_chunks", zigzag_mirror_from_cp, "chunk r and chunk 2*cp-1-r"),
    ("zigzag_chunks", zigzag_nan_bound, "a bound is nan"),
    ("block_kind", block_kind_diagonal_skipped, "you skipped the diagonal block"),
    ("block_kind", block_kind_diagonal_unmasked, "the diagonal block needs the causal mask inside it"),
    ("block_kind", block_kind_no_future_skip, "skip future blocks"),
    ("block_kind", block_kind_swapped, "q_chunk and k_chunk swapped"),
    ("block_kind", block_kind_a_mask, "return one of 'full', 'diagonal', 'skip', not True"),
]
