"""What autograd keeps for backward in one block, measured (``workers/parallel/activations.py``), against
Korthikanti et al. 2022's count (``course_utils.tp_check.activation_terms``). In-process, no ranks.

Korthikanti's terms are exact for the operations a block saves, so the measurement must match them to the
byte once the block's own choices are accounted for: no dropout (their masks and the dropout output are
absent), float32 (activations 4 bytes, masks 1 byte), and LayerNorm's mean and 1/std per token, which the
paper leaves out (2 floats per token per LayerNorm).
"""
import pytest
import torch
from torch import nn

from course_utils import tp_check
from course_utils.ledger import activation_bytes_per_layer
from workers.parallel.activations import TOP, recompute_gradient_error, saved_for_backward
from workers.model.dense import BlockConfig, build

S, B, H, A = 32, 2, 32, 4  # as/h = 4: the s x s terms are a large share, so missing them cannot hide
SBH = S * B * H
FP32 = 4
LN_STATS = 2 * (2 * S * B * FP32)  # two LayerNorms, each a mean and a 1/std per token


def block(dropout=0.0):
    return build("block", BlockConfig(hidden=H, heads=A, hidden_dropout=dropout), seed=3)


def x_in():
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)


def terms(**kw):
    kw = {"bytes_per_element": FP32, "hidden_dropout": False, "attention_dropout": False, **kw}
    return tp_check.activation_terms(S, B, H, A, **kw)


def test_full_recompute_keeps_only_the_block_input():
    # Without checkpointing the block keeps dozens of sbh; with it, one tensor: its input (2sbh in 16-bit
    # terms, 4sbh bytes here). If recompute were ignored this would be the ~60 sbh of the plain forward.
    m, x = block(), x_in()
    plain = saved_for_backward(m, x)
    full = saved_for_backward(m, x, recompute=True)
    assert full["total_bytes"] == full["input_bytes"] == SBH * FP32
    assert list(full["by_segment"]) == [TOP]
    assert plain["total_bytes"] > 10 * full["total_bytes"]


@pytest.mark.parametrize("math_attention", [False, True])
def test_recompute_gives_the_same_gradients(math_attention):
    # the backward runs the forward again; with no randomness in the block it must land on the same numbers
    assert recompute_gradient_error(block(), x_in(), math_attention=math_attention) < 1e-6


def test_math_attention_matches_the_terms_that_apply_to_the_byte():
    # the reference attention stores the probabilities: every term without dropout applies
    got = saved_for_backward(block(), x_in(), math_attention=True)
    expected = terms()
    assert got["total_bytes"] == sum(t["bytes"] for t in expected if t["applies"]) + LN_STATS
    for segment in ("attention.qkv", "attention", "attention.proj", "mlp.fc1", "mlp", "mlp.fc2"):
        assert got["by_segment"][segment] == sum(t["bytes"] for t in expected if t["segment"] == segment
                                                 and t["applies"]), segment
    for ln in ("ln1", "ln2"):
        assert got["by_segment"][ln] == SBH * FP32 + 2 * S * B * FP32  # input, then mean and 1/std
    # the probabilities are saved twice (softmax, P.V) under two shapes: one memory, counted once
    probs = [t for t in got["tensors"] if t["shape"][-2:] == (S, S)]
    assert len(probs) == 2 and sum(t["counted"] for t in probs) == 1


def test_the_default_cpu_kernel_keeps_no_s_by_s_tensor():
    # PyTorch's CPU flash kernel (like FlashAttention on a GPU) keeps Q, K, V, its output (which the output
    # projection saves too: the same memory) and one log-sum-exp per row; the 5as/h term is gone
    got = saved_for_backward(block(), x_in())
    assert not any(t["shape"][-2:] == (S, S) for t in got["tensors"])
    with_probs = sum(t["bytes"] for t in terms() if t["applies"])
    lse = B * A * S * FP32
    assert got["total_bytes"] == with_probs - A * S * S * B * FP32 + lse + LN_STATS
    assert got["by_segment"]["attention.proj"] == 0


def test_hidden_dropout_adds_its_two_one_byte_masks():
    x = x_in()
    extra = saved_for_backward(block(0.1), x)["total_bytes"] - saved_for_backward(block(), x)["total_bytes"]
    assert extra == sum(t["bytes"] for t in terms(hidden_dropout=True) if t["segment"] == "dropout") == 2 * SBH


def test_parameters_are_not_activations_and_one_memory_counts_once():
    linear = nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    got = saved_for_backward(linear, x)
    assert got["total_bytes"] == 4 * 8 * 4  # the input; the weight (and its transposed view) is excluded

    class Probabilities(nn.Module):
        def forward(self, z):
            p = torch.softmax(z, -1)  # saves p
            return torch.bmm(p[None], p[None].transpose(1, 2))  # saves p again, as [1, n, n] and its transpose

    z = torch.randn(6, 6, requires_grad=True)
    got = saved_for_backward(Probabilities(), z)
    assert len(got["tensors"]) == 3 and got["total_bytes"] == 6 * 6 * 4


@pytest.mark.parametrize("shape", [(2048, 1, 12288, 96), (128, 2, 64, 4), (4096, 4, 4096, 32)])
def test_the_terms_add_up_to_the_paper_formulas(shape):
    s, b, h, a = shape
    every = tp_check.activation_terms(s, b, h, a)  # 16-bit, every term: sbh(34 + 5as/h)
    assert sum(t["bytes"] for t in every) == activation_bytes_per_layer(s, b, h, a)
    no_probs = tp_check.activation_terms(s, b, h, a, stores_probabilities=False)  # what selective recompute keeps
    assert sum(t["bytes"] for t in no_probs if t["applies"]) == activation_bytes_per_layer(s, b, h, a,
                                                                                           recompute="selective")


def test_the_table_lists_every_segment_and_the_totals():
    m, x = block(), x_in()
    table = tp_check.activation_table(terms(), {"math": saved_for_backward(m, x, math_attention=True)["by_segment"],
                                                "recompute": saved_for_backward(m, x, recompute=True)["by_segment"]})
    for segment in ("ln1", "attention", "mlp.fc2", "dropout", TOP, "total"):
        assert segment in table
    assert "as^2b (no)" in table and str(SBH * FP32) in table.splitlines()[-1]
