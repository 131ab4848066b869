"""Chapter 11's exercises: the ZeRO ledger (checked in the notebook) and the sharded optimizer step (checked on
2 and 4 real ranks). Solutions pass, the notebook's stubs score zero as "not attempted", and each plausible
wrong answer (re-sync forgotten, DDP dressed as ZeRO, averaging missing, momentum reset) fails with its reason."""
import pytest

from course_utils.exercises import FAIL, PASS, TODO, check, exercises
from tests.exercise_sources import notebook_cells, solutions, stubs
from tests.wrong_answers.ch11 import WRONG

CH11 = exercises("11")


def test_chapter_11_declares_a_local_and_a_rank_exercise():
    by_name = {e.name: e for e in CH11}
    assert set(by_name) == {"zero_state_bytes", "zero1_step"}
    assert by_name["zero_state_bytes"].local is not None
    assert by_name["zero1_step"].worker == "workers.exercises.ch11" and by_name["zero1_step"].world_sizes == (2, 4)


@pytest.mark.ranks
@pytest.mark.parametrize("ex", CH11, ids=lambda e: e.name)
def test_solution_passes_and_stub_is_todo(ex):
    verdict = check(ex.name, getattr(solutions("11"), ex.function))
    assert verdict.status == PASS and verdict.points == ex.points, verdict
    verdict = check(ex.name, stubs("11")[ex.function])
    assert verdict.status == TODO and verdict.points == 0, verdict


@pytest.mark.ranks
@pytest.mark.parametrize("name, fn, fragment", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_wrong_answer_is_caught_with_its_reason(name, fn, fragment):
    verdict = check(name, fn)
    assert verdict.status == FAIL and verdict.points == 0, verdict
    assert fragment in verdict.message, verdict.message


def test_every_exercise_has_a_wrong_answer_and_is_followed_by_its_check():
    assert {e.name for e in CH11} <= {w[0] for w in WRONG}
    cells = [c for c in notebook_cells("11") if c.cell_type == "code"]
    for ex in CH11:
        i = next(i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])
                 and f"def {ex.function}(" in c.source)
        assert f'check("{ex.name}"' in cells[i + 1].source
