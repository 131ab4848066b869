"""Reference answers for chapter 07's exercises (self-contained: imports inside each function)."""


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets, from each set's normalised output and LSE.

    out_x = sum_{j in x} exp(s_j - lse_x) v_j, so exp(lse_x) * out_x is the unnormalised sum over x. Over the
    union lse = log(exp(lse_a) + exp(lse_b)), and each part is reweighted by its share exp(lse_x - lse).
    Computed around m = max(lse_a, lse_b) so that nothing overflows; a part with lse = -inf gets weight 0.
    """
    import torch

    m = torch.maximum(lse_a, lse_b)  # [N]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both parts empty: avoid -inf - -inf
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # [N], each <= 1
    total = w_a + w_b
    lse = m + torch.log(total)
    out = (w_a[:, None] * out_a + w_b[:, None] * out_b) / total.clamp_min(1e-30)[:, None]  # [N, D]
    return out, lse


def forward_tile_loop(q, k, v, causal=False, block=16):
    """FlashAttention forward for one head: q [Nq, D], k and v [Nk, D] -> (out [Nq, D], lse [Nq]).

    Keys are visited in tiles of ``block``; per query row we keep the running max m, the running sum
    l = sum exp(s - m) and acc = sum exp(s - m) v. A new tile that raises the max rescales l and acc by
    exp(m_old - m_new) (Milakov & Gimelshein 2018; Dao et al. 2022, Algorithm 1).
    """
    import math

    import torch

    n_q, d = q.shape
    n_k = k.shape[0]
    scale = 1.0 / math.sqrt(d)
    m = torch.full((n_q,), float("-inf"), dtype=q.dtype)
    l = torch.zeros(n_q, dtype=q.dtype)
    acc = torch.zeros(n_q, v.shape[1], dtype=q.dtype)
    rows = torch.arange(n_q)[:, None]  # absolute query positions
    for start in range(0, n_k, block):
        k_tile, v_tile = k[start:start + block], v[start:start + block]  # [Bk, D]
        s = q @ k_tile.T * scale  # [Nq, Bk]
        if causal:
            cols = torch.arange(start, start + k_tile.shape[0])[None, :]  # absolute key positions
            s = s.masked_fill(cols > rows, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        alpha = torch.exp(m - m_safe)  # rescale what was summed under the old max
        p = torch.exp(s - m_safe[:, None])  # [Nq, Bk]
        l = alpha * l + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v_tile
        m = m_new
    return acc / l[:, None], m + torch.log(l)


def backward_tile(q, k, v, out, dout, lse, scale):
    """One (query tile, key tile) of the FlashAttention backward: (dV contribution [Bk, D], dS [Bq, Bk]).

    P is rebuilt exactly from the saved LSE (no max, no sum over the row needed); delta = rowsum(dO * O)
    equals sum_j P_ij dP_ij over the whole row, so every tile can use it (Dao 2023, Algorithm 2).
    """
    p = (q @ k.T * scale - lse[:, None]).exp()  # [Bq, Bk]
    dv = p.T @ dout  # [Bk, D]
    dp = dout @ v.T  # [Bq, Bk]
    delta = (dout * out).sum(dim=1, keepdim=True)  # [Bq, 1]
    return dv, p * (dp - delta)
