"""The goodput ledger (course_utils/goodput.py): exact against Daly's model and a simulation, and its arithmetic."""
import math

import pytest

from course_utils import goodput as gp
from course_utils.checkpoint_interval import (daly_interval, expected_wall_time, job_mtbf, llama3_job_mtbf,
                                              simulate_wall_time)

HOUR = 3600.0


def test_restart_ledger_is_daly_split_into_shares():
    costs = gp.Costs(step_s=1.0, checkpoint_s=300.0, detect_s=60.0, restart_s=420.0, reload_s=120.0)
    mtbf = 6 * HOUR
    shares = gp.restart_ledger(costs, 3600.0, mtbf)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    wall = float(expected_wall_time(3600.0, 300.0, mtbf, 600.0, 1.0))
    assert shares["productive"] == pytest.approx(1 / wall, rel=1e-12)
    assert shares["checkpoint"] == pytest.approx(300 / 3600 / wall, rel=1e-12)  # one write per tau of kept work
    assert shares["recovery"] == pytest.approx(600 / mtbf, rel=0.1)  # about R per failure, failures every M
    assert shares["degraded"] == shares["heal"] == 0.0
    # first order (Young): checkpoints delta/tau, lost about (tau + delta) / 2 per failure, recovery R per failure
    young_lost = (3600 + 300) / 2 / mtbf
    assert shares["lost"] == pytest.approx(young_lost, rel=0.25)


def test_restart_ledger_matches_a_simulation_of_failures():
    # Daly's model against the course's Monte-Carlo job (the same one chapter 08 draws): 400 jobs of 50 hours' work.
    # The tolerance is 4 standard errors of the simulated mean (seeded, so the check is exact on every machine).
    costs = gp.Costs(step_s=1.0, checkpoint_s=300.0, restart_s=600.0)
    mtbf, tau, solve = 4 * HOUR, 3000.0, 50 * HOUR
    walls = simulate_wall_time(tau, 300.0, mtbf, 600.0, solve, runs=400, seed=1) / solve
    predicted = 1 / gp.restart_ledger(costs, tau, mtbf)["productive"]
    assert abs(walls.mean() - predicted) < 4 * walls.std(ddof=1) / math.sqrt(len(walls))


def test_dalys_interval_maximises_restart_goodput():
    costs = gp.Costs(step_s=1.0, checkpoint_s=120.0, restart_s=300.0)
    mtbf = llama3_job_mtbf()
    best = daly_interval(120.0, mtbf)
    good = {tau: gp.restart_ledger(costs, tau, mtbf)["productive"] for tau in (best / 3, best, 3 * best)}
    assert good[best] > good[best / 3] and good[best] > good[3 * best]


def test_llama3_rate_and_its_published_effective_training_time():
    # 419 interruptions in 54 days on 16,384 GPUs: one every 3.1 hours for the job
    assert job_mtbf(gp.LLAMA3_GPU_MTBF_S, 16_384) == pytest.approx(54 * 24 * HOUR / 419)
    assert job_mtbf(gp.LLAMA3_GPU_MTBF_S, 16_384) / HOUR == pytest.approx(3.09, abs=0.01)
    # Llama 3 reports "higher than 90% effective training time". The paper prints neither its checkpoint stall nor its
    # recovery time: with a 20 s stall (an asynchronous save) and 3 minutes to detect, restart and reload, at Daly's
    # interval, the model agrees; a one-minute stall leaves it below 90%, an hour-long restart below 80%. The
    # published figure says how cheap both must have been.
    mtbf = job_mtbf(gp.LLAMA3_GPU_MTBF_S, 16_384)
    fast = gp.Costs(step_s=6.0, checkpoint_s=20.0, detect_s=30.0, restart_s=120.0, reload_s=30.0)
    assert gp.restart_ledger(fast, daly_interval(20.0, mtbf), mtbf)["productive"] > 0.9
    minute = gp.Costs(step_s=6.0, checkpoint_s=60.0, detect_s=30.0, restart_s=120.0, reload_s=30.0)
    assert gp.restart_ledger(minute, daly_interval(60.0, mtbf), mtbf)["productive"] < 0.9
    slow = gp.Costs(step_s=6.0, checkpoint_s=20.0, restart_s=HOUR)
    assert gp.restart_ledger(slow, daly_interval(20.0, mtbf), mtbf)["productive"] < 0.8


def test_quorum_ledger_shares_and_when_it_beats_a_restart():
    costs = gp.Costs(step_s=6.0, checkpoint_s=60.0, detect_s=60.0, restart_s=600.0, reload_s=60.0, heal_s=30.0,
                     reconfigure_s=5.0)
    mtbf = job_mtbf(gp.LLAMA3_GPU_MTBF_S, 16_384)
    q = gp.quorum_ledger(costs, 4 * HOUR, mtbf, groups=8)
    assert sum(q.values()) == pytest.approx(1.0, abs=1e-12)
    assert q["lost"] == pytest.approx(6.0 / mtbf) and q["recovery"] == pytest.approx(5.0 / mtbf)
    assert q["degraded"] == pytest.approx(720.0 / mtbf / 8) and q["heal"] == pytest.approx(30.0 / mtbf / 8)
    r = gp.restart_ledger(costs, daly_interval(60.0, mtbf), mtbf)
    assert q["productive"] > r["productive"]  # no rollback, and only one group in eight away
    # more groups: each failure takes a smaller share of the capacity away
    assert gp.quorum_ledger(costs, 4 * HOUR, mtbf, groups=64)["degraded"] < q["degraded"]
    with pytest.raises(ValueError, match="groups=1"):
        gp.quorum_ledger(costs, 4 * HOUR, mtbf, groups=1)


def test_timeline_ledger_counts_a_rollback_as_lost_work():
    t = gp.timeline_ledger([("work", 4.0), ("checkpoint", 1.0), ("work", 3.0), ("rollback", 3.0),
                            ("recovery", 2.0), ("work", 3.0), ("work", 1.0), ("checkpoint", 1.0)])
    assert t["productive"] == 8.0 and t["lost"] == 3.0 and t["checkpoint"] == 2.0 and t["recovery"] == 2.0
    assert t["goodput"] == pytest.approx(8 / 15)
    with pytest.raises(ValueError, match="undoes more than"):
        gp.timeline_ledger([("work", 2.0), ("checkpoint", 1.0), ("work", 1.0), ("rollback", 2.0)])
    with pytest.raises(ValueError, match="is not a share"):
        gp.timeline_ledger([("idle", 1.0)])


def test_predict_run_rolls_back_to_the_last_checkpoint():
    costs = gp.Costs(step_s=0.5, checkpoint_s=0.25, detect_s=0.5, restart_s=5.0, reload_s=0.5)
    p = gp.predict_run(costs, steps=10, every=4, fail_at=[7])
    # steps 4, 5, 6 were done after the checkpoint at 4 and are redone; checkpoints after 4 and 8
    assert p["lost"] == pytest.approx(3 * 0.5) and p["productive"] == pytest.approx(10 * 0.5)
    assert p["checkpoint"] == pytest.approx(2 * 0.25) and p["recovery"] == pytest.approx(6.0)
    right_after = gp.predict_run(costs, steps=10, every=4, fail_at=[8])
    assert right_after["lost"] == 0.0  # nothing since the checkpoint to lose


def test_predict_run_prices_a_straggler_as_its_stalls():
    # the model's assumption: the stall dominates, so every other rank waits the whole sleep, less nothing
    costs = gp.Costs(step_s=0.5, checkpoint_s=0.25)
    p = gp.predict_run(costs, steps=12, every=4, fail_at=[], stalls={4: 0.25, 5: 0.25, 6: 0.25})
    assert p["waiting"] == 0.75 and p["productive"] == 6.0 and p["lost"] == 0.0 and p["recovery"] == 0.0
    assert p["goodput"] == 6.0 / (6.0 + 0.75 + 3 * 0.25)  # waiting is wall time the steps did not train in
    assert gp.predict_run(costs, steps=12, every=4, fail_at=[])["waiting"] == 0.0
    # a stalled step done twice (a fault in step 7 rolls back to the checkpoint after step 4) waits twice
    twice = gp.predict_run(costs, steps=12, every=4, fail_at=[7], stalls={5: 0.25})
    assert twice["waiting"] == 0.5 and twice["lost"] == 3 * 0.5


@pytest.mark.parametrize("kwargs, fragment", [
    ({"step_s": 0.0, "checkpoint_s": 1.0}, "step_s=0.0"),
    ({"step_s": 1.0, "checkpoint_s": -1.0}, "checkpoint_s=-1.0"),
    ({"step_s": 1.0, "checkpoint_s": 1.0, "restart_s": float("nan")}, "restart_s=nan"),
])
def test_costs_refuse_impossible_times(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        gp.Costs(**kwargs)
