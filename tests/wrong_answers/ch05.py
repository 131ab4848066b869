"""Plausible wrong answers for chapter 05, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def qkv_naive_chunk(w, heads, kv_heads, head_dim, rank, tp):
    # The fused-QKV trap: a contiguous 1/t of [Q; K; V].
    return w.chunk(tp, dim=0)[rank]


def qkv_chunk_each_part(w, heads, kv_heads, head_dim, rank, tp):
    # Right for MHA and for GQA with KV heads divisible by t; cuts a KV head in pieces when t > kv_heads.
    import torch

    d = head_dim
    q, k, v = w[:heads * d], w[heads * d:(heads + kv_heads) * d], w[(heads + kv_heads) * d:]
    return torch.cat([q.chunk(tp)[rank], k.chunk(tp)[rank], v.chunk(tp)[rank]])


def qkv_k_and_v_swapped(w, heads, kv_heads, head_dim, rank, tp):
    import torch

    d, t = head_dim, tp
    q_per = heads // t
    kv = (list(range(rank * kv_heads // t, (rank + 1) * kv_heads // t)) if kv_heads % t == 0
          else [rank // (t // kv_heads)])
    q = w[rank * q_per * d:(rank + 1) * q_per * d]
    k_all, v_all = w[heads * d:(heads + kv_heads) * d], w[(heads + kv_heads) * d:]
    return torch.cat([q] + [v_all[j * d:(j + 1) * d] for j in kv] + [k_all[j * d:(j + 1) * d] for j in kv])


def kv_round_robin(heads, kv_heads, tp, rank):
    # Right when the KV heads are split; round-robin when they are replicated, so rank 1 reads the wrong head.
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank % kv_heads]


def kv_one_per_rank(heads, kv_heads, tp, rank):
    return [rank]


def qkv_float32_buffer(w, heads, kv_heads, head_dim, rank, tp):
    # The right rows, copied into a buffer made with the default dtype: a bf16 checkpoint comes out float32.
    import torch

    d, t = head_dim, tp
    q_per = heads // t
    if kv_heads % t == 0:
        kv = list(range(rank * kv_heads // t, (rank + 1) * kv_heads // t))
    else:
        kv = [rank // (t // kv_heads)]
    rows = list(range(rank * q_per * d, (rank + 1) * q_per * d))
    for base in (heads * d, (heads + kv_heads) * d):
        rows += [base + j * d + i for j in kv for i in range(d)]
    out = torch.zeros((len(rows),) + tuple(w.shape[1:]))  # dtype forgotten
    for k, row in enumerate(rows):
        out[k] = w[row]
    return out


def kv_one_per_query_head(heads, kv_heads, tp, rank):
    # The right formula, one entry per query head: shared KV heads are listed several times.
    q_per = heads // tp
    return [j // (heads // kv_heads) for j in range(rank * q_per, (rank + 1) * q_per)]


def qkv_nan_in_one_row(w, heads, kv_heads, head_dim, rank, tp):
    # The right rows, then one entry NaN (what a 0 / 0 left in a hand-made buffer looks like).
    import torch

    d, t = head_dim, tp
    q_per = heads // t
    kv = (list(range(rank * kv_heads // t, (rank + 1) * kv_heads // t)) if kv_heads % t == 0
          else [rank // (t // kv_heads)])
    q = w[rank * q_per * d:(rank + 1) * q_per * d]
    k_all, v_all = w[heads * d:(heads + kv_heads) * d], w[(heads + kv_heads) * d:]
    out = torch.cat([q] + [k_all[j * d:(j + 1) * d] for j in kv] + [v_all[j * d:(j + 1) * d] for j in kv])
    out.view(-1)[0] = float("nan")
    return out


def qkv_kv_sliced_like_q(w, heads, kv_heads, head_dim, rank, tp):
    # K and V cut like Q, heads / tp heads per rank: right for multi-head attention (kv_heads == heads) only.
    import torch

    d, t = head_dim, tp
    q_per = heads // t
    k_all, v_all = w[heads * d:(heads + kv_heads) * d], w[(heads + kv_heads) * d:]
    rows = slice(rank * q_per * d, (rank + 1) * q_per * d)
    return torch.cat([w[rows], k_all[rows], v_all[rows]])


def kv_float_group(heads, kv_heads, tp, rank):
    # The right formula with group = heads / kv_heads: a true division, so the head numbers come out floats.
    group = heads / kv_heads
    q_per = heads // tp
    return sorted({j // group for j in range(rank * q_per, (rank + 1) * q_per)})


def kv_nan_when_replicated(heads, kv_heads, tp, rank):
    # Right when the KV heads split; a NaN where they are replicated (tp > kv_heads).
    if kv_heads < tp:
        return [float("nan")]
    group = heads // kv_heads
    q_per = heads // tp
    return sorted({j // group for j in range(rank * q_per, (rank + 1) * q_per)})


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("sizes")(qkv_chunk_each_part)
tries("output")(qkv_float32_buffer)
tries("non-finite")(qkv_nan_in_one_row)
tries("layouts")(qkv_kv_sliced_like_q)
tries("sizes")(kv_round_robin)
tries("layouts")(kv_one_per_rank)
tries("output")(kv_float_group)
tries("non-finite")(kv_nan_when_replicated)

WRONG = [
    ("split_fused_qkv", qkv_naive_chunk, "contiguous chunk"),
    ("split_fused_qkv", qkv_chunk_each_part, "cannot be split"),
    ("split_fused_qkv", qkv_k_and_v_swapped, "in that order"),
    ("split_fused_qkv", qkv_float32_buffer, "it must keep w's dtype"),
    ("split_fused_qkv", qkv_nan_in_one_row, "NaN or infinite value(s)"),
    ("split_fused_qkv", qkv_kv_sliced_like_q, "K and V hold 4 heads each, not 8"),
    ("kv_heads_for_rank", kv_one_per_query_head, "repeats some"),
    ("kv_heads_for_rank", kv_round_robin, "reads KV head j // 4"),
    ("kv_heads_for_rank", kv_one_per_rank, "query head j reads KV head"),
    ("kv_heads_for_rank", kv_float_group, "heads / kv_heads is a true division"),
    ("kv_heads_for_rank", kv_nan_when_replicated, "NaN or infinite"),
]
