"""Chapter 07's notebook-side helpers: the online-softmax walk, exact saved-for-backward bytes, the H200 data.

The walk is checked against the softmax computed in one go (it must end exactly there, and each step must
obey the update rule); the byte counts against the closed forms N^2 and N(d + 1) per head; the reference
copy against the hash of the shared file it came from.
"""
import json
import math

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils import attention_io as io  # noqa: E402
from course_utils import ch07, reference_data  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def close_all():
    import matplotlib.pyplot as plt

    plt.close("all")


# -- the online softmax walk ------------------------------------------------------------------------------

@pytest.mark.parametrize("seed,block", [(0, 4), (1, 1), (2, 5), (3, 24), (4, 7), (5, 30)])
def test_walk_ends_at_the_exact_softmax_and_obeys_the_update_rule(seed, block):
    scores, values = ch07.demo_scores(24, seed)
    steps = ch07.online_softmax_trace(scores, values, block)
    exact = ch07.exact_softmax_stats(scores, values)
    assert len(steps) == math.ceil(24 / block)
    assert steps[-1]["m_new"] == pytest.approx(exact["max"], abs=1e-12)
    assert steps[-1]["l_new"] == pytest.approx(exact["sum"], rel=1e-12)
    assert steps[-1]["out"] == pytest.approx(exact["out"], abs=1e-12)
    assert steps[-1]["m_new"] + math.log(steps[-1]["l_new"]) == pytest.approx(exact["lse"], abs=1e-12)
    seen_max = float("-inf")
    for s in steps:
        tile = scores[s["start"]:s["stop"]]
        # The max only moves when this tile holds a larger score, and then everything carried shrinks by alpha.
        assert s["m_new"] == pytest.approx(max(seen_max, tile.max().item()), abs=1e-15)
        assert (0 < s["alpha"] < 1) == (tile.max().item() > seen_max > float("-inf"))
        assert s["carried"] + s["tile_sum"] == pytest.approx(s["l_new"], rel=1e-12)
        # After each tile, acc / l is exact attention over the keys seen so far.
        prefix = ch07.exact_softmax_stats(scores[:s["stop"]], values[:s["stop"]])
        assert s["out"] == pytest.approx(prefix["out"], abs=1e-12)
        seen_max = max(seen_max, tile.max().item())


def test_default_walk_rescales_where_the_notebook_says():
    # The notebook's text names tiles 2, 4 and 5 as the ones that raise the max.
    steps = ch07.online_softmax_trace(*ch07.demo_scores(24, 0), 4)
    assert [s["tile"] for s in steps if 0 < s["alpha"] < 1] == [2, 4, 5]
    table = ch07.trace_table(steps)
    assert table.splitlines()[1].split()[2] == "-inf" and len(table.splitlines()) == 7


def test_walk_rejects_an_empty_tile():
    with pytest.raises(ValueError, match="block must be a positive number"):
        ch07.online_softmax_trace([1.0, 2.0], [0.0, 1.0], 0)


@pytest.mark.parametrize("step", [None, 0, 3])
def test_tile_walk_figure_draws_three_panels(step):
    fig = ch07.tile_walk_figure(*ch07.demo_scores(24, 0), block=4, step=step)
    assert len(fig.axes) == 3
    expected = 6 if step is None else step
    assert len(fig.axes[1].patches) == 2 * expected  # carried + tile bar for every tile done
    close_all()


def test_tile_walk_widget_redraws_on_every_control():
    box = ch07.tile_walk_widget(n_keys=24, block=4, seed=0)
    assert box.output.outputs[0]["data"]["image/png"]
    assert "l =" in box.status.value
    box.controls["tile"].value = 0
    assert "nothing seen yet" in box.status.value
    box.controls["block"].value = 8  # 3 tiles now: the tile slider follows
    assert box.controls["tile"].max == 3
    before = box.status.value
    box.controls["tile"].value = 3
    box.controls["seed"].value = 5
    assert box.status.value != before and box.output.outputs[0]["data"]["image/png"]
    close_all()


# -- exact bytes saved for backward --------------------------------------------------------------------

@pytest.mark.parametrize("n", [32, 100])
def test_saved_bytes_are_quadratic_for_naive_and_linear_for_tiled(n):
    batch, heads, d = 2, 3, 16
    q, k, v = (torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3))
    naive = ch07.saved_for_backward_bytes(ch07.naive_attention, q, k, v)
    from workers.attention import flash_attention

    tiled = ch07.saved_for_backward_bytes(lambda a, b, c: flash_attention(a, b, c, impl="torch", block_q=16,
                                                                          block_k=16), q, k, v)
    assert naive == batch * heads * n * n * 4  # P, fp32
    assert tiled == batch * heads * (n * d * 4 + n * 4)  # O and the fp32 LSE


def test_saved_bytes_excludes_inputs_and_counts_shared_storage_once():
    x = torch.randn(10, 10, requires_grad=True)
    assert ch07.saved_for_backward_bytes(lambda t: t * t, x) == 0  # saves x itself, twice
    y = torch.randn(10, 10, requires_grad=True)
    assert ch07.saved_for_backward_bytes(lambda t: (t.exp() * t.exp()).sum(), y) == 2 * 400


def test_saved_bytes_rows_match_the_closed_forms():
    for r in ch07.saved_bytes_rows([64, 128], batch=1, heads=2, d=8):
        assert r["naive_bytes"] == 2 * r["n"] ** 2 * 4
        assert r["tiled_bytes"] == 2 * r["n"] * 9 * 4


# -- the reference data and the figures drawn from it ----------------------------------------------------

def test_reference_says_what_it_measured():
    # (that every number is the shared file's, unchanged, is checked for all reference data in test_reference_data.py)
    prov = ch07.load_reference()["provenance"]
    assert prov["date"] == "2026-11-29" and "H200" in prov["device"]
    assert "NOT the course's kernel" in prov["triton_course"]


def test_reference_rows_use_the_benchmark_vocabulary():
    ref = ch07.load_reference()
    rows = ch07.reference_rows(ref)
    assert len(rows) == len(ref["sdpa"]) == 28
    assert {r["impl"] for r in rows} == {"sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "triton_plain"}
    flash_16k = [r for r in rows if r["impl"] == "sdpa_flash" and r["n"] == 16384 and not r["causal"]]
    assert flash_16k[0]["fwd_tflops"] == pytest.approx(360.98, abs=0.01)
    assert "not the course's kernel" in ch07.IMPLS["triton_plain"][0]
    caption = reference_data.label(ch07.load_reference())
    assert caption == ("NVIDIA H200 · torch 2.11.0+cu130 · Triton 3.6.0 · 2026-11-29 "
                       "(data/reference/h200_attention_baseline.json)")


def test_comparison_figure_draws_bench_rows_next_to_the_reference(tmp_path):
    bench = {"provenance": {"device": "NVIDIA H200", "device_kind": "cuda", "torch": "x", "cuda": "13.0", "triton": "y",
                            "date": "2027-01-01T00:00:00+00:00", "command": "python -m workers.bench_attention"},
             "rows": [{"impl": "course_triton", "n": n, "head_dim": 128, "causal": c, "fwd_tflops": 400.0 + n / 1e3,
                       "fwdbwd_tflops": 300.0} for n in (1024, 4096) for c in (False, True)]
             + [{"impl": "sdpa_math", "n": 16384, "head_dim": 128, "causal": False, "skipped": "too big"}]}
    path = tmp_path / "h200_test.json"
    path.write_text(json.dumps(bench))
    assert ch07.bench_files(str(tmp_path / "h200_*.json")) == [path]
    fig = ch07.comparison_figure(ch07.load_reference(), ch07.load_bench(path))
    labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
    assert sum("course Triton kernel (dashed" in lab for lab in labels) == 4  # every panel
    assert "2027-01-01" in fig._suptitle.get_text()
    close_all()


def test_no_bench_files_when_none_are_committed(tmp_path):
    assert ch07.bench_files(str(tmp_path / "h200_*.json")) == []
    assert ch07.latest_bench(pattern=str(tmp_path / "h200_*.json")) is None


def test_latest_bench_is_the_newest_file_with_that_head_dim(tmp_path):
    def write(name, head_dim):
        (tmp_path / name).write_text(json.dumps({"meta": {}, "rows": [{"impl": "sdpa_flash", "n": 1024,
                                                                        "head_dim": head_dim, "causal": False}]}))
    write("h200_2026-12-01.json", 128)
    write("h200_2026-12-02_d128.json", 128)
    write("h200_2026-12-02_d64.json", 64)  # newest by name, but no head dim 128 rows
    path, results = ch07.latest_bench(128, pattern=str(tmp_path / "h200_*.json"))
    assert path.name == "h200_2026-12-02_d128.json" and results["rows"][0]["head_dim"] == 128


def test_io_rows_follow_the_bytes_model():
    ref = ch07.load_reference()
    rows = ch07.io_rows([1024, 16384], ref)
    big = rows[-1]
    assert big["naive_GB"] * 1e9 == io.naive_attention_hbm_bytes(16384, 128, 2, 16, 2, score_bytes=4)
    assert big["naive_GB"] / big["tiled_GB"] == pytest.approx(4.0, rel=0.01)  # 16 N^2 / (4 N^2 d / 128), d = 128
    assert big["compute_ms"] == pytest.approx(io.attention_flops(16384, 128, 2, 16) / 795.668e12 * 1e3, rel=1e-4)
    assert big["naive_flop_per_byte"] == pytest.approx(32, rel=0.01)
    fig = ch07.io_figure(rows, ref)
    assert len(fig.axes) == 2
    close_all()


def test_layout_copy_model_uses_the_measured_copy_rate():
    ref = ch07.load_reference()
    [row] = ch07.layout_copy_model(ref, ns=(1024,))
    tensor_bytes = 2 * 1024 * 16 * 128 * 2
    assert row["copy_ms"] == pytest.approx(8 * tensor_bytes / (ref["copy_TBps"] * 1e12) * 1e3)
    assert row["copy_share"] == pytest.approx(0.264, abs=0.001)


def test_layout_timings_and_figures_run(tmp_path):
    cpu = ch07.layout_timings([64, 128], reps=1)
    assert [r["seq"] for r in cpu] == [64, 128] and all(r["copy_s"] > 0 and r["attention_s"] > 0 for r in cpu)
    ref = ch07.load_reference()
    assert len(ch07.layout_figure(cpu, ch07.layout_copy_model(ref), ref).axes) == 2
    assert len(ch07.memory_figure(ref, ch07.saved_bytes_rows([64, 128])).axes) == 2
    close_all()


def test_function_source_reads_the_kernel_file():
    src = ch07.function_source("_attn_fwd_inner")
    assert src.startswith("@triton.jit") and "def _attn_fwd_inner(" in src and "exp2" in src
    with pytest.raises(KeyError, match="no top-level function"):
        ch07.function_source("_no_such_kernel")
