"""Run a worker with every gloo-unsupported collective forced through ``runtime.host_staged``'s host copies.

On a one-GPU machine gloo gets CUDA tensors and ``host_staged`` moves all_gather / reduce_scatter /
all_to_all through CPU copies. CPU-only CI cannot make CUDA tensors, so this helper makes
``runtime.comm_device`` report a different device for those collectives: the same copy-in, collective,
copy-out path then runs on real gloo ranks, and the worker's own checks say whether the results survived.
"""
import importlib

import torch

from workers import runtime


def main(ctx, target: str = "workers.ch03_mappings", **params):
    real = runtime.comm_device
    staged = []

    def pretend_gpu(backend, device, collective):
        if collective in runtime.GLOO_CUDA_COLLECTIVES:
            return real(backend, device, collective)
        staged.append(collective)
        return torch.device("meta")  # "not where the tensor is": host_staged takes the copy path

    runtime.comm_device = pretend_gpu
    try:
        out = importlib.import_module(target).main(ctx, **params)
    finally:
        runtime.comm_device = real  # warm ranks run other workers next
    return {**out, "staged": sorted(set(staged)), "staged_calls": len(staged)}
