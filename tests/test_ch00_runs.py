"""Chapter 00's figures of the planner against published runs draw every term of every run."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_utils import ch00_runs, planner_runs  # noqa: E402
from course_utils.ch00 import TIME_COLOURS  # noqa: E402
from course_utils.published_configs import PUBLISHED_RUNS  # noqa: E402
from course_utils.step_time import TERMS  # noqa: E402


def test_every_term_has_a_colour_and_every_bar_ends_at_its_ratio():
    assert set(TIME_COLOURS) == set(TERMS)  # a term without a colour would vanish from the stacked bars
    comps = planner_runs.comparisons(PUBLISHED_RUNS[-4:])
    fig, ax = plt.subplots()
    ch00_runs.breakdown_figure(comps, ax=ax)
    ends = {}
    for patch in ax.patches:
        if patch.get_height() < 1:  # the band is a full-height span
            y = round(patch.get_y() + patch.get_height() / 2)
            ends[y] = max(ends.get(y, 0.0), patch.get_x() + patch.get_width())
    for i, c in enumerate(comps):
        assert abs(ends[i] - c.ratio) < 1e-9, c.row.name
    plt.close(fig)


def test_search_table_marks_the_published_layout():
    from course_utils.planner import search_layouts
    from course_utils.published_configs import KORTHIKANTI_2022_TABLE3

    row = KORTHIKANTI_2022_TABLE3[2]
    found = search_layouts(planner_runs.shape(row), row.gpus, global_batch=row.global_batch, seq=row.seq,
                           cluster_name=row.cluster, micro_batches=(1,), zero_stages=(0,), virtual_stages=(1, 2, 3),
                           practice=planner_runs.practice(row), top=None)
    published = dict(tp=row.tp, pp=row.pp, dp=row.dp, virtual_stages=row.virtual_stages, recompute=row.recompute)
    rank = ch00_runs.published_rank(found, published)
    assert rank is not None and rank <= 3  # the notebook's claim: among the planner's best few
    assert [p.mfu for p in found] == sorted((p.mfu for p in found), reverse=True)
    assert all(p.fits for p in found)
    table = ch00_runs.search_table(found[:5], published, "x")
    assert sum(r[-1] == "published" for r in table.rows) == (1 if rank <= 5 else 0)
