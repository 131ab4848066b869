"""The H200 benchmark's CPU-safe parts: it imports, counts FLOPs as documented, and runs end to end on a CPU.

The GPU numbers themselves come from a session with the H200 (``tools/gpu/tp_block_bench.py``), never
from here: this only proves the script would run and that its two blocks compute the same function.
"""
import json
import subprocess
import sys

import torch

from course_utils.paths import ROOT

sys.path.insert(0, str(ROOT / "tools" / "gpu"))

import tp_block_bench as bench  # noqa: E402


def test_flops_convention():
    b, s, h = 8, 1024, 4096
    assert bench.block_flops(b, s, h) == 3 * (24 * b * s * h * h + 2 * b * s * s * h)
    assert bench.block_flops(b, s, h, causal=False) == 3 * (24 * b * s * h * h + 4 * b * s * s * h)


def test_plain_block_loads_the_course_weights_and_matches_the_dense_block():
    from workers.model.dense import BlockConfig, DenseBlock

    torch.manual_seed(0)
    cfg = BlockConfig(hidden=32, heads=4)
    dense = DenseBlock(cfg)
    plain = bench.PlainBlock(32, 4)
    plain.load_course(dense)
    x = torch.randn(2, 16, 32)
    assert torch.allclose(plain(x), dense(x.transpose(0, 1)).transpose(0, 1), atol=1e-5)


def test_runs_end_to_end_on_a_cpu_and_chapter_06_reads_its_output(tmp_path, monkeypatch):
    out = tmp_path / "tp_block_cpu.json"
    cmd = [sys.executable, str(ROOT / "tools" / "gpu" / "tp_block_bench.py"), "--device", "cpu", "--dtype", "float32",
           "--hidden", "32", "--heads", "4", "--shapes", "16x2,32x1", "--matmul", "64", "--iters", "2",
           "--warmup", "1", "--profile", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in ("provenance", "matmul", "shapes"):
        assert key in data
    assert data["provenance"]["device_kind"] == "cpu"  # never mistaken for a GPU measurement
    assert data["provenance"]["command"].startswith("python tools/gpu/tp_block_bench.py --device cpu")
    assert [r["seq"] for r in data["shapes"]] == [16, 32]
    for row in data["shapes"]:
        assert row["max_abs_diff_course_vs_plain"] < 1e-4
        assert row["course_block"]["median_s"] > 0 and row["plain_block"]["tflops"] > 0
        assert row["activation_memory"]["measured_bytes"] is None  # CUDA allocator only
    assert [p["seq"] for p in data["profile"]] == [16, 32]
    # Chapter 06's GPU cell reads whatever tools/gpu/run_all.sh commits: the same file format, from the same script.
    from course_utils import tp_figures

    monkeypatch.setattr(tp_figures, "GPU_DATA", tmp_path)
    monkeypatch.setattr(tp_figures, "ROOT", tmp_path)
    (run,) = tp_figures.gpu_results("tp_block_*.json")
    table = tp_figures.gpu_table(run)
    assert "not GPU numbers" in table and "tp_block_cpu.json" in table and "s=   16 b=2" in table
    assert table.splitlines()[1] == "command: " + data["provenance"]["command"]
    figures = tp_figures.gpu_profile_figures(run)
    assert len(figures) == 2 and "tp_block_cpu.json" in figures[0].texts[-1].get_text()
    import matplotlib.pyplot as plt

    plt.close("all")
