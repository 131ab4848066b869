"""Chapter 01's notebook-side helpers, without ranks: alpha-beta fit, the published sweep, tables."""

import pytest

from course_utils import ch01, reference_data
from course_utils.paths import ROOT


def test_alpha_beta_fit_recovers_known_parameters():
    alpha, B = 25e-6, 40e9  # 25 us, 40 GB/s
    sizes = [2**k for k in range(10, 27, 2)]
    times = [alpha + s / B for s in sizes]
    got_alpha, got_B = ch01.fit_alpha_beta(sizes, times)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_B == pytest.approx(B, rel=1e-9)


def test_alpha_beta_fit_weighs_small_messages():
    # An unweighted fit lets the largest message dominate; the relative fit keeps alpha within 10 %
    # even when the large sizes carry a 5 % error.
    alpha, B = 1e-3, 1e9
    sizes = [1e3, 1e4, 1e5, 1e6, 1e8]
    times = [alpha + s / B for s in sizes]
    times[-1] *= 1.05
    got_alpha, _ = ch01.fit_alpha_beta(sizes, times)
    assert got_alpha == pytest.approx(alpha, rel=0.1)


def test_alpha_beta_fit_never_returns_a_negative_latency():
    # Noisy small messages that are *faster* than the line through the large ones would give alpha < 0.
    sizes, times = [1e3, 1e6, 1e7], [1e-9, 1e-3, 1e-2]
    alpha, B = ch01.fit_alpha_beta(sizes, times)
    assert alpha == 0.0 and B > 0
    with pytest.raises(ValueError, match="two sizes"):
        ch01.fit_alpha_beta([1e3], [1e-3])


def test_published_sweep_is_in_the_repository_with_its_source():
    path = reference_data.published_allreduce_path()
    assert path == ROOT / "data" / "reference" / "allreduce_8xH200_published.csv"
    rows, header = reference_data.published_allreduce()
    assert any("source:" in h and "CC-BY-SA" in h for h in header)
    assert len(rows) == 20 and rows[0]["bytes"] == 32768 and rows[-1]["bytes"] == 16 * 2**30
    # busbw / algbw is the all-reduce factor 2(n-1)/n = 1.75 for n = 8 (to the CSV's rounding)
    for r in rows:
        assert r["busbw"] / r["algbw"] == pytest.approx(1.75, rel=0.01)
    shared = ROOT.parent / "shared" / "reference" / "allreduce_8xH200_published.csv"
    if shared.exists():  # the copy must not drift from the course's shared reference
        assert shared.read_text() == path.read_text()


def test_origin_decodes_the_source_rank():
    assert ch01._origin(23.0, 4, 4) == 1  # 10 * (1 + 1) + 3
    assert ch01._origin(100.0, 4, 4) is None  # a sum: no single origin
    assert ch01._origin(12.5, 4, 4) is None
    assert ch01._origin(15.0, 4, 4) is None  # position 5 does not exist at width 4


def test_comm_device_keeps_gloo_on_the_cpu_where_it_has_no_cuda_implementation():
    # A one-GPU machine runs several ranks with gloo on CUDA tensors; gloo implements only all_reduce and
    # broadcast for CUDA tensors (PyTorch's backend table), so the other collectives must get CPU tensors.
    import torch

    from workers.runtime import comm_device

    gloo_gpu, nccl_gpu, gloo_cpu = ("gloo", "cuda:0"), ("nccl", "cuda:1"), ("gloo", "cpu")
    assert comm_device(*gloo_gpu, "all_reduce") == torch.device("cuda:0")
    assert comm_device(*gloo_gpu, "broadcast") == torch.device("cuda:0")
    for collective in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather", "reduce", "send"):
        assert comm_device(*gloo_gpu, collective) == torch.device("cpu")
        assert comm_device(*nccl_gpu, collective) == torch.device("cuda:1")
        assert comm_device(*gloo_cpu, collective) == torch.device("cpu")


def test_traceback_from_starts_at_the_workers_own_frame():
    # Drill 1 prints the traceback from the worker's line on: the frame in rank_faults.py must come first.
    root = ch01.ROOT
    tb = (f'Traceback (most recent call last):\n'
          f'  File "{root}/workers/pool.py", line 105, in run_task\n    out = module.main(ctx, **params)\n'
          f'  File "{root}/workers/rank_faults.py", line 47, in main\n    dist.all_reduce(x, group=group)\n'
          f'  File "/venv/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n    work.wait()\n'
          f'RuntimeError: Timed out waiting 2000ms for recv operation to complete\n')
    out = ch01.traceback_from(tb, "rank_faults.py").splitlines()
    assert out[0] == '  File "workers/rank_faults.py", line 47, in main'  # relative to the repository
    assert out[1].strip() == "dist.all_reduce(x, group=group)"
    assert out[-1].startswith("RuntimeError: Timed out") and not any("pool.py" in line for line in out)
    assert ch01.traceback_from(tb, "no_such.py").splitlines()[0] == "Traceback (most recent call last):"


def test_tee_output_is_split_by_rank_even_when_torchrun_cut_a_line():
    """CI, test-other-cpu beside the browser test: torchrun read rank 1's line before its newline, so rank 0's piece
    followed on the same line and rank 1's newline came as a piece of its own."""
    from course_utils.ch01 import parse_tee

    output = ("*****************************************\n"
              "W1204 torchrun warning\n"
              "[default1]:rank 1/2 (local_rank 1, cpu): all_reduce -> 3, n(n+1)/2 = 3"
              "[default0]:rank 0/2 (local_rank 0, cpu): all_reduce -> 3, n(n+1)/2 = 3\n"
              "[default1]:\n"
              "[default0]:second line of rank 0\n")
    by_rank, agent = parse_tee(output)
    assert by_rank == {0: ["rank 0/2 (local_rank 0, cpu): all_reduce -> 3, n(n+1)/2 = 3", "second line of rank 0"],
                       1: ["rank 1/2 (local_rank 1, cpu): all_reduce -> 3, n(n+1)/2 = 3"]}
    assert agent == ["W1204 torchrun warning"]
    # whole lines, the usual case, including a rank's empty line
    by_rank, agent = parse_tee("[default0]:a\n[default0]:\n[default0]:b\nagent line\n[default1]:c")
    assert by_rank == {0: ["a", "", "b"], 1: ["c"]} and agent == ["agent line"]
