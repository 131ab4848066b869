"""The backend and device each rank gets (``workers.runtime.select_placement``), for the hardware learners have.

Pretending a GPU count is enough: the choice reads only ``torch.cuda`` and the environment. What happens
on a real GPU (NCCL at world 1, gloo on CUDA tensors at world 2 on one H200) is recorded by
``tools/gpu/spine_check.py`` in data/gpu/ when a session has one.
"""
import pytest
import torch
import torch.distributed as dist

from workers.runtime import select_placement as _select


def select_placement(local_rank, local_world_size):
    p = _select(local_rank, local_world_size)
    return p.backend, p.device


@pytest.fixture
def gpus(monkeypatch):
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)

    def pretend(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return pretend


def test_no_gpu_gloo_on_the_cpu(gpus):
    gpus(0)
    assert [select_placement(r, 4) for r in range(4)] == [("gloo", "cpu")] * 4


def test_one_gpu_one_rank_nccl(gpus):
    gpus(1)
    assert select_placement(0, 1) == ("nccl", "cuda:0")


def test_one_gpu_several_ranks_gloo_on_cuda_tensors(gpus):
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the ranks share it through gloo
    gpus(1)
    assert [select_placement(r, 2) for r in range(2)] == [("gloo", "cuda:0"), ("gloo", "cuda:0")]
    assert "NCCL refuses two ranks on one GPU" in _select(0, 2).why


def test_a_gpu_per_local_rank_nccl_each_on_its_own(gpus):
    gpus(8)
    assert [select_placement(r, 8) for r in range(8)] == [("nccl", f"cuda:{r}") for r in range(8)]
    gpus(2)  # more local ranks than GPUs: shared GPUs, so gloo, spread over both
    assert [select_placement(r, 4) for r in range(4)] == [("gloo", d) for d in
                                                               ("cuda:0", "cuda:1", "cuda:0", "cuda:1")]


def test_overrides_and_a_clear_refusal(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("COURSE_DEVICE", "cpu")  # a GPU machine told to stay on the CPU: gloo, not NCCL
    assert select_placement(0, 1) == ("gloo", "cpu")
    monkeypatch.setenv("COURSE_BACKEND", "gloo")
    assert select_placement(0, 1) == ("gloo", "cpu")
    gpus(0)
    monkeypatch.delenv("COURSE_DEVICE")
    monkeypatch.setenv("COURSE_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match="unset COURSE_BACKEND"):
        select_placement(0, 1)
