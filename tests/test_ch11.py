"""Chapter 11's notebook-side helpers: the figures show the ledger's numbers, GPU data is read only when it was
committed (never invented), and the FP8 experiments behave as the notebook says they do."""
import json
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils import ch11, reference_data  # noqa: E402
from course_utils.ledger import GB, model_state_bytes  # noqa: E402
from tests.numeric import worst

ROOT = ch11.ROOT


def test_ledger_figure_bars_are_the_plans_memory_and_zero_shards_one_state_per_stage():
    plans = ch11.ledger_plans("7B", (8, 64))
    ax = ch11.ledger_figure(plans, "t")
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2, 3)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    want = [plans[(dp, s)].total_memory_bytes / GB for dp in (8, 64) for s in range(4)]
    assert sorted(tops) and [tops[x] for x in sorted(tops)] == pytest.approx(want)
    p0, p1, p2, p3 = (plans[(64, s)].memory for s in range(4))
    assert p1["optimizer"] == pytest.approx(p0["optimizer"] / 64) and p1["grads"] == p0["grads"]
    assert p2["grads"] == pytest.approx(p0["grads"] / 64) and p2["params"] == p0["params"]
    assert p3["params"] < p0["params"] / 8  # sharded, plus one gathered layer
    assert p0["activations"] == p3["activations"]  # ZeRO leaves activations alone
    plt.close("all")


def test_ledger_moment_is_the_zero_ledger_with_adam_allocated_at_the_first_step():
    cfg = dict(layers=2, hidden=64, heads=4, vocab=256, seq=32, micro_batch=2, dtype="bfloat16", optimizer="adamw",
               zero=1, world_size=4)
    n = 1_000_000
    init = ch11.ledger_moment(cfg, n, 0, "init")
    assert init["optimizer"] == 4 * n / 4 and init["params"] == init["grads"] == 2 * n  # fp32 master shard only
    after = ch11.ledger_moment(cfg, n, 1, "step")
    assert after["optimizer"] == model_state_bytes(n, dp=4, zero_stage=1).optimizer == 12 * n / 4
    assert ch11.ledger_moment(cfg, n, 1, "forward")["optimizer"] == init["optimizer"]  # Adam not yet stepped
    assert ch11.ledger_moment(cfg, n, 2, "forward")["activations"] > 0
    assert ch11.ledger_moment(cfg, n, 2, "backward")["activations"] == 0
    ddp = ch11.ledger_moment({**cfg, "zero": 0}, n, 2, "step")
    assert ddp["optimizer"] == 12 * n


def test_gpu_data_is_none_without_a_committed_file_and_read_with_its_label(tmp_path, monkeypatch):
    monkeypatch.setattr(ch11, "GPU_DATA", tmp_path)
    monkeypatch.setattr(ch11, "ROOT", tmp_path)
    assert ch11.gpu_data("memory") is None
    prov = {"device": "NVIDIA H200", "device_kind": "cuda", "torch": "2.x", "cuda": "12.x", "triton": None,
            "python": "3.12", "cpu_capability": "AVX512", "date": "2026-12-01T00:00:00+00:00",
            "command": "bash tools/gpu/ch11_memory.sh"}
    (tmp_path / "ch11_memory_h200.json").write_text(json.dumps({"provenance": prov, "runs": []}))
    data = ch11.gpu_data("memory")
    assert data["provenance"]["device"] == "NVIDIA H200" and data["path"] == "ch11_memory_h200.json"
    assert reference_data.label(data) == "NVIDIA H200 · torch 2.x · CUDA 12.x · 2026-12-01 (ch11_memory_h200.json)"


def test_moments_figure_draws_accounted_bytes_and_allocated_only_when_asked():
    moments = [{"step": 0, "moment": "init", "accounted": {"params": 10, "grads": 10, "optimizer": 20, "activations": 0},
                "cuda_allocated": 45}]
    for step_moment in ("forward", "backward", "step"):
        moments.append({"step": 1, "moment": step_moment, "cuda_allocated": 90,
                        "accounted": {"params": 10, "grads": 10, "optimizer": 60, "activations": 5}})
    cfg = dict(layers=1, hidden=8, heads=1, vocab=8, seq=4, micro_batch=1, dtype="bfloat16", optimizer="adamw",
               zero=0, world_size=1)
    run = {"moments": moments, "config": cfg, "n_params": 5, "baseline_cuda_allocated": 5}
    fig = ch11.moments_figure({"x": run}, gpu=True, unit=1, unit_name="B")
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert [p.get_height() for p in hatched] == [40, 85, 85, 85]  # allocated minus the process's baseline
    plain = ch11.moments_figure({"x": run}, gpu=False, unit=1, unit_name="B")
    assert not [p for p in plain.axes[0].patches if p.get_hatch()]
    plt.close("all")


def test_fp8_granularity_claims_in_the_notebook():
    e4 = ch11.granularity_errors((1, 1e3, 1e5), "e4m3")
    # up to 1e3 the granularity does not matter: E4M3's rounding, ~2.6% rms
    assert all(0.02 < e4[g][i] < 0.03 for g in e4 for i in (0, 1))
    # at 1e5 one scale per tensor ruins the ordinary channels; 1 x 128 tiles confine the damage
    assert e4["tensor"][2] > 0.5 and e4["tile"][2] < 0.1 and e4["block"][2] < e4["tensor"][2]
    e5 = ch11.granularity_errors((1, 1e5), "e5m2")
    assert all(abs(e5[g][1] - e5[g][0]) < 0.005 for g in e5)  # E5M2's range absorbs it, at ~2x the error
    assert e5["tensor"][0] > 1.8 * e4["tensor"][0]


def test_delayed_scaling_clips_the_spike_that_current_scaling_absorbs():
    h = ch11.scaling_history(steps=30, spike_at=20)
    assert h["saturated"][20] > 0.01 and h["delayed_error"][20] > 10 * h["current_error"][20]
    assert max(h["saturated"][21:]) == 0.0  # afterwards the history holds the spike: nothing saturates
    assert worst(h["current_error"]) < 0.03


def test_emulated_gemm_error_orders_bf16_and_fp8_granularities():
    e = ch11.emulated_gemm_errors()
    assert e["bf16"] < 0.005 < e["e4m3 per tile"] < e["e4m3 per tensor"] < 0.05


@pytest.mark.ranks
def test_fp8_gemm_worker_says_plainly_when_there_is_no_gpu():
    import course_utils as cu
    import torch

    out = cu.run("workers.ch11_fp8_gemm", 1, size=64, repeats=2, timeout=120)[0]
    if torch.cuda.is_available():
        assert out["available"] and out["fp8_e4m3_per_tensor"]["rel_error"] < 0.1
    else:
        assert out == {"available": False,
                       "reason": "no GPU on this rank: an FP8 GEMM needs tensor cores (H100/H200/Ada or newer)"}


def test_gpu_script_is_valid_bash_and_refuses_to_run_without_a_gpu():
    script = ROOT / "tools" / "gpu" / "ch11_memory.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    import torch

    if torch.cuda.is_available():  # the script would measure for minutes: syntax only
        return
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300,
                         env={"PY": sys.executable, "PATH": "/usr/bin:/bin"})
    assert run.returncode != 0 and "no GPU visible" in run.stderr
    assert not list((ROOT / "data" / "gpu").glob("ch11_*_cpu*.json"))  # nothing written, nothing faked


@pytest.mark.ranks
def test_gpu_memory_report_draws_every_successful_run_and_names_every_failed_one():
    # The record's structure is the one tools/gpu/ch11_memory.sh writes; its numbers here come from a real CPU run,
    # with cuda_allocated set to the accounted total (a stand-in made in this test only, never saved).
    import course_utils as cu

    res = cu.run("workers.ch11_memory", 1, zero=0, timeout=240, hidden=64, heads=4, layers=2, vocab=256,
                 seq=32, micro_batch=2, steps=2)
    rank = res[0]
    assert rank["provenance"]["command"] == "workers.ch11_memory" and rank["provenance"]["device_kind"] == "cpu"
    for m in rank["moments"]:
        m["cuda_allocated"] = sum(m["accounted"].values())
    data = {"device_name": "stand-in", "torch": "x", "cuda": "y", "date": "2026-12-01", "path": "test",
            "runs": [{"world_size": 1, "zero": 0, "grad_sync": "reduce_scatter", "ranks": res.ranks},
                     {"world_size": 2, "zero": 1, "grad_sync": "reduce_scatter", "error": "RuntimeError: boom"}]}
    fig, text = ch11.gpu_memory_report(data)
    assert "world 2 zero 1 (reduce_scatter) failed: RuntimeError: boom" in text
    assert "DDP, N=1" in text and fig is not None and len(fig.axes) == 1
    hatched = [p for p in fig.axes[0].patches if p.get_hatch()]
    assert len(hatched) == 4  # init + the steady step's forward, backward, step
    assert ch11.gpu_memory_report({**data, "runs": data["runs"][1:]})[0] is None  # nothing to draw, still reported
    plt.close("all")


def test_gemm_report_states_what_was_measured_or_why_not():
    assert ch11.gemm_report({"available": False, "reason": "no GPU"}) == "FP8 GEMM not measured: no GPU"
    g = {"available": True, "size": 8192, "device_name": "NVIDIA H200", "torch": "t", "cuda": "c",
         "bf16": {"ms": 2.0, "tflops": 550.0, "rel_error": 0.002},
         "fp8_e4m3_per_tensor": {"ms": 1.0, "tflops": 1100.0, "rel_error": 0.03}}
    text = ch11.gemm_report(g)  # the layout before workers/provenance.py: still read
    assert "FP8 speed-up over bf16: 2.00x" in text and "NVIDIA H200 · torch t · CUDA c" in text
    new = {k: v for k, v in g.items() if k not in ("device_name", "torch", "cuda")}
    new["provenance"] = {"device": "NVIDIA H200", "device_kind": "cuda", "torch": "t", "cuda": "c",
                         "date": "2026-12-02T00:00:00+00:00"}
    assert "8192^3 GEMM on NVIDIA H200 · torch t · CUDA c · 2026-12-02:" in ch11.gemm_report(new)
    failed = ch11.gemm_report({**g, "fp8_e4m3_per_tensor": {"error": "RuntimeError: no FP8"}})
    assert "failed: RuntimeError: no FP8" in failed and "speed-up" not in failed


def test_activation_terms_are_korthikantis_section_4_1_and_sum_to_table_2():
    from course_utils.ledger import (RECOMPUTE_MODES, activation_bytes_per_layer, activation_terms_per_layer)

    s, b, h, a = 2048, 2, 4096, 32
    sbh, as2b = s * b * h, a * s * s * b
    for recompute in RECOMPUTE_MODES:
        terms = activation_terms_per_layer(s, b, h, a, recompute=recompute)
        assert sum(terms.values()) == activation_bytes_per_layer(s, b, h, a, recompute=recompute)
    none = activation_terms_per_layer(s, b, h, a)
    attention = ("qkv input", "q and k", "v", "projection input", "attention dropout mask")
    mlp = ("fc1 input", "gelu input", "fc2 input", "mlp dropout mask")
    scores = ("softmax output", "softmax dropout mask", "softmax dropout output")
    assert sum(none[t] for t in attention) == 11 * sbh and sum(none[t] for t in scores) == 5 * as2b  # 11sbh + 5as^2b
    assert sum(none[t] for t in mlp) == 19 * sbh and none["layernorm inputs"] == 4 * sbh  # 19sbh, 4sbh
    no_dropout = activation_terms_per_layer(s, b, h, a, recompute="selective", dropout=False)
    assert sum(no_dropout.values()) == 32 * sbh and not any("dropout" in t for t in no_dropout)
    fp32 = activation_terms_per_layer(s, b, h, a, recompute="selective", bytes_per_element=4)
    assert sum(fp32.values()) == 2 * 32 * sbh + 2 * sbh  # 16-bit terms doubled, the 1-byte masks not


def test_activation_terms_of_the_chapter_model_name_what_the_formula_leaves_out():
    cfg = dict(micro_batch=2, seq=128, hidden=128, heads=4, layers=2, vocab=512, dtype="bfloat16")
    terms = ch11.activation_terms(cfg)
    sbh = 2 * 128 * 128
    assert terms[0]["bytes"] == 2 * 32 * sbh and "Korthikanti" in terms[0]["source"]
    assert terms[1]["bytes"] == 0 and "no dropout" in terms[1]["source"]
    assert sum(t["bytes"] for t in terms) == 2_769_924  # what workers/ch11_memory.py accounts for this shape (CPU)
    fp32 = ch11.activation_terms({**cfg, "dtype": "float32"})
    assert sum(t["bytes"] for t in fp32) > sum(t["bytes"] for t in terms)
    cuda = ch11.activation_terms(cfg, device="cuda:0")  # LayerNorm statistics in fp32 there
    assert sum(t["bytes"] for t in cuda) - sum(t["bytes"] for t in terms) == (2 * 2 * 2 + 2) * 2 * 128 * 2


def test_moment_rows_show_every_step_so_the_first_steps_jump_is_visible():
    moments = [{"step": 0, "moment": "init", "saved_tensors_alive": 0,
                "accounted": {"params": 20, "grads": 20, "optimizer": 40, "activations": 0}}]
    for step in (1, 2):
        for moment in ("forward", "backward", "step"):
            stepped = step == 2 or moment == "step"
            moments.append({"step": step, "moment": moment, "saved_tensors_alive": 3 if moment == "forward" else 0,
                            "accounted": {"params": 20, "grads": 20, "optimizer": 124 if stepped else 40,
                                          "activations": 7 if moment == "forward" else 0}})
    cfg = dict(layers=1, hidden=8, heads=1, vocab=8, seq=4, micro_batch=1, dtype="bfloat16", optimizer="adamw",
               zero=0, world_size=1)
    rows = ch11.moment_rows({"x": {"moments": moments, "config": cfg, "n_params": 10}})
    assert [r[1] for r in rows] == ["init"] + [f"step {s}: {m}" for s in (1, 2)
                                               for m in ("forward", "backward", "step")]
    assert [r[4] for r in rows[:4]] == ["40", "40", "40", "124"]  # Adam's moments appear at step 1's step
    assert [r[-1] for r in rows[:4]] == ["80", "80", "80", "160"]  # the ledger: 10 x (2+2+4), then 10 x (2+2+12)
    assert rows[1][6] == "3" and rows[2][6] == "0"


@pytest.mark.ranks
def test_live_gpu_branch_runs_ddp_and_zero1_at_world_1_and_2():
    # The notebook's live branch (taken only where a GPU is visible), run here on the CPU at a small shape:
    # the same function, worlds and stages; every run succeeds and the report draws all four.
    shape = dict(hidden=64, heads=4, layers=2, vocab=256, seq=32, micro_batch=2, steps=2)
    record = ch11.live_memory_record(shape, worlds=(1, 2), zero_stages=(0, 1), timeout=240)
    assert [(r["world_size"], r["zero"]) for r in record["runs"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all("ranks" in r and "error" not in r for r in record["runs"]), record["runs"]
    assert [len(r["ranks"]) for r in record["runs"]] == [1, 1, 2, 2]
    fig, text = ch11.gpu_memory_report(record)
    assert fig is not None and len(fig.axes) == 4
    for label in ("DDP, N=1", "ZeRO-1, N=1", "DDP, N=2", "ZeRO-1, N=2"):
        assert label in text
    plt.close("all")


def _zero3_result(reshard=True, prefetch=False):
    """A rank-0 result of workers.ch11_zero3 as the worker shapes it: root 100 bytes, two 400-byte blocks, 2 ranks."""
    units = [{"name": "root", "bytes": 100}, {"name": "unit0", "bytes": 400}, {"name": "unit1", "bytes": 400}]
    psi = 900
    passes = 2 if reshard else 1  # all-gathers of the whole model per step; one reduce-scatter
    return {"units": units, "world_size": 2, "steps": 1, "padded_bytes": psi,
            "comm_bytes": {"all_gather": passes * psi / 2, "reduce_scatter": psi / 2},  # (n-1)/n of Psi per pass
            "calls": {"all_gather": 3 * passes, "reduce_scatter": 3},
            "peak_params": ch11.zero3_expected_peak({"units": units}, prefetch, reshard),
            "timeline": [{"kind": "gather", "unit": "root", "params": 100, "grads": 0},
                         {"kind": "grad", "unit": "unit1", "params": 500, "grads": 40}]}


def test_zero3_rows_hold_the_peak_to_the_units_and_the_traffic_to_three_or_two_psi():
    assert ch11.zero3_expected_peak(_zero3_result(), prefetch=False, reshard=True) == 500
    assert ch11.zero3_expected_peak(_zero3_result(), prefetch=True, reshard=True) == 900
    assert ch11.zero3_expected_peak(_zero3_result(), prefetch=False, reshard=False) == 900
    rows = ch11.zero3_rows({(False, True): _zero3_result(), (False, False): _zero3_result(reshard=False)})
    assert [row[-1] for row in rows] == ["equal", "equal"]
    assert rows[0][5] == "3Ψ(n-1)/n = 1,350" and rows[1][5] == "2Ψ(n-1)/n = 900" and rows[0][3] == "6 + 3"
    wrong = _zero3_result()
    wrong["peak_params"] += 1  # one byte off: the verdict must say so
    assert ch11.zero3_rows({(False, True): wrong})[0][-1] == "DIFFERENT"
    axes = ch11.zero3_timeline_figure({(False, True): _zero3_result()}, unit=1)
    assert list(axes[0].lines[0].get_ydata()) == [100, 500] and list(axes[0].lines[1].get_ydata()) == [0, 40]


def test_fsdp2_rows_pair_the_calls_and_name_the_roots_extra_all_gather():
    root, block, rs = ["all_gather", 10, 20], ["all_gather", 40, 80], ["reduce_scatter", 80, 40]
    rows = ch11.fsdp2_rows({"hand_calls": [root, block, root, block, rs], "fsdp2_calls": [root, block, block, rs]})
    assert [row[-1] for row in rows] == ["same", "same", "FSDP2 keeps its root whole", "same", "same"]
    rows = ch11.fsdp2_rows({"hand_calls": [root, rs], "fsdp2_calls": [root, ["reduce_scatter", 96, 48]]})
    assert [row[-1] for row in rows] == ["same", "differs", "differs"]


def test_stage_rows_hold_every_moment_to_the_ledger_at_the_padded_count():
    moments = [{"step": 0, "moment": "init", "params": 4 * 10, "grads": 4 * 10, "optimizer": 0},
               {"step": 1, "moment": "backward", "params": 4 * 10, "grads": 4 * 10, "optimizer": 0},
               {"step": 1, "moment": "step", "params": 4 * 10, "grads": 4 * 10, "optimizer": 8 * 10 // 2}]
    r = {"stage": 1, "world_size": 2, "padded_numel": 10, "moments": moments, "config": {},
         "comm": {"reduce_scatter": {"calls": 1, "wire_bytes": 20.0}, "all_gather": {"calls": 1, "wire_bytes": 20.0}}}
    row = ch11.stage_rows({1: r})[0]
    assert row[-1] == "equal" and row[-2] == "40" and row[-3] == "40"  # 2 Psi' (n-1)/n = 2 * 40 / 2
    r["moments"][2]["optimizer"] += 4  # one fp32 element too many at one moment: the verdict must say so
    assert ch11.stage_rows({1: r})[0][-1] == "DIFFERENT"


@pytest.mark.ranks
def test_the_stages_explorer_draws_what_each_rank_held_and_sent():
    import course_utils as cu

    for stage, panels in ((3, 3), (1, 2)):
        res = cu.run("workers.ch11_stages", 2, stage=stage, steps=1, timeout=180)
        fig = ch11.stages_live_draw(res, {})
        assert len(fig.axes) == panels
        bars = fig.axes[0].patches  # rank by rank, state by state, a bar per moment
        moments = res[0]["moments"]
        per_state = len(moments)
        for k, r in enumerate(res.ranks):
            for j, state in enumerate(("params", "grads", "optimizer")):
                heights = [b.get_height() for b in bars[(3 * k + j) * per_state:(3 * k + j + 1) * per_state]]
                assert heights == [m[state] / 1024 for m in r["moments"]]
        sent = [b.get_height() for b in fig.axes[-1].patches]
        assert sent == [c["wire_bytes"] / 1024 for c in res[0]["comm"].values()]
        plt.close(fig)
