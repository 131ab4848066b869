"""Chapter 13's notebook-side measurement (no ranks): the idle share read off a timeline is the schedule's.

``course_utils.ch13.idle_fractions`` is what every bubble number in the notebook comes from. Fed the
ideal timeline of ``schedules.simulate`` (t_F = 1, t_B = 2) it must give exactly (p-1)/(m+p-1) per stage,
the ledger's idle / total; a helper that divided by the rank's own span, or by the ideal time, would not.
"""
from types import SimpleNamespace

import matplotlib
import pytest

from course_utils import ch13, timelines
from course_utils.ledger import pipeline_bubble_fraction
from workers.pipeline.model import PipelineConfig
from workers.pipeline.schedules import all_stages, simulate

matplotlib.use("Agg")


def fake_result(name: str, p: int, m: int, v: int = 1):
    sim = simulate(all_stages(name, p, m, v) if v > 1 else all_stages(name, p, m))
    ranks = [{"pipeline": 0, "stage": s, "schedule": name, "config": PipelineConfig(micro_batches=m).as_dict(),
              "virtual_stages": v, "timeline": [{**e, "start": e["start"] / 1e3, "end": e["end"] / 1e3} for e in sim["timeline"][s]]}
             for s in range(p)]
    return SimpleNamespace(ranks=ranks)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 16)])
def test_idle_fraction_of_an_ideal_timeline_is_the_formula(name, p, m):
    res = fake_result(name, p, m)
    want = pipeline_bubble_fraction(p, m, denominator="total")
    assert ch13.idle_fractions(res) == pytest.approx([want] * p)
    assert ch13.bubble_formulas(p, m)["bubble/ideal (p-1)/m"] == pytest.approx((p - 1) / m)


def test_gantt_draws_one_row_per_stage_and_one_box_per_action():
    res = fake_result("1f1b", 4, 8)
    fig = ch13.gantt_figure(res)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * 2 * 8  # every F and B of every stage, none invented
    assert len(ax.get_yticks()) == 4


def test_interleaved_labels_stay_readable_over_the_hatching():
    """The interleaved Gantt hatches a rank's later chunks; the hatching once hid the F/B labels on them."""
    fig = ch13.gantt_figure(fake_result("interleaved", 4, 8, v=2))
    ax = fig.axes[0]
    hatched = [b for b in ax.patches if b.get_hatch()]
    assert len(hatched) == 4 * 2 * 8  # chunk 1's F and B of every micro-batch, on every stage
    assert all(b.get_hatch_linewidth() < 1 and b.get_hatchcolor()[:3] != (0, 0, 0) for b in hatched)
    on_hatched = [t for t in ax.texts if any(b.contains_point(ax.transData.transform(t.get_position()))
                                             for b in hatched)]
    assert on_hatched, "no label on a hatched box: the test would prove nothing"
    for t in on_hatched:
        box = t.get_bbox_patch()
        assert box is not None and box.get_facecolor()[:3] == (1, 1, 1), f"label {t.get_text()} has no white ground"


def test_chunks_crossover_is_where_the_replayed_bubbles_cross():
    from workers.pipeline.schedules import ideal_bubble

    def bubble(v, a):
        return ideal_bubble(all_stages("interleaved", 4, 8, v), message_time=a)

    a = ch13.chunks_crossover(4, 8, 2, 4)
    assert bubble(4, a) > bubble(2, a) and bubble(4, a - 0.005) <= bubble(2, a - 0.005)
    assert 0 < a < ch13.chunks_crossover(4, 8, 1, 2)  # the first split into chunks pays for longer


def test_fit_message_time_recovers_the_latency_of_a_replayed_timeline():
    # a timeline made by replaying with 0.3 units per message must be explained by 0.3, not by the formula
    from workers.pipeline.schedules import simulate as sim

    runs = []
    for name, v in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
        schedules = all_stages(name, 4, 8, v)
        timeline = sim(schedules, 20.0, 40.0, message_time=0.3)["timeline"]
        ranks = [{"pipeline": 0, "stage": s, "schedule": name, "virtual_stages": v, "forward_ms": 20.0, "backward_ms": 40.0,
                  "config": PipelineConfig(micro_batches=8).as_dict(), "actions": [list(a) for a in schedules[s]],
                  "timeline": timeline[s]} for s in range(4)]
        runs.append(SimpleNamespace(ranks=ranks))
    fit = ch13.fit_message_time(runs)
    assert fit["message_ms"] == pytest.approx(0.3)
    assert fit["simulated"] == pytest.approx(fit["measured"])
    assert all(f < got for f, got in zip(fit["formula"], fit["measured"]))


def fake_split_result(name: str, p: int, m: int, forward_ms=20.0, backward_ms=40.0, w_share=0.5):
    """A zero-bubble run as the ranks report it, its timeline the table replayed in ideal time (ms -> s)."""
    from workers.pipeline.validity import simulate_split
    from workers.pipeline.zero_bubble import placement_of, split_stages

    table, placement = split_stages(name, p, m), placement_of(name)
    sim = simulate_split(table, forward_ms, backward_ms * (1 - w_share), backward_ms * w_share, placement=placement)
    v = 2 if placement == "v" else 1
    ranks = [{"pipeline": 0, "stage": s, "schedule": name, "config": PipelineConfig(micro_batches=m).as_dict(),
              "virtual_stages": v, "placement": placement, "actions": [list(a) for a in table[s]],
              "forward_ms": forward_ms, "backward_ms": backward_ms, "w_share": w_share, "peak_stash": 0,
              "timeline": [{**e, "start": e["start"] / 1e3, "end": e["end"] / 1e3} for e in sim["timeline"][s]]}
             for s in range(p)]
    return SimpleNamespace(ranks=ranks)


@pytest.mark.parametrize("name, p, m, step_idle", [("zb-h1", 4, 8, 3 / 27), ("zb-h2", 4, 8, 3 / 27),
                                                   ("zb-v", 4, 8, 1 - 24 / 25.5), ("zb-h1", 2, 4, 1 / 13)])
def test_a_zero_bubble_timeline_reads_as_its_replay(name, p, m, step_idle):
    # the measured idle share of an ideal timeline is the replay's; both are the sync-at-the-end count, (p-1)/(3m+p-1)
    # for ZB-H1 and ZB-H2 at T_F = T_B = T_W (Qi et al. 2023 count the span inside each stage: 0 for ZB-H2 and ZB-V)
    res = fake_split_result(name, p, m)
    assert ch13.measured_bubble(res) == pytest.approx(step_idle)
    assert ch13.replayed(res)["step_idle"] == pytest.approx(step_idle)
    assert ch13.replayed(res)["span_idle"] == pytest.approx(0.0 if name in ("zb-h2", "zb-v") else step_idle)
    assert ch13.padded_times(res.ranks[0]) == (20.0, 20.0, 20.0)


def test_a_table_replayed_with_message_latency_idles_more_and_1f1b_is_the_formula():
    one = all_stages("1f1b", 4, 8)  # B is the whole backward: t_B + t_W = 2 t_F
    assert ch13.replay(one)["step_idle"] == pytest.approx(pipeline_bubble_fraction(4, 8, denominator="total"))
    from workers.pipeline.zero_bubble import split_stages

    zb = split_stages("zb-v", 4, 8)
    assert ch13.replay(zb, placement="v")["step_idle"] < ch13.replay(zb, message=0.5, placement="v")["step_idle"]


def test_a_zero_bubble_gantt_draws_w_half_height_and_the_replay_in_its_title():
    fig = ch13.gantt_figure(fake_split_result("zb-h1", 4, 8))
    ax = fig.axes[0]
    heights = sorted({round(b.get_height(), 2) for b in ax.patches})
    assert heights == [0.4, 0.8] and len(ax.patches) == 4 * 3 * 8  # F, B and W of every micro-batch on every stage
    assert "W half height" in ax.get_title() and "free messages 11%" in ax.get_title()


def test_side_by_side_prints_pytorchs_table_its_tuples_and_the_courses_per_rank():
    rank = {"torch_table": [["0F0", None, "0I0", "0W0"]], "table": [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)]],
            "course_table": [[("F", 0), ("B", 0), ("W", 0)]]}
    assert ch13.side_by_side(rank).splitlines() == ["rank 0 PyTorch: 0F0 - 0I0 0W0", "rank 0 as ours: F0.0 B0.0 W0.0",
                                                    "rank 0 course : F0 B0 W0"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 8)])
def test_the_least_idle_of_an_ideal_timeline_is_its_own_idle_and_the_formula(name, p, m):
    lines = [d["timeline"] for d in fake_result(name, p, m).ranks]
    assert timelines.least_idle_fractions(lines) == pytest.approx(timelines.idle_fractions(lines))
    assert timelines.least_idle_fractions(lines) == pytest.approx([pipeline_bubble_fraction(p, m, denominator="total")] * p)


def test_the_least_idle_keeps_each_boxs_length_and_starts_it_as_soon_as_its_neighbour_allows():
    # 1F1B, p = 2, m = 2, every box 1 long but stage 0's F1, stretched to 3 (its rank lost its core); as measured,
    # every message 0.5 late
    def box(kind, micro, start, end):
        return {"kind": kind, "micro": micro, "start": start, "end": end}

    line0 = [box("F", 0, 0.0, 1.0), box("F", 1, 1.0, 4.0), box("B", 0, 4.0, 5.0), box("B", 1, 7.0, 8.0)]
    line1 = [box("F", 0, 1.5, 2.5), box("B", 0, 2.5, 3.5), box("F", 1, 4.5, 5.5), box("B", 1, 5.5, 6.5)]
    # as soon as possible: stage 0 F0 [0, 1] F1 [1, 4]; stage 1 F0 [1, 2] B0 [2, 3] F1 [4, 5] B1 [5, 6]; stage 0
    # B0 [4, 5] (after its own F1) and B1 [6, 7]: span 7, busy 6 and 4
    least = timelines.least_idle_fractions([line0, line1])
    assert least == pytest.approx([1 - 6 / 7, 1 - 4 / 7])
    assert timelines.idle_fractions([line0, line1]) == pytest.approx([1 - 6 / 8, 1 - 4 / 8])  # above it
    with pytest.raises(ValueError, match="cycle"):  # stage 0 lists its B0 first: it waits for a B0 after an F0
        timelines.least_idle_fractions([[line0[2], *line0[:2], line0[3]], line1])  # that waits for stage 0's F0
