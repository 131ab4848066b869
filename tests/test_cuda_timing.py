"""``workers/timing/cuda.py``, the one CUDA timing loop, checked on a CPU.

No GPU here, so the CUDA path runs against fake events on a fake GPU clock: each call of the timed function
advances the clock by a known number of milliseconds, and the fake refuses to read an event the host has not
synchronized on since it was recorded (reading early is the classic bug: it times the launch, not the work).
The CPU path runs with the host clock replaced. The benchmarks that use the helper are checked for the same
arithmetic they had when each wrote its own loop.
"""
import statistics
import sys

import pytest
import torch

from course_utils.paths import ROOT
from workers.timing import cuda as timing


class FakeGPU:
    """A stream whose work finishes only when the host synchronizes; events read the clock when recorded."""

    def __init__(self):
        self.clock = 0.0  # ms of GPU work done so far
        self.syncs = 0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing, "an event made without enable_timing=True cannot be timed"
                self.at, self.synced = None, False

            def record(self):
                self.at, self.synced = gpu.clock, False
                gpu.unsynced.append(self)

            def elapsed_time(self, end):
                assert self.synced and end.synced, "read before torch.cuda.synchronize(): the work may not be done"
                return end.at - self.at

        self.Event, self.unsynced = Event, []

    def synchronize(self, device=None):
        self.syncs += 1
        for e in self.unsynced:
            e.synced = True
        self.unsynced = []

    def work(self, ms):
        self.clock += ms


@pytest.fixture()
def gpu(monkeypatch):
    fake = FakeGPU()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def test_each_timed_call_gets_its_own_gpu_time_and_warm_up_is_not_timed(gpu):
    durations = iter([50.0, 40.0, 3.0, 1.0, 2.0, 4.0])  # two warm-up calls (slow: compiling), then four timed
    calls = []

    def fn():
        calls.append(1)
        gpu.work(next(durations))

    assert timing.times_ms(fn, 4, warmup=2) == [3.0, 1.0, 2.0, 4.0]
    assert len(calls) == 6
    assert gpu.syncs == 1 + 4  # once after the warm-up, once after each timed call


def test_setup_runs_before_every_call_outside_the_timed_window(gpu):
    order = []

    def setup():
        order.append("setup")
        gpu.work(100.0)  # e.g. zeroing gradients: real work, but not what is measured

    def fn():
        order.append("fn")
        gpu.work(2.5)

    assert timing.times_ms(fn, 3, warmup=1, setup=setup) == [2.5, 2.5, 2.5]
    assert order == ["setup", "fn"] * 4


def test_median_is_the_middle_call_and_the_mean_of_the_two_middle_ones_for_an_even_count(gpu):
    durations = iter([9.0, 1.0, 7.0, 3.0, 100.0])
    assert timing.median_ms(lambda: gpu.work(next(durations)), 5) == 7.0  # 1 3 [7] 9 100: the outlier does not move it
    durations = iter([4.0, 1.0, 2.0, 3.0])
    assert timing.median_ms(lambda: gpu.work(next(durations)), 4) == 2.5 == statistics.median([1.0, 2.0, 3.0, 4.0])


def test_a_cpu_device_is_timed_with_the_host_clock_and_never_touches_cuda(monkeypatch):
    now = [10.0]  # seconds
    monkeypatch.setattr(timing, "_now", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "Event", lambda **_: pytest.fail("a CPU device recorded a CUDA event"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: pytest.fail("a CPU device synchronized CUDA"))
    steps = iter([0.5, 0.002, 0.004])  # seconds: one warm-up, two timed

    def fn():
        now[0] += next(steps)

    assert timing.times_ms(fn, 2, warmup=1, device=torch.device("cpu")) == pytest.approx([2.0, 4.0])


@pytest.mark.parametrize("reps, warmup", [(0, 0), (-1, 0), (2.0, 0), (True, 0), (1, -1), (1, 0.5)])
def test_nonsense_counts_are_refused(reps, warmup):
    with pytest.raises(ValueError, match="whole number"):
        timing.times_ms(lambda: None, reps, warmup=warmup, device="cpu")


def test_reps_fill_the_budget_between_the_floor_and_the_ceiling():
    assert timing.reps_for(200.0, 10.0) == 20
    assert timing.reps_for(200.0, 10.0, min_reps=5, max_reps=10) == 10
    assert timing.reps_for(200.0, 100.0) == 5  # floor
    assert timing.reps_for(200.0, 30.0) == 6  # 6.67 calls fill it: whole calls, rounded down
    assert timing.reps_for(200.0, 0.0, max_reps=10**9) == 200_000  # a pilot under 1 us counts as 1 us


def test_the_attention_bench_sizes_its_run_from_one_timed_call(gpu):
    from workers.attention import bench

    durations = iter([80.0, 4.0] + [5.0] * 100)  # warm-up (autotuning), the pilot, then the run
    times = bench.time_ms(lambda: gpu.work(next(durations)), target_ms=100.0)
    assert times == [5.0] * 25  # 100 ms / 4 ms: the pilot sets the count, it is not one of the times


def test_the_block_bench_clears_the_gradient_before_each_call_and_reports_seconds():
    sys.path.insert(0, str(ROOT / "tools" / "gpu"))
    import tp_block_bench

    x = torch.ones(3, requires_grad=True)
    grad = torch.tensor([1.0, 2.0, 3.0])
    out = tp_block_bench.time_fwd_bwd(lambda t: 2 * t, x, grad, iters=3, warmup=2)
    assert torch.equal(x.grad, 2 * grad)  # five backward passes, but each started from x.grad = None
    assert out["iters"] == 3 and 0 <= out["min_s"] <= out["median_s"] < 1.0  # seconds, not milliseconds
