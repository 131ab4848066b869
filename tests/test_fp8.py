"""FP8 quantiser: the formats' limits, rounding, scaling granularity and delayed vs current scaling.

Formats: Micikevicius et al. 2022, "FP8 Formats for Deep Learning", Table 1. Granularity:
DeepSeek-V3 technical report, sec 3.3.2. Delayed scaling: Transformer Engine's DelayedScaling recipe.
All inputs are seeded, so every number here is deterministic.
"""

import pytest
import torch

from course_utils.fp8 import (
    E4M3,
    E5M2,
    DelayedScaling,
    compute_scale,
    current_scale,
    fake_quantize,
    quantize,
    relative_error,
    round_to_fp8,
    saturated_fraction,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------
# The formats
# ------------------------------------------------------------------------------------------------


def test_format_limits_match_the_paper_and_torch():
    # Table 1: E4M3 max 448, min normal 2^-6, min subnormal 2^-9; E5M2 max 57344, min normal 2^-14,
    # min subnormal 2^-16. torch.finfo of the dtypes we cast with must agree.
    assert (E4M3.max, E5M2.max) == (448.0, 57344.0)
    assert torch.finfo(E4M3.dtype).max == 448.0 and torch.finfo(E5M2.dtype).max == 57344.0
    assert torch.finfo(E4M3.dtype).smallest_normal == 2.0**-6
    assert torch.finfo(E5M2.dtype).smallest_normal == 2.0**-14
    # The smallest subnormals survive a round trip; half of them is a tie and rounds to even (0).
    assert round_to_fp8(torch.tensor(2.0**-9), "e4m3").item() == 2.0**-9
    assert round_to_fp8(torch.tensor(2.0**-16), "e5m2").item() == 2.0**-16
    assert round_to_fp8(torch.tensor(2.0**-10), "e4m3").item() == 0.0


def test_rounding_is_to_nearest_even_on_the_e4m3_grid():
    # In [1, 2) E4M3 has 3 mantissa bits: spacing 1/8. 1.0625 is exactly between 1 and 1.125 and
    # rounds to the even mantissa (1.0); 1.07 is nearer 1.125; 1.1875 (between 1.125 and 1.25)
    # rounds to 1.25 (even).
    x = torch.tensor([1.0625, 1.07, 1.1875, 448.0, -3.0])
    assert round_to_fp8(x, "e4m3").tolist() == [1.0, 1.125, 1.25, 448.0, -3.0]


def test_out_of_range_saturates_instead_of_overflowing():
    # E5M2 has infinities and torch's cast overflows to inf; the quantiser clamps first, so values
    # beyond range become +-max (what the scaling recipes do) and never inf or NaN.
    big = torch.tensor([1e6, -1e6])
    assert torch.isinf(big.to(torch.float8_e5m2).float()).all()
    assert round_to_fp8(big, "e5m2").tolist() == [57344.0, -57344.0]
    assert round_to_fp8(big, "e4m3").tolist() == [448.0, -448.0]
    # the same holds inside quantize when a given (delayed) scale is too large for the data
    assert quantize(torch.tensor([1e6, 1.0]), "e5m2", scale=1.0).dequantize().tolist() == [57344.0, 1.0]


@pytest.mark.parametrize("fmt, mantissa_bits", [("e4m3", 3), ("e5m2", 2)])
def test_relative_rounding_error_is_half_an_ulp(fmt, mantissa_bits):
    # For normal numbers, round-to-nearest with m mantissa bits errs by at most half a unit in the
    # last place, 2^-(m+1) relative to the binade's bottom; the worst relative error is at the
    # first midpoint, x = 1 + 2^-(m+1): 1/(2^(m+1) + 1) = 1/17 for E4M3 and 1/9 for E5M2. Over
    # 20k values some error comes within 5% of that, so a coarser grid would fail the first assert
    # and a finer one the second.
    x = (_randn(20_000, seed=1).abs() + 0.05) * torch.where(_randn(20_000, seed=2) > 0, 1.0, -1.0)
    q = round_to_fp8(x, fmt)
    rel = ((q - x).abs() / x.abs()).max().item()
    worst = 1 / (2 ** (mantissa_bits + 1) + 1)
    assert rel <= worst + 1e-6
    assert rel > 0.95 * worst


# ------------------------------------------------------------------------------------------------
# Scaling granularity
# ------------------------------------------------------------------------------------------------


def test_per_tensor_scale_maps_amax_to_the_format_max():
    # scale = fp8_max / amax (Transformer Engine): the largest magnitude lands exactly on 448 and
    # dequantises back to itself.
    x = _randn(64, 256, seed=3)
    q = quantize(x, "e4m3", "tensor")
    assert q.scale.item() == pytest.approx(448.0 / x.abs().max().item())
    assert q.data.float().abs().max().item() == 448.0
    i = x.abs().argmax()
    assert q.dequantize().flatten()[i].item() == pytest.approx(x.flatten()[i].item(), rel=1e-6)


def test_tile_and_block_scales_are_per_group():
    # DeepSeek-V3 sec 3.3.2: 1 x 128 tiles along the last dim, 128 x 128 blocks. A 200 x 300 matrix
    # has 200 x 3 tiles and 2 x 3 blocks (partial groups at the edges). Each scale must be
    # 448 / amax of exactly its own group, computed here by slicing.
    x = _randn(200, 300, seed=4)
    tile = quantize(x, "e4m3", "tile")
    block = quantize(x, "e4m3", "block")
    assert tuple(tile.scale.shape) == (200, 3) and tuple(block.scale.shape) == (2, 3)
    assert tile.scale[7, 2].item() == pytest.approx(448.0 / x[7, 256:300].abs().max().item())
    assert block.scale[1, 0].item() == pytest.approx(448.0 / x[128:200, 0:128].abs().max().item())
    for q in (tile, block):
        assert q.dequantize().shape == x.shape
        assert relative_error(x, q.dequantize()) < 0.04  # ~2^-4 / sqrt(3) for gaussian data


def test_tile_scaling_of_a_3d_activation_keeps_its_shape():
    # Activations are [batch, seq, hidden]; tiles run along hidden, per token.
    x = _randn(2, 5, 256, seed=5)
    q = quantize(x, "e4m3", "tile")
    assert tuple(q.scale.shape) == (10, 2)
    assert q.dequantize().shape == x.shape


def test_outlier_channels_ruin_per_tensor_scaling_but_not_fine_groups():
    # Activations with a few huge channels (4 of 512 columns) force one small per-tensor scale on
    # everything. FP8 is floating point, so a moderate outlier (x100) only shifts the ordinary
    # values down a few binades and costs nothing; an extreme one (x1e5) pushes them below E4M3's
    # normal range (2^-6) into subnormals spaced 2^-9 apart, and they lose most of their bits.
    # Tiles (1 x 128) and blocks (128 x 128) confine the outliers to the 128 columns that hold
    # them (DeepSeek-V3 sec 3.3.2). Errors measured on the other 384 columns.
    clean = slice(128, 512)

    def errors(outlier):
        x = _randn(256, 512, seed=6)
        x[:, :4] *= outlier
        return {g: relative_error(x[:, clean], fake_quantize(x, "e4m3", g)[:, clean])
                for g in ("tensor", "tile", "block")}

    moderate, extreme = errors(1e2), errors(1e5)
    assert moderate["tensor"] < 1.1 * moderate["tile"]
    assert extreme["tensor"] > 10 * extreme["tile"]
    for err in (moderate, extreme):
        assert err["tile"] < 0.04 and err["block"] < 0.04  # ~2^-4/sqrt(3) for gaussian data


def test_e4m3_is_more_precise_and_e5m2_has_more_range():
    # One more mantissa bit halves the rounding error: on the same gaussian tensor E5M2's error is
    # about twice E4M3's. E5M2's range is 57344 / 448 = 128x wider.
    x = _randn(128, 512, seed=8)
    e4 = relative_error(x, fake_quantize(x, "e4m3"))
    e5 = relative_error(x, fake_quantize(x, "e5m2"))
    assert 1.5 < e5 / e4 < 2.5
    assert E5M2.max / E4M3.max == 128


def test_power_of_two_scale_is_exact_and_never_overflows():
    # Rounding the scale down to a power of two (shared-exponent scales) makes scaling exact in
    # binary and keeps amax * scale <= 448, at the cost of up to half the range.
    x = _randn(64, 128, seed=9) * 3.7
    s = compute_scale(x.abs().max(), "e4m3", power_of_two=True)
    assert torch.log2(s).item() == round(torch.log2(s).item())
    assert (x.abs().max() * s).item() <= 448.0
    assert s.item() > 0.5 * compute_scale(x.abs().max(), "e4m3").item()


def test_nbytes_is_one_byte_per_element_plus_scales():
    # What FP8 changes in the ledger: 1 byte per element instead of 2, plus a float32 per group.
    x = _randn(256, 256, seed=10)
    assert quantize(x, "e4m3", "tensor").nbytes == 256 * 256 + 4
    assert quantize(x, "e4m3", "block").nbytes == 256 * 256 + 4 * 4
    assert quantize(x, "e4m3", "tile").nbytes == 256 * 256 + 4 * 256 * 2


# ------------------------------------------------------------------------------------------------
# Delayed vs current scaling
# ------------------------------------------------------------------------------------------------


def test_delayed_scaling_clips_a_sudden_jump_that_current_scaling_handles():
    # Delayed scaling (TE) takes its scale from earlier amaxes; when the tensor is suddenly 8x
    # larger, everything above the old amax is clipped to 448. Current scaling measures this
    # tensor and clips nothing. One step later the history has caught up and nothing clips.
    delayed = DelayedScaling("e4m3", history_len=4)
    for step in range(5):
        delayed.quantize(_randn(4096, seed=100 + step))
    jump = 8 * _randn(4096, seed=200)
    scale_used = delayed.scale
    q_delayed = delayed.quantize(jump)
    assert saturated_fraction(jump, scale_used) > 0.3
    assert saturated_fraction(jump, current_scale(jump)) == 0.0
    err_delayed = relative_error(jump, q_delayed.dequantize())
    err_current = relative_error(jump, fake_quantize(jump, "e4m3"))
    assert err_delayed > 10 * err_current
    after = 8 * _randn(4096, seed=201)
    assert saturated_fraction(after, delayed.scale) < 0.01


def test_amax_history_max_versus_most_recent():
    # TE's amax_compute_algo: "max" takes the largest amax in the window, "most_recent" the last.
    # Feed constant tensors with amax 1, then 8 (a spike), then 1 again, window 3. After the spike
    # "most_recent" is back to 448/1 at once, "max" stays at 448/8 until the spike leaves the
    # window (three more steps).
    ones, spike = torch.ones(16), 8 * torch.ones(16)
    by_max = DelayedScaling(history_len=3, amax_compute_algo="max")
    by_last = DelayedScaling(history_len=3, amax_compute_algo="most_recent")
    assert by_max.scale.item() == 1.0  # empty history: TE starts from scale 1
    for x in (ones, spike, ones):
        by_max.quantize(x)
        by_last.quantize(x)
    assert by_last.scale.item() == 448.0
    assert by_max.scale.item() == 56.0
    by_max.quantize(ones)
    assert by_max.scale.item() == 56.0  # history [8, 1, 1]
    by_max.quantize(ones)
    assert by_max.scale.item() == 448.0  # history [1, 1, 1]


def test_margin_leaves_headroom():
    # margin m divides the scale by 2^m (TE: the FP8 max is 2^-margin * fp8_max), so amax lands on
    # 448 / 2^m and a tensor up to 2^m times larger still fits.
    x = _randn(1024, seed=11)
    q = quantize(x, "e4m3", "tensor", margin=1)
    assert q.data.float().abs().max().item() == 224.0


# ------------------------------------------------------------------------------------------------
# Inputs a learner can get wrong
# ------------------------------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_a_sentence():
    x = _randn(8, 128, seed=12)
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'; use 'e4m3' or 'e5m2'"):
        quantize(x, "e3m4")
    with pytest.raises(ValueError, match="granularity"):
        quantize(x, "e4m3", "row")
    with pytest.raises(ValueError, match="at least two dimensions"):
        quantize(x[0], "e4m3", "block")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize(torch.tensor([1.0, float("nan")]), "e4m3")


# ------------------------------------------------------------------------------------------------
# What FP8 changes in the activation ledger

def test_fp8_linear_inputs_halve_14_of_korthikantis_34_sbh():
    from course_utils.ledger import (LINEAR_INPUT_TERMS, activation_bytes_per_layer, activation_terms_per_layer,
                                     fp8_linear_inputs_activation_bytes_per_layer)

    shape = dict(seq=2048, micro_batch=1, hidden=4096, heads=32)
    sbh = 2048 * 4096
    terms = activation_terms_per_layer(**shape, recompute="selective")
    assert sum(terms[t] for t in LINEAR_INPUT_TERMS) == 14 * sbh  # QKV 2 + projection 2 + fc1 2 + fc2 8
    assert activation_bytes_per_layer(**shape, recompute="selective") == 34 * sbh
    assert fp8_linear_inputs_activation_bytes_per_layer(**shape) == 27 * sbh  # 34 - 14/2
    # a fused attention keeps its bf16 output O (the projection's input) for its own backward: the FP8 copy adds 1
    assert fp8_linear_inputs_activation_bytes_per_layer(**shape, attention_keeps_output=True) == 29 * sbh
    # without recomputation the s x s terms stay in 16 bits; full recomputation keeps only the layer input
    none = fp8_linear_inputs_activation_bytes_per_layer(**shape, recompute="none")
    assert none == activation_bytes_per_layer(**shape) - 7 * sbh
    assert fp8_linear_inputs_activation_bytes_per_layer(**shape, recompute="full") == 2 * sbh
    with pytest.raises(ValueError, match="recompute must be one of"):
        fp8_linear_inputs_activation_bytes_per_layer(**shape, recompute="some")
