"""PyTorch's FSDP2 on chapter 11's GPT, as the hand-written ZeRO-3 is compared with it (``workers/ch11_fsdp2.py``,
``workers/ch11_zero3_mixed.py``): ``fully_shard`` on every block and then on the root (torchtitan's
``apply_fsdp``), the collectives it makes caught on their way to ``torch.distributed``, its weights gathered whole.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def recording(calls: list, on: bool = True):
    """Every ``all_gather_single`` / ``reduce_scatter_single`` made through ``torch.distributed`` inside, as
    (kind, bytes in, bytes out): FSDP2's collectives (the hand version calls them through ``workers.runtime``)."""
    if not on:
        yield
        return
    real = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def wrap(kind):
        def call(output, input, *args, **kwargs):
            calls.append((kind, input.nbytes, output.nbytes))
            return real[kind](output, input, *args, **kwargs)
        return call

    dist.all_gather_single, dist.reduce_scatter_single = wrap("all_gather"), wrap("reduce_scatter")
    try:
        yield
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real["all_gather"], real["reduce_scatter"]


def fully_shard_gpt(model, mesh, reshard_after_forward: bool, param_dtype=None, reduce_dtype=None,
                    output_dtype=None) -> None:
    """``fully_shard`` every block, then the root with FSDP2's default (None: kept whole from forward to backward),
    under one ``MixedPrecisionPolicy`` (its defaults, no casts, when every dtype is None). ``output_dtype`` goes to
    the root's policy alone: FSDP2 casts the output of *every* module it wraps, so on the blocks it would hand the
    final LayerNorm fp32 activations next to its bf16 weight (refused on the CPU) and cast each block's output
    back and forth."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                                                 output_dtype=output_dtype))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # SUM, then / N: gloo has no ReduceOp.AVG


def full_flat(model) -> torch.Tensor:
    """FSDP2's parameters, whole (DTensors gathered), flattened in ``model.parameters()`` order, as float64 on the
    CPU (as ``workers/zero/model.py: flat_params``)."""
    return torch.cat([p.full_tensor().detach().reshape(-1).to("cpu", torch.float64) for p in model.parameters()])
