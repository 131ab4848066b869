"""workers.attention.bench: the parts that run without a GPU (the sweep itself needs one)."""
import pytest
import torch

from course_utils import attention_io
from workers.attention import bench


def test_flops_follow_the_reference_convention():
    # shared/reference/h200_attention_baseline.json, N=4096, non-causal, SDPA flash: 0.77584 ms -> 354.297 TFLOP/s
    flops = bench.attention_flops(2, 16, 4096, 128, causal=False, mode="fwd")
    assert bench.tflops(flops, 0.7758399844169617) == pytest.approx(354.29716496317064, rel=1e-9)
    # causal halves, forward+backward is 3.5x; and the notebook-side model agrees with the worker's
    assert bench.attention_flops(2, 16, 4096, 128, True, "fwdbwd") == flops / 2 * 3.5
    for causal in (False, True):
        for mode, backward in (("fwd", False), ("fwdbwd", True)):
            assert bench.attention_flops(2, 16, 1024, 64, causal, mode) == \
                attention_io.attention_flops(1024, 64, 2, 16, causal, backward)
    assert bench.tflops(flops, None) is None
    with pytest.raises(ValueError):
        bench.attention_flops(1, 1, 8, 8, False, "bwd")


def test_plan_runs_math_only_where_it_fits():
    cases = bench.plan_cases([4096, 8192, 16384], [128], [False], ["sdpa_math", "sdpa_flash"], 2, 16, 48.0)
    skipped = {(c["n"], c["impl"]) for c in cases if c["skip"]}
    # 5 fp32 N x N copies for B=2, H=16: 10 GiB at 4096, 40 GiB at 8192, 160 GiB at 16384
    assert skipped == {(16384, "sdpa_math")}
    assert len(cases) == 6


def test_quick_arguments_and_unknown_impl():
    args = bench.parse_args(["--out", "x.json", "--quick"])
    assert args.seqlens == [1024, 4096, 16384] and args.head_dims == [128] and args.causal_flags == [False, True]
    assert args.impls == list(bench.ALL_IMPLS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--impls", "sdpa_flash,magic"])


def test_environment_info_without_gpu():
    info = bench.environment_info(["--out", "r.json"])
    prov = info["provenance"]
    assert prov["torch"] == torch.__version__ and prov["command"] == "python -m workers.attention.bench --out r.json"
    assert prov["date"].startswith("20") and prov["device_kind"] == "cpu"
    assert {"flash_attn", "cudnn", "gpu_memory_gib"} <= set(info["environment"])


def test_refuses_politely_without_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same refusal on a GPU machine
    out = tmp_path / "results.json"
    assert bench.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == bench.NO_GPU_MESSAGE and err.count(". ") == 0 and "GPU" in err
    assert not out.exists()


def test_course_runners_work_on_cpu():
    # The runner plumbing is device-agnostic; on CPU the torch path runs (the sweep itself needs CUDA).
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    out = bench.make_runner("course_torch", q, k, v, causal=True)()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
