"""Chapter 07, the PyTorch side: reference, tiled FlashAttention, online softmax, merge, API.

The float64 reference (naive attention) is the specification. Every test draws fresh random inputs from a
seed derived from the test's own name, so tests differ from each other but each one is reproducible.
Mutation tests at the end rewrite one line of ``tiled.py`` (drop the rescale, shift the mask, break the
backward) and check that the same comparison that passes for the real code fails for the broken one:
a test that cannot fail proves nothing.
"""
import importlib.util
import math
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from workers.attention import (attention_reference, attention_reference_grads, flash_attention,
                               online_softmax_merge, online_softmax_update, tiled_flash_attention)
from workers.attention.reference import LSE_TOLERANCE, RELATIVE_TOLERANCE, assert_close_to_reference
from course_utils.paths import ROOT



@pytest.fixture
def gen(request):
    """A generator seeded from the test id: fresh inputs per test, the same ones on every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def check_attention(attn, gen, dtype, causal, batch=2, heads=2, n_q=45, n_k=None, head_dim=24, scale=None):
    """Run ``attn(q, k, v, causal, scale) -> (out, lse)`` forward and backward; compare with the reference.

    Raises AssertionError naming the first tensor (out, lse, dq, dk, dv) that misses its tolerance.
    """
    n_k = n_q if n_k is None else n_k
    q = randn(gen, batch, heads, n_q, head_dim, dtype=dtype).requires_grad_(True)
    k = randn(gen, batch, heads, n_k, head_dim, dtype=dtype).requires_grad_(True)
    v = randn(gen, batch, heads, n_k, head_dim, dtype=dtype).requires_grad_(True)
    dout = randn(gen, batch, heads, n_q, head_dim, dtype=dtype)
    out, lse = attn(q, k, v, causal, scale)
    out.backward(dout)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference_grads(q, k, v, dout, causal, scale)
    tol = RELATIVE_TOLERANCE[dtype]
    assert out.dtype == dtype and q.grad.dtype == dtype
    assert_close_to_reference("out", out, ref_out, tol)
    assert_close_to_reference("lse", lse, ref_lse, LSE_TOLERANCE[dtype], relative=False)
    assert_close_to_reference("dq", q.grad, ref_dq, tol)
    assert_close_to_reference("dk", k.grad, ref_dk, tol)
    assert_close_to_reference("dv", v.grad, ref_dv, tol)


def tiled(block_q=16, block_k=8, module=None):
    fn = tiled_flash_attention if module is None else module.tiled_flash_attention
    return lambda q, k, v, causal, scale: fn(q, k, v, causal, scale, block_q, block_k)


# ---------------------------------------------------------------------------------------------------------
# The reference itself
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_pytorch_sdpa(gen, causal):
    # Two independent float64 computations of the same formula agree to rounding.
    q, k, v = (randn(gen, 2, 3, 33, 16, dtype=torch.float64) for _ in range(3))
    out, lse = attention_reference(q, k, v, causal=causal)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    scores = q @ k.transpose(-1, -2) / math.sqrt(16)
    if causal:
        scores = scores.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Tiled PyTorch FlashAttention
# ---------------------------------------------------------------------------------------------------------

# Sequence lengths that are not multiples of the tiles (16 x 8 here), one shorter than a tile, one exact.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_q,head_dim", [(45, 16), (37, 64), (5, 128), (32, 24)])
def test_tiled_matches_reference(gen, dtype, causal, n_q, head_dim):
    check_attention(tiled(), gen, dtype, causal, n_q=n_q, head_dim=head_dim)


def test_tiled_cross_attention_and_custom_scale(gen):
    # More keys than queries (non-causal), and a softmax scale that is not 1/sqrt(d).
    check_attention(tiled(), gen, torch.float32, False, n_q=19, n_k=53, head_dim=32, scale=0.3)


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_gradcheck_float64(gen, causal):
    # In float64 the tiled backward must equal finite differences of the tiled forward: this checks the
    # recomputation formulas themselves, independently of the reference.
    q, k, v = (randn(gen, 1, 2, 9, 4, dtype=torch.float64).requires_grad_(True) for _ in range(3))
    fn = lambda q, k, v: tiled_flash_attention(q, k, v, causal, None, 4, 3)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, fast_mode=True)


def test_tiled_saves_no_quadratic_tensor(gen):
    # What autograd keeps for backward must be O(N): q, k, v, out (N x d) and lse (N), never N x N.
    n = 64
    q, k, v = (randn(gen, 1, 2, n, 16).requires_grad_(True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out, _ = tiled_flash_attention(q, k, v, True)
    assert sorted(saved) == sorted([(1, 2, n, 16)] * 4 + [(1, 2, n)])



@pytest.mark.parametrize("shape", [(3, 20, 16), (2, 4, 20, 16)], ids=["batch-seq-dim", "batch-heads-seq-dim"])
def test_the_saved_log_sum_exp_is_one_batch_by_queries_tensor_per_head(gen, shape):
    # The backward reads lse row by row; what autograd keeps is one tensor in the queries' leading shape: [B, Sq]
    # for one head (the layout Stanford CS336's FlashAttention tests look for in ctx.saved_tensors), [B, H, Sq]
    # with heads; the lse returned is that same tensor, equal to the float64 reference's log-sum-exp.
    q, k, v = (randn(gen, *shape).requires_grad_(True) for _ in range(3))
    out, lse = tiled_flash_attention(q, k, v, True, None, 8, 8)
    saved = out.grad_fn.saved_tensors
    lses = [t for t in saved if t.shape == shape[:-1]]
    assert len(saved) == 5 and len(lses) == 1 and lses[0].dtype == torch.float32
    assert lses[0].data_ptr() == lse.data_ptr()
    _, ref_lse = attention_reference(q, k, v, causal=True)
    assert_close_to_reference("lse", lse, ref_lse, LSE_TOLERANCE[torch.float32])
    out.sum().backward()  # the 3-D path's backward runs on the saved [B, Sq] tensor
    assert q.grad.shape == shape and torch.isfinite(q.grad).all()

def test_online_softmax_update_over_chunks_equals_softmax(gen):
    # Feeding a row of scores in three uneven chunks gives exactly softmax(scores) @ v at the end.
    scores = randn(gen, 1, 1, 4, 23, dtype=torch.float64) * 5
    values = randn(gen, 1, 1, 23, 8, dtype=torch.float64)
    m = torch.full((1, 1, 4), float("-inf"), dtype=torch.float64)
    l = torch.zeros(1, 1, 4, dtype=torch.float64)
    acc = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    for lo, hi in ((0, 5), (5, 17), (17, 23)):
        m, l, acc = online_softmax_update(m, l, acc, scores[..., lo:hi], values[..., lo:hi, :])
    torch.testing.assert_close(acc / l[..., None], torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(m + l.log(), torch.logsumexp(scores, -1))


def test_online_softmax_update_survives_fully_masked_chunk():
    # A chunk where a row sees only masked keys must leave that row's state unchanged, not turn it into nan.
    m, l, acc = torch.tensor([[[-1.0]]]), torch.tensor([[[2.0]]]), torch.ones(1, 1, 1, 3)
    m2, l2, acc2 = online_softmax_update(m, l, acc, torch.full((1, 1, 1, 4), float("-inf")), torch.ones(1, 1, 4, 3))
    assert torch.equal(m2, m) and torch.equal(l2, l) and torch.equal(acc2, acc)
    m0 = torch.full((1, 1, 1), float("-inf"))  # nothing seen yet and nothing visible: still finite state
    m3, l3, acc3 = online_softmax_update(m0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 3),
                                         torch.full((1, 1, 1, 4), float("-inf")), torch.ones(1, 1, 4, 3))
    assert torch.isneginf(m3).all() and (l3 == 0).all() and (acc3 == 0).all()


# ---------------------------------------------------------------------------------------------------------
# online_softmax_merge: the step context parallelism and the exercises build on
# ---------------------------------------------------------------------------------------------------------

def _split_and_merge(gen, split, causal=False, merge=online_softmax_merge):
    q, k, v = (randn(gen, 2, 2, 9, 8, dtype=torch.float64) for _ in range(3))
    full_out, full_lse = attention_reference(q, k, v)
    out_a, lse_a = attention_reference(q, k[..., :split, :], v[..., :split, :])
    out_b, lse_b = attention_reference(q, k[..., split:, :], v[..., split:, :])
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    return out, lse, full_out, full_lse


@pytest.mark.parametrize("split", [1, 4, 8])
def test_merge_of_two_key_halves_equals_full_attention(gen, split):
    # Attention over keys [0, split) and [split, n) separately, merged, equals attention over all keys.
    out, lse, full_out, full_lse = _split_and_merge(gen, split)
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), full_lse, rtol=1e-6, atol=1e-6)


def test_merge_wrong_answer_is_caught(gen):
    # The plausible wrong merge (average the two outputs) must fail the check the exercise grades with.
    naive_average = lambda oa, la, ob, lb: ((oa + ob) / 2, torch.logaddexp(la, lb))  # noqa: E731
    out, _, full_out, _ = _split_and_merge(gen, 3, merge=naive_average)
    with pytest.raises(AssertionError):
        assert_close_to_reference("out", out, full_out, 1e-6)


def test_merge_with_empty_parts():
    # A part that saw no keys has lse = -inf: it gets weight 0; two empty parts give 0, not nan.
    out_a, lse_a = torch.randn(1, 3, 4), torch.randn(1, 3)
    empty_out, empty_lse = torch.zeros(1, 3, 4), torch.full((1, 3), float("-inf"))
    out, lse = online_softmax_merge(out_a, lse_a, empty_out, empty_lse)
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)
    out, lse = online_softmax_merge(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(out, empty_out) and torch.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------------------
# The public API
# ---------------------------------------------------------------------------------------------------------

def test_api_accepts_three_dimensional_inputs(gen):
    q, k, v = (randn(gen, 3, 20, 16) for _ in range(3))  # (batch, seq, head_dim)
    out, lse = flash_attention(q, k, v, causal=True, impl="torch", return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert out.shape == (3, 20, 16) and lse.shape == (3, 20)
    assert_close_to_reference("out", out, ref_out, RELATIVE_TOLERANCE[torch.float32])


def test_api_auto_uses_torch_on_cpu(gen):
    q, k, v = (randn(gen, 1, 2, 10, 16) for _ in range(3))
    assert torch.equal(flash_attention(q, k, v, impl="auto"), flash_attention(q, k, v, impl="torch"))


@pytest.mark.parametrize("shapes,kwargs,match", [
    (((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16)), {}, "must agree"),
    (((1, 2, 8, 16), (1, 3, 8, 16), (1, 3, 8, 16)), {}, "must agree"),
    (((1, 2, 8, 16), (1, 2, 9, 16), (1, 2, 9, 16)), {"causal": True}, "as many queries as keys"),
    (((2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}, "4-D"),
    (((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {"impl": "cuda"}, "impl must be one of"),
])
def test_api_rejects_bad_inputs_in_one_sentence(shapes, kwargs, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kwargs)


def test_package_import_does_not_need_triton():
    # A learner without triton imports the package and runs the torch path; triton is imported lazily.
    code = ("import sys; sys.modules['triton'] = None\n"  # makes any `import triton` fail
            "import torch, workers.attention as a\n"
            "q = torch.randn(1, 1, 5, 16)\n"
            "assert a.flash_attention(q, q, q, impl='auto').shape == q.shape\n"
            "assert not [m for m in sys.modules if m.startswith('workers.attention.triton')]\n"
            "try:\n"
            "    a.flash_attention(q, q, q, impl='triton')\n"
            "except ImportError as e:\n"
            "    assert \"impl='torch'\" in str(e)\n"
            "else:\n"
            "    raise AssertionError('impl=triton without triton should fail')\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ---------------------------------------------------------------------------------------------------------
# Mutation tests: the checks above must fail on the classic mistakes
# ---------------------------------------------------------------------------------------------------------

TILED_MUTANTS = {
    # forgetting to rescale what was accumulated under the old running max
    "no_rescale": ("acc_new = alpha[..., None] * acc + p @ v_tile", "acc_new = acc + p @ v_tile"),
    "no_rescale_of_sum": ("l_new = alpha * l + p.sum(dim=-1)", "l_new = l + p.sum(dim=-1)"),
    # a mask that hides the diagonal (a token cannot see itself), or shows the next token
    "mask_hides_diagonal": ("return cols <= rows  # [Bq, Bk]", "return cols < rows  # [Bq, Bk]"),
    "mask_shows_next_token": ("return cols <= rows  # [Bq, Bk]", "return cols <= rows + 1  # [Bq, Bk]"),
    # causal tile skipping that stops one tile early (drops the diagonal tile)
    "skips_diagonal_tile": ("k_end = min(n_k, q_start + q_len) if causal else n_k",
                            "k_end = min(n_k, q_start) if causal else n_k"),
    # backward without the softmax Jacobian's delta term, or without the scale in dK
    "backward_no_delta": ("ds = p * (dp - delta[:, :, q_start:q_start + q_len, None])", "ds = p * dp"),
    "backward_dk_unscaled": ("+= (ds.transpose(-1, -2) @ q_tile) * scale", "+= (ds.transpose(-1, -2) @ q_tile)"),
}


def load_mutant(tmp_path, source_path, name, old, new):
    """Import a copy of ``source_path`` with ``old`` replaced by ``new`` (which must occur exactly once)."""
    source = source_path.read_text()
    assert source.count(old) == 1, f"mutation {name!r} no longer matches the source: update the test"
    path = tmp_path / f"mutant_{name}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"mutant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(TILED_MUTANTS))
def test_tiled_mutant_is_caught(tmp_path, request, name):
    mutant = load_mutant(tmp_path, ROOT / "workers" / "attention" / "tiled.py", name, *TILED_MUTANTS[name])
    seed = zlib.crc32(request.node.nodeid.encode())
    # The unmodified code passes on these exact inputs...
    check_attention(tiled(), torch.Generator().manual_seed(seed), torch.float32, True, n_q=37)
    # ...and the mutant fails (causal, so mask mutations matter; 37 rows over 16-row tiles, so rescales do).
    with pytest.raises(AssertionError):
        check_attention(tiled(module=mutant), torch.Generator().manual_seed(seed), torch.float32, True, n_q=37)
