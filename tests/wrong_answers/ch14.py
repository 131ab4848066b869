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


def seq_to_heads_scatters_sequence(x, cp, all_to_all):
    import torch

    return torch.cat(all_to_all(list(x.chunk(cp, dim=0))), dim=0)  # pieces of rows, not of heads


def seq_to_heads_gathers_heads(x, cp, all_to_all):
    import torch

    return torch.cat(all_to_all(list(x.chunk(cp, dim=1))), dim=1)  # the arrivals joined along the heads


def seq_to_heads_strided_heads(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    return torch.cat(all_to_all([x[:, j::cp] for j in range(cp)]), dim=0)  # heads j, j+cp, ... on rank j


def seq_to_heads_interleaved_rows(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    got = all_to_all(list(x.chunk(cp, dim=1)))
    return torch.stack(got, dim=1).reshape(-1, x.shape[1] // cp, x.shape[2])  # row 0 of every rank, then row 1...


def seq_to_heads_split_not_chunk(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    return torch.cat(all_to_all(list(x.split(cp, dim=1))), dim=0)  # pieces of cp heads: cp pieces only if h = cp^2


def seq_to_heads_no_refusal(x, cp, all_to_all):
    import torch

    return torch.cat(all_to_all(list(x.chunk(cp, dim=1))), dim=0)  # sends whatever chunk gives when cp does not divide


def seq_to_heads_sent_as_float64(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    got = all_to_all([p.double() for p in x.chunk(cp, dim=1)])  # "safer" in float64: twice float32's bytes
    return torch.cat(got, dim=0).to(x.dtype)


def seq_to_heads_transpose_in_place(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    x.transpose_(0, 1)  # [heads, seq/cp, d], in the caller's tensor
    got = all_to_all(list(x.chunk(cp, dim=0)))  # [heads/cp, seq/cp, d] each
    return torch.cat(got, dim=1).transpose(0, 1)  # [seq, heads/cp, d]


def seq_to_heads_float32_buffer(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    rows, heads, d = x.shape
    out = torch.empty(rows * cp, heads // cp, d)  # the default dtype, float32
    for i, piece in enumerate(all_to_all(list(x.chunk(cp, dim=1)))):
        out[i * rows:(i + 1) * rows] = piece
    return out


def seq_to_heads_added_into_zeros(x, cp, all_to_all):
    import torch

    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    rows, heads, d = x.shape
    out = torch.zeros(rows * cp, heads // cp, d, dtype=x.dtype)
    for i, piece in enumerate(all_to_all(list(x.chunk(cp, dim=1)))):
        out[i * rows:(i + 1) * rows] += piece  # 0.0 + -0.0 is 0.0: a computation, not a copy
    return out


def seq_to_heads_returns_pieces(x, cp, all_to_all):
    if x.shape[1] % cp:
        raise ValueError("cp does not divide the heads")
    return all_to_all(list(x.chunk(cp, dim=1)))  # the received pieces, never joined


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("output")(zigzag_float_bounds)
tries("layouts")(zigzag_mirror_from_cp)
tries("non-finite")(zigzag_nan_bound)
tries("output")(block_kind_a_mask)
tries("layouts")(seq_to_heads_split_not_chunk)
tries("sizes")(seq_to_heads_no_refusal)
tries("traffic")(seq_to_heads_sent_as_float64)
tries("mutation")(seq_to_heads_transpose_in_place)
tries("output")(seq_to_heads_float32_buffer)
tries("bits")(seq_to_heads_added_into_zeros)


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
    ("seq_to_heads", seq_to_heads_scatters_sequence, "you split the sequence (dim 0)"),
    ("seq_to_heads", seq_to_heads_gathers_heads, "you concatenated what arrived along the heads (dim 1)"),
    ("seq_to_heads", seq_to_heads_strided_heads, "strided: rank j takes h/cp consecutive heads"),
    ("seq_to_heads", seq_to_heads_interleaved_rows, "rows are interleaved"),
    ("seq_to_heads", seq_to_heads_split_not_chunk, "x.chunk(cp, dim=1) cuts cp pieces"),
    ("seq_to_heads", seq_to_heads_no_refusal, "raise ValueError naming cp and heads before anything is sent"),
    ("seq_to_heads", seq_to_heads_sent_as_float64, "you sent the pieces as torch.float64 for torch.float32 input"),
    ("seq_to_heads", seq_to_heads_transpose_in_place, "changed the caller's x"),
    ("seq_to_heads", seq_to_heads_float32_buffer, "torch.float32 on cpu for torch.float64 input"),
    ("seq_to_heads", seq_to_heads_added_into_zeros, "not their bits"),
    ("seq_to_heads", seq_to_heads_returns_pieces, "not one tensor"),
]
