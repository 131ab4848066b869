"""course_utils.attention_io: the HBM-bytes and memory models of chapter 07, checked by hand counts."""
import math

import pytest

from course_utils import attention_io as io

MiB = 2**20


def test_naive_bytes_is_algorithm0_count():
    # Algorithm 0 (Dao et al. 2022): read Q, K, write S, read S, write P, read P, V, write O:
    # 4Nd + 4N^2 elements per head.
    n, d = 1000, 64
    assert io.naive_attention_hbm_bytes(n, d, bytes_per_element=2) == 2 * (4 * n * d + 4 * n * n)
    assert io.naive_attention_hbm_bytes(n, d, batch=3, heads=5, bytes_per_element=4) == 15 * 4 * (4 * n * d + 4 * n * n)
    # softmax in fp32 on bf16 inputs: only the N^2 terms change size
    assert io.naive_attention_hbm_bytes(n, d, score_bytes=4) == 2 * 4 * n * d + 4 * 4 * n * n


def test_tiled_bytes_counts_kv_once_per_query_tile():
    n, d, block_q = 1000, 64, 128
    tiles = math.ceil(n / block_q)  # 8
    expected = 2 * (2 * n * d) + tiles * 2 * (2 * n * d) + 4 * n  # Q and O once; K and V per tile; LSE fp32
    assert io.tiled_attention_hbm_bytes(n, d, block_q, bytes_per_element=2) == expected


def test_causal_tiled_reads_about_half_the_keys():
    n, d, block_q = 4096, 128, 128
    full = io.tiled_attention_hbm_bytes(n, d, block_q, causal=False)
    causal = io.tiled_attention_hbm_bytes(n, d, block_q, causal=True)
    keys = io.keys_read_per_query_tile(n, block_q, causal=True)
    assert keys[0] == block_q and keys[-1] == n and len(keys) == n // block_q
    # sum_i (i+1) B over T tiles = B T (T+1) / 2: a little over half of T * N
    assert sum(keys) == block_q * 32 * 33 // 2
    assert 0.5 < (causal - 4 * n * d) / (full - 4 * n * d) < 0.52


def test_naive_is_quadratic_and_tiled_traffic_beats_it_by_2_block_over_d():
    d, block_q = 128, 128
    naive = [io.naive_attention_hbm_bytes(n, d) for n in (4096, 8192)]
    assert naive[1] / naive[0] == pytest.approx(4, rel=0.02)
    # For large N the ratio naive / tiled tends to 2 * block_q / d (4N^2 vs 2N^2 d / block_q).
    for d, expected in ((128, 2.0), (64, 4.0)):
        n = 65536
        ratio = io.naive_attention_hbm_bytes(n, d) / io.tiled_attention_hbm_bytes(n, d, block_q)
        assert ratio == pytest.approx(expected, rel=0.02)
    # The compulsory traffic is linear in N.
    assert io.compulsory_attention_hbm_bytes(8192, 128) == 2 * io.compulsory_attention_hbm_bytes(4096, 128)


def test_theorem2_scales_as_n2_d2_over_m():
    # Doubling M (SRAM) halves the dominant term; doubling d (with B_c ~ M / 4d) quadruples it.
    n = 16384
    base = io.fa1_theorem2_hbm_bytes(n, 64, sram_bytes=100 * 1024)
    double_sram = io.fa1_theorem2_hbm_bytes(n, 64, sram_bytes=200 * 1024)
    double_d = io.fa1_theorem2_hbm_bytes(n, 128, sram_bytes=100 * 1024)
    assert base / double_sram == pytest.approx(2, rel=0.05)
    assert double_d / base == pytest.approx(4, rel=0.05)
    assert io.fa1_block_sizes(64, 100 * 1024, 2) == (64, 200)  # B_c = ceil(51200 / 256), B_r = min(B_c, d)


def test_backward_models():
    n, d = 2048, 64
    assert io.naive_attention_backward_hbm_bytes(n, d, bytes_per_element=2) == 2 * (7 * n * n + 8 * n * d)
    full = io.tiled_attention_backward_hbm_bytes(n, d, causal=False)
    causal = io.tiled_attention_backward_hbm_bytes(n, d, causal=True)
    assert causal < full < io.naive_attention_backward_hbm_bytes(n, d)


def test_peak_memory_matches_the_h200_flash_measurement():
    # shared/reference/h200_attention_baseline.json: SDPA flash, B=2, H=16, N=4096, D=128, bf16,
    # fwd_peak_mib = 32.5009765625. The model: output (32 MiB) + fp32 LSE (0.5 MiB).
    tiled = io.attention_peak_extra_bytes(4096, 128, batch=2, heads=16, bytes_per_element=2, impl="tiled")
    assert tiled / MiB == 32.5
    # Linear vs quadratic: doubling N doubles tiled memory and about quadruples naive memory.
    assert io.attention_peak_extra_bytes(8192, 128, 2, 16, impl="tiled") == 2 * tiled
    naive = [io.attention_peak_extra_bytes(n, 128, 2, 16, impl="naive") for n in (4096, 8192)]
    assert naive[1] / naive[0] == pytest.approx(4, rel=0.05)
    # The math backend measured 7448 MiB there: about 3.6 fp32 N x N copies, which the model can express.
    math_like = io.attention_peak_extra_bytes(4096, 128, 2, 16, impl="naive", score_copies=3.6, score_bytes=4)
    assert math_like / MiB == pytest.approx(7448, rel=0.02)


def test_flops_convention_matches_the_reference_file():
    # The reference json: SDPA flash, N=4096, non-causal: 0.7758399844 ms forward = 354.297 TFLOP/s.
    flops = io.attention_flops(4096, 128, batch=2, heads=16)
    assert flops / (0.7758399844169617e-3) / 1e12 == pytest.approx(354.29716496317064, rel=1e-9)
    assert io.attention_flops(4096, 128, 2, 16, causal=True, backward=True) == flops / 2 * 3.5


def test_byte_models_are_ordered_and_sram():
    for n in (1024, 2048):
        naive, tiled = io.naive_attention_hbm_bytes(n, 64, 1, 1, 2), io.tiled_attention_hbm_bytes(n, 64, 128, 1, 1, 2)
        assert naive > tiled > io.compulsory_attention_hbm_bytes(n, 64, 1, 1, 2)
        assert io.attention_peak_extra_bytes(n, 64, 1, 1, 2, "naive") > io.attention_peak_extra_bytes(n, 64, 1, 1, 2, "tiled")
    # 128 x 64 tiles, d = 128, bf16, 3 stages: Q 32 KiB + K,V 96 KiB, plus fp32 accumulators
    assert io.tiled_sram_bytes(128, 64, 128, 2, num_stages=3) == 32768 + 98304 + 65536 + 1024 + 32768


@pytest.mark.parametrize("bad", [dict(n=0), dict(d=-1), dict(batch=1.5)])
def test_bad_sizes_are_rejected(bad):
    args = dict(n=128, d=64, batch=1)
    args.update(bad)
    with pytest.raises(ValueError, match="must be a positive integer"):
        io.naive_attention_hbm_bytes(args["n"], args["d"], batch=args["batch"])
