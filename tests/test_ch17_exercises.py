"""Chapter 17's exercise declarations and what is particular to its checkers (the grading itself, solution, stub and
every wrong answer through ``check``, is in tests/test_exercises.py).

Start here: ``resume_position`` is checked on ranks inside the real restart path (``workers/exercises/ch17.py``), and
names a wrong answer from its rows with ``resume_problem``, a pure function; the tests below run every wrong answer
through that function in this process, at every world size and rank the check uses, so a case that stops telling
two mistakes apart fails here in a second, not only on ranks. ``quorum_grad_scale`` and ``timeline_goodput`` are
checked in the notebook process against ``workers/resilience/replicas.reference`` and
``course_utils.goodput.timeline_ledger``. Everything here is exact: integer rows, sums of given seconds, and float64
gradients compared to a stated tolerance.
"""
import copy
import glob
import os
import tempfile
import time

import pytest
import torch

from course_utils.catalogue.ch17 import QUORUM_RUNS, TIMELINES, check_quorum_grad_scale, check_timeline_goodput
from course_utils.exercises import FAIL, PASS, exercises
from solutions import ch17 as solution
from tests.wrong_answers.ch17 import WRONG
from workers.checkpointing.training import RunConfig
from workers.exercises.ch17 import RESUME_CASES, as_rows, resume_problem, steps_per_epoch
from workers.exercises.support import Wrong


def test_chapter_17_declares_one_exercise_on_ranks_and_two_in_the_notebook():
    by_name = {e.name: e for e in exercises("17")}
    assert set(by_name) == {"resume_position", "quorum_grad_scale", "timeline_goodput"}
    assert by_name["resume_position"].worker == "workers.exercises.ch17"
    assert by_name["resume_position"].world_sizes == (2, 4) and by_name["resume_position"].local is None
    for name in ("quorum_grad_scale", "timeline_goodput"):
        assert by_name[name].local is not None and by_name[name].worker is None


# -- resume_position ------------------------------------------------------------------------------------------------

def _saved_step(case) -> int:
    """The newest checkpoint of the job that fails during ``failed_step``: the last multiple of ``ckpt_every`` it
    finished (the trainer saves after every ``ckpt_every``-th step)."""
    _, _, _, _, every, failed = case
    return (failed - 1) // every * every


def test_resume_cases_hold_every_situation_the_check_needs():
    seen = set()
    for case in RESUME_CASES:
        n, batch, _, steps, every, failed = case
        spe, saved = steps_per_epoch(n, batch), _saved_step(case)
        assert 0 < saved < failed <= steps + 1 and saved + 1 <= steps, case
        assert batch % 4 == 0  # world 2 and 4 both divide the global batch, as the sampler requires
        seen |= {"an incomplete last batch"} if n % batch else set()
        seen |= {"epoch 0"} if saved < spe else {"a later epoch"}
        seen |= {"the checkpoint closes an epoch"} if saved % spe == 0 else {"mid epoch"}
        seen |= {"work lost between checkpoint and failure"} if failed - 1 > saved else set()
        seen |= {"ceil(n / B) steps an epoch lands elsewhere"} if divmod(saved, -(-n // batch)) != divmod(saved, spe) \
            else set()
    assert seen >= {"an incomplete last batch", "epoch 0", "a later epoch", "the checkpoint closes an epoch",
                    "mid epoch", "work lost between checkpoint and failure", "ceil(n / B) steps an epoch lands elsewhere"}


def _in_process_verdict(answer):
    """What the rank check says of ``answer``, worked out here: every case at world 2 then 4, every rank called with
    the checkpoint the trainer writes, the lowest rank's finding first (as ``agree`` reports it)."""
    for world in (2, 4):
        for case in RESUME_CASES:
            n, batch, seed, steps, _, failed = case
            config = {**RunConfig(n_samples=n, global_batch=batch, seed=seed, total_steps=steps).as_dict(),
                      "dtype": "float64", "world_size": world}
            checkpoint = {"step": _saved_step(case), "config": config}
            rows, found = [], []
            for rank in range(world):
                given = copy.deepcopy(checkpoint)
                value = answer(given, failed, rank, world)
                try:
                    if given != checkpoint:
                        raise Wrong("your function changed the checkpoint it was given")
                    rows.append(as_rows(value, n))
                except Wrong as exc:
                    found.append(str(exc))
            if found:
                return found[0]
            for rank in range(world):
                problem = resume_problem(rows[rank], rows, rank, world, n, batch, seed, checkpoint["step"], failed)
                if problem:
                    return problem
    return None


def test_the_solution_reads_what_the_real_sampler_resumes_to():
    assert _in_process_verdict(solution.resume_position) is None


RESUME_WRONG = [(fn, fragment) for name, fn, fragment in WRONG if name == "resume_position"]


@pytest.mark.parametrize("fn, fragment", RESUME_WRONG, ids=[fn.__name__ for fn, _ in RESUME_WRONG])
def test_each_resume_mistake_is_named_from_its_rows(fn, fragment):
    """The diagnosis tells the mistakes apart in the first case each one fails: the rows of the failed step, of the
    checkpoint's own step, of the step after next, of the epoch's first step, epoch 0's order, an 8-step epoch, the
    leftover rows past an epoch's end, and the right rows on the wrong ranks are never the same rows there."""
    verdict = _in_process_verdict(fn)
    assert verdict is not None and fragment in verdict, verdict


def test_rows_must_be_integer_indices_inside_the_dataset():
    assert as_rows(torch.tensor([3, 1], dtype=torch.int32), 60) == [3, 1]
    assert as_rows([torch.tensor(4), 5], 60) == [4, 5]
    for bad, fragment in ((torch.tensor([1.0, 2.0]), "dtype torch.float32"), ([1, 2.0], "not an int"),
                          ([[1, 2], [3, 4]], "nested list"), ([True, 2], "not an int"), ([60], "not a row of"),
                          ([-1], "not a row of"), (7, "not int")):
        with pytest.raises(Wrong, match=fragment):
            as_rows(bad, 60)


@pytest.mark.ranks
def test_the_rank_check_leaves_no_folder_behind():
    """Each case writes checkpoints and journals into a folder of its own under the system's temporary directory;
    rank 0 removes it, after a pass and after a failing verdict alike.

    Another test process (make test runs two) may be checking the same exercise meanwhile, so a folder that appeared
    during these checks may be its, still in use: each must be gone within a minute (a check's ranks take seconds);
    one left by these checks never goes."""
    from course_utils.exercises import check
    from tests.wrong_answers.ch17 import resume_from_failed_step

    pattern = os.path.join(tempfile.gettempdir(), "ch17_resume_*")
    before = set(glob.glob(pattern))
    assert check("resume_position", solution.resume_position).status == PASS
    assert check("resume_position", resume_from_failed_step).status == FAIL
    appeared = set(glob.glob(pattern)) - before
    deadline = time.monotonic() + 60
    while appeared and time.monotonic() < deadline:
        time.sleep(0.2)
        appeared &= set(glob.glob(pattern))
    assert not appeared, f"left behind: {sorted(appeared)}"


# -- quorum_grad_scale ----------------------------------------------------------------------------------------------

def test_quorum_runs_shrink_the_quorum_every_way():
    seen = set()
    for replicas, schedule, garbage in QUORUM_RUNS:
        assert len(schedule[0]) == replicas and len(schedule[-1]) == replicas  # all start, all return
        for present in schedule:
            missing = sorted(set(range(replicas)) - set(present))
            seen |= {"the last replica missing"} if missing and missing[-1] == replicas - 1 and \
                max(present) + 1 == len(present) else set()
            seen |= {"a replica in the middle missing"} if missing and max(present) + 1 not in (len(present), replicas) \
                else set()
            seen |= {"a quorum of one"} if len(present) == 1 else set()
        for step, replica in garbage.items():
            assert replica not in schedule[step - 1]  # the replica that died mid-allreduce is out of its step
            seen.add("a garbage buffer")
        seen |= {f"{replicas} planned"}
    assert seen >= {"the last replica missing", "a replica in the middle missing", "a quorum of one",
                    "a garbage buffer", "3 planned", "4 planned"}


def test_quorum_check_accepts_any_summation_order_and_leaves_the_global_rng_alone():
    """The tolerance (1e-12 of the largest value) is for sums in another order; the check's own forward passes seed
    the global RNG (the replicas' dropout), inside a fork, so the notebook's streams are as they were."""
    def reversed_mean(grads, participants, replicas):
        import torch

        return [torch.stack(gs).mean(0) for gs in zip(*(grads[r] for r in reversed(sorted(participants))))]

    state = torch.get_rng_state()
    status, message = check_quorum_grad_scale(reversed_mean)
    assert status == PASS, message
    assert torch.equal(torch.get_rng_state(), state)


# -- timeline_goodput -----------------------------------------------------------------------------------------------

def test_timelines_are_possible_and_cover_what_goodput_counts():
    from course_utils.goodput import timeline_ledger

    kinds, shares = set(), []
    for _, segments in TIMELINES:
        ledger = timeline_ledger(segments)  # raises on a rollback that undoes more than was done
        kinds |= {kind for kind, _ in segments}
        shares.append(ledger["goodput"])
        kinds |= {"a rollback of 0 s"} if ("rollback", 0.0) in segments else set()
    assert kinds >= {"work", "checkpoint", "rollback", "recovery", "degraded", "heal", "a rollback of 0 s"}
    assert 0.0 in shares and all(0.0 <= s < 1.0 for s in shares)


def test_the_laptop_timeline_is_predict_runs():
    from course_utils.goodput import Costs, predict_run

    _, segments = TIMELINES[-1]
    costs = Costs(step_s=0.5, checkpoint_s=0.25, detect_s=0.5, restart_s=5.0, reload_s=0.5)
    assert check_timeline_goodput(solution.timeline_goodput)[0] == PASS
    assert solution.timeline_goodput(segments) == pytest.approx(
        predict_run(costs, steps=12, every=4, fail_at=[7])["goodput"], rel=1e-12)


def test_goodput_accepts_a_one_element_tensor():
    def as_tensor(segments):
        import torch

        work = sum(s for k, s in segments if k == "work") - sum(s for k, s in segments if k == "rollback")
        return torch.tensor(work) / sum(s for k, s in segments if k != "rollback")

    status, message = check_timeline_goodput(as_tensor)
    assert status == PASS, message
