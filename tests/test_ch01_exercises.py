"""Chapter 01's exercises, graded on real ranks: the solutions pass, the notebook's stubs score zero as
"not attempted", and every plausible wrong answer fails with a message that names the mistake.
(``tests/test_exercises.py`` does the same for every chapter; this file runs chapter 01 alone.)"""
import dataclasses

import pytest

from course_utils.exercises import FAIL, PASS, TODO, check, exercises
from tests.exercise_sources import solutions, stubs
from tests.wrong_answers.ch01 import WRONG

pytestmark = pytest.mark.ranks
MINE = exercises("01")


def test_chapter_has_the_three_exercises():
    assert {e.name for e in MINE} == {"ring_all_reduce", "all_gather_from_broadcast", "bus_bandwidth"}
    assert {name for name, _, _ in WRONG} == {e.name for e in MINE}
    assert sum(e.worker is not None for e in MINE) >= 2  # at least two are graded on ranks


@pytest.mark.parametrize("ex", MINE, ids=lambda e: e.name)
def test_solution_passes(ex):
    verdict = check(ex.name, getattr(solutions("01"), ex.function))
    assert verdict.status == PASS, verdict.message
    if ex.worker:
        assert "2, 4" in verdict.message


@pytest.mark.parametrize("ex", MINE, ids=lambda e: e.name)
def test_stub_scores_zero(ex):
    verdict = check(ex.name, stubs("01")[ex.function])
    assert verdict.status == TODO and verdict.points == 0, verdict


@pytest.mark.parametrize("name, fn, fragment", WRONG, ids=[fn.__name__ for _, fn, _ in WRONG])
def test_wrong_answer_is_caught(name, fn, fragment):
    verdict = check(name, fn)
    assert verdict.status == FAIL, verdict
    assert fragment in verdict.message, verdict.message


def test_ring_that_deadlocks_fails_with_a_timeout_not_a_hang():
    # Every rank blocks in recv before anyone sends: the check must end, with advice, not hang the notebook.
    def ring_recv_first(x):
        import torch
        import torch.distributed as dist

        n, rank = dist.get_world_size(), dist.get_rank()
        incoming = torch.empty_like(x)
        dist.recv(incoming, (rank - 1) % n)
        dist.send(x, (rank + 1) % n)
        return x + incoming

    from course_utils import exercises as ex_mod

    quick = dataclasses.replace(ex_mod.get("ring_all_reduce"), timeout_s=5.0, world_sizes=(2,))
    status, message = ex_mod._run_on_ranks(quick, ring_recv_first)  # check(), with a 5 s limit
    assert status == FAIL
    assert "did not finish within 5 s" in message and "recv" in message, message


def test_checker_restores_the_real_collectives():
    # While a learner's function runs, the ready-made collectives are stubbed out on the ranks; afterwards
    # the same warm ranks must have the real ones back (a later worker's all_reduce must work).
    import course_utils as cu

    check("ring_all_reduce", getattr(solutions("01"), "ring_all_reduce"))
    res = cu.run("workers.ch01_collectives", world_size=2, collective="all_reduce", timeout=30)
    assert res.launch == "warm"
    assert res[0]["after"].tolist() == [30.0, 32.0]
