"""Chapter 06's overlap section, notebook side (``course_utils/tp_overlap.py``): the verdicts, ring counts and planner
prices the chapter prints, the statistics and figure it draws from timed runs, and the chunk order its exercise grades.

Start here when changing the section's printouts or figures. The float64 verdicts hold with a margin of ~400 (errors
~2e-15 against 1e-12, measured in ``tests/test_collective_matmul.py``); the ring's bytes are integers, compared with
``==``; the planner's prices are arithmetic on committed constants. The timed statistics are tested on hand-made
timelines whose answers are known, never on a measurement.
"""
import copy
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

import course_utils as cu
from course_utils import tp_overlap
from course_utils.catalogue.ch06 import RING_SIZES, check_collective_matmul_blocks
from workers.parallel.collective_matmul import ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER

WORKER = "workers.ch06_collective_matmul"  # launched by name: a test never imports a torchrun script
SEQ, BATCH, HIDDEN = 8, 2, 32  # the chapter's shape
_runs: dict = {}


class _Result:
    """What ``tp_overlap`` reads of a ``RunResult``: ``.ranks`` and ``res[rank]``."""

    def __init__(self, ranks):
        self.ranks = ranks

    def __getitem__(self, rank):
        return self.ranks[rank]


def float64_run(tp: int):
    """The chapter's float64 run at ``tp`` on 4 ranks, once for the file."""
    if tp not in _runs:
        _runs[tp] = cu.run(WORKER, world_size=4, tp=tp, seq=SEQ, batch=BATCH, hidden=HIDDEN, timeout=120)
    return _runs[tp]


# -- the chunk order the exercise grades ------------------------------------------------------------------------

def test_ring_order_is_the_closed_form_at_every_size_the_exercise_tries():
    # The reference is the module's own ring loops driven without communication: at step k rank r multiplies the
    # shard of rank r - k and adds to block r - k - 1 (mod tp), ending on its own block.
    for tp in RING_SIZES + (7, 16):
        for r in range(tp):
            gather, scatter = tp_overlap.ring_order(r, tp)
            assert gather == [(r - k) % tp for k in range(tp)], (tp, r, gather)
            assert scatter == [(r - k - 1) % tp for k in range(tp)], (tp, r, scatter)
            assert gather[0] == r and scatter[-1] == r


@pytest.mark.ranks
@pytest.mark.parametrize("tp", [2, 4])
def test_ring_order_is_what_the_ranks_ran(tp):
    # The all-gather rings (forward of fc1, backward of fc2) multiply in the gather order, the reduce-scatter rings
    # (forward of fc2, backward of fc1) in the scatter order, on every rank of every TP group.
    res = float64_run(tp)
    for rank, r in enumerate(res.ranks):
        gather, scatter = tp_overlap.ring_order(r["tp_group_ranks"].index(rank), tp)
        for (op, pass_), want in {(ALL_GATHER_MATMUL, "forward"): gather, (MATMUL_REDUCE_SCATTER, "backward"): gather,
                                  (MATMUL_REDUCE_SCATTER, "forward"): scatter,
                                  (ALL_GATHER_MATMUL, "backward"): scatter}.items():
            got = [e["chunk"] for e in r["decomposed"]["timeline"]
                   if e["kind"] == "compute" and e["op"] == op and e["pass"] == pass_]
            assert got == want, (rank, op, pass_, got, want)


def test_the_reference_solution_passes_and_the_stub_is_not_attempted():
    from solutions.ch06 import collective_matmul_blocks

    assert check_collective_matmul_blocks(collective_matmul_blocks)[0] == "pass"
    assert cu.check("collective_matmul_blocks", lambda rank, tp, step: (_ for _ in ()).throw(NotImplementedError)
                    ).status == "todo"


@pytest.mark.parametrize("answer,fragment", [
    (lambda r, tp, k: ((r - k) % tp, float((r - k - 1) % tp)), "return an int"),
    (lambda r, tp, k: [(r - k) % tp], "return a pair (shard, block)"),
    (lambda r, tp, k: ((r - k) % tp + tp, (r - k - 1) % tp), "not a rank of the group 0..0"),
    (lambda r, tp, k: ((r - k) % tp, (r + k + 1) % tp), "Your running sums travel to the left"),
    (lambda r, tp, k: ((r - k) % tp, (r - k - 1) & (tp - 1)), "(r - k - 1) & (tp - 1) wraps around only"),
])
def test_other_mistakes_are_named(answer, fragment):
    status, message = check_collective_matmul_blocks(answer)
    assert status == "fail" and fragment in message, message


# -- the verdicts and counts the chapter prints ----------------------------------------------------------------------

@pytest.mark.ranks
@pytest.mark.parametrize("tp", [2, 4])
def test_the_equality_lines_say_true_for_every_mode(tp):
    lines = tp_overlap.equality_lines(float64_run(tp))
    groups = 4 // tp
    assert lines[0] == (f"tp {tp} ({groups} group{'s' if groups > 1 else ''} of {tp} ranks), float64, output, input "
                        "gradient and 4 parameter gradients:")
    assert lines[1:] == ["  blocking    equals the dense MLP within 1e-12: True",
                         "  decomposed  equals the dense MLP within 1e-12: True; equals blocking on every rank: True",
                         "  serialized  equals the dense MLP within 1e-12: True; equals blocking on every rank: True"]


@pytest.mark.ranks
@pytest.mark.parametrize("damage", [1e-9, float("nan")])
def test_a_damaged_ring_output_is_reported_false(damage):
    # One entry of one rank's decomposed output off by 1e-9 (a thousand times the tolerance), or NaN: both verdicts
    # of that mode say False, and the others still say True.
    res = _Result([copy.deepcopy(dict(r)) for r in float64_run(2).ranks])
    res[1]["decomposed"]["output"]["value"][0, 0, 0] += damage
    rows = tp_overlap.equality(res)
    assert rows["decomposed"]["equals_dense"] is False and rows["decomposed"]["equals_blocking"] is False
    assert rows["serialized"]["equals_dense"] and rows["serialized"]["equals_blocking"] and rows["blocking"]["equals_dense"]


@pytest.mark.ranks
def test_each_ring_sends_exactly_the_collectives_bytes():
    # tp 4, float64, s=8, b=2, h=32: a block of 2 rows is 2*2*32*8 = 1,024 B; 3 of them per ring = 3/4 of 4,096 B
    res = float64_run(4)
    for rank in range(4):
        rows = tp_overlap.ring_rows(res[rank])
        assert [(r["chunks"], r["transfers"], r["bytes each"], r["sent"], r["collective"]) for r in rows] == \
            [(4, 3, "1,024", 3072, 3072)] * 4
    assert sum(r["sent"] for r in rows) == 12_288  # two all-reduces' worth: 2 x 2(t-1)/t x b*s*h*8
    table = str(tp_overlap.ring_table(res))
    assert table.count("True") == 4 and "False" not in table


# -- the timed runs: statistics on hand-made timelines ------------------------------------------------------------

def _compute(op, pass_, step, chunk, start, end):
    return {"kind": "compute", "op": op, "pass": pass_, "step": step, "chunk": chunk, "start": start, "end": end}


def _wait(op, pass_, step, posted, start, end, nbytes=1024):
    return {"kind": "wait", "op": op, "pass": pass_, "step": step, "posted": posted, "bytes": nbytes, "start": start,
            "end": end}


AG, RS = ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER


def _step(wait_ms: float, chunk_ms: float, overlap: bool) -> list[dict]:
    """Two rings of tp 2, forward: a chunk of ``chunk_ms``, the wait of ``wait_ms``, the second chunk. Decomposed
    (``overlap``): the transfer is posted before the first chunk, so that chunk runs under it."""
    ms, events, t = 1e-3, [], 0.0
    for op in (AG, RS):
        posted = t if overlap else t + chunk_ms * ms
        events.append(_compute(op, "forward", 0, 0, t, t + chunk_ms * ms))
        t += chunk_ms * ms
        events.append(_wait(op, "forward", 0, posted, t, t + wait_ms * ms))
        t += wait_ms * ms
        events.append(_compute(op, "forward", 1, 1, t, t + 1 * ms))
        t += 1 * ms
    return events


def _blocking(wait_ms: float) -> list[dict]:
    ms = 1e-3
    return [{**_wait(AG, "forward", 0, 0.0, 0.0, wait_ms * ms), "bytes": None},
            _compute(AG, "forward", 0, -1, wait_ms * ms, (wait_ms + 4) * ms)]


def _fake_run(waits: dict, chunk_ms: dict, step_ms: dict) -> _Result:
    ranks = []
    for rank in range(2):
        steps = {"blocking": _blocking(waits["blocking"]),
                 "decomposed": _step(waits["decomposed"], chunk_ms["decomposed"], True),
                 "serialized": _step(waits["serialized"], chunk_ms["serialized"], False)}
        ranks.append({**{m: {"timeline": steps[m]} for m in tp_overlap.MODES}, "timed_timelines": steps,
                      "step_seconds": {m: [step_ms[m] * 1e-3] * 2 for m in tp_overlap.MODES},
                      "tp": 2, "seq": 512, "batch": 1, "dtype": "float32", "config": {"hidden": 512},
                      "timing_device": "CPU wall time, gloo, 2 ranks with 1 intra-op thread(s) each"})
    return _Result(ranks)


def test_timing_summary_pools_every_recorded_step_and_counts_the_overlap():
    runs = [_fake_run({"blocking": 20, "decomposed": w, "serialized": 12}, {"decomposed": 6, "serialized": 4},
                      {"blocking": 100, "decomposed": 110, "serialized": 120}) for w in (1, 2, 30)]
    summary = tp_overlap.timing_summary(runs)
    assert len(summary["decomposed"]["wait_s"]) == 3 * 2 * 2  # runs x ranks x (first step, last step)
    assert summary["decomposed"]["wait_s"] == pytest.approx([2 * w * 1e-3 for w in (1, 2, 30) for _ in range(4)])
    assert [summary[m]["waits"] for m in tp_overlap.MODES] == [1, 2, 2]
    assert [summary[m]["overlapped"] for m in tp_overlap.MODES] == [0, 2, 0]  # the first chunk of each ring
    assert summary["serialized"]["vs_blocking"] == pytest.approx([1.2] * 12)  # 120 ms over 100 ms, round by round
    table = str(tp_overlap.timing_table(runs))
    assert "3 runs x 2 ranks: 12 timed steps per mode, waits from 12 recorded steps" in table
    assert "measured on this machine's CPU" in table
    assert table.splitlines()[-3:] == ["blocking    100.0    100-100   1.00         20.0             1      0",
                                       "decomposed  110.0    110-110   1.10         4.0              2      2",
                                       "serialized  120.0    120-120   1.20         24.0             2      0"]
    chunks = tp_overlap.chunks_under_transfer(runs)
    assert chunks["chunks"] == 24 and chunks["under_s"] == pytest.approx(6e-3) and chunks["alone_s"] == pytest.approx(4e-3)
    assert tp_overlap.typical_run(runs) is runs[1]  # the median of decomposed waits 2, 4, 60 ms


def test_an_empty_comparison_is_nan_not_a_crash():
    runs = [_fake_run({"blocking": 1, "decomposed": 1, "serialized": 1}, {"decomposed": 1, "serialized": 1},
                      {"blocking": 1, "decomposed": 1, "serialized": 1})]
    for r in runs[0].ranks:  # nothing decomposed overlapped: posted after the chunk
        for step in (r["timed_timelines"], r["decomposed"]):
            events = step["decomposed"] if "decomposed" in step else step["timeline"]
            for e in events:
                if e["kind"] == "wait":
                    e["posted"] = e["start"]
    assert math.isnan(tp_overlap.chunks_under_transfer(runs)["under_s"])


def _small_text(fig) -> list[str]:
    """Visible text under 8 points: at the figure's dpi (110) and JupyterLab's width, below about 8 pixels."""
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text)
            if t.get_visible() and t.get_text().strip() and t.get_fontsize() < 8]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_timeline_figure_marks_the_overlapped_chunks_and_keeps_its_legend_off_the_data(ranks):
    run = _fake_run({"blocking": 20, "decomposed": 1, "serialized": 12}, {"decomposed": 6, "serialized": 4},
                    {"blocking": 100, "decomposed": 110, "serialized": 120})
    timelines = [run[0]["timed_timelines"]] * ranks
    fig = tp_overlap.timeline_figure(timelines, "title", step_s={"blocking": 0.1})
    assert not _small_text(fig)
    outlined = [p for ax in fig.axes for p in ax.patches if p.get_linewidth() > 1 and tuple(p.get_edgecolor()) == (0, 0, 0, 1)]
    assert len(outlined) == 2 * ranks  # the decomposed step's first chunk of each ring, on every rank
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert all(not legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    assert fig.axes[0].get_title(loc="left").startswith("blocking: waits 20.0 ms (median over ranks), step 100.0 ms")
    plt.close(fig)


def test_the_widget_figure_draws_from_a_run():
    run = _fake_run({"blocking": 20, "decomposed": 1, "serialized": 12}, {"decomposed": 6, "serialized": 4},
                    {"blocking": 100, "decomposed": 110, "serialized": 120})
    fig = tp_overlap.live_figure(run, {})
    assert fig._suptitle.get_text() == "tp 2, s=512, b=1, h=512, float32 (CPU)"
    assert "step 110.0 ms" in fig.axes[1].get_title(loc="left")
    assert not _small_text(fig)
    plt.close(fig)


# -- the planner's prices ----------------------------------------------------------------------------------------------

def test_the_planner_hides_all_but_one_ring_step_of_a_llama_3_70b_layer():
    without, with_ = tp_overlap.planner_rows("llama-3-70b", tp=8, seq=8192, cluster="h100-ib")
    # the layer's GEMMs (6.7 ms) outlast its collectives (1.4 ms): only the last ring step of each, 1/8, stays
    assert with_["TP fwd ms"] == pytest.approx(without["TP fwd ms"] / 8)
    assert with_["TP bwd ms"] == pytest.approx(without["TP bwd ms"] / 8)
    assert with_["GEMMs fwd+bwd ms"] == without["GEMMs fwd+bwd ms"] > without["TP fwd ms"] + without["TP bwd ms"]
    # the step: every layer's TP hidden the same way (the loss's small all-reduces are not), nothing else changes
    assert with_["step's TP term ms"] < without["step's TP term ms"] / 7
    saved = without["step ms"] - with_["step ms"]
    assert saved == pytest.approx(without["step's TP term ms"] - with_["step's TP term ms"])
    text = str(tp_overlap.planner_table())
    assert text.splitlines()[0].startswith("Llama 3 70B's layer (h=8192), TP 8 + SP, 1 x 8192 tokens, bf16")
    assert [line.split()[0] for line in text.splitlines()[3:]] == ["Practice(tp_overlap=False)",
                                                                    "Practice(tp_overlap=True)"]
