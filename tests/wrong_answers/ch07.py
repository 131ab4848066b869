"""Plausible wrong answers for chapter 07, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


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


def merge_unguarded(out_a, lse_a, out_b, lse_b):
    # The reference without its guard: when both parts are empty, max is -inf and -inf - (-inf) is nan.
    import torch

    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (w_a[:, None] * out_a + w_b[:, None] * out_b) / (w_a + w_b)[:, None], m + torch.log(w_a + w_b)


def merge_logaddexp_unguarded(out_a, lse_a, out_b, lse_b):
    # torch.logaddexp gets the LSE right (-inf for two empty parts), but the weights exp(-inf - -inf) are nan.
    import torch

    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[:, None] * out_a + torch.exp(lse_b - lse)[:, None] * out_b, lse


def merge_anchored_on_a(out_a, lse_a, out_b, lse_b):
    # Subtracts part a's LSE instead of the larger one: exp(lse_b - lse_a) overflows when b outweighs a by e^88.
    import torch

    r = torch.exp(lse_b - lse_a)
    lse = lse_a + torch.log1p(r)
    return (out_a + r[:, None] * out_b) / (1 + r)[:, None], lse


def merge_anchored_on_b_guarded(out_a, lse_a, out_b, lse_b):
    # Anchored on part b, with a guard for an empty b: still overflows when a outweighs b by more than e^88.
    import torch

    anchor = torch.where(torch.isinf(lse_b), lse_a, lse_b)
    anchor = torch.where(torch.isinf(anchor), torch.zeros_like(anchor), anchor)
    w_a, w_b = torch.exp(lse_a - anchor), torch.exp(lse_b - anchor)
    return (w_a[:, None] * out_a + w_b[:, None] * out_b) / (w_a + w_b).clamp_min(1e-30)[:, None], \
        anchor + torch.log(w_a + w_b)


def merge_clamped_lse(out_a, lse_a, out_b, lse_b):
    # Guards the empty rows with a clamp inside the log: out is right, but an empty union gets lse = -69, not -inf.
    import torch

    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = (w_a + w_b).clamp_min(1e-30)
    return (w_a[:, None] * out_a + w_b[:, None] * out_b) / total[:, None], m + torch.log(total)


def merge_in_place(out_a, lse_a, out_b, lse_b):
    # Right values, but accumulates into the caller's out_a and lse_a.
    import torch

    lse = torch.logaddexp(lse_a, lse_b)
    m = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out_a.mul_(torch.exp(lse_a - m)[:, None]).add_(torch.exp(lse_b - m)[:, None] * out_b)
    lse_a.copy_(lse)
    return out_a, lse_a


def merge_nan_in_one_row(out_a, lse_a, out_b, lse_b):
    # The reference's result with one nan where every part saw keys: stands for any slip that makes a nan there.
    from solutions.ch07 import merge_attention

    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    out[-1, 0] = float("nan")
    return out, lse


def merge_lse_keepdim(out_a, lse_a, out_b, lse_b):
    # logsumexp over the stacked LSEs with keepdim=True, so that lse broadcasts against out: lse comes back [N, 1].
    import torch

    lse = torch.logsumexp(torch.stack([lse_a, lse_b], dim=-1), dim=-1, keepdim=True)
    m = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse_a[:, None] - m) * out_a + torch.exp(lse_b[:, None] - m) * out_b, lse


def _tile_loop(q, k, v, causal, block, rescale=True, mask="absolute", subtract_max=True, lse_kind="m+log(l)",
               m_start=float("-inf"), scale_q_in_place=False):
    import math

    import torch

    n_q, d = q.shape
    scale = 1.0 / math.sqrt(d)
    if scale_q_in_place:
        q.mul_(scale)
        scale = 1.0
    m = torch.full((n_q,), m_start)
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


def forward_max_starts_at_zero(q, k, v, causal=False, block=16):
    # The running max initialised at 0: right whenever some score is near or above 0.
    return _tile_loop(q, k, v, causal, block, m_start=0.0)


def forward_full_matrix(q, k, v, causal=False, block=16):
    # Right numbers, but materialises the whole score matrix: not FlashAttention.
    import math

    import torch

    s = q @ k.T / math.sqrt(q.shape[1])
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=1)
    return torch.exp(s - lse[:, None]) @ v, lse


def forward_whole_tiles_only(q, k, v, causal=False, block=16):
    # n_k // block tiles: right when block divides the number of keys, blind to the shorter last tile.
    from solutions.ch07 import forward_tile_loop

    whole = (k.shape[0] // block) * block
    return forward_tile_loop(q, k[:whole], v[:whole], causal=causal, block=block)


def forward_loop_bounded_by_queries(q, k, v, causal=False, block=16):
    # The loop over key tiles stops at the number of queries: right for a square score matrix only.
    from solutions.ch07 import forward_tile_loop

    return forward_tile_loop(q, k[:max(q.shape[0], block)], v[:max(q.shape[0], block)], causal=causal, block=block)


def forward_scales_q_in_place(q, k, v, causal=False, block=16):
    # Folds the 1/sqrt(d) scale into q once, in place, to save a multiply per tile: the caller's q changes.
    return _tile_loop(q, k, v, causal, block, scale_q_in_place=True)


def forward_in_float64(q, k, v, causal=False, block=16):
    # Accumulates in float64 for safety, and hands the float64 result back.
    from solutions.ch07 import forward_tile_loop

    return forward_tile_loop(q.double(), k.double(), v.double(), causal=causal, block=block)


def forward_inf_lse(q, k, v, causal=False, block=16):
    # The reference's result with an infinite LSE in one row: stands for any slip that makes one there.
    from solutions.ch07 import forward_tile_loop

    out, lse = forward_tile_loop(q, k, v, causal=causal, block=block)
    lse[0] = float("inf")
    return out, lse


def backward_p_as_a_ratio(q, k, v, out, dout, lse, scale):
    # exp(s) / exp(lse): the same P in real numbers, inf / inf once a score passes about 88.7.
    p = (q @ k.T * scale).exp() / lse.exp()[:, None]
    dp = dout @ v.T
    return p.T @ dout, p * (dp - (dout * out).sum(dim=1, keepdim=True))


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


def backward_nan_in_ds(q, k, v, out, dout, lse, scale):
    # The reference's tile with one nan in dS: stands for any slip that makes one there.
    from solutions.ch07 import backward_tile

    dv, ds = backward_tile(q, k, v, out, dout, lse, scale)
    ds[0, -1] = float("nan")
    return dv, ds


def backward_delta_in_place(q, k, v, out, dout, lse, scale):
    # delta = rowsum(dO * O) computed in out's own memory, to save a tile-sized temporary.
    p = (q @ k.T * scale - lse[:, None]).exp()
    delta = out.mul_(dout).sum(dim=1, keepdim=True)
    return p.T @ dout, p * (dout @ v.T - delta)


def backward_in_float64(q, k, v, out, dout, lse, scale):
    # Recomputes P in float64 for accuracy, and hands float64 dV and dS back.
    from solutions.ch07 import backward_tile

    return backward_tile(q.double(), k.double(), v.double(), out.double(), dout.double(), lse.double(), scale)


# The classes of input each answer shows the check trying (tests/test_exercise_coverage.py).
tries("ragged")(merge_unguarded)
tries("mutation")(merge_in_place)
tries("non-finite")(merge_nan_in_one_row)
tries("output")(merge_lse_keepdim)
tries("memory")(forward_full_matrix)
tries("sizes", "ragged")(forward_whole_tiles_only)
tries("layouts")(forward_loop_bounded_by_queries)
tries("mutation")(forward_scales_q_in_place)
tries("output")(forward_in_float64)
tries("non-finite")(forward_inf_lse)
tries("non-finite")(backward_nan_in_ds)
tries("mutation")(backward_delta_in_place)
tries("output")(backward_in_float64)


WRONG = [
    ("merge_attention", merge_by_averaging, "missing rescale"),
    ("merge_attention", merge_lse_is_max, "not the larger of the two"),
    ("merge_attention", merge_without_max, "forgetting the max subtraction"),
    ("merge_attention", merge_unguarded, "both parts are empty (lse_a = lse_b = -inf): the merge is unguarded"),
    ("merge_attention", merge_logaddexp_unguarded, "the merge is unguarded"),
    ("merge_attention", merge_anchored_on_a, "anchored on one side's maximum"),
    ("merge_attention", merge_anchored_on_b_guarded, "anchored on one side's maximum"),
    ("merge_attention", merge_clamped_lse, "lse should be -inf (the log of an empty sum)"),
    ("merge_attention", merge_in_place, "changed its inputs in place"),
    ("merge_attention", merge_nan_in_one_row, "nan or inf where the answer is finite (first in row 11"),
    ("merge_attention", merge_lse_keepdim, "lse should have shape (12,), got (12, 1)"),
    ("forward_tile_loop", forward_missing_rescale, "missing rescale"),
    ("forward_tile_loop", forward_tile_local_mask, "wrong mask"),
    ("forward_tile_loop", forward_no_max_subtraction, "forgetting the max subtraction"),
    ("forward_tile_loop", forward_lse_without_max, "wrong LSE"),
    ("forward_tile_loop", forward_full_matrix, "as large as the whole"),
    ("forward_tile_loop", forward_max_starts_at_zero, "the running max starts at 0 instead of -inf"),
    ("forward_tile_loop", forward_whole_tiles_only, "the only tile is shorter than block"),
    ("forward_tile_loop", forward_loop_bounded_by_queries, "bounded by the number of queries"),
    ("forward_tile_loop", forward_scales_q_in_place, "changed q in place"),
    ("forward_tile_loop", forward_in_float64, "out should be float32"),
    ("forward_tile_loop", forward_inf_lse, "the LSE holds nan or inf (first in row 0)"),
    ("backward_tile", backward_without_delta, "left out delta"),
    ("backward_tile", backward_p_as_a_ratio, "rebuild P in one exponent"),
    ("backward_tile", backward_delta_over_tile, "this tile's keys only"),
    ("backward_tile", backward_softmax_over_tile, "saved LSE"),
    ("backward_tile", backward_nan_in_ds, "dS holds nan or inf (first in row 0)"),
    ("backward_tile", backward_delta_in_place, "changed out in place"),
    ("backward_tile", backward_in_float64, "dv should be float32"),
]
