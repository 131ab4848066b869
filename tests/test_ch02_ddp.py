"""Chapter 02 on real ranks (gloo, CPU): DDP equals one process, and each part of the one line does its job.

Every rank-side result is compared with a single-process reference computed here from
``workers/data_parallel/model.py``, with the fp32 tolerance stated there (atol 1e-6, rtol 1e-5).
"""
import pytest
import torch

import course_utils as cu
from course_utils.ch02 import compare_to_baseline, reduction_ratios, reduction_reference
from workers.data_parallel.buckets import MIB, bucket_assignment, predict_ddp_buckets
from workers.data_parallel.model import (FP32_TOL, Setup, accumulated_reference, grads_on, make_batches, make_model,
                                         make_stack, shard, train_single)

LIMITS = {"timeout": 60}  # default collective limit, like the exercise checks: shared warm ranks


@pytest.fixture(scope="module")
def baseline():
    return train_single(Setup())


# -- pure functions (no ranks) --------------------------------------------------------------------------

def test_tolerance_is_tight_enough_to_catch_ranks_that_do_not_average(baseline):
    # A rank that skipped the all-reduce would step with the gradient of its own B/n rows. That step must
    # land far outside the tolerance, or "DDP equals the baseline" would prove nothing.
    setup = Setup()
    model = make_model(setup)
    x, y = shard(make_batches(setup, steps=1)[0], rank=0, world_size=2)
    lone_grad = grads_on(model, x, y)
    assert not torch.allclose(lone_grad, baseline["grads"][0], **FP32_TOL)
    assert (lone_grad - baseline["grads"][0]).abs().max() > 100 * FP32_TOL["atol"]


def test_bucket_rule_closes_a_bucket_once_it_reaches_the_limit():
    # DDP keeps the tensor that crosses the limit in the bucket (reducer.cpp): 3+3 >= 5 closes the first.
    assert bucket_assignment([3, 3, 3, 3], [5]) == [[0, 1], [2, 3]]
    assert bucket_assignment([10, 1, 1], [5]) == [[0], [1, 2]]  # an oversized tensor fills a bucket alone
    assert bucket_assignment([1, 1, 1, 1, 1], [1, 3]) == [[0], [1, 2, 3], [4]]  # first limit, then the rest
    with pytest.raises(ValueError):
        bucket_assignment([1], [])


def test_predicted_buckets_for_the_stack_by_hand():
    # Each Linear(256, 256) holds 256*256 + 256 fp32 numbers = 263,168 bytes; the cap is in MiB.
    model = make_stack(6, 256)
    layer = 263_168
    assert predict_ddp_buckets(model, 0.5)["rebuilt"] == [2 * layer] * 3  # 2 layers reach 524,288
    assert predict_ddp_buckets(model, 1.0)["rebuilt"] == [4 * layer, 2 * layer]  # 4 layers reach 1 MiB
    assert predict_ddp_buckets(model, None)["rebuilt"] == [4 * layer, 2 * layer]  # default: 1 MiB first bucket
    assert predict_ddp_buckets(model, 0.5)["first_iteration"] == [6 * layer]


# -- DDP equals one process -------------------------------------------------------------------------------

@pytest.mark.ranks
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ddp_equals_single_process_after_every_step(world, baseline):
    res = cu.run("workers.ch02_ddp", world_size=world, **LIMITS)
    c = compare_to_baseline(res, baseline)
    # every step came back: the initial weights and S steps of weights, gradients and losses
    assert all(w.shape == baseline["weights"].shape for w in res.gather("weights"))  # [steps + 1, P]
    assert all(g.shape == baseline["grads"].shape for g in res.gather("grads"))  # [steps, P]
    assert all(len(l) == len(baseline["losses"]) for l in res.gather("local_losses"))
    # The mean loss over B/n rows, averaged over n ranks, is the mean over B rows: only the order of the
    # additions differs, so at every step the gradient DDP leaves in .grad, the global loss and the weights
    # after the step agree with one process to fp32 rounding (FP32_TOL).
    assert c["grads_within_tol"], c["grad_max_abs"]
    assert c["loss_within_tol"], c["loss_abs"]
    assert c["weights_within_tol"], c["max_abs"]
    assert c["within_tol"]
    assert c["grad_max_abs"].max() <= FP32_TOL["atol"] and c["max_abs"].max() <= FP32_TOL["atol"]
    # Every rank applied the same all-reduced gradient to the same weights: bit-identical.
    assert c["ranks_identical"]
    # And training moved the weights (a run that did nothing would fail the baseline comparison, but say so).
    weights = res.gather("weights")
    assert (weights[0][-1] - weights[0][0]).abs().max() > 1e-2
    if world == 1 and res.devices == ["cpu"]:
        # one CPU rank: the baseline's kernels, bit for bit
        assert torch.equal(weights[0], baseline["weights"]) and torch.equal(res[0]["grads"], baseline["grads"])
    if world > 1:
        # each rank read its own B/n rows: the local losses differ from rank to rank
        assert not torch.equal(res[0]["local_losses"], res[1]["local_losses"])


def test_comparison_catches_a_rank_that_does_not_average(baseline):
    # compare_to_baseline must not be a tautology: a run whose gradients are one rank's own (never
    # all-reduced) fails on the gradients, whatever the weights say.
    setup = Setup()
    model = make_model(setup)
    lone = grads_on(model, *shard(make_batches(setup, steps=1)[0], rank=0, world_size=2))

    class Fake:
        ranks = [{"weights": baseline["weights"].clone(), "grads": baseline["grads"].clone(),
                  "local_losses": baseline["losses"].clone()}]

        def gather(self, key):
            return [d[key] for d in self.ranks]

    fake = Fake()
    assert compare_to_baseline(fake, baseline)["within_tol"]
    fake.ranks[0]["grads"][0] = lone
    c = compare_to_baseline(fake, baseline)
    assert not c["grads_within_tol"] and not c["within_tol"] and c["weights_within_tol"]
    fake.ranks[0]["local_losses"][2] += 1e-3
    assert not compare_to_baseline(fake, baseline)["loss_within_tol"]


@pytest.mark.ranks
def test_batch_that_does_not_split_is_refused_before_launch():
    with pytest.raises(cu.InvalidParameter, match="choose a positive multiple of 4"):
        cu.run("workers.ch02_ddp", world_size=4, global_batch=10)


# -- what the one line does -------------------------------------------------------------------------------

@pytest.mark.ranks
def test_construction_broadcasts_rank0_parameters_and_buffers():
    res = cu.run("workers.ch02_internals", world_size=4, **LIMITS, part="broadcast")
    rank0 = res[0]["before"]
    for r in range(1, 4):
        # they really started different (seed + 1000 * rank) ...
        assert not torch.equal(res[r]["before"]["params"], rank0["params"])
        assert not torch.equal(res[r]["before"]["in_scale"], rank0["in_scale"])
        # ... and DDP(model) copied rank 0's parameters and buffers to them, exactly
        assert torch.equal(res[r]["after"]["params"], rank0["params"])
        assert torch.equal(res[r]["after"]["in_scale"], rank0["in_scale"])
    # rank 0's own start is the single-process model's start
    assert torch.equal(rank0["params"], torch.cat([p.detach().reshape(-1) for p in make_model(Setup()).parameters()]))


@pytest.mark.ranks
def test_gradient_is_the_mean_of_local_gradients_and_the_step_is_plain_sgd():
    res = cu.run("workers.ch02_internals", world_size=4, **LIMITS, part="average")
    local = torch.stack(res.gather("local_grad"))  # [4, P]
    for d in res.ranks:
        assert torch.allclose(d["ddp_grad"], local.mean(dim=0), **FP32_TOL)
        assert torch.equal(d["ddp_grad"], res[0]["ddp_grad"])
        assert torch.allclose(d["weights_after"], d["weights_before"] - d["lr"] * d["ddp_grad"], atol=1e-7, rtol=0)
    assert not torch.allclose(res[0]["ddp_grad"], local[0], **FP32_TOL)  # communication happened
    # and the average is the single-process gradient on the whole batch
    assert torch.allclose(res[0]["ddp_grad"], train_single(Setup(steps=1))["grads"][0], **FP32_TOL)


@pytest.mark.ranks
@pytest.mark.parametrize("cap, later", [(0.25, 6), (0.5, 3), (1.0, 2), (2.0, 1), (None, 2)])
def test_all_reduce_count_against_bucket_cap_mb(cap, later):
    # 6 layers of 263,168 bytes. Step 1: one bucket with everything (DDP has not yet seen the backward
    # order). Step 2 on: buckets rebuilt with the cap, counted by a comm hook that sees every all-reduce.
    params = {"default_cap": True} if cap is None else {"bucket_cap_mb": cap}
    res = cu.run("workers.ch02_internals", world_size=2, **LIMITS, part="buckets", steps=3, **params)
    for d in res.ranks:
        per_step = d["all_reduce_bytes"]
        assert per_step[0] == [6 * 263_168]
        assert len(per_step[1]) == len(per_step[2]) == later
        assert per_step[1] == d["predicted"]["rebuilt"]
        assert all(b >= (cap or 1) * MIB for b in per_step[1][:-1])  # every closed bucket reached its cap
        assert d["ddp_logging"]["num_buckets_reduced"] == later  # DDP's own count agrees with the hook's


@pytest.mark.ranks
def test_first_bucket_is_launched_while_backward_is_still_running():
    res = cu.run("workers.ch02_internals", world_size=2, **LIMITS, part="buckets", bucket_cap_mb=0.5, steps=2)
    events = [e for e in res[0]["events"] if e["step"] == 1]
    kinds = [e["kind"] for e in events]
    first_reduce = kinds.index("all_reduce")
    assert "grad" in kinds[first_reduce:]  # gradients still to come after the first all-reduce: overlap
    ready_before = {e["param"] for e in events[:first_reduce] if e["kind"] == "grad"}
    assert ready_before == set(events[first_reduce]["params"])  # launched as soon as its own gradients were in
    assert max(ready_before) == 11  # the last layer's gradients come first


# -- pitfalls ---------------------------------------------------------------------------------------------

@pytest.mark.ranks
def test_without_set_epoch_every_epoch_is_the_same():
    res = cu.run("workers.ch02_pitfalls", world_size=2, **LIMITS, part="sampler", dataset_size=12, epochs=3)
    for d in res.ranks:
        assert d["without_set_epoch"][0] == d["without_set_epoch"][1] == d["without_set_epoch"][2]
        assert d["with_set_epoch"][0] != d["with_set_epoch"][1]
        assert d["with_set_epoch"][0] == d["without_set_epoch"][0]  # epoch 0 is epoch 0 either way
    for mode in ("without_set_epoch", "with_set_epoch"):
        for e in range(3):  # the shards of one epoch are disjoint and cover the dataset
            assert sorted(res[0][mode][e] + res[1][mode][e]) == list(range(12))


@pytest.mark.ranks
def test_sum_reduction_scales_the_gradient_by_one_over_world_size():
    reference = reduction_reference(Setup())
    runs = {w: cu.run("workers.ch02_pitfalls", world_size=w, **LIMITS, part="reduction") for w in (2, 4)}
    for w, r in reduction_ratios(runs, reference).items():
        assert r["mean"] == pytest.approx(1.0, abs=1e-6) and r["mean_residual"] < 1e-6
        assert r["sum"] == pytest.approx(1 / w, abs=1e-6) and r["sum_residual"] < 1e-5


@pytest.mark.ranks
def test_no_sync_accumulation_equals_a_big_batch_with_one_all_reduce():
    k = 4
    res = cu.run("workers.ch02_pitfalls", world_size=2, **LIMITS, part="no_sync", accumulation=k)
    big_batch = accumulated_reference(Setup(), k)
    for d in res.ranks:
        assert d["with_no_sync"]["all_reduces"] == 1  # the tiny MLP fits one bucket: one all-reduce per step
        assert d["without_no_sync"]["all_reduces"] == k  # every backward all-reduces
        assert torch.allclose(d["with_no_sync"]["grad"], big_batch, **FP32_TOL)
        assert torch.allclose(d["without_no_sync"]["grad"], big_batch, **FP32_TOL)


def _timeline(layers: int, per_bucket: int) -> list[dict]:
    """What workers.ch02_internals reports for one backward: each layer's bias then weight gradient lands, last
    layer first; an all-reduce follows every ``per_bucket`` layers (257 KiB each, as Linear(256, 256))."""
    names = [f"layer{i}.{k}" for i in range(layers) for k in ("weight", "bias")]
    events, pending, bucket = [], [], 0
    for layer in reversed(range(layers)):
        for p in (2 * layer + 1, 2 * layer):
            events.append({"step": 1, "kind": "grad", "param": p})
            pending.append(p)
        if len(pending) == 2 * per_bucket or layer == 0:
            events.append({"step": 1, "kind": "all_reduce", "bucket": bucket, "params": pending,
                           "bytes": 263_168 * len(pending) // 2})
            pending, bucket = [], bucket + 1
    return [{"events": events, "param_names": names}]


@pytest.mark.parametrize("layers, per_bucket", [(12, 1), (6, 2), (1, 1)])
def test_bucket_labels_never_cover_each_other_or_the_dots(layers, per_bucket):
    """At 12 layers and a small cap (a bucket per layer) the labels once sat on each other and on the dots."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_utils.ch02 import draw_bucket_timeline

    fig = draw_bucket_timeline(_timeline(layers, per_bucket), step=1)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(labels) == -(-layers // per_bucket)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert not a.overlaps(b), "two bucket labels overlap"
    for coll in ax.collections:
        for x, y in coll.get_offsets():
            px, py = ax.transData.transform((x, y))
            for box in labels:
                assert not box.contains(px, py + 4) and not box.contains(px, py - 4), \
                    f"a label covers the dot at event {x:g}"
    plt.close(fig)
