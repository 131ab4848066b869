"""Chapter 08, checkpointing: the specification of a checkpoint that resumes bit for bit and survives a crash.

Bitwise means ``torch.equal``, never ``allclose``: a resumed run executes the same fp32 operations on the same
bits in the same order as the straight run, so any difference at all means some state was lost. Each
experiment also runs with a part left out and must then differ, from the step the lost part first acts on:
a test that passed with the feature removed would prove nothing.

Rank tests run on gloo/CPU. Where a new process is the point (resume, crash), ``warm=False`` starts fresh
ranks; elsewhere warm ranks keep the file fast.
"""
import io
import os
import random

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import course_utils as cu
from course_utils.ch08_checkpoint import (ckpt_async_times, ckpt_compare, ckpt_dcp_compare, ckpt_draw_scaler,
                               ckpt_first_difference, ckpt_scale_table, ckpt_scan_table)
from course_utils.exercises import FAIL, PASS, TODO, check
from workers.checkpointing import atomic
from workers.checkpointing.sampler import ShuffledSampler
from workers.checkpointing.state import capture_training_state, restore_training_state, rng_state, set_rng_state
from workers.checkpointing.training import (RunConfig, flat_params, make_dataset, make_model, make_optimizer,
                                            make_sampler, make_scaler, make_scheduler, next_batch, rank_seed,
                                            seed_rngs, train_step)

RUN = {"timeout": 90}
STEPS, SAVE_AT = 12, 5  # the worker's defaults: 8 steps per epoch, so the resumed part crosses an epoch boundary


# -- single-process reference -----------------------------------------------------------------------------

def _objects(cfg, init_seed=None):
    model = make_model(cfg, seed=init_seed)
    optimizer = make_optimizer(model, cfg)
    return {"model": model, "optimizer": optimizer, "scheduler": make_scheduler(optimizer, cfg),
            "sampler": make_sampler(cfg)}


def _train(objs, cfg, first, last):
    data, losses = make_dataset(cfg), []
    for _ in range(first, last + 1):
        losses.append(train_step(objs["model"], objs["optimizer"], objs["scheduler"],
                                 next_batch(data, objs["sampler"], cfg, "cpu")).item())
    return torch.tensor(losses), flat_params(objs["model"])


def single_process(cfg=RunConfig(total_steps=STEPS), omit=()):
    """Straight, and k steps + torch.save/torch.load into fresh objects (other init, other RNG) + the rest."""
    seed_rngs(rank_seed(cfg, 0))
    straight = _train(_objects(cfg), cfg, 1, STEPS)
    seed_rngs(rank_seed(cfg, 0))
    objs = _objects(cfg)
    head, _ = _train(objs, cfg, 1, SAVE_AT)
    torch.save(capture_training_state(**objs, step=SAVE_AT, omit=omit), buf := io.BytesIO())
    seed_rngs(rank_seed(cfg, 0))  # a fresh process seeds like the first one did
    fresh = _objects(cfg, init_seed=cfg.seed + 1)
    restore_training_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), **fresh)
    tail, weights = _train(fresh, cfg, SAVE_AT + 1, STEPS)
    return straight, (torch.cat([head, tail]), weights)


@pytest.fixture(scope="module")
def reference():
    return single_process()


def test_single_process_resume_is_bitwise_and_needs_the_rng(one_thread, reference):
    (losses, weights), (resumed_losses, resumed_weights) = reference
    assert torch.equal(resumed_losses, losses) and torch.equal(resumed_weights, weights)
    # Without the RNG the fresh process replays the masks of step 1 at step 6: the very first resumed loss moves.
    (losses, _), (no_rng, _) = single_process(omit=("rng",))
    assert ckpt_first_difference(no_rng, losses) == SAVE_AT


def test_sampler_position_resumes_mid_epoch_and_ignores_the_global_rng():
    a = ShuffledSampler(24, 8, seed=3)
    straight = [a.next_indices() for _ in range(7)]  # 3 steps per epoch: crosses two epoch boundaries
    b = ShuffledSampler(24, 8, seed=3)
    head = [b.next_indices() for _ in range(4)]
    c = ShuffledSampler(24, 8, seed=3)
    torch.manual_seed(1234)  # the order must not depend on the global RNG (dropout draws from it)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(head + [c.next_indices() for _ in range(3)], straight))
    assert not torch.equal(straight[0], straight[3])  # epoch 1 is reshuffled, not a repeat of epoch 0
    # at world 2 the ranks read the two halves of the same global batch: together every row once
    halves = [ShuffledSampler(24, 8, seed=3, rank=r, world_size=2).next_indices() for r in (0, 1)]
    assert torch.equal(torch.cat(halves), straight[0])
    with pytest.raises(ValueError, match="seed"):
        ShuffledSampler(24, 8, seed=4).load_state_dict(b.state_dict())


def test_the_scaler_is_captured_omittable_and_restored(one_thread):
    cfg = RunConfig(precision="fp16")
    seed_rngs(rank_seed(cfg, 0))
    objs = _objects(cfg)
    scaler = make_scaler(cfg)
    data = make_dataset(cfg)
    for _ in range(3):  # growth_interval=2: the scale has doubled once, one good step counted since
        train_step(objs["model"], objs["optimizer"], objs["scheduler"], next_batch(data, objs["sampler"], cfg, "cpu"),
                   scaler)
    state = capture_training_state(**objs, scaler=scaler)
    assert (state["scaler"]["scale"], state["scaler"]["_growth_tracker"]) == (2 * cfg.init_scale, 1)
    assert "scaler" not in capture_training_state(**objs, scaler=scaler, omit=("scaler",))
    torch.save(state, buf := io.BytesIO())  # python numbers only: loads with weights_only=True
    fresh = make_scaler(cfg)
    info = restore_training_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), **_objects(cfg),
                                  scaler=fresh)
    assert "scaler" in info["restored"] and fresh.state_dict() == scaler.state_dict()
    assert make_scaler(RunConfig()) is None  # fp32: nothing to scale, nothing to save


def test_rng_state_restores_every_stream_and_loads_with_weights_only():
    seed_rngs(5)
    torch.save(rng_state(), buf := io.BytesIO())  # numpy's tuple would need weights_only=False; ours does not
    want = (random.random(), np.random.rand(), torch.rand(3))
    seed_rngs(99)
    set_rng_state(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])


# -- atomic writes, single process --------------------------------------------------------------------------

def test_atomic_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    atomic.atomic_torch_save({"step": 1}, path)

    def half_then_crash(f):
        f.write(b"x" * 1000)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic.atomic_write(path, half_then_crash)
    assert torch.load(path)["step"] == 1  # the old checkpoint, whole
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # an exception (unlike a kill) cleans its temporary up


def test_loader_takes_the_newest_complete_checkpoint_and_says_why_it_skipped_others(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        atomic.save_checkpoint(root, step, {"model.pt": {"step": step, "w": torch.randn(100)}})
    assert atomic.latest_valid(root)["step"] == 3
    # damage after the commit: same size, one byte flipped -> only the hash notices
    victim = os.path.join(root, "step_00000003", "model.pt")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    found = atomic.latest_valid(root)
    assert found["step"] == 2 and "sha256" in found["skipped"][0]["reason"]
    # a truncated file -> the size disagrees with the manifest
    with open(os.path.join(root, "step_00000002", "model.pt"), "r+b") as f:
        f.truncate(10)
    found = atomic.latest_valid(root)
    assert found["step"] == 1 and "manifest says" in found["skipped"][1]["reason"]
    # a directory named like a checkpoint without a manifest, and a staging directory, are never chosen
    os.makedirs(os.path.join(root, "step_00000009"))
    torch.save({"step": 9}, os.path.join(root, "step_00000009", "model.pt"))
    os.makedirs(atomic.staging_path(root, 10))
    found = atomic.latest_valid(root)
    assert found["step"] == 1 and found["skipped"][0] == {
        "name": "step_00000009",
        "reason": "no MANIFEST.json: not committed by the atomic writer, so it cannot be trusted"}


# -- bitwise resume on ranks --------------------------------------------------------------------------------

@pytest.mark.ranks
@pytest.mark.parametrize("world", [1, 2])
def test_resume_in_a_new_process_is_bit_identical(world, tmp_path, reference):
    straight = cu.run("workers.ch08_resume", world_size=world, mode="straight", **RUN)
    saved = cu.run("workers.ch08_resume", world_size=world, mode="save", ckpt_dir=str(tmp_path), **RUN)
    resumed = cu.run("workers.ch08_resume", world_size=world, mode="resume", ckpt_dir=str(tmp_path), warm=False, **RUN)
    c = ckpt_compare(straight, saved, resumed)
    assert c["new_process"]  # the resumed ranks are other processes: nothing survived in memory
    assert resumed[0]["resumed_from"] == SAVE_AT and resumed[0]["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
    assert set(resumed[0]["restored"]) == {"model", "optimizer", "scheduler", "sampler", "rng"}
    # Same bits in, same operations, same order: every loss and every weight after every step, on every rank.
    assert c["bitwise"], c["ranks"]
    if world == 1:
        # one CPU rank under DDP is the single-process loop, bit for bit (DDP divides by a world size of 1)
        assert torch.equal(straight[0]["losses"], reference[0][0])
        assert torch.equal(straight[0]["weights"][-1], reference[0][1])
    else:
        # each rank drew its own dropout masks and noise (and read its own rows): their local losses differ
        assert not torch.equal(straight[0]["local_losses"], straight[1]["local_losses"])


# The first step whose weights and whose loss differ when a part is lost (the loss of step s is computed from the
# weights after step s-1, so it shows a wrong update one step later). rng: the first resumed forward draws other
# dropout masks; sampler: it reads other rows; both change the loss of step k+1 itself. optimizer: zero moments
# and a fresh bias correction (and the lr a fresh scheduler put in the fresh optimizer) change the update of step
# k+1. scheduler: the optimizer's state carries the lr of step k+1, so that update is right; the fresh scheduler's
# first step then sets the warmup's lr back, and the update of step k+2 is wrong.
DROPPED = {"rng": (SAVE_AT + 1, SAVE_AT + 1), "sampler": (SAVE_AT + 1, SAVE_AT + 1),
           "optimizer": (SAVE_AT + 1, SAVE_AT + 2), "scheduler": (SAVE_AT + 2, SAVE_AT + 3)}


@pytest.mark.ranks
@pytest.mark.parametrize("part", list(DROPPED))
def test_dropping_a_part_splits_the_curves_from_the_step_it_acts_on(part, tmp_path):
    straight = cu.run("workers.ch08_resume", world_size=2, mode="straight", **RUN)
    saved = cu.run("workers.ch08_resume", world_size=2, mode="save", ckpt_dir=str(tmp_path), omit=part, **RUN)
    resumed = cu.run("workers.ch08_resume", world_size=2, mode="resume", ckpt_dir=str(tmp_path), **RUN)
    assert part not in saved[0]["saved_parts"] and part not in resumed[0]["restored"]
    c = ckpt_compare(straight, saved, resumed)
    assert not c["bitwise"]
    for r in c["ranks"]:
        assert (r["first_weight_diff_step"], r["first_loss_diff_step"]) == DROPPED[part], (part, r)
        assert r["max_loss_diff"] > 1e-4  # a real split, not rounding


# fp16 + GradScaler(growth_interval=2): the scale doubles until the fp16 backward overflows. Saved after step 5, the
# scaler holds a scale other than a fresh one's 65536; without it the resumed run skips other steps. Which steps
# overflow depends on this CPU's fp16 rounding and on each rank's batch (it differs with the world size), so the
# test does not pin them: it checks the rule that places the split, on the skips the runs measured (every CPU
# kernel and seed measured had one: python -m course_utils.cpu_spread ch08_fp16_resume).


@pytest.mark.ranks
@pytest.mark.parametrize("world", [1, 2])
def test_fp16_resume_needs_the_scaler_and_a_fresh_one_skips_other_steps(world, tmp_path):
    fp16 = {"precision": "fp16", **RUN}
    straight = cu.run("workers.ch08_resume", world_size=world, mode="straight", **fp16)
    s = straight[0]
    # real overflows happened (not injected): those steps left every weight alone, on every rank alike
    skips = [i for i, k in enumerate(s["skipped"]) if k]
    assert skips and all(torch.equal(s["weights"][i], s["weights"][i - 1]) for i in skips if i > 0)
    assert all(straight[r]["skipped"] == s["skipped"] for r in range(world))

    saved = cu.run("workers.ch08_resume", world_size=world, mode="save", ckpt_dir=str(tmp_path / "full"), **fp16)
    resumed = cu.run("workers.ch08_resume", world_size=world, mode="resume", ckpt_dir=str(tmp_path / "full"),
                     warm=False, **fp16)
    assert "scaler" in saved[0]["saved_parts"] and "scaler" in resumed[0]["restored"]
    assert resumed[0]["scales"] == s["scales"][SAVE_AT:] and resumed[0]["skipped"] == s["skipped"][SAVE_AT:]
    assert ckpt_compare(straight, saved, resumed)["bitwise"]

    saved = cu.run("workers.ch08_resume", world_size=world, mode="save", ckpt_dir=str(tmp_path / "no_scaler"),
                   omit="scaler", **fp16)
    resumed = cu.run("workers.ch08_resume", world_size=world, mode="resume", ckpt_dir=str(tmp_path / "no_scaler"),
                     **fp16)
    assert "scaler" not in saved[0]["saved_parts"] and "scaler" not in resumed[0]["restored"]
    r = resumed[0]
    assert r["scales"][0] == RunConfig().init_scale == 65536.0 != s["scales"][SAVE_AT]  # a fresh scaler's scale
    # A power-of-two scale cancels exactly: the weights split at the first step one run skips and the other does
    # not, not at the first step whose scale differs; the loss follows one step later (a step's loss is computed
    # before its update).
    tail = list(zip(s["skipped"][SAVE_AT:], r["skipped"]))
    split = SAVE_AT + 1 + next(i for i, (a, b) in enumerate(tail) if a != b)
    c = ckpt_compare(straight, saved, resumed)
    for rank in c["ranks"]:
        assert (rank["first_weight_diff_step"], rank["first_loss_diff_step"]) == (split, split + 1), rank
        assert rank["max_loss_diff"] > 1e-4
    # ... and every resumed step before the split (if any) ran at another scale with bit-identical weights
    # (resumed record i is step SAVE_AT + 1 + i, the straight run's record SAVE_AT + i)
    assert all(torch.equal(r["weights"][i], s["weights"][SAVE_AT + i]) for i in range(split - SAVE_AT - 1))
    assert not torch.equal(r["weights"][split - SAVE_AT - 1], s["weights"][split - 1])
    # the notebook's table and figure say the same: the saved scale, and which resumed steps left the straight run
    table = ckpt_scale_table(straight, {"without scaler": (saved, resumed)}, SAVE_AT)
    assert f"the scaler holds scale {s['scales'][SAVE_AT]:.0f}" in table
    rows = {int(line.split("|")[0]): line for line in table.splitlines() if line.split("|")[0].strip().isdigit()}
    assert all(("OTHER weights" in rows[t]) == (t >= split) for t in range(SAVE_AT + 1, STEPS + 1))
    fig = ckpt_draw_scaler(straight, {"without scaler": (saved, resumed)}, SAVE_AT)
    assert len(fig.axes) == 2
    plt.close(fig)


@pytest.mark.ranks
def test_omitting_a_scaler_an_fp32_run_does_not_have_is_refused_before_launch(tmp_path):
    with pytest.raises(cu.InvalidParameter, match="needs precision='fp16'"):
        cu.run("workers.ch08_resume", world_size=1, mode="save", ckpt_dir=str(tmp_path), omit="scaler", **RUN)


@pytest.mark.ranks
def test_resume_refuses_a_checkpoint_written_with_other_settings(tmp_path):
    cu.run("workers.ch08_resume", world_size=1, mode="save", ckpt_dir=str(tmp_path), **RUN)
    with pytest.raises(cu.WorkerFailed, match="other settings"):
        cu.run("workers.ch08_resume", world_size=1, mode="resume", ckpt_dir=str(tmp_path), lr=1e-3, **RUN)


# -- DCP: save sharded at world 2, load at world 1 -------------------------------------------------------------

@pytest.mark.ranks
def test_dcp_sharded_save_at_world_2_loads_at_world_1_exactly(tmp_path):
    from workers.checkpointing.sharded import make_mlp

    saved = cu.run("workers.ch08_dcp", world_size=2, part="save", ckpt_dir=str(tmp_path), **RUN)
    loaded = cu.run("workers.ch08_dcp", world_size=1, part="load", ckpt_dir=str(tmp_path), **RUN)
    for name, info in saved[0]["shards"].items():
        rows = [saved[r]["shards"][name]["local_shape"][0] for r in (0, 1)]
        assert rows == [4, 3] and sum(rows) == info["global_shape"][0]  # each rank held only its rows (Shard(0))
        assert len(loaded[0]["chunks"][name]) == 2  # the checkpoint stores two pieces of every tensor ...
    c = ckpt_dcp_compare(saved, loaded)
    assert c["keys_match"] and c["all_equal"], c  # ... and the world-1 load put them back together, exactly
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in c["equal"])  # AdamW's state too
    # the load started from other weights: equality is not an accident of initialisation
    fresh = make_mlp(6, 2, seed=99).state_dict()
    assert not torch.equal(fresh["0.weight"], loaded[0]["full"]["model"]["0.weight"])
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(saved[0]["files"])


@pytest.mark.ranks
def test_async_save_returns_before_durable_and_keeps_the_staged_values(tmp_path):
    res = cu.run("workers.ch08_dcp", world_size=2, part="async", ckpt_dir=str(tmp_path), width=512, repeats=1, **RUN)
    for r in res.ranks:
        # async_save handed control back while its checkpoint was still being written: the Future was pending
        # and .metadata (which DCP writes last, once every rank's shard is written) did not exist yet
        assert r["pending_at_return"] == [True] and r["metadata_at_return"] == [False]
        # the weights were changed right after async_save returned; the checkpoint holds the values from before
        assert r["snapshot_ok"]
    slowest = ckpt_async_times(res)  # what the notebook prints and draws: per save, the slowest rank
    assert all(slowest[k][0] == max(r["timings_s"][k][0] for r in res.ranks) for k in slowest)


# -- a save killed midway ---------------------------------------------------------------------------------------

def _crash(**params):
    with pytest.raises(cu.WorkerFailed, match="died without a Python traceback"):
        cu.run("workers.ch08_atomic", world_size=1, part="save", warm=False, **params, **RUN)


def _scan(path):
    return cu.run("workers.ch08_atomic", world_size=1, part="scan", ckpt_dir=path, **RUN)[0]


@pytest.mark.once  # files left by a killed process: the same on every CPU
@pytest.mark.ranks
def test_atomic_save_killed_midway_leaves_the_previous_checkpoint_chosen(tmp_path):
    root = str(tmp_path)
    cu.run("workers.ch08_atomic", world_size=1, part="save", writer="atomic", step=1, ckpt_dir=root, **RUN)
    _crash(writer="atomic", step=2, ckpt_dir=root, kill_at_bytes=500_000)  # inside optimizer.pt
    scan = _scan(root)
    staged = [e for e in scan["entries"] if e["name"] == ".partial-step_00000002"]
    assert staged and not staged[0]["valid"]  # the killed save got as far as staging, never to a final name
    assert any(name.endswith(".tmp") for name in staged[0]["others"])  # its half-written optimizer file
    assert scan["atomic_pick"]["name"] == "step_00000001" and scan["atomic_pick"]["consistent"]
    assert scan["naive_pick"]["name"] == "step_00000001"  # nothing newer even looks like a checkpoint


@pytest.mark.once  # files left by a killed process: the same on every CPU
@pytest.mark.ranks
def test_naive_save_killed_midway_leaves_a_truncated_file_or_a_torn_directory(tmp_path):
    root = str(tmp_path / "per_step")
    cu.run("workers.ch08_atomic", world_size=1, part="save", writer="naive", step=1, ckpt_dir=root, **RUN)
    _crash(writer="naive", step=2, ckpt_dir=root, kill_at_bytes=500_000)
    scan = _scan(root)
    pick = scan["naive_pick"]
    assert pick["name"] == "step_00000002" and not pick["all_load"]  # resumes from the broken one
    assert not pick["files"]["optimizer.pt"]["loads"] and pick["files"]["model.pt"]["loads"]
    assert scan["atomic_pick"] is None  # no manifest anywhere: the careful loader trusts none of it
    # the notebook quotes the loader's error: the table shows it whole, up to the end of its first sentence
    assert "failed reading zip archive: failed finding central directory)" in ckpt_scan_table(scan)

    root = str(tmp_path / "in_place")
    cu.run("workers.ch08_atomic", world_size=1, part="save", writer="naive", step=1, name="latest", ckpt_dir=root,
           **RUN)
    _crash(writer="naive", step=2, name="latest", ckpt_dir=root, kill_after_file="model.pt")
    pick = _scan(root)["naive_pick"]
    # worse: every file loads, and the state is torn: the model from step 2, the optimizer and meta from step 1
    assert pick["all_load"] and not pick["consistent"] and pick["steps"] == [1, 2]
    assert pick["files"]["model.pt"]["step"] == 2 and pick["files"]["optimizer.pt"]["step"] == 1


# -- the exercise checkers, directly (tests/test_exercises.py needs the notebook) --------------------------------

@pytest.mark.ranks
@pytest.mark.parametrize("name", ["training_state", "atomic_save"])
def test_checker_passes_the_solution_and_scores_the_stub_as_todo(name):
    import solutions.ch08 as solutions

    verdict = check(name, getattr(solutions, name))
    assert verdict.status == PASS, verdict.message

    def training_state(model, optimizer, scheduler, sampler, scaler):
        raise NotImplementedError

    def atomic_save(obj, path):
        raise NotImplementedError

    assert check(name, {"training_state": training_state, "atomic_save": atomic_save}[name]).status == TODO


def _checkpointing_wrong():
    from tests.wrong_answers.ch08 import WRONG

    return [w for w in WRONG if w[0] in ("training_state", "atomic_save")]


@pytest.mark.ranks
@pytest.mark.parametrize("name, fn, fragment", _checkpointing_wrong(), ids=lambda v: getattr(v, "__name__", None))
def test_checker_catches_each_wrong_answer_with_its_reason(name, fn, fragment):
    verdict = check(name, fn)
    assert verdict.status == FAIL and fragment in verdict.message, verdict.message
