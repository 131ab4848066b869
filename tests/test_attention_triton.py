"""Chapter 07, the Triton kernels: forward and backward against the float64 reference.

Without a GPU the kernels run in the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be set
before ``workers.attention.triton_kernels`` is imported (``@triton.jit`` decides at import time), which this
module does first thing. The interpreter executes every program instance in numpy, so shapes are small;
its fixed tile config (32 x 16 forward, 16 x 32 dK/dV, 32 x 16 dQ) makes these sequences span several tiles,
a ragged last tile and a multi-step causal diagonal. On a CUDA machine the same tests run compiled.

Mutation tests rewrite one line of the kernel source (drop the rescale, shift the causal mask, drop the tail
mask, break the backward) and check that the comparison that passes for the real kernel fails for the mutant.
"""
import os

import torch

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything below imports the kernels

import zlib  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton path is optional")

from workers.attention import attention_reference, flash_attention  # noqa: E402
from workers.attention import triton_kernels as tk  # noqa: E402
from workers.attention.reference import (LSE_TOLERANCE, RELATIVE_TOLERANCE, assert_close_to_reference,  # noqa: E402
                                         attention_reference_grads, tf32_tolerances)

from course_utils.paths import ROOT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_SOURCE = ROOT / "workers" / "attention" / "triton_kernels.py"


@pytest.fixture(scope="module", autouse=True)
def _restore_interpret_flag():
    # The interpreter reads the flag while kernels run, so it stays on for this module's tests only.
    yield
    if _PREVIOUS_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET


def tolerances(dtype):
    if DEVICE == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return tf32_tolerances()
    return RELATIVE_TOLERANCE[dtype], LSE_TOLERANCE[dtype]


def seed_of(request, salt=""):
    return zlib.crc32((request.node.nodeid + salt).encode())


def make_inputs(seed, dtype, batch, heads, n_q, n_k, head_dim):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, n_q, head_dim), (batch, heads, n_k, head_dim), (batch, heads, n_k, head_dim),
              (batch, heads, n_q, head_dim)]
    return [torch.randn(s, generator=gen).to(dtype).to(DEVICE) for s in shapes]


def check_triton(attn, seed, dtype, causal, batch=1, heads=1, n_q=45, n_k=None, head_dim=16, scale=None,
                 backward=True):
    """Compare ``attn(q, k, v, causal, scale) -> (out, lse)`` and its gradients with the float64 reference.

    One (batch, head) by default, to keep the interpreter quick; the tests that need several (the batch and
    head strides) ask for them.
    """
    n_k = n_q if n_k is None else n_k
    q, k, v, dout = make_inputs(seed, dtype, batch, heads, n_q, n_k, head_dim)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    out, lse = attn(q, k, v, causal, scale)
    tol, lse_tol = tolerances(dtype)
    if not backward:
        ref_out, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), causal, scale)
    else:
        out.backward(dout)
        ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference_grads(q, k, v, dout, causal, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_reference("out", out, ref_out, tol)
    assert_close_to_reference("lse", lse, ref_lse, lse_tol, relative=False)
    if backward:
        assert q.grad.dtype == dtype
        assert_close_to_reference("dq", q.grad, ref_dq, tol)
        assert_close_to_reference("dk", k.grad, ref_dk, tol)
        assert_close_to_reference("dv", v.grad, ref_dv, tol)


def triton_attn(module=tk, configs=None):
    return lambda q, k, v, causal, scale: module.triton_flash_attention(q, k, v, causal, scale, configs)


# Every dtype, causal and not, head dims 16, 64, 128 and two that need padding (24, 40); lengths that are
# not multiples of any tile, one shorter than a tile, and one exact multiple.
CASES = [
    (torch.float32, False, 16, 45), (torch.float32, True, 64, 37), (torch.float32, True, 24, 64),
    (torch.float16, False, 128, 50), (torch.float16, True, 16, 70), (torch.float16, True, 40, 29),
    (torch.bfloat16, False, 64, 33), (torch.bfloat16, True, 128, 45), (torch.bfloat16, True, 16, 5),
]


@pytest.mark.parametrize("dtype,causal,head_dim,n", CASES,
                         ids=[f"{str(c[0])[6:]}-{'causal' if c[1] else 'full'}-d{c[2]}-n{c[3]}" for c in CASES])
def test_triton_matches_reference(request, dtype, causal, head_dim, n):
    check_triton(triton_attn(), seed_of(request), dtype, causal, n_q=n, head_dim=head_dim,
                 batch=2 if causal else 1)  # causal cases also check the batch/head offsets


@pytest.mark.parametrize("configs", [
    {"fwd": tk._cfg(16, 16, 4, 1), "dkdv": tk._cfg(16, 16, 4, 1), "dq": tk._cfg(16, 16, 4, 1)},
    {"fwd": tk._cfg(64, 32, 4, 1), "dkdv": tk._cfg(32, 64, 4, 1), "dq": tk._cfg(64, 32, 4, 1)},
], ids=["square16", "wide64"])
def test_triton_other_tile_shapes(request, configs):
    # The masking logic must hold for every tile shape the autotuner may pick, not only the default one.
    check_triton(triton_attn(configs=configs), seed_of(request), torch.float32, True, n_q=50, head_dim=16)


def test_triton_cross_attention_lengths(request):
    # Fewer queries than keys (non-causal): the key tail and the query tail are different tiles.
    check_triton(triton_attn(), seed_of(request), torch.float32, False, n_q=20, n_k=53, head_dim=32, scale=0.2)


def test_triton_reads_bshd_layout_without_copy(request):
    # A (B, S, H, D) tensor viewed as (B, H, S, D) is strided, not contiguous: the kernels read it through its
    # strides and must give the same numbers as on the contiguous copy.
    q, k, v, dout = make_inputs(seed_of(request), torch.float16, 2, 2, 21, 21, 16)
    as_bshd = [t.transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v)]  # [B, S, H, D]
    views = [t.transpose(1, 2) for t in as_bshd]  # [B, H, S, D], strided
    assert not views[0].is_contiguous()
    out_view, _ = tk.triton_flash_attention(*views, True)
    out_view.backward(dout)
    contiguous = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out_contig, _ = tk.triton_flash_attention(*contiguous, True)
    out_contig.backward(dout)
    assert torch.equal(out_view, out_contig)
    for a, b in zip(as_bshd, contiguous):
        assert torch.equal(a.grad.transpose(1, 2), b.grad)


def test_api_triton_three_dimensional_and_lse(request):
    q, k, v, _ = make_inputs(seed_of(request), torch.float32, 2, 1, 19, 19, 16)
    q, k, v = (t.squeeze(1) for t in (q, k, v))  # (batch, seq, head_dim)
    out, lse = flash_attention(q, k, v, causal=True, impl="triton", return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert_close_to_reference("out", out, ref_out, RELATIVE_TOLERANCE[torch.float32])
    assert_close_to_reference("lse", lse, ref_lse, LSE_TOLERANCE[torch.float32], relative=False)


def test_triton_saves_no_quadratic_tensor(request):
    q, k, v, _ = make_inputs(seed_of(request), torch.float32, 1, 2, 40, 40, 16)
    q.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        tk.triton_flash_attention(q, k, v, True)
    assert sorted(saved) == sorted([(1, 2, 40, 16)] * 4 + [(1, 2, 40)])


def test_triton_saves_one_batch_by_queries_log_sum_exp_for_one_head(request):
    # 3-D inputs (one head): the kernels run on [B, 1, S, D] views, and what autograd keeps is the [B, Sq] log-sum-exp
    # the tiled version keeps too (the layout CS336's FlashAttention tests look for in ctx.saved_tensors)
    q, k, v, _ = make_inputs(seed_of(request), torch.float32, 2, 1, 40, 40, 16)
    q, k, v = (t.squeeze(1).requires_grad_(True) for t in (q, k, v))  # [2, 40, 16]
    out, lse = tk.triton_flash_attention(q, k, v, True)
    saved = out.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(2, 40, 16)] * 4 + [(2, 40)]
    assert saved[-1].data_ptr() == lse.data_ptr() and lse.shape == (2, 40)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    out_tol, lse_tol = tolerances(torch.float32)
    assert_close_to_reference("out", out, ref_out, out_tol)
    assert_close_to_reference("lse", lse, ref_lse, lse_tol, relative=False)
    out.sum().backward()
    assert q.grad.shape == (2, 40, 16) and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("shape,dtype,causal,match", [
    ((1, 2, 8, 8), torch.float32, False, "head_dim 8"),
    ((1, 2, 8, 256), torch.float32, False, "head_dim 256"),
    ((1, 2, 8, 16), torch.float64, False, "dtype"),
])
def test_triton_rejects_unsupported_inputs(shape, dtype, causal, match):
    q = torch.zeros(shape, dtype=dtype, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        tk.triton_flash_attention(q, q, q, causal)


def test_config_constraints_are_checked():
    with pytest.raises(ValueError, match="BLOCK_M divisible by BLOCK_N"):
        tk.check_config("fwd", tk._cfg(16, 32, 4, 1))
    with pytest.raises(ValueError, match="BLOCK_N divisible by BLOCK_M"):
        tk.check_config("dkdv", tk._cfg(32, 16, 4, 1))
    for name, configs in tk.GPU_CONFIGS.items():  # the autotune lists respect them too
        for config in configs:
            tk.check_config(name, config)


# ---------------------------------------------------------------------------------------------------------
# Mutation tests
# ---------------------------------------------------------------------------------------------------------

# name: (exact source line fragment, replacement, needs backward to show)
TRITON_MUTANTS = {
    "fwd_no_rescale_acc": ("        acc = acc * alpha[:, None]\n", "\n", False),
    "fwd_no_rescale_sum": ("l_i = l_i * alpha + tl.sum(p, 1)", "l_i = l_i + tl.sum(p, 1)", False),
    "fwd_mask_hides_diagonal": ("visible = (offs_n[None, :] <= offs_m[:, None])",
                                "visible = (offs_n[None, :] < offs_m[:, None])", False),
    "fwd_mask_shows_next_token": ("visible = (offs_n[None, :] <= offs_m[:, None])",
                                  "visible = (offs_n[None, :] <= offs_m[:, None] + 1)", False),
    "fwd_no_tail_mask": ("qk = tl.where(offs_n[None, :] < n_kv, qk, float(\"-inf\"))", "qk = qk", False),
    "fwd_skips_diagonal": ("masked.\n        diag_hi = tl.minimum(start_m + BLOCK_M, N_KV)",
                           "masked.\n        diag_hi = start_m", False),
    "bwd_no_delta": ("dsT = pT * (dpT - delta[None, :])", "dsT = pT * dpT", True),
    "bwd_dk_unscaled": ("dk = dk * softmax_scale", "dk = dk", True),
    "bwd_dkdv_mask_off_by_one": ("pT = tl.where((offs_m[None, :] >= offs_n[:, None])",
                                 "pT = tl.where((offs_m[None, :] > offs_n[:, None])", True),
    "bwd_dq_no_causal_mask": ("p = tl.where((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] < n_kv), p, 0.0)",
                              "p = p", True),
}


def load_mutant(tmp_path, name, old, new):
    """Import a copy of the kernel module with ``old`` replaced by ``new`` (which must occur exactly once)."""
    import importlib.util

    source = KERNEL_SOURCE.read_text()
    assert source.count(old) == 1, f"mutation {name!r} no longer matches the kernel source: update the test"
    path = tmp_path / f"mutant_{name}.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"mutant_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the mutants produce nan on purpose
@pytest.mark.parametrize("name", sorted(TRITON_MUTANTS))
def test_triton_mutant_is_caught(tmp_path, request, name):
    old, new, backward = TRITON_MUTANTS[name]
    mutant = load_mutant(tmp_path, name, old, new)
    # Non-causal for the tail mask (it is the non-causal loop's), causal otherwise; 45 rows over 32/16 tiles.
    causal = name != "fwd_no_tail_mask"
    seed = seed_of(request)
    check = dict(dtype=torch.float32, causal=causal, backward=backward)
    check_triton(triton_attn(), seed, **check)  # the real kernel passes on these inputs...
    with pytest.raises(AssertionError):
        check_triton(triton_attn(mutant), seed, **check)  # ...and the mutant does not
