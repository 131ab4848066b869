"""Every graded exercise, checked three ways on real ranks (CS336 style: the tests are the specification).

- the reference solution scores full marks: the checker accepts a correct answer;
- the stub shipped in the notebook scores zero, as "not attempted", without raising: a learner who has
  not started sees a friendly verdict, never a traceback;
- each plausible wrong answer is caught, with a message that names the mistake.

Exercises live in ``course_utils/catalogue/chNN.py``, reference solutions in ``solutions/chNN.py``, wrong
answers in ``tests/wrong_answers/chNN.py``. What is particular to one chapter's checker (a deadlocking
answer, world 4, malformed answers) is tested in ``tests/test_chNN_exercises.py``.

Start here when adding an exercise: register its checker in the chapter's catalogue, put the reference
answer in ``solutions/chNN.py`` and at least one plausible mistake in ``tests/wrong_answers/chNN.py``; this
file then runs all three without a line added (``docs/CHAPTERS.md`` lists each chapter's four files).
"""
import pytest

from course_utils.exercises import FAIL, PASS, TODO, check, exercises
from tests.exercise_sources import MUTANT, notebook_cells, solutions, stubs, wrong_answers

pytestmark = pytest.mark.ranks
ALL = exercises()
CHAPTERS = sorted({e.chapter for e in ALL})


@pytest.mark.parametrize("ex", ALL, ids=lambda e: e.name)
def test_reference_solution_passes(ex):
    answer = getattr(solutions(ex.chapter), ex.function)
    verdict = check(ex.name, answer)
    assert verdict.status == PASS, verdict.message
    assert verdict.points == ex.points
    if ex.worker:  # graded on real ranks, at every world size the exercise declares
        assert ", ".join(str(w) for w in ex.world_sizes) in verdict.message, verdict.message


@pytest.mark.parametrize("ex", ALL, ids=lambda e: e.name)
def test_shipped_stub_scores_zero_without_error(ex):
    stub = stubs(ex.chapter).get(ex.function)
    assert stub is not None, f"no cell tagged 'exercise' defines {ex.function} in chapter {ex.chapter}"
    verdict = check(ex.name, stub)
    assert verdict.status == TODO and verdict.points == 0, verdict


WRONG = [(chapter, *w) for chapter in CHAPTERS for w in wrong_answers(chapter)]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_has_a_wrong_answer(chapter):
    covered = {name for name, _, _ in wrong_answers(chapter)}
    missing = {e.name for e in ALL if e.chapter == chapter} - covered
    assert not missing, f"no wrong answer for {sorted(missing)} in tests/wrong_answers/ch{chapter}.py"


@pytest.mark.once  # the reference solutions (above) run under every CPU's kernels; the wrong answers miss by far more
@pytest.mark.parametrize("chapter, name, fn, fragment", WRONG, ids=[f"{w[0]}-{w[2].__name__}" for w in WRONG])
def test_wrong_answer_is_caught_with_its_reason(chapter, name, fn, fragment, record_property):
    verdict = check(name, fn)
    # a row of the mutation report, carried by the test's report (tests run in several worker processes)
    record_property(MUTANT, {"chapter": chapter, "exercise": name, "answer": fn.__name__, "seconds": verdict.seconds,
                             "caught": verdict.status == FAIL and verdict.points == 0,
                             "reason": fragment in verdict.message})
    assert verdict.status == FAIL and verdict.points == 0, (name, fn.__name__, verdict)
    assert fragment in verdict.message, (name, fn.__name__, verdict.message)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_notebook_has_two_exercises_each_followed_by_its_check(chapter):
    cells = [c for c in notebook_cells(chapter) if c.cell_type == "code"]
    mine = [e for e in ALL if e.chapter == chapter]
    assert len(mine) >= 2
    for ex in mine:
        idx = [i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])
               and f"def {ex.function}(" in c.source]
        assert idx, f"chapter {chapter}: no exercise cell defines {ex.function}"
        follow = cells[idx[0] + 1]
        assert f"check({ex.name!r}" in follow.source or f'check("{ex.name}"' in follow.source, follow.source


def test_unknown_exercise_and_missing_answer_are_verdicts_not_errors():
    assert check("no_such_exercise", lambda: None).status == FAIL
    if ALL:
        assert check(ALL[0].name, None).status == TODO


def test_a_local_check_that_never_ends_is_a_verdict_not_a_frozen_notebook():
    import time

    from course_utils.exercises import Exercise, REGISTRY

    def slow_checker(answer):
        answer()
        return PASS, "ok"

    REGISTRY["_test_endless"] = Exercise("_test_endless", "99", "f", "endless", local=slow_checker, timeout_s=1.0)
    try:
        start = time.time()
        verdict = check("_test_endless", lambda: time.sleep(30))
        assert verdict.status == FAIL and "did not finish within 1 s" in verdict.message
        assert time.time() - start < 5
    finally:
        del REGISTRY["_test_endless"]


def test_a_check_that_starts_ranks_limits_the_answer_alone(monkeypatch):
    """A local check that launches ranks has a long limit for itself (chapter 15's cold start of 8 ranks), and
    ``call_answer`` a short one for the learner's function inside it: an endless answer fails fast, with the
    sentence about loops; a check that is merely slow is not blamed on the answer."""
    import time

    from course_utils import exercises
    from course_utils.exercises import Exercise, REGISTRY, call_answer

    monkeypatch.setattr(exercises, "ANSWER_LIMIT_S", 1.0)

    def slow_check(answer):
        value = call_answer(answer, limit_s=exercises.ANSWER_LIMIT_S)
        time.sleep(2)  # the check's own work (the ranks), longer than the answer's limit
        return PASS, f"ok {value}"

    REGISTRY["_test_slow_check"] = Exercise("_test_slow_check", "99", "f", "slow check", local=slow_check, timeout_s=30)
    try:
        assert check("_test_slow_check", lambda: 7).message == "ok 7"
        start = time.time()
        verdict = check("_test_slow_check", lambda: time.sleep(30))
        assert verdict.status == FAIL and verdict.message.startswith("your function did not finish within 1 s")
        assert time.time() - start < 5
        verdict = check("_test_slow_check", lambda: 1 / 0)
        assert verdict.status == FAIL and "ZeroDivisionError" in verdict.message
    finally:
        del REGISTRY["_test_slow_check"]


def test_a_rank_error_names_its_type_once():
    """An answer that raises on the ranks: "raised AttributeError: 'NoneType' ...", not "AttributeError: AttributeError"."""
    def block_forward(*args, **kwargs):
        return None.shape  # AttributeError on every rank

    verdict = check("block_forward", block_forward)
    assert verdict.status == FAIL and "raised AttributeError: " in verdict.message, verdict.message
    assert "AttributeError: AttributeError" not in verdict.message, verdict.message


def test_an_exact_comparison_says_so():
    import torch

    from workers.exercises.support import Wrong, expect_close

    with pytest.raises(Wrong) as err:
        expect_close(torch.ones(3), torch.zeros(3), "the counts", atol=0, rtol=0)
    assert "must be exact" in str(err.value) and "tolerance 0" not in str(err.value)


def test_a_failing_verdict_names_the_world_size_and_the_rank_that_saw_it_once(monkeypatch):
    """One sentence: "at world size 4, rank 1: ...", the rank that saw the mistake (not rank 0 relaying it as
    "(seen on rank 1)"); "not attempted yet" with no world size or rank; a message that names its own world size
    is not told it twice."""
    from course_utils import exercises
    from course_utils.exercises import Exercise, where_seen

    assert where_seen(4, 1, "the sum is short") == "at world size 4, rank 1: the sum is short"
    assert where_seen(4, 0, "at world size 4 your step raised ValueError: x") == \
        "at world size 4, rank 0: your step raised ValueError: x"
    assert where_seen(4, 0, "at world size 2 it was fine") == "at world size 4, rank 0: at world size 2 it was fine"

    class Result:
        def __init__(self, verdicts):
            self.verdicts = verdicts

        def gather(self, key):
            return self.verdicts

    todo = "not attempted yet: replace the `raise NotImplementedError` with your code"
    outcomes = {  # what the ranks of each world size return, as workers/exercises/support.py makes it
        "agreed": [{"status": "fail", "message": "the sum is short", "rank": 1}] * 4,
        "own": [{"status": "pass", "message": "correct"}, {"status": "pass", "message": "correct"},
                {"status": "fail", "message": "rank 2's rows are swapped"}, {"status": "pass", "message": "correct"}],
        "todo": [{"status": "todo", "message": todo}] * 4,
    }
    ex = Exercise("_test_where", "99", "f", "where", worker="workers.exercises.ch01", world_sizes=(4,))
    for case, verdicts in outcomes.items():
        monkeypatch.setattr(exercises, "_started", lambda *a, v=verdicts: Result(v))
        status, message = exercises._run_on_ranks(ex, lambda: None)
        if case == "agreed":
            assert (status, message) == (FAIL, "at world size 4, rank 1: the sum is short")
        elif case == "own":
            assert (status, message) == (FAIL, "at world size 4, rank 2: rank 2's rows are swapped")
        else:
            assert (status, message) == (TODO, todo), message


def test_agree_shares_the_finding_naming_the_global_rank_that_saw_it(monkeypatch):
    """Every rank raises the lowest finding's message unchanged, with ``rank`` = the global rank that found it (in a
    sub-group, its rank in the world); ``run_exercise`` puts that rank in the verdict."""
    from workers.exercises import support
    from workers.exercises.support import Wrong, agree, run_exercise

    def world(findings, members=None):
        monkeypatch.setattr(support.dist, "get_world_size", lambda group=None: len(findings))
        monkeypatch.setattr(support.dist, "all_gather_object", lambda out, mine, group=None: out.__setitem__(
            slice(None), findings))
        monkeypatch.setattr(support.dist, "get_process_group_ranks", lambda group: members)

    world([None, "the sum is short", "also wrong", None])
    with pytest.raises(Wrong) as err:
        agree(lambda: None)
    assert str(err.value) == "the sum is short" and err.value.rank == 1
    world([None, "the sum is short"], members=[1, 3])  # a sub-group of ranks 1 and 3 of the world
    with pytest.raises(Wrong) as err:
        agree(lambda: None, group=object())
    assert err.value.rank == 3

    def check(ctx, answer):
        agree(lambda: None)

    world([None, "the sum is short"])
    assert run_exercise(None, {"x": check}, "x", None) == {
        "verdict": {"status": "fail", "message": "the sum is short", "rank": 1}}
    assert run_exercise(None, {"x": lambda ctx, a: None}, "x", None) == {
        "verdict": {"status": "pass", "message": "correct"}}
