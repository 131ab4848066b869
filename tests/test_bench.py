"""``make bench``'s GPU part writes its results where the chapters read them (the numbers need a GPU; the
names do not)."""
import fnmatch
from pathlib import Path

import torch

from course_utils import bench, ch07, tp_figures


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("NVIDIA GeForce RTX 4090") == "nvidia_geforce_rtx_4090"


def test_gpu_results_land_where_the_chapters_read_them():
    commands = bench.gpu_commands("h200", "2026-12-01")
    attention = Path(commands["attention"][commands["attention"].index("--out") + 1])
    assert fnmatch.fnmatch(str(attention), ch07.BENCH_GLOB)  # chapter 07
    tp_block = Path(commands["tp_block"][commands["tp_block"].index("--out") + 1])
    assert tp_block.parent == tp_figures.GPU_DATA and fnmatch.fnmatch(tp_block.name, "tp_block_*.json")  # chapter 06
    assert Path(commands["ch11_memory"][1]).exists()  # chapter 11: the script names its own files
    # a later dated run sorts ahead of run_all's undated file, so chapter 06 shows the newest
    names = sorted(["tp_block_h200.json", tp_block.name], reverse=True)
    assert names[0] == tp_block.name


def test_no_gpu_no_gpu_benchmarks(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.bench_gpu() == {}
    assert "skipped" in capsys.readouterr().out
