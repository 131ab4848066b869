"""Chapter 00's exercises (all checked in the notebook process): solutions pass, the notebook's stubs score zero
as "not attempted", and every plausible wrong answer fails with a message that names the mistake."""
import pytest

from course_utils.exercises import FAIL, PASS, TODO, check, exercises
from tests.exercise_sources import notebook_cells, solutions, stubs
from tests.wrong_answers.ch00 import WRONG

CH00 = exercises("00")


def test_chapter_00_declares_its_four_exercises_locally():
    assert {e.name for e in CH00} == {"zero_total_bytes", "layout_70b", "min_gpus_fsdp", "max_tp"}
    assert all(e.local is not None and e.worker is None for e in CH00)


@pytest.mark.parametrize("ex", CH00, ids=lambda e: e.name)
def test_solution_passes_and_stub_is_todo(ex):
    verdict = check(ex.name, getattr(solutions("00"), ex.function))
    assert verdict.status == PASS and verdict.points == ex.points, verdict
    stub = stubs("00")[ex.function]
    verdict = check(ex.name, stub)
    assert verdict.status == TODO and verdict.points == 0, verdict


@pytest.mark.parametrize("name, fn, fragment", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_wrong_answer_is_caught_with_its_reason(name, fn, fragment):
    verdict = check(name, fn)
    assert verdict.status == FAIL and verdict.points == 0, verdict
    assert fragment in verdict.message, verdict.message


def test_every_exercise_has_a_wrong_answer_and_is_followed_by_its_check():
    assert {e.name for e in CH00} <= {w[0] for w in WRONG}
    cells = [c for c in notebook_cells("00") if c.cell_type == "code"]
    for ex in CH00:
        i = next(i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])
                 and f"def {ex.function}(" in c.source)
        assert f'check("{ex.name}"' in cells[i + 1].source


def test_the_reference_layout_is_checked_by_the_planner_not_by_a_fixed_answer():
    # Several layouts fit; the check must accept any of them and refuse one that does not fit.
    from course_utils.catalogue.ch00 import check_layout_70b

    assert check_layout_70b(lambda: dict(tp=8, pp=1, dp=32, zero_stage=1))[0] == PASS
    assert check_layout_70b(lambda: dict(tp=4, pp=8, dp=8, zero_stage=1))[0] == PASS
    status, message = check_layout_70b(lambda: dict(tp=1, pp=1, dp=256, zero_stage=3))
    assert status == FAIL and "activations" in message
