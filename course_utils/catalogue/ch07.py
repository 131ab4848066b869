"""Chapter 07's graded exercises, checked in the notebook process (attention is single-process here).

- ``merge_attention``: combine attention over two disjoint sets of keys from their (out, lse) pairs;
- ``forward_tile_loop``: the FlashAttention forward for one head, walking the keys tile by tile;
- ``backward_tile``: one tile of the backward: P rebuilt from the LSE, dV's share, and dS = P * (dP - delta).

Every check compares with the float64 reference of ``workers/attention/reference.py`` on fresh random inputs,
and climbs a ladder of cases, each adding one difficulty (several tiles, a causal mask, scores large enough
to overflow exp in fp32), so that the first case that fails names the missing idea.
"""
from __future__ import annotations

import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

# Inputs are fp32 (what a kernel's accumulators hold); the reference is float64. fp32 arithmetic in a
# correct answer errs by about 1e-7 relative: 1e-5 leaves room for any order of summation.
RELATIVE_TOLERANCE = 1e-5
LSE_TOLERANCE = 1e-4  # absolute: the LSE is a log
SHIFT = 200.0  # added to every score in the overflow cases: exp(200) overflows fp32 (max about 3.4e38 = e^88.7)


def _tolerance(shift: float) -> float:
    """An fp32 score near ``shift`` is rounded by about shift * 2^-24 (1.2e-5 at 200), and exp turns that absolute
    error into the same relative error: correct fp32 answers on shifted scores miss by that much."""
    return RELATIVE_TOLERANCE + 8 * abs(shift) * 2.0 ** -24


def _generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _fresh_seed(seed: int | None) -> int:
    """Fresh inputs on every check (a correct answer passes any of them); a failing verdict names the seed, and
    ``check_<exercise>(answer, seed=...)`` replays exactly those inputs."""
    import random

    return random.SystemRandom().randrange(1, 2 ** 31) if seed is None else seed


def _with_seed(verdict: tuple[str, str], seed: int) -> tuple[str, str]:
    status, message = verdict
    return (status, message) if status == PASS else (status, f"{message} [random inputs, seed {seed}]")


def _relative_error(actual, expected) -> float:
    diff = (actual.detach().double() - expected.double()).abs().max()
    return (diff / expected.double().abs().max().clamp_min(1e-300)).item()


def _tensor_problem(name: str, got, shape) -> str | None:
    """A one-sentence complaint if ``got`` is not a float32 tensor of ``shape`` (finite or not); else None."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{name} should be a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(shape):
        return f"{name} should have shape {tuple(shape)}, got {tuple(got.shape)}"
    if got.dtype != torch.float32:
        return (f"{name} should be float32, the dtype of the inputs, got {got.dtype}: a kernel hands back its inputs' "
                "dtype (accumulate in a wider one if you like, then cast back)")
    return None


def _first_bad_row(*tensors) -> int:
    """The first row index where any of ``tensors`` (same number of rows) holds nan or inf."""
    import torch

    bad = torch.zeros(tensors[0].shape[0], dtype=torch.bool)
    for t in tensors:
        bad |= ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
    return int(torch.nonzero(bad)[0])


def _unchanged(inputs, originals, names) -> str | None:
    """The name of the first input the answer changed in place (nan compared as nan), or None."""
    import torch

    for name, now, before in zip(names, inputs, originals):
        if not torch.equal(now.isnan(), before.isnan()) or not torch.equal(now.nan_to_num(), before.nan_to_num()):
            return name
    return None


def _pair(got, names=("out", "lse")):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return None, f"return a pair ({names[0]}, {names[1]}), got {type(got).__name__}"
    return got, None


def _partial_attention(scores, v, visible):
    """float64 (out, lse) of attention restricted to the keys where ``visible`` is True (lse = -inf, out = 0
    for a row that sees none of them)."""
    import torch

    s = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [N]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[:, None])  # [N, Nk]; rows with no visible key are all 0
    return p @ v, lse


# ----------------------------------------------------------------------------------------------------------
# 1. Merging two partial results
# ----------------------------------------------------------------------------------------------------------

GAP = 100.0  # in the far-apart case one part's scores sit this far above the other's: exp(100) overflows fp32


def _merge_cases(seed: int):
    """(description, out_a, lse_a, out_b, lse_b, expected_out, expected_lse, score shift); fp32 in, float64
    expected. Each case adds one regime a merge meets in a ring or a split-K kernel."""
    import torch

    gen = _generator(seed)
    n, nk, d, split = 12, 20, 8, 7
    q, k, v = (torch.randn(m, d, generator=gen, dtype=torch.float64) for m in (n, nk, nk))
    scores = q @ k.T / math.sqrt(d)  # [N, Nk]
    keys = torch.arange(nk)
    rows = torch.arange(n)[:, None]
    in_a, in_b = keys[None, :] < split, keys[None, :] >= split  # [1, Nk]
    everything = torch.ones(n, nk, dtype=torch.bool)
    causal = keys[None, :] <= rows  # [N, Nk]: row i sees keys 0..i
    # rows 0-2 see no key at all, rows 3-5 only part b's, rows 6-8 only part a's, the rest every key
    empties = ((rows >= 3) & (rows < 6) & in_b) | ((rows >= 6) & (rows < 9) & in_a) | (rows >= 9)
    # even rows: part b's scores GAP above part a's; odd rows: GAP below
    apart = torch.where(in_b, GAP, 0.0) * (rows % 2 == 0) + torch.where(in_a, GAP, 0.0) * (rows % 2 == 1)
    cases = []
    for label, visible, shift in (("two halves of the keys", everything, 0.0),
                                  ("causal, where the first rows see no key of part b", causal, 0.0),
                                  (f"the same scores shifted by +{SHIFT:g} (softmax is unchanged, the LSEs are "
                                   "large)", everything, SHIFT),
                                  (f"LSEs far apart: on even rows part b's scores are {GAP:g} above part a's, on odd "
                                   "rows below", everything, apart),
                                  ("empty parts: rows 0-2 see no key at all (the union is empty too: out = 0, "
                                   "lse = -inf), rows 3-5 only part b's, rows 6-8 only part a's", empties, 0.0)):
        s = scores + shift
        out_a, lse_a = _partial_attention(s, v, visible & in_a)
        out_b, lse_b = _partial_attention(s, v, visible & in_b)
        out, lse = _partial_attention(s, v, visible)
        big = shift if isinstance(shift, float) else GAP
        cases.append((label, out_a.float(), lse_a.float(), out_b.float(), lse_b.float(), out, lse, big))
    return cases


def _nonfinite_merge_message(label, got_out, got_lse, lse_a, lse_b, want_lse) -> str:
    """Name the regime where the answer's nan or inf appeared: both parts empty, one part empty, LSEs far apart,
    or LSEs large."""
    import torch

    bad = ~torch.isfinite(got_out).all(dim=-1)
    bad |= torch.isfinite(want_lse) & ~torch.isfinite(got_lse)
    both_empty = torch.isinf(lse_a) & torch.isinf(lse_b)
    one_empty = torch.isinf(lse_a) ^ torch.isinf(lse_b)
    if (bad & both_empty).any():
        return (f"{label}: nan or inf on a row where both parts are empty (lse_a = lse_b = -inf): the merge is "
                "unguarded for that case. max(lse_a, lse_b) is then -inf and -inf - (-inf) is nan; subtract 0 "
                "instead of an infinite max, so that the union comes out empty too: out = 0, lse = -inf")
    if (bad & one_empty).any():
        return (f"{label}: nan or inf on a row where one part saw no keys (its lse = -inf, its out = 0): its weight "
                "exp(-inf - m) must come out as 0, so m must be finite. Subtract m = max(lse_a, lse_b), never one "
                "side's lse (anchored on one side's maximum, the merge breaks when that side is empty)")
    if "far apart" in label:
        return (f"{label}: nan or inf where the two LSEs differ by about {GAP:g}: exp(lse_b - lse_a) (or "
                "exp(lse_a - lse_b)) overflows fp32 above e^88.7: anchored on one side's maximum. Subtract "
                "m = max(lse_a, lse_b), row by row, so that both weights are at most 1")
    if "shifted" in label:
        return (f"{label}: nan or inf, because exp(lse) overflows fp32 above e^88.7: forgetting the max "
                "subtraction; subtract m = max(lse_a, lse_b) before exponentiating (torch.logaddexp does it for you)")
    row = int(torch.nonzero(bad)[0])
    return (f"{label}: nan or inf where the answer is finite (first in row {row}, where both parts saw keys): "
            "a division by a zero total, or exp(-inf - -inf)? A part that saw no keys has lse = -inf and out = 0: "
            "its weight exp(-inf - m) must come out as 0, so subtract a finite m")


def _merge_hint(got_out, got_lse, out_a, lse_a, out_b, lse_b, want_out, want_lse) -> str:
    import torch

    if torch.allclose(got_out.double(), (out_a.double() + out_b.double()) / 2, atol=1e-6):
        return ("you averaged the two outputs: weight each by its share of the softmax mass, "
                "exp(lse_a - lse) and exp(lse_b - lse), which is a missing rescale of both parts")
    if torch.allclose(got_lse.double(), torch.maximum(lse_a, lse_b).double(), atol=1e-6):
        return "the LSE of the union is log(exp(lse_a) + exp(lse_b)), not the larger of the two"
    return ""


def check_merge_attention(answer, seed: int | None = None) -> tuple[str, str]:
    seed = _fresh_seed(seed)
    return _with_seed(_check_merge(answer, seed), seed)


def _check_merge(answer, seed: int) -> tuple[str, str]:
    import torch

    for label, out_a, lse_a, out_b, lse_b, want_out, want_lse, big in _merge_cases(seed):
        inputs = (out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
        got, problem = _pair(answer(*inputs))
        if problem:
            return FAIL, problem
        if not all(torch.equal(x, y) for x, y in zip(inputs, (out_a, lse_a, out_b, lse_b))):
            return FAIL, (f"{label}: your function changed its inputs in place: the caller still needs both parts "
                          "(a ring merges each new block into them); compute into new tensors")
        got_out, got_lse = got
        problem = _tensor_problem("out", got_out, want_out.shape) or _tensor_problem("lse", got_lse, want_lse.shape)
        if problem:
            return FAIL, f"{label}: {problem}"
        empty = torch.isinf(want_lse)
        if not torch.isfinite(got_out).all() or not torch.isfinite(got_lse[~empty]).all():
            return FAIL, _nonfinite_merge_message(label, got_out, got_lse, lse_a, lse_b, want_lse)
        if empty.any() and not (got_out[empty] == 0).all():
            return FAIL, (f"{label}: on rows where both parts are empty out should be 0 (attention over no key "
                          f"sums nothing), got values up to {got_out[empty].abs().max().item():.3g}")
        if empty.any() and not (got_lse[empty] == float("-inf")).all():
            return FAIL, (f"{label}: on rows where both parts are empty lse should be -inf (the log of an empty sum), "
                          f"got {got_lse[empty].tolist()}: a clamp inside the log leaves a finite lse behind, which a "
                          "later merge would count as real softmax mass")
        hint = _merge_hint(got_out, got_lse, out_a, lse_a, out_b, lse_b, want_out, want_lse)
        err_out = _relative_error(got_out, want_out)
        if not err_out <= _tolerance(big):
            return FAIL, (f"{label}: out differs from attention over all the keys (relative error {err_out:.2g})"
                          + (f"; {hint}" if hint else ""))
        err_lse = (got_lse[~empty].double() - want_lse[~empty]).abs().max().item()
        if not err_lse <= LSE_TOLERANCE * max(1.0, want_lse[~empty].abs().max().item() / 100):
            return FAIL, (f"{label}: out is right but lse is off by {err_lse:.2g}"
                          + (f"; {hint}" if hint else ": lse = log(exp(lse_a) + exp(lse_b))"))
    return PASS, ("correct: two partial attentions merge into one, empty parts, LSEs far apart and large scores "
                  "included")


# ----------------------------------------------------------------------------------------------------------
# 2. The forward tile loop
# ----------------------------------------------------------------------------------------------------------

def _largest_output_numel(fn, *args, **kwargs):
    """Call ``fn`` and return (its result, the largest number of elements of any tensor a torch call produced)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Watch(TorchFunctionMode):
        largest = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(t, torch.Tensor):
                    Watch.largest = max(Watch.largest, t.numel())
            return result

    with Watch():
        result = fn(*args, **kwargs)
    return result, Watch.largest


# (what the case adds, n_q, n_k, head_dim, causal, block, score shift): each case adds one difficulty.
FORWARD_CASES = [
    ("one tile (all keys fit in one block)", 9, 12, 8, False, 16, 0.0),
    ("several tiles, the last one ragged", 10, 45, 8, False, 16, 0.0),
    ("a causal mask over several tiles", 37, 37, 16, True, 8, 0.0),
    (f"scores shifted by +{SHIFT:g} (the same softmax; exp overflows fp32 without the max subtraction)",
     20, 50, 8, False, 16, SHIFT),
    (f"scores shifted by -{SHIFT:g}, every one of them very negative (the same softmax; exp underflows to 0 "
     "in fp32 unless the running max follows the scores down)", 20, 50, 8, True, 16, -SHIFT),
]
FORWARD_HINTS = {
    0: "even with one tile: out should be softmax(q k^T / sqrt(d)) v, so check the scale and the division by l",
    1: ("correct for one tile but not across tiles: missing rescale. When a tile raises the running max from m to "
        "m_new, multiply l and acc by exp(m - m_new) before adding the new tile"),
    2: ("wrong mask: with causal=True, query i sees key j iff j <= i, in absolute positions (the tile's first key "
        "index plus the position inside the tile)"),
    3: ("overflow: exp of the raw scores is inf in fp32; forgetting the max subtraction. Exponentiate "
        "scores - m_new, never the scores themselves"),
    4: ("underflow: every score is near -200, so exp(score - m) is 0 in fp32 when m stays at 0, and l = 0. Either the "
        "running max starts at 0 instead of -inf (max(0, scores) never comes down to negative scores), or the max "
        "is not subtracted; start m at -inf, and on a row that has seen no key yet subtract 0 (-inf - -inf is nan)"),
}


def _forward_inputs(seed, n_q, n_k, d, shift):
    import torch

    gen = _generator(seed)
    q, k, v = (torch.randn(m, d, generator=gen) for m in (n_q, n_k, n_k))
    if shift:
        # Append a constant coordinate so that every score gains exactly `shift` (scale 1/sqrt(d) included):
        # the softmax and the output are unchanged, the LSE grows by `shift`.
        d2 = d + 1
        q = torch.cat([q * math.sqrt(d2 / d), torch.full((n_q, 1), shift * math.sqrt(d2))], dim=1)
        k = torch.cat([k, torch.ones(n_k, 1)], dim=1)
        v = torch.cat([v, torch.zeros(n_k, 1)], dim=1)
    return q, k, v


def _keys_skipped(got_out, got_lse, q, k, v, causal: bool, block: int) -> str:
    """Name the loop bound when the answer is attention over only the first keys (whole tiles, or as many keys
    as there are queries); "" when it is not."""
    import torch

    from workers.attention.reference import attention_reference

    n_q, n_k = q.shape[0], k.shape[0]
    tiles = "the last tile may be shorter than block: loop over range(0, n_k, block) and slice k[start:start + block]"
    if torch.isneginf(got_lse).all():
        return (f"no key was visited (lse = -inf on every row): with {n_k} keys and block = {block}, "
                f"{'the only tile is' if n_k < block else 'some tile is'} shorter than block; {tiles}")
    for seen in range(block, n_k, block):
        out, _ = attention_reference(q, k[:seen], v[:seen], causal=causal)
        if torch.allclose(got_out.double(), out, rtol=1e-4, atol=1e-5):
            if seen == (n_k // block) * block:
                return f"only the first {seen} of the {n_k} keys count: the last, shorter tile was dropped; {tiles}"
            bound = (f": the loop over key tiles is bounded by the number of queries, n_q = {n_q}, not of keys "
                     f"(here n_q != n_k); loop over range(0, k.shape[0], block)" if seen >= n_q else "")
            return f"only the first {seen} of the {n_k} keys count{bound}"
    return ""


def check_forward_tile_loop(answer, seed: int | None = None) -> tuple[str, str]:
    seed = _fresh_seed(seed)
    return _with_seed(_check_forward(answer, seed), seed)


def _check_forward(answer, seed: int) -> tuple[str, str]:
    import torch

    from workers.attention.reference import attention_reference

    for i, (label, n_q, n_k, d, causal, block, shift) in enumerate(FORWARD_CASES):
        q, k, v = _forward_inputs(seed + i, n_q, n_k, d, shift)
        want_out, want_lse = attention_reference(q, k, v, causal=causal)
        inputs = (q.clone(), k.clone(), v.clone())
        got, largest = _largest_output_numel(answer, *inputs, causal=causal, block=block)
        changed = _unchanged(inputs, (q, k, v), ("q", "k", "v"))
        if changed:
            return FAIL, (f"{label}: your function changed {changed} in place (an in-place scale or update of the "
                          f"caller's tensor): the backward needs q, k and v as they were; compute into new tensors")
        got, problem = _pair(got)
        if problem:
            return FAIL, problem
        got_out, got_lse = got
        problem = _tensor_problem("out", got_out, want_out.shape) or _tensor_problem("lse", got_lse, want_lse.shape)
        if problem:
            return FAIL, f"{label}: {problem}"
        if n_k > block and largest >= n_q * n_k:
            return FAIL, (f"{label}: a tensor of {largest} elements appeared, as large as the whole {n_q} x {n_k} "
                          f"score matrix: walk the keys in tiles of `block` = {block} rows instead")
        err_out = _relative_error(got_out, want_out)
        wrong = not torch.isfinite(got_out).all() or not err_out <= _tolerance(shift)
        skipped = _keys_skipped(got_out, got_lse, q, k, v, causal, block) if wrong and not shift else ""
        if skipped:
            return FAIL, f"{label}: {skipped}"
        if not torch.isfinite(got_out).all():
            hint = FORWARD_HINTS[i] if shift else ("a division by l = 0, or exp(-inf - -inf) on a row that has seen "
                                                    "no key yet?")
            return FAIL, f"{label}: out holds nan or inf (first in row {_first_bad_row(got_out)}); {hint}"
        if not err_out <= _tolerance(shift):
            return FAIL, f"{label}: out is wrong (relative error {err_out:.2g}); {FORWARD_HINTS[i]}"
        if not torch.isfinite(got_lse).all():
            return FAIL, (f"{label}: out is right but the LSE holds nan or inf (first in row "
                          f"{_first_bad_row(got_lse)}), where every row sees at least one key: lse = m + log(l) is "
                          "finite whenever l > 0")
        err_lse = (got_lse.double() - want_lse).abs().max().item()
        if not err_lse <= LSE_TOLERANCE * max(1.0, want_lse.abs().max().item() / 100):
            return FAIL, (f"{label}: out is right but the LSE is off by {err_lse:.2g}: wrong LSE. It is the log of "
                          "the whole sum of exp(scores): lse = m + log(l), with the running max m added back")
    return PASS, ("correct: one tile, many tiles, causal, and scores that would overflow or underflow without the "
                  "running max")


# ----------------------------------------------------------------------------------------------------------
# 3. One tile of the backward
# ----------------------------------------------------------------------------------------------------------

def _backward_problem(seed, shift=0.0):
    """A whole attention problem in fp32 with its float64 truth: (q, k, v, dout, out, lse, truth dict); ``shift``
    is added to every score (as in the forward's cases: the softmax is unchanged, exp(score) overflows)."""
    import torch

    from workers.attention.reference import attention_reference_grads

    n, d = 40, 16
    q, k, v = _forward_inputs(seed, n, n, d, shift)
    dout = torch.randn(n, q.shape[1], generator=_generator(seed + 1))
    out, lse, dq, dk, dv = attention_reference_grads(q, k, v, dout)
    d = q.shape[1]
    scale = 1.0 / math.sqrt(d)
    p = torch.exp(q.double() @ k.double().T * scale - lse[:, None])  # [N, N]
    dp = dout.double() @ v.double().T
    ds = p * (dp - (dout.double() * out).sum(-1, keepdim=True))
    return q, k, v, dout, out.float(), lse.float(), scale, {"dq": dq, "dk": dk, "dv": dv, "p": p, "dp": dp, "ds": ds}


def _backward_hint(ds_got, p, dp, rows, cols, scale, q, k, dout, out_tile) -> str:
    """Name the mistake when ``ds_got`` matches a plausible wrong formula; a recipe otherwise."""
    import torch

    p_t, dp_t = p[rows, cols], dp[rows, cols]
    close = lambda x: torch.allclose(ds_got.double(), x, atol=1e-5)  # noqa: E731
    if close(p_t * dp_t):
        return ("you left out delta: dS = P * (dP - delta) with delta_i = rowsum(dO_i * O_i), the same number "
                "for every key of row i")
    if close(p_t * (dp_t - (p_t * dp_t).sum(-1, keepdim=True))):
        return ("delta summed over this tile's keys only: delta_i = sum over ALL keys of P_ij dP_ij, which is "
                "rowsum(dO_i * O_i), computable from the tile's own rows of dO and O")
    s_local = q[rows].double() @ k[cols].double().T * scale
    p_soft = torch.softmax(s_local, dim=-1)
    if close(p_soft * (dp_t - (dout[rows].double() * out_tile.double()).sum(-1, keepdim=True))):
        return ("you normalised P over this tile's keys: rebuild it with the saved LSE, P = exp(scale * q k^T - lse), "
                "which is already normalised over the whole row")
    return ("recompute in this order: P = exp(scale * q @ k.T - lse[:, None]), dP = dO @ v.T, "
            "delta = rowsum(dO * O), dS = P * (dP - delta)")


def check_backward_tile(answer, seed: int | None = None) -> tuple[str, str]:
    seed = _fresh_seed(seed)
    for shift in (0.0, SHIFT):
        verdict = _check_backward(answer, seed, shift)
        if verdict[0] != PASS:
            return _with_seed(verdict, seed)
    return verdict


def _check_backward(answer, seed: int, shift: float) -> tuple[str, str]:
    import torch

    q, k, v, dout, out, lse, scale, truth = _backward_problem(seed, shift)
    n, d = q.shape
    tol = 10 * _tolerance(shift)
    where = f" with every score shifted by +{shift:g}" if shift else ""
    block_q, block_k = 16, 12  # 40 = 16 + 16 + 8 and 12 + 12 + 12 + 4: ragged tiles both ways
    dq, dk, dv = (torch.zeros(n, d, dtype=torch.float64) for _ in range(3))
    for qs in range(0, n, block_q):
        rows = slice(qs, min(n, qs + block_q))
        for ks in range(0, n, block_k):
            cols = slice(ks, min(n, ks + block_k))
            originals = (q[rows], k[cols], v[cols], out[rows], dout[rows], lse[rows])
            inputs = tuple(t.clone() for t in originals)
            got, problem = _pair(answer(*inputs, scale), names=("dv", "ds"))
            changed = _unchanged(inputs, originals, ("q", "k", "v", "out", "dout", "lse"))
            if changed:
                return FAIL, (f"your function changed {changed} in place: every tile of this row (and of this key "
                              f"column) reads the same {changed} again; compute into new tensors")
            if problem:
                return FAIL, problem
            dv_tile, ds_tile = got
            n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
            problem = (_tensor_problem("dv", dv_tile, (n_cols, d))
                       or _tensor_problem("ds", ds_tile, (n_rows, n_cols)))
            if problem:
                return FAIL, f"tile (queries {rows.start}:{rows.stop}, keys {cols.start}:{cols.stop}){where}: {problem}"
            err = _relative_error(ds_tile, truth["ds"][rows, cols])
            tile = f"tile (queries {rows.start}:{rows.stop}, keys {cols.start}:{cols.stop}){where}"
            if shift and not (torch.isfinite(ds_tile).all() and torch.isfinite(dv_tile).all()):
                return FAIL, (f"{tile}: nan or inf: overflow. exp(scale * q k^T) is inf in fp32 once a score passes "
                              "about 88.7, and inf / exp(lse) is nan; rebuild P in one exponent, "
                              "P = exp(scale * q @ k.T - lse[:, None]), which is at most 1")
            for name, got_tile in (("dS", ds_tile), ("dV", dv_tile)):
                if not torch.isfinite(got_tile).all():
                    return FAIL, (f"{tile}: {name} holds nan or inf (first in row {_first_bad_row(got_tile)}) where "
                                  "the true one is finite: P = exp(scale * q @ k.T - lse[:, None]) is at most 1, and "
                                  "nothing here divides")
            if not err <= tol:
                hint = _backward_hint(ds_tile, truth["p"], truth["dp"], rows, cols, scale, q, k, dout, out[rows])
                return FAIL, (f"{tile}: dS is wrong (relative error {err:.2g})" + (f"; {hint}" if hint else ""))
            want_dv = truth["p"][rows, cols].T @ dout[rows].double()
            err = _relative_error(dv_tile, want_dv)
            if not err <= tol:
                return FAIL, (f"{tile}: dS is right "
                              f"but this tile's dV is wrong (relative error {err:.2g}): dV_tile = P_tile^T @ dO_tile, "
                              "with P rebuilt from the saved LSE")
            dv[cols] += dv_tile.double()
            dq[rows] += ds_tile.double() @ k[cols].double() * scale
            dk[cols] += ds_tile.double().T @ q[rows].double() * scale
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        err = _relative_error(got, truth[name])
        if not err <= tol:
            return FAIL, f"every tile looks right{where}, yet the assembled {name} is off by {err:.2g} (relative)"
    return PASS, ("correct: summed over the tiles, your dV and dS give dq, dk and dv equal to autograd through "
                  "naive float64 attention, large scores included")


# What each check tries, class by class (course_utils.exercises.INPUT_CLASSES).
_SINGLE_PROCESS = {
    "order": NOT_APPLICABLE + "no gradients arrive: the answer is a pure function of the tensors it is given",
    "traffic": NOT_APPLICABLE + "one process, no collective: attention is checked in the notebook",
    "bits": NOT_APPLICABLE + "fp32 results are compared within a tolerance: any order of summation is right",
}

register(Exercise("merge_attention", "07", "merge_attention",
                  "Merge attention over two sets of keys from their (out, lse) pairs", local=check_merge_attention,
                  tries={**_SINGLE_PROCESS,
                         "non-finite": "nan or inf anywhere in out, or in lse on a row that sees a key, fails, named "
                                       "with the regime where it appeared",
                         "sizes": NOT_APPLICABLE + "the two parts come whole (7 and 13 of 20 keys): the answer "
                                                   "splits no size",
                         "ragged": "empty parts: rows where part a, part b or both saw no key (lse = -inf): the union "
                                   "is the other part, or out = 0 with lse = -inf",
                         "layouts": NOT_APPLICABLE + "one shape, 12 rows by a head dim of 8: rows and columns differ, "
                                                     "so a mixed-up axis fails on it already",
                         "mutation": "out_a, lse_a, out_b and lse_b are compared with copies after the call",
                         "output": "out and lse must be float32 tensors of shapes [N, D] and [N]",
                         "memory": NOT_APPLICABLE + "returns two new tensors of its inputs' size: nothing to release"}))
register(Exercise("forward_tile_loop", "07", "forward_tile_loop",
                  "The FlashAttention forward for one head: the online softmax over key tiles",
                  local=check_forward_tile_loop,
                  tries={**_SINGLE_PROCESS,
                         "non-finite": "nan or inf in out or lse fails, named with the row where it appeared",
                         "sizes": "key counts below block (12 keys, block 16) and not multiples of it (45, 37, 50): "
                                  "every key must count",
                         "ragged": "the last key tile shorter than the others (45 keys in tiles of 16, 16 and 13)",
                         "layouts": "score matrices that are not square (9 x 12, 10 x 45, 20 x 50), head dims 8, 9 "
                                    "and 16, causal and not: a loop bound or mask written for n_q = n_k fails",
                         "mutation": "q, k and v are compared with copies after the call",
                         "output": "out and lse must be float32 tensors of shapes [n_q, D] and [n_q]",
                         "memory": "every torch call's output is watched: none may be as large as the whole n_q x n_k "
                                   "score matrix"}))
register(Exercise("backward_tile", "07", "backward_tile",
                  "One tile of the backward: P from the LSE, dV's share, dS = P * (dP - delta)",
                  local=check_backward_tile,
                  tries={**_SINGLE_PROCESS,
                         "non-finite": "nan or inf in dS or dV fails, named, with and without scores large enough "
                                       "to overflow exp in fp32",
                         "sizes": NOT_APPLICABLE + "the answer is handed one tile and takes every size from its "
                                                   "tensors; it splits nothing itself",
                         "ragged": NOT_APPLICABLE + "the check's tiles are ragged (40 = 16 + 16 + 8 queries, "
                                                    "12 + 12 + 12 + 4 keys), but a tile's answer never sees the others",
                         "layouts": NOT_APPLICABLE + "one problem, 40 x 40 with a head dim of 16, in tiles that are "
                                                     "not square: one layout is all a tile has",
                         "mutation": "q, k, v, out, dout and lse are compared with copies after every tile",
                         "output": "dV and dS must be float32 tensors of shapes [keys, D] and [queries, keys]",
                         "memory": NOT_APPLICABLE + "returns two new tile-sized tensors: nothing to release"}))
