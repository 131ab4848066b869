"""One provenance record for every measurement (workers/provenance.py), one reader (course_utils.reference_data.label).

Every writer that runs without a GPU is checked to store a record that ``label`` reads; every layout committed
under data/ (and the shared reference beside the clone), and the layouts written before the record existed, are
read by the same ``label``.
"""
import json
import platform
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from course_utils import reference_data
from course_utils.paths import ROOT
from workers import provenance

SHARED = ROOT.parent / "shared" / "reference"


def gpu_record(**kw) -> dict:
    return {"device": "NVIDIA H200", "device_kind": "cuda", "torch": "2.11.0+cu130", "cuda": "13.0",
            "triton": "3.6.0", "python": "3.12.3", "cpu_capability": "AVX512", "date": "2026-12-02T10:00:00+00:00",
            "command": "bash tools/gpu/run_all.sh attention", **kw}


# -- the record ------------------------------------------------------------------------------------------------

def test_record_has_every_field_and_is_json():
    rec = provenance.record()
    assert tuple(rec) == provenance.FIELDS
    assert json.loads(json.dumps(rec)) == rec
    assert rec["torch"] == torch.__version__ and rec["cuda"] == torch.version.cuda
    assert rec["python"] == platform.python_version()
    assert rec["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rec["date"].endswith("+00:00") and rec["date"][:2] == "20"
    if torch.cuda.is_available():
        assert rec["device_kind"] == "cuda" and rec["device"] == torch.cuda.get_device_name(0)
    else:
        assert rec["device_kind"] == "cpu" and rec["device"] == provenance.cpu_model() + " (CPU)"
    cpu = provenance.record("x", device="cpu")
    assert cpu["device_kind"] == "cpu" and cpu["device"].endswith(" (CPU)") and cpu["command"] == "x"


def test_record_carries_nothing_personal(monkeypatch):
    home = str(Path.home())
    monkeypatch.setattr(sys, "argv", [str(ROOT / "tools" / "gpu" / "tp_block_bench.py"), "--out",
                                      f"{home}/secret/tp.json", "--device", "cpu"])
    rec = provenance.record(device="cpu")
    assert rec["command"] == "tools/gpu/tp_block_bench.py --out tp.json --device cpu"
    text = json.dumps(rec)
    assert socket.gethostname() not in text.replace(rec["device"], "")
    assert home not in text


# -- the reader ------------------------------------------------------------------------------------------------

def test_label_of_a_gpu_record():
    assert reference_data.label({"provenance": gpu_record(), "file": "data/gpu/tp_block_h200.json"}) == (
        "NVIDIA H200 · torch 2.11.0+cu130 · CUDA 13.0 · Triton 3.6.0 · 2026-12-02 (data/gpu/tp_block_h200.json)")
    assert reference_data.label(gpu_record(triton=None)) == "NVIDIA H200 · torch 2.11.0+cu130 · CUDA 13.0 · 2026-12-02"


def test_label_of_a_cpu_record_says_it_is_not_gpu_numbers():
    rec = provenance.record("python -m course_utils.cpu_spread", device="cpu")
    text = reference_data.label({"provenance": rec}, live=True)
    model = rec["device"].removesuffix(" (CPU)")
    assert text.startswith(f"CPU {model} ({rec['cpu_capability']}) · torch {torch.__version__} · {rec['date'][:10]}")
    assert text.endswith(", measured on this machine: not GPU numbers")
    assert "CUDA" not in text and "Triton" not in text


@pytest.mark.parametrize("path", sorted((ROOT / "data").rglob("*.json")), ids=lambda p: p.name)
def test_label_reads_every_committed_data_file(path):
    name = path.relative_to(ROOT).as_posix()
    rec = reference_data.load(path.stem) if path.parent == reference_data.REFERENCE_DIR else json.loads(path.read_text())
    p = reference_data.provenance_of(rec)
    assert p["device"] and p["torch"] and p["date"], name
    text = reference_data.label(rec)
    assert p["device"] in text and f"torch {p['torch']}" in text and p["date"][:10] in text
    if path.parent == reference_data.REFERENCE_DIR:
        assert text.endswith(f"({name})")


@pytest.mark.parametrize("name", ["h200_attention_baseline", "h200_block_fp8_baseline"])
def test_label_reads_the_shared_reference_files(name):
    # The raw layout of ../shared/reference/<name>.json is the committed file without its provenance key (the
    # reference-data tests check the hash), so it is tested from the repository, with or without ../shared.
    raw = json.loads((ROOT / "data" / "reference" / f"{name}.json").read_text())
    raw.pop("provenance")
    if (SHARED / f"{name}.json").exists():
        assert json.loads((SHARED / f"{name}.json").read_text()) == raw
    text = reference_data.label(raw, source=f"../shared/reference/{name}.json")
    assert text.startswith("NVIDIA H200 · torch 2.11.0+cu130 · ") and "date not recorded" in text


def test_committed_reference_captions():
    # what chapters 06, 07 and 11 print for them
    assert reference_data.label(reference_data.load("h200_attention_baseline")) == (
        "NVIDIA H200 · torch 2.11.0+cu130 · Triton 3.6.0 · 2026-11-29 (data/reference/h200_attention_baseline.json)")
    ref = reference_data.load("h200_block_fp8_baseline")
    assert reference_data.label(ref) == reference_data.label(ref, "h200_block_fp8_baseline") == (
        "NVIDIA H200 · torch 2.11.0+cu130 · 2026-11-29 (data/reference/h200_block_fp8_baseline.json)")


OLD_LAYOUTS = {
    "bench_attention meta": ({"meta": {"gpu": "NVIDIA H200", "torch": "t", "triton": "3.6", "cuda": "13.0",
                                       "date": "2026-12-02T10:00:00+00:00", "command": "c"}, "rows": []},
                             "NVIDIA H200 · torch t · CUDA 13.0 · Triton 3.6 · 2026-12-02"),
    "ch11 device_name": ({"device_name": "NVIDIA H200", "torch": "t", "cuda": "13.0", "date": "2026-12-02T10:00:00",
                          "path": "data/gpu/ch11_memory_h200.json"},
                         "NVIDIA H200 · torch t · CUDA 13.0 · 2026-12-02 (data/gpu/ch11_memory_h200.json)"),
    "tp_block_bench device": ({"device": "NVIDIA H200", "torch": "t", "cuda": "13.0", "date": "2026-12-02 10:00:00 UTC",
                               "command": "c", "file": "data/gpu/tp_block_h200.json"},
                              "NVIDIA H200 · torch t · CUDA 13.0 · 2026-12-02 (data/gpu/tp_block_h200.json)"),
    "tp_block_bench on a CPU": ({"device": "cpu (no GPU): not a GPU measurement", "torch": "t", "date": "2026-12-02"},
                                "CPU · torch t · 2026-12-02: not GPU numbers"),
    "cpu_spread meta": ({"meta": {"cpu": "AMD EPYC 9654", "native_capability": "AVX512", "torch": "t",
                                  "date": "2026-12-02", "command": "c"}, "runs": []},
                        "CPU AMD EPYC 9654 (AVX512) · torch t · 2026-12-02: not GPU numbers"),
}


@pytest.mark.parametrize("layout", OLD_LAYOUTS)
def test_label_reads_the_layouts_written_before_the_record(layout):
    rec, caption = OLD_LAYOUTS[layout]
    assert reference_data.label(rec) == caption


# -- the writers that run without a GPU ------------------------------------------------------------------------

def _readable(rec: dict) -> str:
    prov = rec["provenance"]
    assert set(provenance.FIELDS) <= set(prov) and json.loads(json.dumps(rec)) == rec
    text = reference_data.label(rec)
    assert prov["device"].removesuffix(" (CPU)") in text and prov["date"][:10] in text
    return text


def test_bench_attention_results_carry_a_record():
    from workers.attention import bench as bench_attention

    info = bench_attention.environment_info(["--quick", "--out", "r.json"])
    assert info["provenance"]["command"] == "python -m workers.attention.bench --quick --out r.json"
    _readable(info)


def test_tp_block_bench_environment_is_a_record():
    sys.path.insert(0, str(ROOT / "tools" / "gpu"))
    import tp_block_bench

    env = tp_block_bench.environment("cpu")
    assert env["provenance"]["device_kind"] == "cpu" and "host" not in env
    assert _readable(env).endswith("not GPU numbers")


def test_cpu_spread_files_carry_a_record():
    from course_utils import cpu_spread

    out = cpu_spread.result_file([{"experiment": "x", "seed": 0}], ["ch09_fp16", "--seeds", "0"])
    assert out["provenance"]["command"] == "python -m course_utils.cpu_spread ch09_fp16 --seeds 0"
    assert out["provenance"]["device_kind"] == "cpu" and out["runs"][0]["seed"] == 0
    assert _readable(out).startswith("CPU ")


def test_ch11_live_record_and_run_record():
    from course_utils import ch11

    live = ch11.live_memory_record(worlds=(), zero_stages=())  # no runs: only the header
    assert live["runs"] == [] and _readable(live).split(": not GPU")[0].endswith("measured on this machine") \
        or torch.cuda.is_available()
    res = SimpleNamespace(worker="workers.hello", world_size=2, devices=["cpu", "cpu"])
    rec = reference_data.run_record(res)
    assert rec["provenance"]["command"] == "course_utils.run('workers.hello', world_size=2)"
    assert _readable(rec).endswith(", measured on this machine: not GPU numbers")
