"""Plausible wrong answers for chapter 07, each with a fragment of the message the check must give."""


def merge_by_averaging(out_a, lse_a, out_b, lse_b):
    # Treats the two parts as equally important: a missing rescale by each part's softmax mass.
    import torch

    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_lse_is_max(out_a, lse_a, out_b, lse_b):
    # Right weights, but reports the larger LSE as the union's.
    import torch

    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse)[:, None] * out_a + torch.exp(lse_b - lse)[:, None] * out_b
    return out, torch.maximum(lse_a, lse_b)


def merge_without_max(out_a, lse_a, out_b, lse_b):
    # Exact in real numbers, but exp(lse) overflows fp32 once an LSE passes about 88.7.
    import torch

    ea, eb = torch.exp(lse_a), torch.exp(lse_b)
    return (ea[:, None] * out_a + eb[:, None] * out_b) / (ea + eb)[:, None], torch.log(ea + eb)


def _tile_loop(q, k, v, causal, block, rescale=True, mask="absolute", subtract_max=True, lse_kind="m+log(l)"):
    import math

    import torch

    n_q, d = q.shape
    scale = 1.0 / math.sqrt(d)
    m = torch.full((n_q,), float("-inf"))
    l = torch.zeros(n_q)
    acc = torch.zeros(n_q, v.shape[1])
    for start in range(0, k.shape[0], block):
        k_tile, v_tile = k[start:start + block], v[start:start + block]
        s = q @ k_tile.T * scale
        if causal:
            local = torch.arange(k_tile.shape[0])[None, :]
            cols = local if mask == "tile-local" else local + start
            s = s.masked_fill(cols > torch.arange(n_q)[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=1))
        m_ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new) if subtract_max else torch.zeros(n_q)
        alpha = torch.exp(m - m_ref) if (rescale and subtract_max) else torch.ones(n_q)
        p = torch.exp(s - m_ref[:, None])
        l = alpha * l + p.sum(dim=1)
        acc = alpha[:, None] * acc + p @ v_tile
        m = m_new
    lse = {"m+log(l)": (m if subtract_max else 0) + torch.log(l), "log(l)": torch.log(l)}[lse_kind]
    return acc / l[:, None], lse


def forward_missing_rescale(q, k, v, causal=False, block=16):
    return _tile_loop(q, k, v, causal, block, rescale=False)


def forward_tile_local_mask(q, k, v, causal=False, block=16):
    # Compares key positions inside the tile (0..block-1) with absolute query positions.
    return _tile_loop(q, k, v, causal, block, mask="tile-local")


def forward_no_max_subtraction(q, k, v, causal=False, block=16):
    # exp(scores) directly: fine for small scores, inf once a score passes about 88.7 in fp32.
    return _tile_loop(q, k, v, causal, block, subtract_max=False)


def forward_lse_without_max(q, k, v, causal=False, block=16):
    # out is right; the LSE forgets to add the running max back.
    return _tile_loop(q, k, v, causal, block, lse_kind="log(l)")


def forward_full_matrix(q, k, v, causal=False, block=16):
    # Right numbers, but materialises the whole score matrix: not FlashAttention.
    import math

    import torch

    s = q @ k.T / math.sqrt(q.shape[1])
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=1)
    return torch.exp(s - lse[:, None]) @ v, lse


def backward_without_delta(q, k, v, out, dout, lse, scale):
    p = (q @ k.T * scale - lse[:, None]).exp()
    return p.T @ dout, p * (dout @ v.T)


def backward_delta_over_tile(q, k, v, out, dout, lse, scale):
    # The textbook delta_i = sum_j P_ij dP_ij, but summed over this tile's keys only.
    p = (q @ k.T * scale - lse[:, None]).exp()
    dp = dout @ v.T
    return p.T @ dout, p * (dp - (p * dp).sum(dim=1, keepdim=True))


def backward_softmax_over_tile(q, k, v, out, dout, lse, scale):
    # Rebuilds P by a softmax over the tile's keys instead of with the saved LSE.
    p = (q @ k.T * scale).softmax(dim=1)
    dp = dout @ v.T
    return p.T @ dout, p * (dp - (dout * out).sum(dim=1, keepdim=True))


WRONG = [
    ("merge_attention", merge_by_averaging, "missing rescale"),
    ("merge_attention", merge_lse_is_max, "not the larger of the two"),
    ("merge_attention", merge_without_max, "forgetting the max subtraction"),
    ("forward_tile_loop", forward_missing_rescale, "missing rescale"),
    ("forward_tile_loop", forward_tile_local_mask, "wrong mask"),
    ("forward_tile_loop", forward_no_max_subtraction, "forgetting the max subtraction"),
    ("forward_tile_loop", forward_lse_without_max, "wrong LSE"),
    ("forward_tile_loop", forward_full_matrix, "whole"),
    ("backward_tile", backward_without_delta, "left out delta"),
    ("backward_tile", backward_delta_over_tile, "this tile's keys only"),
    ("backward_tile", backward_softmax_over_tile, "saved LSE"),
]
