"""Chapter 17, restart and roll back: the specification of a job that survives a dead or hung rank.

Start here: ``workers/ch17_restart.py`` trains chapter 08's run (float64, DDP on two gloo ranks) with a DCP checkpoint
every 4 steps. A fault strikes one rank in the middle of a step on the first attempt; torchrun (``max_restarts=1``)
restarts every rank, the job reloads its newest complete checkpoint and trains on. The reference is the same run
uninterrupted.

Bitwise means ``torch.equal``: the restarted run executes the same float64 operations on the same bits in the same
order as the uninterrupted one (the checkpoint holds every input of the next step, DDP averages two ranks' gradients,
a + b, exactly), so any difference at all means some state was lost. Both runs are on this machine, so the property
holds on every CPU. The wall times are measurements; the tests ask of them only what must hold on any machine (a
hang is detected no sooner than the collective timeout, and not much later).
"""
import json

import pytest
import torch

import course_utils as cu
from tests.leftovers import children, new_children, port_free
from workers.resilience import journal, state
from workers.resilience.journal import Journal, ledger, read_events

# once: processes, restarts, ports and exact equalities within one machine's kernels; the chapter's execution under
# the other kernels (test-other-cpu) runs the same runs and compares their verdicts
pytestmark = [pytest.mark.ranks, pytest.mark.once]

STEPS, EVERY = 12, 4  # the worker's defaults: checkpoints after steps 4, 8 and 12
COLLECTIVE_TIMEOUT = 3.0
RUN = {"world_size": 2, "warm": False, "timeout": 120, "steps": STEPS, "ckpt_every": EVERY}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    res = cu.run("workers.ch17_restart", ckpt_dir=str(tmp_path_factory.mktemp("straight")), **RUN)
    assert res[0]["attempts"] == 1 and res[0]["lost_steps"] == []
    return res


def _restarted(tmp_path, **fault):
    before = children()
    res = cu.run("workers.ch17_restart", ckpt_dir=str(tmp_path / "run"), max_restarts=1,
                 collective_timeout=COLLECTIVE_TIMEOUT, **RUN, **fault)
    # nothing of the job outlives it: not the restarted ranks, not the killed attempt's, not torchrun
    assert new_children(before) == []
    assert all(port_free(r["store_port"]) for r in res.ranks)
    return res


def _same_run(res, reference):
    """The restarted run is the uninterrupted run, bit for bit: every loss and both ranks' final weights."""
    assert res[0]["steps"] == reference[0]["steps"] == list(range(1, STEPS + 1))
    assert res[0]["losses"].dtype == torch.float64
    assert torch.equal(res[0]["losses"], reference[0]["losses"])
    for rank in range(2):
        assert torch.equal(res[rank]["weights"], reference[rank]["weights"])


def test_a_rank_killed_mid_step_restarts_from_the_last_checkpoint_bit_for_bit(tmp_path, uninterrupted):
    res = _restarted(tmp_path, fault="kill", fault_rank=1, fault_step=7)
    _same_run(res, uninterrupted)
    record = res[0]
    assert record["attempts"] == 2 and [r["attempt"] for r in res.ranks] == [1, 1]
    # the newest complete checkpoint before step 7 is step 4's: steps 5 and 6 were done, lost and done again
    assert record["resumed_from"] == [4]
    assert record["lost_steps"] == [5, 6] == list(range(4 + 1, 7))
    assert record["step_attempts"] == [0] * 4 + [1] * 8
    assert [(f["kind"], f["rank"], f["step"]) for f in record["faults"]] == [("kill", 1, 7)]
    # the lost steps really streamed to the notebook from the first attempt before they were thrown away
    streamed = {(m["step"], m["attempt"]) for m in res.metrics[0]}
    assert {(5, 0), (6, 0), (5, 1), (6, 1)} <= streamed and (7, 0) not in streamed
    assert any("attempt 0" in line and "restarts every rank" in line for line in res.logs)
    # the wall-time split: every part measured (positive and finite), the restart the largest on two cores
    split = {k: record[k] for k in ("productive_s", "lost_s", "restart_s", "reload_s", "checkpoint_s")}
    assert all(0 < v < 120 for v in split.values()), split
    assert split["restart_s"] > split["reload_s"], split


def test_a_hang_ends_at_the_collective_timeout_naming_the_collective_and_the_rank_then_recovers(tmp_path,
                                                                                                uninterrupted):
    # rank 0 stops after the forward of step 10 and never calls the gradient all_reduce; rank 1 waits in it
    res = _restarted(tmp_path, fault="hang", fault_rank=0, fault_step=10, hang_s=300.0)
    _same_run(res, uninterrupted)
    record = res[0]
    (failure,) = record["failures"]
    assert (failure["rank"], failure["step"], failure["missing"]) == (1, 10, [0])
    assert "gradient all_reduce" in failure["collective"]
    assert "rank 0 never called it" in failure["message"] and "step 10" in failure["message"]
    # detected by gloo's timeout, not before it, and not much after it on a loaded 2-core machine
    assert COLLECTIVE_TIMEOUT - 0.05 <= record["detect_s"] <= COLLECTIVE_TIMEOUT + 5, record["detect_s"]
    assert record["resumed_from"] == [8] and record["lost_steps"] == [9]


def test_a_checkpoint_torn_mid_save_is_passed_over_and_the_run_is_still_bit_for_bit(tmp_path, uninterrupted):
    # rank 1 dies inside the save after step 8, its own shard written, before the coordinator's .metadata: the folder
    # step_000008 is left torn; the restart must take step 4's checkpoint and redo 5 to 8
    res = _restarted(tmp_path, fault="torn", fault_rank=1, fault_step=8)
    _same_run(res, uninterrupted)
    record = res[0]
    assert [(f["kind"], f["rank"], f["step"]) for f in record["faults"]] == [("torn", 1, 8)]
    assert record["resumed_from"] == [4] and record["lost_steps"] == [5, 6, 7, 8]
    assert record["skipped"] == [[8]]  # the torn folder was there, without .metadata, and passed over


SLOW_S, SLOW_STEPS, SLOW_FROM = 0.3, 3, 5
# A spread of arrivals at the gradient all_reduce over this names a straggler. It holds on a loaded 2-core machine:
# the ranks leave the previous step together (its loss all_reduce), so without a stall they reach the next all_reduce
# within one forward pass and the scheduler's jitter (milliseconds; tens of them under load), while the straggler
# arrives a 0.3 s sleep later, and a sleep is never shorter than asked (only longer, which widens the gap).
STRAGGLER_S = 0.1


def test_a_straggler_costs_time_not_arithmetic_and_the_journal_names_it(tmp_path, uninterrupted):
    # rank 1 sleeps 0.3 s after its forward in steps 5, 6 and 7; rank 0 waits for it in the gradient all_reduce.
    # Nothing fails, so nothing restarts (max_restarts 0, as ch17.restart_run runs it)
    before = children()
    res = cu.run("workers.ch17_restart", ckpt_dir=str(tmp_path / "run"), fault="slow", fault_rank=1,
                 fault_step=SLOW_FROM, slow_steps=SLOW_STEPS, slow_s=SLOW_S, **RUN)
    assert new_children(before) == []
    _same_run(res, uninterrupted)  # the same float64 operations in the same order: only later
    record = res[0]
    assert record["attempts"] == 1 and record["lost_steps"] == [] and record["faults"] == []
    struck = list(range(SLOW_FROM, SLOW_FROM + SLOW_STEPS))
    assert sorted((e["rank"], e["step"]) for e in record["stalls"]) == [(1, s) for s in struck]
    assert journal.STRAGGLER_S == STRAGGLER_S  # the threshold the ledger named the last to arrive with
    # every slowed step names rank 1 (its 0.3 s sleep against a threshold of 0.1 s); an unslowed step is not asked
    # for None: on a loaded 2-core machine a rank can, rarely, be descheduled past 0.1 s (the exact rule is held by
    # the hand-made journals of test_the_ledger_*)
    named = dict(zip(record["steps"], record["last_to_arrive"]))
    assert [named[s] for s in struck] == [1] * SLOW_STEPS, (record["last_to_arrive"], record["wait_by_step"])
    # a lower bound on a sleep holds under any load (no upper bound: the machine may be busy)
    assert record["waiting_s"] >= 0.5 * SLOW_S * SLOW_STEPS, record["wait_by_step"]
    assert len(record["wait_by_step"]) == STEPS


def test_refusals_of_a_straggler_name_what_to_change_before_any_rank_starts():
    base = dict(steps=12, ckpt_every=4, ckpt_dir="/tmp/never-written", fault="slow", fault_step=5, fault_rank=1)
    for change, fragment in [({"fault_step": 11}, "slow_steps=3 from fault_step=11 runs past steps=12: choose "
                                                  "slow_steps of at most 2, or an earlier fault_step"),
                             ({"slow_steps": 0}, "slow_steps=0 must be at least 1"),
                             ({"slow_s": 0.0}, "slow_s=0.0 is not a stall"),
                             ({"slow_s": -1.0}, "slow_s=-1.0 is not a stall")]:
        with pytest.raises(cu.InvalidParameter, match=fragment):
            cu.launch("workers.ch17_restart", 2, **{**base, **change})


def test_without_restarts_a_killed_rank_ends_the_job_and_is_named(tmp_path):
    before = children()
    with pytest.raises(cu.WorkerFailed) as info:
        cu.run("workers.ch17_restart", ckpt_dir=str(tmp_path / "run"), fault="kill", fault_rank=1, fault_step=3,
               **RUN)
    assert info.value.rank == 1 and "died without a Python traceback" in str(info.value)
    if 0 in info.value.errors:  # rank 0's named error follows the dead rank's, when it saw the closed connection
        assert "rank 1 never called it" in str(info.value)  # before torchrun stopped it (a loaded machine: not always)
    assert new_children(before) == []


def test_the_rank_named_is_the_first_to_vanish_not_the_lowest():
    """CI, loaded: rank 1 killed itself, torchrun stopped rank 0 before rank 0 raised, and the job named rank 0.
    The ends arrive in order (rank 1's first); the first rank to end without a traceback is the cause."""
    from course_utils.jobs import RankJob

    job = RankJob.__new__(RankJob)
    job.close, job._output_tail, job.output = (lambda: None), (lambda: ""), []
    with pytest.raises(cu.WorkerFailed) as info:
        job._raise_failure("w", {}, {1: "rank 1 exited", 0: "rank 0 exited"})
    assert info.value.rank == 1 and str(info.value).startswith("w: rank 1 died without a Python traceback")
    with pytest.raises(cu.WorkerFailed) as info:  # a rank that raised is never the vanished one
        job._raise_failure("w", {1: {"type": "RuntimeError", "message": "x"}}, {1: "rank 1 exited", 0: "rank 0 exited"})
    assert info.value.rank == 0


# -- the pieces, without ranks ------------------------------------------------------------------------------

def test_a_checkpoint_without_its_metadata_is_never_chosen(tmp_path):
    for step in (4, 8):
        (tmp_path / f"step_{step:06d}").mkdir()
        (tmp_path / f"step_{step:06d}" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "step_000004" / ".metadata").write_bytes(b"x")  # step 8's save was cut short: no metadata
    assert state.latest_complete(str(tmp_path)) == (4, str(tmp_path / "step_000004"))
    assert state.latest_complete(str(tmp_path / "missing")) is None


def test_the_ledger_splits_a_restarted_run(tmp_path):
    """A hand-made journal: attempt 0 does steps 1-3 (checkpoint after 2), dies in step 4; attempt 1 reloads step 2."""
    j0, j1 = Journal(str(tmp_path), 0, 0, "r"), Journal(str(tmp_path), 1, 0, "r")
    j0.write("start", t=0.0)
    for s, (t0, t1) in enumerate([(1.0, 2.0), (2.0, 3.0), (3.5, 4.5)], start=1):
        j0.write("step", step=s, loss=float(s), t0=t0, t1=t1, t=t1)
    j0.write("checkpoint", step=2, t0=3.0, t1=3.5, t=3.5)
    j1.write("fault", kind="hang", step=4, t=5.0)
    j0.write("failure", step=4, collective="gradient all_reduce", missing=[1], message="m", t=8.0)
    k0 = Journal(str(tmp_path), 0, 1, "r")
    k0.write("start", t=10.0)
    k0.write("reload", step=2, t0=11.0, t1=11.25, t=11.25)
    for s, (t0, t1) in zip((3, 4), [(11.25, 12.0), (12.0, 13.0)]):
        k0.write("step", step=s, loss=10.0 * s, t0=t0, t1=t1, t=t1)
    Journal(str(tmp_path), 0, 0, "another run").write("step", step=1, loss=-1.0, t0=0.0, t1=100.0)
    out = ledger(read_events(str(tmp_path), "r"))
    assert out["steps"] == [1, 2, 3, 4] and out["losses"] == [1.0, 2.0, 30.0, 40.0]
    assert out["step_attempts"] == [0, 0, 1, 1] and out["lost_steps"] == [3] and out["resumed_from"] == [2]
    assert out["productive_s"] == 1 + 1 + 0.75 + 1  # steps 1, 2 of attempt 0; 3, 4 of attempt 1
    assert out["lost_s"] == 1.0 + 0.5  # step 3 done then thrown away; step 4 from the last step's end to the fault
    assert (out["detect_s"], out["restart_s"], out["reload_s"], out["checkpoint_s"]) == (3.0, 3.0, 0.25, 0.5)
    assert json.loads((tmp_path / "journal" / "rank1.jsonl").read_text().splitlines()[0])["event"] == "fault"


def test_the_ledger_takes_the_wait_for_a_straggler_out_of_the_productive_time(tmp_path):
    """A hand-made journal of two ranks, three steps: the spread of their arrivals at the gradient all_reduce is the
    waiting, taken out of rank 0's step time (binary fractions: every sum below is exact)."""
    j0, j1 = Journal(str(tmp_path), 0, 0, "r"), Journal(str(tmp_path), 1, 0, "r")
    # step: (rank 0's t0, t1, arrive), rank 1's arrive
    plan = {1: ((1.0, 2.0, 1.25), 1.3125),   # 0.0625 s apart: jitter, nobody named
            2: ((2.0, 3.5, 2.25), 3.0),      # rank 1 arrives 0.75 s late: rank 0 waited that long
            3: ((3.5, 4.5, 3.75), 2.5)}      # rank 0 is 1.25 s late, more than its step: capped at the step's 1.0 s
    for s, ((t0, t1, arrive), other) in plan.items():
        j0.write("step", step=s, loss=float(s), t0=t0, t1=t1, arrive=arrive, t=t1)
        j1.write("step", step=s, loss=float(s), t0=t0, t1=t1, arrive=other, t=t1)
    j1.write("stall", step=2, t0=2.25, t1=3.0, seconds=0.75, t=3.0)
    out = ledger(read_events(str(tmp_path), "r"), straggler_s=0.1)
    assert out["wait_by_step"] == [0.0625, 0.75, 1.0] and out["waiting_s"] == 1.8125
    assert out["last_to_arrive"] == [None, 1, 0]
    assert out["productive_s"] == (1.0 + 1.5 + 1.0) - 1.8125  # each second counted once: steps = productive + waiting
    assert out["productive_s"] + out["waiting_s"] == sum(out["step_s"])
    assert [(e["rank"], e["step"]) for e in out["stalls"]] == [(1, 2)]
    assert out["lost_s"] == out["restart_s"] == 0.0 and out["attempts"] == 1


def test_refusals_name_what_to_change_before_any_rank_starts():
    base = dict(steps=12, ckpt_every=4, ckpt_dir="/tmp/never-written", fault="kill", fault_step=7, fault_rank=1)
    for change, fragment in [({"fault_rank": 2}, "fault_rank=2 is not a rank of a world of 2"),
                             ({"fault_step": 13}, "fault_step=13 is not a step of this run: choose 1 to 12"),
                             ({"ckpt_every": 0}, "ckpt_every=0 must be at least 1"),
                             ({"fault": "oom"}, "fault='oom' is not one of"),
                             ({"fault": "torn", "fault_step": 7}, "fault_step=7 saves no checkpoint to tear"),
                             ({"max_restarts": -1}, "max_restarts=-1 must be a whole number")]:
        with pytest.raises(cu.InvalidParameter, match=fragment):
            cu.launch("workers.ch17_restart", 2, **{**base, **change})
