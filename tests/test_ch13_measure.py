"""Chapter 13's notebook-side measurement (no ranks): the idle share read off a timeline is the schedule's.

``course_utils.pipeline.idle_fractions`` is what every bubble number in the notebook comes from. Fed the
ideal timeline of ``schedules.simulate`` (t_F = 1, t_B = 2) it must give exactly (p-1)/(m+p-1) per stage,
the ledger's idle / total; a helper that divided by the rank's own span, or by the ideal time, would not.
"""
from types import SimpleNamespace

import matplotlib
import pytest

from course_utils import pipeline as pp
from course_utils.ledger import pipeline_bubble_fraction
from workers.pipeline.model import PipelineConfig
from workers.pipeline.schedules import all_stages, simulate

matplotlib.use("Agg")


def fake_result(name: str, p: int, m: int):
    sim = simulate(all_stages(name, p, m))
    ranks = [{"pipeline": 0, "stage": s, "schedule": name, "config": PipelineConfig(micro_batches=m).as_dict(),
              "timeline": [{"kind": k, "micro": i, "start": a / 1e3, "end": b / 1e3} for k, i, a, b in sim["timeline"][s]]}
             for s in range(p)]
    return SimpleNamespace(ranks=ranks)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 16)])
def test_idle_fraction_of_an_ideal_timeline_is_the_formula(name, p, m):
    res = fake_result(name, p, m)
    want = pipeline_bubble_fraction(p, m, denominator="total")
    assert pp.idle_fractions(res) == pytest.approx([want] * p)
    assert pp.bubble_formulas(p, m)["bubble/ideal (p-1)/m"] == pytest.approx((p - 1) / m)


def test_gantt_draws_one_row_per_stage_and_one_box_per_action():
    res = fake_result("1f1b", 4, 8)
    fig = pp.gantt_figure(res)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 * 2 * 8  # every F and B of every stage, none invented
    assert len(ax.get_yticks()) == 4
