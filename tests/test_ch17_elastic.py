"""Chapter 17, a lost node: the specification of an elastic job that goes on in a smaller world.

Start here: ``course_utils.ch17.lost_node_run`` runs ``workers/ch17_restart.py`` (chapter 08's run, float64, DDP,
a DCP checkpoint every 4 steps) on two simulated nodes of two ranks: two torchrun agents meeting in a c10d
rendezvous with ``--nnodes=1:2``, as on a cluster. In step 7 rank 2's whole node is lost (its agent and both its
ranks SIGKILLed). The survivors' collective fails, their agent restarts them (``max_restarts=1``), the rendezvous
closes with the one node left, and two ranks reload the checkpoint four wrote and finish the run.

The reference for a smaller world is not the four-rank run: dropout masks and input noise are drawn per rank, so two
ranks draw other ones for the same rows. It is a new two-rank job launched by hand on a copy of the checkpoint the
restart loaded: bit for bit (``torch.equal``) the same steps, losses and weights, on every CPU (both on this
machine). The data is checked against the uninterrupted four-rank run: every step reads exactly its samples, none
skipped or read twice, whatever the world.
"""
import pytest
import psutil

import course_utils as cu
from course_utils import ch17
from course_utils.validate import InvalidParameter
from tests.leftovers import children, new_children, port_free

# once: processes, restarts, ports and exact equalities within one machine's kernels
pytestmark = [pytest.mark.ranks, pytest.mark.once]


@pytest.fixture(scope="module")
def lost():
    before = children()
    res = ch17.lost_node_run(fault_step=7, fault_rank=2, name="test-ch17-lost-node")
    return res, before


def test_a_lost_node_restarts_the_job_in_the_world_that_is_left_from_the_last_checkpoint(lost):
    res, _ = lost
    record = res[0]
    assert res.world_size == 2 and len(res.ranks) == 2
    assert record["world_sizes"] == [4, 2] and record["attempts"] == 2
    # the newest complete checkpoint before step 7 is step 4's, written by four ranks and read by two
    assert record["resumed_from"] == [4] and record["lost_steps"] == [5, 6]
    assert record["steps"] == list(range(1, ch17.STEPS + 1))
    assert record["step_attempts"] == [0] * 4 + [1] * 8
    # the whole node went at once: rank 2 put its node's processes on record (two ranks and their agent) first
    (fault,) = record["faults"]
    assert (fault["kind"], fault["rank"], fault["step"]) == ("node", 2, 7) and len(fault["pids"]) == 3
    assert any("attempt 0" in line and "restarts every rank" in line for line in res.logs)


def test_the_smaller_world_goes_on_as_a_job_resumed_there_by_hand_bit_for_bit(lost):
    res, _ = lost
    by_hand = ch17.resumed_by_hand(res, name="test-ch17-by-hand")
    assert by_hand[0]["world_sizes"] == [2] and by_hand[0]["steps"] == list(range(5, ch17.STEPS + 1))
    assert ch17.same_continuation(res, by_hand) == {"steps": True, "losses": True, "weights": True, "bitwise": True}


def test_every_step_reads_the_samples_of_the_uninterrupted_run_none_twice_none_skipped(lost, tmp_path):
    res, _ = lost
    four = ch17.restart_run("none", world_size=4, name="test-ch17-four")
    assert ch17.same_rows(res, four)
    rows = [r for step in res[0]["rows"] for r in step]
    # 12 steps of 8 over 64 samples: epoch 0 (steps 1-8) reads each sample once, epoch 1 starts over
    assert sorted(rows[:64]) == list(range(64)) and len(rows) == 96 and len(set(rows[64:])) == 32
    assert not ch17.same_rows(res, ch17.restart_run("none", steps=ch17.STEPS, seed=1, name="test-ch17-seed1"))


def test_nothing_of_the_lost_node_or_the_job_is_left(lost):
    res, before = lost
    (fault,) = res[0]["faults"]
    # the lost node's processes were orphans once their agent died: not our children, so asked for by pid
    assert not [p for p in fault["pids"] if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert new_children(before) == []
    assert all(port_free(r["store_port"]) for r in res.ranks)


def test_a_lost_node_is_refused_before_launch_where_the_job_could_not_go_on():
    with pytest.raises(ValueError, match="lose a rank of node 1"):
        ch17.lost_node_run(fault_rank=1)  # node 0's agent hosts the rendezvous
    with pytest.raises(InvalidParameter, match="fault_rank=0 is on node 0"):
        cu.run(ch17.WORKER, world_size=4, nnodes=2, min_nodes=1, max_restarts=1, warm=False, fault="node",
               fault_rank=0, ckpt_dir="unused")
    with pytest.raises(InvalidParameter, match="give max_restarts of 1 or more"):
        cu.run(ch17.WORKER, world_size=4, nnodes=2, min_nodes=1, warm=False, ckpt_dir="unused")
    with pytest.raises(InvalidParameter, match="min_nodes=3 must be a whole number from 1 to nnodes=2"):
        cu.run(ch17.WORKER, world_size=4, nnodes=2, min_nodes=3, max_restarts=1, warm=False, ckpt_dir="unused")


def test_a_lost_node_run_announces_the_rendezvous_wait_too():
    class Job:
        start_note, expected_s = "a cold start", 6.0

    said = ch17.announce({"fault": "node", "world_size": 4}, Job())
    assert said.startswith(f"about {2 * 6 + ch17.ELASTIC_WAIT_S:.0f} s in all") and "lost node" in said, said


def test_the_ledger_reads_each_step_from_the_ranks_of_the_attempt_that_made_it(tmp_path):
    """A hand-made journal: four ranks do steps 1-2, a node is lost in step 3, two ranks redo step 2 and do step 3."""
    from workers.resilience.journal import Journal, ledger, read_events

    for rank in range(4):
        j = Journal(str(tmp_path), rank, 0, "r")
        j.write("start", world_size=4, t=0.0)
        for step, (t0, t1) in enumerate([(1.0, 2.0), (2.0, 3.0)], start=1):
            # rank 3 arrives 0.5 s late in step 2 of the first attempt, which the restart throws away
            j.write("step", step=step, loss=1.0, t0=t0, t1=t1, arrive=t0 + 0.1 + 0.5 * (rank == 3 and step == 2),
                    rows=[2 * step + rank], t=t1)
    Journal(str(tmp_path), 2, 0, "r").write("fault", kind="node", step=3, pids=[], t=3.5)
    for rank in range(2):
        k = Journal(str(tmp_path), rank, 1, "r")
        k.write("start", world_size=2, t=10.0)
        k.write("reload", step=1, t0=11.0, t1=11.5, saved_world=4, world_size=2, t=11.5)
        for step, (t0, t1) in zip((2, 3), [(12.0, 13.0), (13.0, 14.0)]):
            k.write("step", step=step, loss=2.0, t0=t0, t1=t1, arrive=t0 + 0.2 + 0.01 * rank, rows=[10 * step + rank],
                    t=t1)
    out = ledger(read_events(str(tmp_path), "r"))
    assert out["world_sizes"] == [4, 2] and out["resumed_from"] == [1] and out["lost_steps"] == [2]
    assert out["rows"] == [[2, 3, 4, 5], [20, 21], [30, 31]]  # step 1: four ranks' rows; 2 and 3: the two left
    assert out["wait_by_step"] == pytest.approx([0.0, 0.01, 0.01]) and out["last_to_arrive"] == [None] * 3
