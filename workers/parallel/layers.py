"""Column- and row-parallel linear layers (Shoeybi et al. 2019, "Megatron-LM", sec. 3, eq. 3 and Figure 3).

``Y = X A + b`` with ``A`` of shape ``[in, out]`` (``torch.nn.Linear`` stores ``A^T``, ``[out, in]``):

* **column parallel**: ``A = [A_1, ..., A_t]`` split by output columns. Rank r computes ``Y_r = X A_r + b_r``,
  its slice of the output, from the whole input. Forward needs no communication; the input enters through
  ``f`` (identity forward, all-reduce backward) because every rank's slice depends on all of X, so the
  gradient of X is the sum of the ranks' contributions. ``gather_output=True`` all-gathers Y.
* **row parallel**: ``A = [A_1; ...; A_t]`` split by input rows, X split by columns. Rank r computes the
  partial product ``X_r A_r``; the output is their sum: ``g`` (all-reduce forward, identity backward).
  The bias is added *once*, after the reduce: added before it, it would be summed t times.

With ``sequence_parallel=True`` (Korthikanti et al. 2022, sec. 4.2.2) the input of a column-parallel
layer is a ``[s/t, b, h]`` shard that is all-gathered (reduce-scattered in backward), and the row-parallel
output is reduce-scattered (all-gathered in backward) instead of all-reduced: same bytes, a 1/t-size
result. The row bias then works on a sequence shard, so its gradient is partial on each rank: it enters
through ``f`` too, which sums the gradient over the group in backward.

Both layers can be built from the dense ``nn.Linear`` they replace: ``ColumnParallelLinear.from_dense(linear,
group)`` keeps this rank's rows of ``linear.weight``. Every sharded parameter carries ``partition_dim``
and ``partition_index`` (which rows or columns of the dense parameter it holds), Megatron-style, so its
gradient can be put back in place and compared (``workers/parallel/plan.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.parallel import mappings
from workers.parallel.comm_stats import PARAMETER, region


def group_size_rank(group=None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def divide(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {tp}: "
                         f"choose a tensor-parallel size that divides {size}")
    return size // tp


def contiguous_index(size: int, tp: int, rank: int, what: str) -> torch.Tensor:
    """Rank r's block ``[r size/t, (r+1) size/t)`` of a dimension of length ``size``."""
    n = divide(size, tp, what)
    return torch.arange(rank * n, (rank + 1) * n)


def shard_parameter(full: torch.Tensor, dim: int, index: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``full``'s entries at ``index`` along ``dim``, labelled with where they came from."""
    param = nn.Parameter(full.detach().index_select(dim, index.to(full.device)).clone())
    param.partition_dim = dim
    param.partition_index = index.cpu()
    return param


def replicated_parameter(full: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(full.detach().clone())


class ColumnParallelLinear(nn.Module):
    """``Y_r = X A_r + b_r``: this rank's output columns. Input ``[s, b, in]`` (``[s/t, b, in]`` with SP).

    Output ``[s, b, out/t]``, or ``[s, b, out]`` with ``gather_output=True``. Megatron-LM:
    ``megatron/core/tensor_parallel/layers.py: ColumnParallelLinear``.
    """

    comm_scope = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group=None, *, sequence_parallel: bool = False, device=None, dtype=None,
                 _dense: nn.Linear | None = None, _rows: torch.Tensor | None = None):
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("gather_output=True cannot be combined with sequence_parallel=True: a sequence-parallel "
                             "column layer feeds a row-parallel layer, which wants the split output")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group, self.sequence_parallel = gather_output, group, sequence_parallel
        tp, rank = group_size_rank(group)
        if _dense is None:  # the same master weight on every rank (same seed), then keep our rows
            _dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if _rows is None:
            _rows = contiguous_index(out_features, tp, rank, "out_features")
        elif gather_output:
            raise ValueError("gather_output=True needs the contiguous split (each rank a block of columns)")
        self.weight = shard_parameter(_dense.weight, 0, _rows)  # [out/t, in]
        self.bias = shard_parameter(_dense.bias, 0, _rows) if _dense.bias is not None else None  # [out/t]
        self.out_features_per_partition = len(_rows)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, *, gather_output: bool = False,
                   sequence_parallel: bool = False, rows: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """This rank's shard of ``linear``: the contiguous block of output rows, or the given ``rows``."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                   sequence_parallel=sequence_parallel, _dense=linear, _rows=rows)

    def input_region(self, x: torch.Tensor) -> torch.Tensor:
        """``f`` (or, with SP, the sequence all-gather): the input every rank's columns read in full."""
        if self.sequence_parallel:
            return region(self.comm_scope, mappings.gather_from_sequence_parallel_region, x, True,
                          group=self.group)  # [s/t, b, in] -> [s, b, in]
        return region(self.comm_scope, mappings.copy_to_tensor_model_parallel_region, x, group=self.group)

    def local(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        """The rank's own matmul, no communication: ``x [s, b, in]`` -> ``[s, b, out/t]``."""
        weight = self.weight if weight is None else weight
        bias = self.bias if bias is None else bias
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        """``weight``/``bias``: use these (views of this layer's parameters after a mapping) instead."""
        y = self.local(self.input_region(x), weight, bias)  # [s, b, out/t]
        if self.gather_output:
            y = region(self.comm_scope, mappings.gather_from_tensor_model_parallel_region, y,
                       group=self.group)  # [s, b, out]
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} on this rank), gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = sum_r X_r A_r + b``: partial products all-reduced, then the bias, once.

    Input ``[s, b, in/t]`` (``input_is_parallel=True``, the output of a column-parallel layer) or
    ``[s, b, in]`` (split here). Output ``[s, b, out]`` replicated, or ``[s/t, b, out]`` with SP.
    Megatron-LM: ``megatron/core/tensor_parallel/layers.py: RowParallelLinear``.
    """

    comm_scope = "row"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group=None, *, sequence_parallel: bool = False, device=None, dtype=None,
                 _dense: nn.Linear | None = None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True: the input is the split output "
                             "of a column-parallel layer")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group, self.sequence_parallel = input_is_parallel, group, sequence_parallel
        tp, rank = group_size_rank(group)
        if _dense is None:
            _dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        cols = contiguous_index(in_features, tp, rank, "in_features")
        self.weight = shard_parameter(_dense.weight, 1, cols)  # [out, in/t]
        self.bias = replicated_parameter(_dense.bias) if _dense.bias is not None else None  # [out], every rank
        self.in_features_per_partition = len(cols)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, *, input_is_parallel: bool = True,
                   sequence_parallel: bool = False) -> "RowParallelLinear":
        """This rank's shard of ``linear``: its block of input columns; the bias is kept whole on every rank."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                   sequence_parallel=sequence_parallel, _dense=linear)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``X_r A_r``, no bias, no communication: ``[s, b, in/t]`` -> ``[s, b, out]``."""
        return F.linear(x, self.weight)

    def output_region(self, partial: torch.Tensor) -> torch.Tensor:
        """``g`` (or, with SP, the sequence reduce-scatter): sum the ranks' partial products."""
        if self.sequence_parallel:
            return region(self.comm_scope, mappings.reduce_scatter_to_sequence_parallel_region, partial,
                          group=self.group)  # [s, b, out] -> [s/t, b, out]
        return region(self.comm_scope, mappings.reduce_from_tensor_model_parallel_region, partial, group=self.group)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return y
        bias = self.bias
        if self.sequence_parallel:  # each rank adds it to its own rows: its gradient is a partial sum
            bias = region(self.comm_scope + ".bias", mappings.copy_to_tensor_model_parallel_region, bias,
                          group=self.group, kind=PARAMETER)
        return y + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = region(self.comm_scope, mappings.scatter_to_tensor_model_parallel_region, x,
                       group=self.group)  # [s, b, in] -> [s, b, in/t]
        return self.add_bias(self.output_region(self.local(x)))  # bias once, after the reduce

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} on this rank), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
