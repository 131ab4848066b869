"""Chapter 17, quorum and heal, and DiLoCo, with torchft: the specification.

Start here: ``course_utils.ch17_quorum.quorum_run()`` starts a torchft lighthouse in this process, three replica groups
(one torchrun job of one rank each) and trains chapter 08's model in float64 for 12 steps. Replica 2 dies (SIGKILL)
after its forward of step 5; its replacement is launched once the dead job has ended, and the survivors hold before
step 9 until it is up; it heals from a live peer and trains steps 9-12 with them. The reference
(``workers/resilience/replicas.py: reference``) is one process training each step on the batches of the replicas
that took part in it, the gradient averaged over them.

Exact, and why: the replicas of a step all apply the same allreduced gradient to the same weights, and the replacement
receives a peer's weights and AdamW moments as they are, so every process ends with the same bits (``torch.equal``).
The run against the reference: the same float64 operations except the order of the allreduce's sum over three
replicas (gloo's order, the reference's ascending order), a few units in the last place per step: 1e-12 is a
thousand times what that can grow to in 12 AdamW steps, and a replica's batch counted in the wrong step (or the
gradient divided by 3 instead of 2) moves the weights by more than 1e-4. The bytes of DDP and DiLoCo are counts.
The times are measurements; the tests ask of them only what holds on any machine.
"""
import pytest
import torch

import course_utils as cu
from course_utils import ch17_quorum
from course_utils.results import InvalidParameter
from tests import leftovers
from workers.resilience import replicas as rp

# once: processes, restarts, ports and exact equalities within one machine's kernels; the chapter's execution under
# the other kernels (test-other-cpu) runs the same runs and compares their verdicts
pytestmark = [pytest.mark.ranks, pytest.mark.once]

STEPS, KILLED, FAULT_STEP, REJOIN_STEP = 12, 2, 5, 9  # quorum_run's defaults


@pytest.fixture(scope="module")
def healed():
    before = leftovers.children()
    run = ch17_quorum.quorum_run(timeout=150)
    return run, before


@pytest.fixture(scope="module")
def diloco():
    before = leftovers.children()
    return ch17_quorum.diloco_vs_ddp(timeout=150), before


@pytest.mark.timeout(240)
def test_a_killed_replica_leaves_the_quorum_and_its_replacement_heals_back_in(healed):
    run, _ = healed
    everyone, survivors = [0, 1, 2], [0, 1]
    assert run.participation == {k: survivors if FAULT_STEP <= k < REJOIN_STEP else everyone
                                 for k in range(1, STEPS + 1)}
    assert run.quorum_sizes == [3] * 4 + [2] * 4 + [3] * 4
    # step 5 was tried once with all three (the kill broke its allreduce, nobody committed) and again with two
    assert sorted((r["replica"], r["step"], r["participants"]) for r in run.retried) == [(0, 5, 3), (1, 5, 3)]
    # the replacement started at step 0 and healed to step 8 in its first quorum: nothing was loaded from disk
    (heal,) = run.heals
    assert (heal["from_step"], heal["to_step"]) == (0, REJOIN_STEP - 1)
    # what moved: the weights and AdamW's two moments (float64), and AdamW's step counts (one float32 per tensor)
    parameters = run.reference_weights.numel()
    assert heal["bytes"] == 3 * parameters * 8 + 4 * 4
    assert sorted(run.weights) == ["0.0", "1.0", "2.1"]


@pytest.mark.timeout(240)
def test_the_quorum_run_equals_one_process_training_on_the_batches_that_were_there(healed):
    run, _ = healed
    first = run.weights["0.0"]
    assert first.dtype == torch.float64
    assert all(torch.equal(w, first) for w in run.weights.values())  # the healed replacement too, bit for bit
    assert run.replicas_identical
    assert run.weight_error <= 1e-12, run.weight_error
    assert run.loss_error <= 1e-12, run.loss_error
    # the reference is not trivially close: training the dead replica's batches anyway while it was away, or counting
    # them in the step its death broke, both miss by far more than the tolerance
    for wrong in ({k: run.participation[k] if len(run.participation[k]) == 3 else [0, 1, 2] for k in run.participation},
                  {**run.participation, FAULT_STEP: [0, 1, 2]}):
        w, _ = rp.reference(run.cfg, wrong)
        assert (w - first).abs().max().item() > 1e-4


@pytest.mark.timeout(240)
def test_the_timings_of_a_quorum_run_are_measured(healed):
    run, _ = healed
    t = run.timings
    # the survivors waited for the lighthouse to declare the dead replica silent (1 s without a heartbeat)
    assert ch17_quorum.HEARTBEAT_TIMEOUT_MS / 1000 - 0.05 <= t["shrink_s"] <= 30, t
    assert 0 < t["heal_load_s"] <= t["heal_s"] < 30, t
    assert t["replacement_s"] > t["heal_s"] and t["held_s"] > 0, t


@pytest.mark.timeout(240)
def test_nothing_of_a_quorum_run_survives_it(healed):
    run, before = healed
    assert leftovers.new_children(before) == []
    assert leftovers.port_free(run.lighthouse_port)
    assert len(run.job_ports) == 2 * 4  # a store and a Manager server for each of the four replica processes
    assert all(leftovers.port_free(p) for p in run.job_ports), run.job_ports


@pytest.mark.timeout(240)
def test_diloco_sends_one_hth_of_ddps_bytes_and_ends_with_identical_replicas(diloco):
    out, _ = diloco
    P, H = out.parameters, out.sync_every
    # DDP: every step, every gradient once (float64); DiLoCo: every H steps, every pseudo-gradient once
    assert out.bytes["ddp"] == out.steps * P * 8
    assert out.bytes["diloco"] == out.steps // H * P * 8 == out.bytes["ddp"] // H
    assert out.calls["ddp"] == out.steps and out.calls["diloco"] == out.steps // H * 4  # DiLoCo: one per tensor
    for mode in ("ddp", "diloco"):
        first, second = out.weights[mode]
        assert torch.equal(first, second), mode  # the run ends on a synchronisation: both replicas hold the average


@pytest.mark.timeout(240)
def test_diloco_trains_about_as_well_as_ddp(diloco):
    out, _ = diloco
    # Chaotic numbers: the final loss on the whole dataset. Their tolerances come from the spread measured across CPU
    # kernels and seeds (`python -m course_utils.cpu_spread ch17_diloco --variants native,avx2,default --seeds 0-3`,
    # CRITERIA["ch17_diloco"]). Seeds 0-3: DDP 0.457-0.472, DiLoCo 0.428-0.435, from 0.507-0.541 at the start;
    # DiLoCo / DDP 0.943, 0.907, 0.934, 0.927. The same on native (AVX-512) and avx2 (bit for bit) and on default
    # (within 1e-7 relative: the run is float64), so the spread is the seeds'. Worst margins: |DiLoCo / DDP - 1| is at
    # most 0.093 against 0.2 (+53%); DDP ends at most 0.902 of the start, DiLoCo 0.851 (+10%, +15% under 1). The 20%
    # band is kept: 0.2 is over twice the worst deviation, and the claim is only "about as well".
    assert out.eval_loss["ddp"] < out.initial_eval_loss and out.eval_loss["diloco"] < out.initial_eval_loss, out
    assert abs(out.eval_loss["diloco"] / out.eval_loss["ddp"] - 1) <= 0.2, out.eval_loss


@pytest.mark.timeout(240)
def test_nothing_of_the_diloco_runs_survives_them(diloco):
    out, before = diloco
    assert leftovers.new_children(before) == []
    assert all(leftovers.port_free(p) for p in out.lighthouse_ports + out.job_ports)


@pytest.mark.timeout(120)
def test_a_quorum_that_never_forms_ends_the_job_with_its_traceback(tmp_path):
    """A lighthouse that needs two replicas, and one replica: it waits for the quorum no longer than its timeout."""
    before = leftovers.children()
    with ch17_quorum.lighthouse(2) as address:
        with pytest.raises(cu.WorkerFailed) as info:
            cu.run(ch17_quorum.WORKER, 1, warm=False, timeout=60, env=ch17_quorum.QUIET, lighthouse=address,
                   replicas=1, min_replicas=1, run_dir=str(tmp_path), quorum_timeout_s=3.0)
    assert "step 1: the lighthouse formed no quorum within 3 s" in str(info.value)
    assert "start_quorum" in info.value.rank_traceback
    assert leftovers.new_children(before) == [] and leftovers.port_free(ch17_quorum.port_of(address))


# -- refusals and the pieces, without ranks -----------------------------------------------------------------

def test_refusals_name_what_to_change_before_anything_starts():
    before = leftovers.children()
    for change, fragment in [({"rejoin_step": 4}, "rejoin_step=4 must be a whole number from 6 to 12"),
                             ({"fault_step": 13}, "fault_step=13 must be a whole number from 1 to 12"),
                             ({"fault_replica": 3}, "fault_replica=3 must be a whole number from 0 to 2"),
                             ({"min_replicas": 4}, "min_replicas=4 must be a whole number from 1 to 3"),
                             ({"batch": 30}, "batch=30 x replicas=3 rows a step exceed n_samples=64"),
                             ({"learning_rate": 1.0}, "learning_rate: not a setting of this run")]:
        with pytest.raises(InvalidParameter, match=fragment):
            ch17_quorum.quorum_run(**change)
    with pytest.raises(InvalidParameter, match="steps=10 is not a multiple of sync_every=4"):
        ch17_quorum.diloco_vs_ddp(steps=10)
    assert leftovers.new_children(before, within=0) == []


def test_without_torchft_the_learner_gets_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(InvalidParameter, match=r"needs torchft, which is not installed.*make setup") as info:
        ch17_quorum.quorum_run()
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)
    with pytest.raises(InvalidParameter, match="needs torchft"):
        with ch17_quorum.lighthouse(2):
            pass


def test_a_lighthouse_takes_a_free_port_and_gives_it_back():
    with ch17_quorum.lighthouse(2) as first, ch17_quorum.lighthouse(2) as second:
        assert first != second and not leftovers.port_free(ch17_quorum.port_of(first))
    assert leftovers.port_free(ch17_quorum.port_of(first)) and leftovers.port_free(ch17_quorum.port_of(second))


def test_a_steps_batches_are_disjoint_across_replicas_and_keyed_by_step():
    cfg = rp.ReplicaConfig()
    data = rp.make_data(cfg)
    rows = [rp.replica_batch(data, cfg, 7, r)["rows"] for r in range(cfg.replicas)]
    assert len(set(torch.cat(rows).tolist())) == cfg.replicas * cfg.batch  # no row twice in one step
    again = rp.replica_batch(data, cfg, 7, 2)  # a replacement asks for step 7 of replica 2: the same rows and mask
    assert torch.equal(again["rows"], rows[2]) and not torch.equal(rp.replica_batch(data, cfg, 8, 2)["rows"], rows[2])


def test_the_reference_averages_over_the_replicas_present():
    """One step with a single replica present is plain AdamW on its batch; with two, the gradient is their mean."""
    cfg = rp.ReplicaConfig(steps=1)
    data = rp.make_data(cfg)
    model = rp.make_replica_model(cfg)
    optimizer = rp.make_inner_optimizer(model, cfg)
    rp.set_lr(optimizer, cfg, 1)
    grads = []
    for r in (0, 1):
        model.zero_grad(set_to_none=True)
        rp.forward_loss(model, rp.replica_batch(data, cfg, 1, r), 1).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, a, b in zip(model.parameters(), *grads):
        p.grad = (a + b) / 2
    optimizer.step()
    weights, losses = rp.reference(cfg, {1: [1, 0]})
    assert torch.equal(weights, rp.flat_weights(model)) and losses.shape == (1,)


def test_a_survivor_that_gave_up_on_the_replacement_says_what_the_replacement_had_come_to():
    from types import SimpleNamespace

    failed = SimpleNamespace(error=RuntimeError("workers.ch17_quorum: rank 0 raised OSError: no port\n(traceback)"),
                             status="failed")
    assert ch17_quorum._replacement_state(failed, 2) == (
        "replica 2's replacement (incarnation 1) had failed: workers.ch17_quorum: rank 0 raised OSError: no port")
    starting = SimpleNamespace(error=None, status="running")
    assert ch17_quorum._replacement_state(starting, 2) == (
        "replica 2's replacement (incarnation 1) was running when the survivor gave up on it")
