"""Chapter 02, overlap: OverlappedDDP (async all-reduce per bucket, launched from inside backward) on real ranks.

It must equal torch's DDP with the same bucket cap and one process on the whole batch, all-reduce the buckets
DDP's rule predicts, and launch at least one bucket before backward's last gradient hook has fired.
"""
import pytest
import torch

import course_utils as cu
from course_utils.ch02 import compare_to_baseline
from workers.data_parallel.buckets import MIB, bucket_assignment, ddp_bucket_limits
from workers.data_parallel.model import Setup, make_model, train_single

pytestmark = pytest.mark.ranks

LIMITS = {"timeout": 60}
CAP = 256  # bytes: TinyMLP's 848 gradient bytes split into two buckets, fc2 (16 + 256 bytes) then fc1 (64 + 512)
_RUNS: dict = {}


def run(world: int, **params):
    key = (world, tuple(sorted(params.items())))
    if key not in _RUNS:
        _RUNS[key] = cu.run("workers.ch02_overlap", world_size=world, **LIMITS, bucket_cap_bytes=CAP, **params)
    return _RUNS[key]


@pytest.fixture(scope="module")
def baseline():
    return train_single(Setup())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_overlapped_ddp_equals_torch_ddp_and_one_process(world, baseline):
    res = run(world)
    for d in res.ranks:
        ours, theirs = d, d["torch"]
        if world <= 2:
            # Bit for bit: both pre-scale by 1/world (exact for 1 and 2) and gloo's sum of one or two addends does
            # not depend on the order (a + b == b + a in IEEE arithmetic).
            for key in ("weights", "grads", "local_losses"):
                assert torch.equal(ours[key], theirs[key]), key
        else:
            # Four addends: gloo's order of the additions depends on where an element sits in the buffer, and
            # torch's first iteration all-reduces one bucket of all 848 bytes in model order where ours sends two
            # buckets from the start, so the sums differ by rounding. Measured over AVX512, AVX2 and the plain
            # kernels, seeds 0-2: at most 3e-8 on weights, 1.5e-8 on gradients, 1.2e-7 on losses of ~0.7 (2 fp32
            # ulp). 5e-7 is 4x that; skipping the average, or a missed bucket, is off by O(0.1).
            for key in ("weights", "grads", "local_losses"):
                assert torch.allclose(ours[key], theirs[key], atol=5e-7, rtol=0), key
    # And both equal one process on the whole batch, to fp32 rounding (only the order of additions differs).
    c = compare_to_baseline(res, baseline)
    assert c["within_tol"], (c["grad_max_abs"], c["max_abs"], c["loss_abs"])
    assert c["ranks_identical"]  # every rank applied the same all-reduced gradient
    assert (res[0]["weights"][-1] - res[0]["weights"][0]).abs().max() > 1e-2  # training moved the weights


def test_buckets_are_ddps_buckets():
    res = run(2)
    model = make_model(Setup())
    sizes = [p.numel() * 4 for p in reversed(list(model.parameters()))]  # fc2.bias, fc2.weight, fc1.bias, fc1.weight
    assert sizes == [16, 256, 64, 512]
    expected = bucket_assignment(sizes, ddp_bucket_limits(CAP / MIB))
    assert expected == [[0, 1], [2, 3]]
    for d in res.ranks:
        assert d["bucket_names"] == [["fc2.bias", "fc2.weight"], ["fc1.bias", "fc1.weight"]]
        assert d["buckets"] == d["predicted"]["rebuilt_params"] == [[3, 2], [1, 0]]
        # exact counts: two all-reduces of 272 and 576 bytes per step, as predicted and as torch's DDP rebuilt them
        assert d["comm_per_step"] == {"all_reduces": 2, "bytes": [272, 576], "total_bytes": 848}
        assert d["comm_per_step"]["bytes"] == d["predicted"]["rebuilt"]
        logging = d["torch"]["ddp_logging"]
        assert logging["bucket_cap_bytes"] == CAP and logging["num_buckets_reduced"] == 2
        assert logging["rebuilt_bucket_sizes"] == "272, 576"
        for events in d["timeline"]:  # what was really launched, every step
            assert [e["bytes"] for e in events if e["kind"] == "launch"] == [272, 576]


def test_a_bucket_is_launched_while_backward_is_still_running():
    res = run(2)
    for d in res.ranks:
        assert len(d["timeline"]) == len(d["overlap"]) == Setup().steps
        for events, summary in zip(d["timeline"], d["overlap"]):
            kinds = [e["kind"] for e in events]
            assert kinds[0] == "backward_start"
            first_launch = kinds.index("launch")
            assert "grad" in kinds[first_launch:]  # gradients still to come after fc2's bucket went out: overlap
            # launched as soon as its own gradients were in: exactly fc2's two parameters came before it
            assert sorted(e["param"] for e in events[:first_launch] if e["kind"] == "grad") == [2, 3]
            assert summary["buckets"] == 2 and summary["launched_before_last_grad"] == 1
            # every wait comes after every hook: the step waits, backward does not
            assert max(i for i, k in enumerate(kinds) if k == "grad") < kinds.index("wait_begin")
            ts = [e["t"] for e in events]
            assert ts == sorted(ts) and ts[0] >= 0


def test_without_overlap_the_same_buckets_go_out_after_backward():
    res, overlapped = run(2, overlap=False), run(2)
    for d, o in zip(res.ranks, overlapped.ranks):
        for events, summary in zip(d["timeline"], d["overlap"]):
            kinds = [e["kind"] for e in events]
            assert summary["buckets"] == 2 and summary["launched_before_last_grad"] == 0
            assert max(i for i, k in enumerate(kinds) if k == "grad") < kinds.index("launch")
        # the same buffers summed the same way: the timing changed, not one bit of the result
        assert torch.equal(d["weights"], o["weights"]) and torch.equal(d["grads"], o["grads"])


def test_a_parameter_without_gradient_is_named():
    with pytest.raises(cu.WorkerFailed, match=r"spare\.weight.*received no gradient"):
        cu.run("workers.ch02_overlap", world_size=2, **LIMITS, unused_param=True, with_torch=False, steps=1)


def test_bad_cap_is_refused_before_launch():
    with pytest.raises(cu.InvalidParameter, match="bucket_cap_bytes=0"):
        cu.run("workers.ch02_overlap", world_size=2, bucket_cap_bytes=0)


def test_the_overlap_figure_draws_every_gradient_launch_and_wait_of_the_step():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_utils import ch02

    runs = {"overlap": run(2), "after": run(2, overlap=False)}
    fig = ch02.draw_overlap(runs, step=1)
    ax = fig.axes[0]
    for row, res in enumerate(runs.values()):
        events = res[0]["timeline"][1]
        y = len(runs) - 1 - row
        # the scatter collections of this row: a dot per gradient hook (y + 0.25), a triangle per launch (y)
        dots = [c for c in ax.collections if c.get_offsets()[0][1] == y + 0.25]
        launches = [c for c in ax.collections if c.get_offsets()[0][1] == y]
        assert len(dots) == sum(e["kind"] == "grad" for e in events)
        assert sorted(c.get_offsets()[0][0] for c in launches) == \
            sorted(e["t"] * 1e3 for e in events if e["kind"] == "launch")
        waits = [line for line in ax.lines if list(line.get_ydata()) == [y - 0.25, y - 0.25]]
        assert len(waits) == sum(e["kind"] == "wait_end" for e in events)
    plt.close(fig)
