"""Collective communication inside autograd: the conjugate pairs of Megatron-LM's ``mappings.py``.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", sec. 3 and Figure 3) needs exactly two operators
around a parallel region, which the paper calls ``f`` and ``g``:

    f = copy_to_tensor_model_parallel_region      forward: identity     backward: all_reduce
    g = reduce_from_tensor_model_parallel_region  forward: all_reduce   backward: identity

They are *conjugates*: each one's backward is the other one's forward. The same duality gives the other
pairs used by tensor and sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4.2.2, the ``g`` and ``g-bar`` operators):

    scatter_to_tensor_model_parallel_region       split last dim  /  all_gather last dim
    gather_from_tensor_model_parallel_region      all_gather last dim  /  split last dim
    scatter_to_sequence_parallel_region           split first dim  /  all_gather first dim
    gather_from_sequence_parallel_region          all_gather first dim  /  reduce_scatter first dim
    reduce_scatter_to_sequence_parallel_region    reduce_scatter first dim  /  all_gather first dim
    all_to_all                                    all_to_all  /  all_to_all with the splits swapped

Why the backward is what it is: a tensor that is *replicated* (the same value on every rank, like the
output of ``g``) is one logical tensor, and the loss computed from it on every rank is one logical loss;
its gradient is already complete on every rank, so nothing is communicated. A tensor that enters
rank-specific computation (like the output of ``f``) gets a different gradient on each rank, and the
true gradient is their sum: that is the all_reduce in ``f``'s backward. Chapter 03 derives this and
checks every function here against a single-process reference (``workers/parallel/reference.py``).

Each public function takes an optional process group (default: the world), works on gloo (CPU, or CUDA
tensors on a one-GPU machine) and NCCL, and skips communication when the group has one rank. Inputs are
never modified in place: forward and backward communicate on fresh tensors.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from workers.runtime import all_gather_single, host_staged, reduce_scatter_single

# -- instrumentation: which collectives ran, in which pass, with how many bytes ------------------------

_recorders: list[list[dict]] = []  # active ``record_communication`` blocks (empty outside them)


@contextlib.contextmanager
def record_communication():
    """``with record_communication() as log:`` lists every collective the mappings run, forward and backward.

    Each entry: ``{"mapping", "collective", "pass", "group_size", "shape", "bytes"}`` where ``bytes`` is the
    size of the tensor each rank contributes (``group_size`` ranks take part: with ``comm_stats.wire_factor``
    that gives the bytes each rank sends). Only calls made through this module are seen.
    """
    log: list[dict] = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


def _note(mapping: str, collective: str, pass_: str, tensor: torch.Tensor, group) -> None:
    for log in _recorders:
        log.append({"mapping": mapping, "collective": collective, "pass": pass_, "group_size": get_world_size(group),
                    "shape": list(tensor.shape), "bytes": tensor.numel() * tensor.element_size()})


# -- helpers: one collective each, on a fresh tensor -------------------------------------------------

def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def _divisible(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(f"the {what} dimension has size {size}, which is not divisible by the group's "
                         f"{world_size} ranks: choose a size that is a multiple of {world_size}")
    return size // world_size


def _reduce(input_: torch.Tensor, group, mapping: str, pass_: str) -> torch.Tensor:
    """All-reduce (sum) across the group; a clone, so the caller's tensor is left alone."""
    if get_world_size(group) == 1:
        return input_
    output = input_.clone(memory_format=torch.contiguous_format)
    _note(mapping, "all_reduce", pass_, output, group)
    dist.all_reduce(output, group=group)
    return output


def _split_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension (no communication)."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input_
    width = _divisible(input_.shape[-1], world_size, "last")
    rank = get_rank(group)
    return input_[..., rank * width:(rank + 1) * width].contiguous()  # [..., h/n]


def _split_along_first_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the first dimension (no communication)."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input_
    rows = _divisible(input_.shape[0], world_size, "first")
    rank = get_rank(group)
    return input_[rank * rows:(rank + 1) * rows].contiguous()  # [s/n, ...]


def _gather_along_first_dim(input_: torch.Tensor, group, mapping: str, pass_: str) -> torch.Tensor:
    """All-gather, concatenating the ranks' tensors along the first dimension, in rank order."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    output = input_.new_empty((world_size * input_.shape[0], *input_.shape[1:]))  # [n*s, ...]
    _note(mapping, "all_gather", pass_, input_, group)
    return host_staged("all_gather", all_gather_single, output, input_, group)


def _gather_along_last_dim(input_: torch.Tensor, group, mapping: str, pass_: str) -> torch.Tensor:
    """All-gather along the last dimension: gather along the first (contiguous), then move the blocks."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input_
    stacked = _gather_along_first_dim(input_, group, mapping, pass_)  # [n*b, ..., h/n]
    return torch.cat(stacked.chunk(world_size, dim=0), dim=-1).contiguous()  # [b, ..., h]


def _reduce_scatter_along_first_dim(input_: torch.Tensor, group, mapping: str, pass_: str) -> torch.Tensor:
    """Sum across the group, and keep this rank's slice of the first dimension."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input_
    rows = _divisible(input_.shape[0], world_size, "first")
    input_ = input_.contiguous()
    output = input_.new_empty((rows, *input_.shape[1:]))  # [s/n, ...]
    _note(mapping, "reduce_scatter", pass_, input_, group)
    return host_staged("reduce_scatter", reduce_scatter_single, output, input_, group)


def _all_to_all(input_: torch.Tensor, output_split_sizes, input_split_sizes, group, mapping: str,
                pass_: str) -> torch.Tensor:
    """Rank r sends its i-th first-dim block to rank i and receives rank i's r-th block, in rank order."""
    world_size = get_world_size(group)
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    if input_split_sizes is None:
        _divisible(input_.shape[0], world_size, "first")
    elif sum(input_split_sizes) != input_.shape[0] or len(input_split_sizes) != world_size:
        raise ValueError(f"input_split_sizes={list(input_split_sizes)} must have one entry per rank "
                         f"({world_size}) summing to the first dimension ({input_.shape[0]})")
    rows = input_.shape[0] if output_split_sizes is None else sum(output_split_sizes)
    output = input_.new_empty((rows, *input_.shape[1:]))
    _note(mapping, "all_to_all", pass_, input_, group)
    return host_staged("all_to_all", dist.all_to_all_single, output, input_, group,
                       output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes)


# -- the autograd functions: forward of one is the backward of its conjugate ----------------------------

class _CopyToModelParallelRegion(torch.autograd.Function):
    """``f`` in Megatron-LM (Shoeybi et al. 2019, sec. 3): identity forward, all-reduce backward.

    Conjugate of ``_ReduceFromModelParallelRegion`` (``g``). Its input is replicated; each rank's copy
    feeds that rank's part of the model, so each rank's gradient is one addend of the true gradient.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return _reduce(grad_output, ctx.group, "copy_to_tensor_model_parallel_region", "backward"), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """``g`` in Megatron-LM (Shoeybi et al. 2019, sec. 3): all-reduce forward, identity backward.

    Conjugate of ``_CopyToModelParallelRegion`` (``f``). Its output is replicated, so the gradient that
    comes back is already the whole gradient on every rank: summing it again would multiply it by the
    world size (the scaling trap of chapter 03).
    """

    @staticmethod
    def forward(ctx, input_, group):
        return _reduce(input_, group, "reduce_from_tensor_model_parallel_region", "forward")

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Split the last dimension, keep this rank's slice; backward all-gathers the slices' gradients.

    Conjugate of ``_GatherFromModelParallelRegion``.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_last_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group, "scatter_to_tensor_model_parallel_region",
                                      "backward"), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension; backward keeps this rank's slice of the gradient.

    Conjugate of ``_ScatterToModelParallelRegion``. Used by ``ColumnParallelLinear(gather_output=True)``.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _gather_along_last_dim(input_, group, "gather_from_tensor_model_parallel_region", "forward")

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Split the first (sequence) dimension; backward all-gathers the gradient along it.

    Conjugate of ``_GatherFromSequenceParallelRegion(tensor_parallel_output_grad=False)``.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _split_along_first_dim(input_, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, "scatter_to_sequence_parallel_region",
                                       "backward"), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the first (sequence) dimension.

    Backward, by default (``tensor_parallel_output_grad=True``): reduce-scatter, because the gathered
    tensor feeds a tensor-parallel region (a column-parallel linear), where every rank computes a
    different part of the model and so sends back a different, partial gradient of the whole sequence.
    This is Korthikanti et al.'s ``g`` (sec. 4.2.2); its conjugate is ``_ReduceScatterToSequenceParallelRegion``.
    With ``tensor_parallel_output_grad=False`` the output is used identically on every rank (replicated),
    its gradient is already complete, and the backward only keeps this rank's slice.
    """

    @staticmethod
    def forward(ctx, input_, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_along_first_dim(input_, group, "gather_from_sequence_parallel_region", "forward")

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.tensor_parallel_output_grad:
            grad = _reduce_scatter_along_first_dim(grad_output, ctx.group, "gather_from_sequence_parallel_region",
                                                   "backward")
        else:
            grad = _split_along_first_dim(grad_output, ctx.group)
        return grad, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the first (sequence) dimension; backward all-gathers.

    Korthikanti et al.'s ``g-bar`` (sec. 4.2.2): it replaces ``g``'s all-reduce after a row-parallel
    linear when sequence parallelism is on. Conjugate of ``_GatherFromSequenceParallelRegion``.
    """

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return _reduce_scatter_along_first_dim(input_, group, "reduce_scatter_to_sequence_parallel_region",
                                               "forward")

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output, ctx.group, "reduce_scatter_to_sequence_parallel_region",
                                       "backward"), None


class _AllToAll(torch.autograd.Function):
    """All-to-all along the first dimension; backward is the all-to-all that undoes it (splits swapped).

    An all-to-all only moves blocks between ranks (a permutation), so its adjoint is its inverse: its
    own conjugate. Used by expert parallelism (token dispatch) and Ulysses-style sequence parallelism.
    """

    @staticmethod
    def forward(ctx, input_, output_split_sizes, input_split_sizes, group):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _all_to_all(input_, output_split_sizes, input_split_sizes, group, "all_to_all", "forward")

    @staticmethod
    def backward(ctx, grad_output):
        grad = _all_to_all(grad_output, ctx.input_split_sizes, ctx.output_split_sizes, ctx.group, "all_to_all",
                           "backward")
        return grad, None, None, None


# -- the public functions ------------------------------------------------------------------------------

def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """``f``: identity forward, all-reduce backward (conjugate of ``reduce_from_tensor_model_parallel_region``)."""
    return _CopyToModelParallelRegion.apply(input_, group)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """``g``: all-reduce forward, identity backward (conjugate of ``copy_to_tensor_model_parallel_region``)."""
    return _ReduceFromModelParallelRegion.apply(input_, group)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Split the last dim forward, all-gather backward (conjugate of ``gather_from_tensor_model_parallel_region``)."""
    return _ScatterToModelParallelRegion.apply(input_, group)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the last dim forward, split backward (conjugate of ``scatter_to_tensor_model_parallel_region``)."""
    return _GatherFromModelParallelRegion.apply(input_, group)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Split the first dim forward, all-gather backward (conjugate of the gather with replicated output)."""
    return _ScatterToSequenceParallelRegion.apply(input_, group)


def gather_from_sequence_parallel_region(input_: torch.Tensor, tensor_parallel_output_grad: bool = True,
                                         group=None) -> torch.Tensor:
    """All-gather the first dim forward; reduce-scatter backward (or split, if the output is replicated).

    Conjugate of ``reduce_scatter_to_sequence_parallel_region``.
    """
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter the first dim forward, all-gather backward (conjugate of the sequence gather).

    Korthikanti et al.'s ``g-bar``: after a row-parallel linear with sequence parallelism.
    """
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group)


def all_to_all(input_: torch.Tensor, output_split_sizes=None, input_split_sizes=None, group=None) -> torch.Tensor:
    """All-to-all along the first dim forward; the inverse all-to-all backward (its own conjugate).

    ``input_split_sizes[i]`` rows go to rank i and ``output_split_sizes[i]`` rows come from rank i
    (``None``: equal blocks).
    """
    return _AllToAll.apply(input_, output_split_sizes, input_split_sizes, group)


# Name -> function, in the order the chapter presents them; and each one's conjugate.
MAPPINGS = {
    "copy_to_tensor_model_parallel_region": copy_to_tensor_model_parallel_region,
    "reduce_from_tensor_model_parallel_region": reduce_from_tensor_model_parallel_region,
    "scatter_to_tensor_model_parallel_region": scatter_to_tensor_model_parallel_region,
    "gather_from_tensor_model_parallel_region": gather_from_tensor_model_parallel_region,
    "scatter_to_sequence_parallel_region": scatter_to_sequence_parallel_region,
    "gather_from_sequence_parallel_region": gather_from_sequence_parallel_region,
    "reduce_scatter_to_sequence_parallel_region": reduce_scatter_to_sequence_parallel_region,
    "all_to_all": all_to_all,
}

CONJUGATE = {
    "copy_to_tensor_model_parallel_region": "reduce_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region": "copy_to_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region": "gather_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region": "scatter_to_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region": "gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)",
    "gather_from_sequence_parallel_region": "reduce_scatter_to_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region": "gather_from_sequence_parallel_region",
    "all_to_all": "all_to_all",
}
