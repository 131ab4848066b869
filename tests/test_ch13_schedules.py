"""Chapter 13's schedules as data (no ranks): what GPipe and 1F1B must be, checked by hand and by simulation.

A schedule is one list of ("F", i) / ("B", i) per stage. It is valid when each micro-batch is forwarded and
backwarded exactly once per stage, every F before its B, and the stages can run their lists in order with
F(i) on stage s after F(i) on s-1 and B(i) on s after B(i) on s+1 (``simulate`` finds no deadlock).
"""
import random

import pytest

from course_utils.ledger import pipeline_bubble_fraction
from workers.pipeline.model import partition_table
from workers.pipeline.schedules import (all_stages, ideal_bubble, interleaved_order,
                                        interleaved_schedule, num_warmup_interleaved, num_warmup_microbatches,
                                        one_f_one_b_schedule, peak_stash, simulate, validate, with_p2p)

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 3), (4, 1), (4, 2), (4, 8), (8, 16)]


def test_one_f_one_b_by_hand():
    # Narayanan et al. 2021 Figure 4 (p=4, m=8), stage 0: 3 warm-up forwards, then F/B pairs, then 3 backwards.
    got = one_f_one_b_schedule(4, 8, 0)
    assert got[:4] == [("F", 0), ("F", 1), ("F", 2), ("F", 3)] and got[4] == ("B", 0)
    assert got[-3:] == [("B", 5), ("B", 6), ("B", 7)]
    assert one_f_one_b_schedule(4, 8, 3)[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]  # last stage: no warm-up
    assert [num_warmup_microbatches(4, 8, s) for s in range(4)] == [3, 2, 1, 0]
    assert num_warmup_microbatches(4, 2, 0) == 2  # never more warm-up forwards than micro-batches


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", SHAPES)
def test_schedules_are_valid_and_run_to_the_end(name, p, m):
    schedules = all_stages(name, p, m)
    assert validate(schedules, m) is None
    for actions in schedules:  # each micro-batch once forward, once backward, F before B
        assert sorted(i for k, i in actions if k == "F") == list(range(m))
        assert sorted(i for k, i in actions if k == "B") == list(range(m))
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))


@pytest.mark.parametrize("p, m", SHAPES)
def test_memory_bound_gpipe_m_and_1f1b_p_minus_stage(p, m):
    # GPipe keeps every micro-batch until the turn; 1F1B never more than its warm-up + 1 = p - stage.
    assert [peak_stash(a) for a in all_stages("gpipe", p, m)] == [m] * p
    assert [peak_stash(a) for a in all_stages("1f1b", p, m)] == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", SHAPES)
def test_ideal_bubble_is_the_formula_for_both(name, p, m):
    # With t_B = 2 t_F and free messages, both schedules idle (p-1)(t_F + t_B) per rank: 1F1B saves memory,
    # not time. The ledger's "total" convention is exactly that share of the step.
    assert ideal_bubble(all_stages(name, p, m)) == pytest.approx(pipeline_bubble_fraction(p, m, denominator="total"))
    assert simulate(all_stages(name, p, m))["makespan"] == pytest.approx((m + p - 1) * 3.0)


def test_validator_names_each_mistake():
    assert "B(0) comes before F(0)" in validate([[("B", 0), ("F", 0)]], 1)
    assert "exactly one F" in validate([[("F", 0), ("F", 0), ("B", 0)]], 1)
    # Last stage doing both forwards before any backward while stage 0 waits for B(0) first is fine, but a
    # stage 1 that wants B(1) before stage 0 can send F(1) after B(0) deadlocks:
    dead = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 1), ("B", 0)]]
    assert "wait on each other" in validate(dead, 2)


def test_p2p_actions_surround_compute():
    assert with_p2p([("F", 0), ("B", 0)], 3, 1) == [("recv_forward", 0), ("F", 0), ("send_forward", 0),
                                                   ("recv_backward", 0), ("B", 0), ("send_backward", 0)]
    assert with_p2p([("F", 0), ("B", 0)], 1, 0) == [("F", 0), ("B", 0)]  # one stage: no messages


def test_partition_table_is_contiguous_and_rejects_uneven_splits():
    assert partition_table(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError):
        partition_table(6, 4)


# --- interleaved 1F1B (Narayanan et al. 2021 section 2.2.2): v model chunks per rank -------------------------

INTERLEAVED = [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 16, 2), (2, 8, 4), (8, 16, 2)]


def test_interleaved_order_by_hand():
    # p = 2, v = 2: micro-batches in groups of p, each group through chunk 0 then chunk 1; backwards last chunk first
    assert interleaved_order(2, 4, 2, forward=True) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert interleaved_order(2, 4, 2, forward=False) == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # Megatron's warm-up, (p - s - 1) * 2 + (v - 1) * p, capped at m * v
    assert [num_warmup_interleaved(4, 8, s, 2) for s in range(4)] == [10, 8, 6, 4]
    assert num_warmup_interleaved(4, 12, 0, 4) == 18
    assert [num_warmup_interleaved(4, 4, s, 2) for s in range(4)] == [8] * 4  # m == p: all forwards first
    assert interleaved_schedule(2, 2, 1, 2)[:3] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1)]


@pytest.mark.parametrize("p, m, v", INTERLEAVED)
def test_interleaved_is_valid_and_its_bubble_is_the_formula_divided_by_v(p, m, v):
    schedules = all_stages("interleaved", p, m, v)
    assert validate(schedules, m) is None
    # (p-1)/(v m + p - 1) of the step, exactly; the step is (m + (p-1)/v) (t_F + t_B)
    assert ideal_bubble(schedules) == pytest.approx(pipeline_bubble_fraction(p, m, v, denominator="total"))
    assert simulate(schedules)["makespan"] == pytest.approx((m + (p - 1) / v) * 3.0)
    # what is in flight: the warm-up's chunk-forwards plus one, p + (p-1)/v micro-batches' worth on rank 0
    if m == p:  # one group: Megatron runs every forward first (all_warmup_microbatches)
        assert [peak_stash(a) for a in schedules] == [m * v] * p
    else:
        assert [peak_stash(a) for a in schedules] == [min(2 * (p - s - 1) + (v - 1) * p + 1, m * v) for s in range(p)]


def test_interleaved_needs_m_a_multiple_of_p():
    with pytest.raises(ValueError, match="not a multiple of the 4 stages"):
        interleaved_schedule(4, 6, 0, 2)


def test_interleaved_messages_wrap_round_the_ranks():
    # rank 0's chunk 1 is virtual stage p: it receives from rank p-1's chunk 0 and sends its gradient back there
    assert with_p2p([("F", 0, 1), ("B", 0, 1)], 4, 0, 2) == [
        ("recv_forward", 0, 1), ("F", 0, 1), ("send_forward", 0, 1),
        ("recv_backward", 0, 1), ("B", 0, 1), ("send_backward", 0, 1)]
    # virtual stage 0 has no predecessor; the last (rank p-1, chunk v-1) no successor
    assert with_p2p([("F", 0, 0), ("B", 0, 0)], 4, 0, 2) == [("F", 0, 0), ("send_forward", 0, 0),
                                                           ("recv_backward", 0, 0), ("B", 0, 0)]
    assert with_p2p([("F", 0, 1), ("B", 0, 1)], 4, 3, 2) == [("recv_forward", 0, 1), ("F", 0, 1),
                                                           ("B", 0, 1), ("send_backward", 0, 1)]


def test_validator_names_a_missing_chunk():
    schedules = all_stages("interleaved", 2, 2, 2)
    schedules[1] = [a for a in schedules[1] if a[2] == 0]  # stage 1 forgot its second chunk
    assert "needs exactly one F per chunk" in validate(schedules, 2)


def test_message_latency_costs_interleaving_more():
    # every dependency between ranks waits message_time; interleaving has v times as many on its critical path
    plain, inter = all_stages("1f1b", 4, 8), all_stages("interleaved", 4, 8, 4)
    assert ideal_bubble(inter, message_time=0.0) < ideal_bubble(plain, message_time=0.0)
    extra_plain = ideal_bubble(plain, message_time=0.2) - ideal_bubble(plain)
    extra_inter = ideal_bubble(inter, message_time=0.2) - ideal_bubble(inter)
    assert extra_inter > 2 * extra_plain > 0
    # one stage sends nothing: latency changes nothing
    assert ideal_bubble(all_stages("1f1b", 1, 4), message_time=5.0) == 0.0


def _fake_p2p(monkeypatch) -> list:
    """Replace ``dist.isend`` / ``dist.irecv`` as ``pipeline/p2p.py`` calls them with recorders: the list they fill,
    ``(kind "send" | "recv", peer rank, tag, group)`` per call; each returns work that is already done."""
    from workers.pipeline import p2p as p2p_mod

    calls = []

    class Work:
        def wait(self):
            return True

    def isend(buf, dst, tag, group=None):
        calls.append(("send", dst, tag, group))
        return Work()

    def irecv(buf, src, tag, group=None):
        calls.append(("recv", src, tag, group))
        return Work()

    monkeypatch.setattr(p2p_mod.dist, "isend", isend)
    monkeypatch.setattr(p2p_mod.dist, "irecv", irecv)
    return calls


def test_receives_are_posted_ahead_once_each_and_a_posted_receive_left_unused_is_an_error(monkeypatch):
    # P2P.post_receives posts irecvs before the step; recv_* then waits on the posted one (no second irecv), a key
    # posted twice is refused, and finish() refuses a receive posted for a message the schedule never waited for
    import torch

    from workers.pipeline import p2p as p2p_mod
    from workers.pipeline.executor import receives
    from workers.pipeline.schedules import with_p2p

    calls = _fake_p2p(monkeypatch)

    def posted():
        return [(peer, tag) for kind, peer, tag, _ in calls if kind == "recv"]

    link = p2p_mod.P2P(0, 2, (4, 16), torch.device("cpu"), torch.device("cpu"))
    link.post_receives([("recv_forward", 3), ("recv_backward", 3)])
    assert posted() == [(0, p2p_mod.tag(p2p_mod.FORWARD_TAG, 3)), (2, p2p_mod.tag(p2p_mod.BACKWARD_TAG, 3))]
    with pytest.raises(ValueError, match="posted twice"):
        link.post_receives([("recv_forward", 3)])
    link.recv_forward(3)
    link.recv_backward(3)
    assert len(posted()) == 2 and link.posted_ahead == link.received == {"forward": 1, "backward": 1}
    link.recv_forward(4)  # not posted ahead: posted now, and counted as such
    assert len(posted()) == 3 and link.posted_ahead["forward"] == 1 and link.received["forward"] == 2
    link.post_receives([("recv_backward", 5)])
    with pytest.raises(RuntimeError, match="never waited for"):
        link.finish()
    # the executor's list: a middle stage of 1F1B (p = 4, m = 3) receives each micro-batch's input and gradient
    steps = list(with_p2p([("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)], 4, 1, 1))
    got = receives(steps, lambda c: 1, 3)
    assert sorted(got) == sorted([(0, "recv_forward", i) for i in range(3)] + [(0, "recv_backward", 3 + i)
                                                                            for i in range(3)])


def test_with_links_a_message_up_the_ranks_and_one_down_travel_on_different_groups(monkeypatch):
    # gloo polls while a rank holds a pair's lock to send (workers/pipeline/p2p.py): with links = (up, down), rank 1
    # of a ring of 3 sends forward to 2 on "up", backward to 0 on "down", receives from 0 on "up" and from 2 on
    # "down"; rank 2's forward round the ring to 0 goes down. Without links everything is the default group (None).
    import torch

    from workers.pipeline import p2p as p2p_mod

    calls = _fake_p2p(monkeypatch)
    cpu = torch.device("cpu")
    link = p2p_mod.P2P(0, 2, (4, 16), cpu, cpu, links=("UP", "DOWN"))
    link.rank = 1  # as on rank 1 of the world (no process group here)
    link.post_receives([("recv_forward", 0), ("recv_backward", 0)])
    link.send_forward(torch.ones(4, 16), 1)
    link.send_backward(torch.ones(4, 16), 0)
    assert [(kind, peer, group) for kind, peer, _, group in calls] == [
        ("recv", 0, "UP"), ("recv", 2, "DOWN"), ("send", 2, "UP"), ("send", 0, "DOWN")]
    assert link.sent_on == {"up": 1, "down": 1, "default": 0}
    last = p2p_mod.P2P(1, 0, (4, 16), cpu, cpu, links=("UP", "DOWN"))  # rank 2: its next stage is rank 0, round
    last.rank = 2
    last.send_forward(torch.ones(4, 16), 2)
    assert calls[-1] == ("send", 0, p2p_mod.tag(p2p_mod.FORWARD_TAG, 2), "DOWN") and last.sent_on["down"] == 1
    plain = p2p_mod.P2P(0, 2, (4, 16), cpu, cpu)
    plain.rank = 1
    plain.send_forward(torch.ones(4, 16), 3)
    assert calls[-1] == ("send", 2, p2p_mod.tag(p2p_mod.FORWARD_TAG, 3), None)
    assert plain.sent_on == {"up": 0, "down": 0, "default": 1}


def _relaxed_ends(rows, f, b, w, message, placement="loop"):
    """Every action's end by brute force, independent of ``simulate``'s order: start each action at the latest of its
    rank's previous end and its dependency's end (plus ``message`` when it crossed ranks), sweeping every action
    until nothing moves (a longest path)."""
    from workers.pipeline.zero_bubble import placed_stage, rank_of, virtual_count

    p, chunks = len(rows), 1 + max((a[2] if len(a) > 2 else 0) for row in rows for a in row)
    last = virtual_count(p, chunks, placement) - 1
    split = any(a[0] == "W" for row in rows for a in row)
    took = {"F": f, "B": [x + (0 if split else y) for x, y in zip(b, w)], "W": w}
    end: dict = {}
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(rows):
            prev = 0.0
            for a in row:
                kind, i, c = a[0], a[1], a[2] if len(a) > 2 else 0
                vs = placed_stage(r, c, p, placement)
                dep = {"F": ("F", vs - 1, i) if vs else None, "W": ("B", vs, i),
                       "B": ("F", vs, i) if vs == last else ("B", vs + 1, i)}[kind]
                start = prev
                if dep is not None:
                    lag = message if rank_of(dep[1], p, placement)[0] != r else 0.0
                    start = max(start, end.get(dep, 0.0) + lag)
                new = start + took[kind][vs]
                if end.get((kind, vs, i)) != new:
                    end[(kind, vs, i)], moved = new, True
                prev = new
    return end


def test_one_compiled_plan_prices_any_times_as_a_brute_force_longest_path_does():
    # The planner compiles each table once (schedules.Plan) and prices it at every GEMM share it tries: the order a
    # plan runs its units in must not depend on the times. Held to a longest path found by sweeping to a fixed
    # point, for 1F1B, interleaved and a split-backward V table, each plan run at three sets of uneven stage times.
    from workers.pipeline.schedules import Plan
    from workers.pipeline.zero_bubble import split_stages

    rng = random.Random(3)
    for rows, placement in ((all_stages("1f1b", 4, 9), "loop"), (all_stages("interleaved", 3, 6, 2), "loop"),
                            (split_stages("zb-v", 3, 6), "v")):
        plan = Plan(rows, placement)
        stages = plan.last + 1
        for message in (0.0, 0.4, 0.05):
            f, b, w = ([rng.uniform(0.2, 2.0) for _ in range(stages)] for _ in range(3))
            got = plan.run(f, b, message, weight_time=w)
            ends = _relaxed_ends(rows, f, b, w, message, placement)
            assert got["makespan"] == pytest.approx(max(ends.values()), rel=1e-12)
            assert plan.run(f, b, message, weight_time=w, boxes=False)["makespan"] == got["makespan"]
            assert sorted(e["end"] for line in got["timeline"] for e in line) == pytest.approx(sorted(ends.values()),
                                                                                             rel=1e-12)
