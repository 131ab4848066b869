"""A Megatron-style pre-LN transformer layer, tensor-parallel, with optional sequence parallelism.

    h = x + dropout(attention(ln1(x)))        attention: f -> QKV (column, by heads) -> local heads -> proj (row) -> g
    y = h + dropout(mlp(ln2(h)))              MLP:       f -> fc1 (column) -> GeLU -> fc2 (row) -> g

Tensor parallelism alone (Shoeybi et al. 2019, Figure 4): two ``g`` forward (after each row-parallel
layer) and two ``f`` backward (before each column-parallel layer): 2 + 2 all-reduces of ``b*s*h``
elements per layer. Everything outside the two parallel regions (LayerNorms, dropouts, residual adds)
runs *replicated*: every rank computes the same thing on the whole ``[s, b, h]`` tensor.

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2, Figure 5): those replicated regions are
split along the sequence instead, each rank working on ``[s/t, b, h]``. Each ``g`` becomes a
reduce-scatter (sum the partial products, keep my s/t rows), each ``f`` an all-gather (rebuild the whole
sequence for the column-parallel GEMM); backward swaps them. A ring all-reduce *is* a reduce-scatter
followed by an all-gather, so the bytes are the same; what is gained is that LayerNorm, dropout and the
residuals store 1/t of their activations. The price is that LayerNorm parameters and the row biases now
see a different slice of the sequence on each rank, so their gradients are partial sums: they enter
through ``f`` (an all-reduce of their gradient in backward). Megatron-LM does the same sum after the
backward pass, coalesced into one bucket (``finalize_model_grads``); here each parameter gets its own
small all-reduce, which the communication ledger counts as kind "parameter".
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import mappings
from workers.parallel.attention import ParallelAttention, head_problem
from workers.parallel.comm_stats import PARAMETER, region
from workers.model.dense import ATTENTION_SITE, MLP_SITE, BlockConfig, DenseBlock, SharedMaskDropout
from workers.model.dense import problem as dense_problem
from workers.parallel.layers import group_size_rank, replicated_parameter
from workers.parallel.mlp import ParallelMLP


def block_problem(cfg: BlockConfig, tp: int) -> str | None:
    """One sentence saying why ``cfg`` cannot be split over ``tp`` ranks, or None: every rule of the layer.

    The dense shape (hidden % heads, heads % kv_heads, ...), the heads over TP (heads % tp, and kv_heads and tp
    dividing one another), the MLP's ffn % tp; hidden % tp follows from hidden % heads and heads % tp.
    ``ParallelBlock`` checks all of them before building anything, because the attention creates its KV-replica
    process groups (when kv_heads < tp) before the MLP would find a bad ffn.
    """
    return (dense_problem(cfg) or head_problem(cfg.heads, cfg.kv_heads, tp)
            or (f"ffn={cfg.ffn} is not divisible by tp={tp}: "
                f"choose a tensor-parallel size that divides {cfg.ffn}" if cfg.ffn % tp else None))


class ParallelLayerNorm(nn.Module):
    """LayerNorm with replicated parameters; on a sequence shard their gradients are summed over the group."""

    comm_scope = "layernorm"

    def __init__(self, dense: nn.LayerNorm, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.normalized_shape, self.eps = dense.normalized_shape, dense.eps
        self.weight = replicated_parameter(dense.weight)
        self.bias = replicated_parameter(dense.bias)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight = region(self.comm_scope + ".weight", mappings.copy_to_tensor_model_parallel_region, weight,
                            group=self.group, kind=PARAMETER)
            bias = region(self.comm_scope + ".bias", mappings.copy_to_tensor_model_parallel_region, bias,
                          group=self.group, kind=PARAMETER)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class ParallelBlock(nn.Module):
    """The tensor-parallel layer. ``[s, b, h]`` -> ``[s, b, h]``; with ``sequence_parallel`` ``[s/t, b, h]`` both ways.

    ``segment`` (optional) is a context-manager factory ``segment(name)`` wrapped around each stage
    (ln1, attention, residual1, ln2, mlp, residual2): the profiler of chapter 06 times them with it.
    """

    def __init__(self, cfg: BlockConfig, group=None, *, sequence_parallel: bool = False, device=None, dtype=None,
                 _dense: DenseBlock | None = None):
        super().__init__()
        self.tp, self.rank = group_size_rank(group)
        # All sizes first: a refusal after dist.new_group would leave a process group behind on warm ranks.
        problem = block_problem(cfg, self.tp)
        if problem:
            raise ValueError(problem)
        if _dense is None:
            _dense = DenseBlock(cfg, device, dtype)
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        sp = dict(sequence_parallel=sequence_parallel)
        self.ln1 = ParallelLayerNorm(_dense.ln1, group, sequence_parallel)
        self.attention = ParallelAttention.from_dense(_dense.attention, group, **sp)
        self.ln2 = ParallelLayerNorm(_dense.ln2, group, sequence_parallel)
        self.mlp = ParallelMLP.from_dense(_dense.mlp, group, **sp)
        self.dropout = SharedMaskDropout(_dense.dropout.p, _dense.dropout.seed)
        self.segment = lambda name: contextlib.nullcontext()

    @classmethod
    def from_dense(cls, block: DenseBlock, group=None, *, sequence_parallel: bool = False) -> "ParallelBlock":
        return cls(block.cfg, group, sequence_parallel=sequence_parallel, _dense=block)

    def drop(self, y: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return self.dropout(y)
        rows = y.shape[0]  # my s/t rows of the whole sequence's mask
        return self.dropout(y, slice(self.rank * rows, (self.rank + 1) * rows), rows * self.tp)

    def forward(self, x: torch.Tensor, drop=None) -> torch.Tensor:
        """``drop(y, site)`` replaces the block's own dropout (the GPT's keyed dropout, ``workers/parallel/gpt.py``)."""
        drop = drop or (lambda y, site: self.drop(y))
        with self.segment("ln1"):
            y = self.ln1(x)  # [s, b, h] (or [s/t, b, h])
        with self.segment("attention"):
            y = self.attention(y)  # f ... g inside
        with self.segment("residual1"):
            h = x + drop(y, ATTENTION_SITE)
        with self.segment("ln2"):
            y = self.ln2(h)
        with self.segment("mlp"):
            y = self.mlp(y)  # f ... g inside
        with self.segment("residual2"):
            return h + drop(y, MLP_SITE)
