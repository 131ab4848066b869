"""Chapter 01's exercise checker beyond the generic grading (tests/test_exercises.py): an answer that deadlocks
ends at the timeout with advice, and the ready-made collectives the checker hides come back afterwards."""
import dataclasses

import pytest

from course_utils.exercises import FAIL, check, exercises
from tests.exercise_sources import solutions
from tests.wrong_answers.ch01 import WRONG

pytestmark = pytest.mark.ranks
MINE = exercises("01")


def test_chapter_has_the_three_exercises():
    assert {e.name for e in MINE} == {"ring_all_reduce", "all_gather_from_broadcast", "bus_bandwidth"}
    assert {name for name, _, _ in WRONG} == {e.name for e in MINE}
    assert sum(e.worker is not None for e in MINE) >= 2  # at least two are graded on ranks


@pytest.mark.once  # a timeout, not arithmetic: the same on every CPU
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
    assert "matching receive" in message and "collectives" not in message and "()" not in message, message


def test_checker_restores_the_real_collectives():
    # While a learner's function runs, the ready-made collectives are stubbed out on the ranks; afterwards
    # the same warm ranks must have the real ones back (a later worker's all_reduce must work).
    import course_utils as cu

    check("ring_all_reduce", getattr(solutions("01"), "ring_all_reduce"))
    res = cu.run("workers.ch01_collectives", world_size=2, collective="all_reduce", timeout=30)
    assert res.launch == "warm"
    assert res[0]["after"].tolist() == [30.0, 32.0]
