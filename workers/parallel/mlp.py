"""The Megatron MLP: h -> ffn column-parallel, activation local, ffn -> h row-parallel (Shoeybi et al. 2019, Fig. 3a).

Why column first, then row: GeLU is elementwise, so ``GeLU(X [A_1, A_2]) = [GeLU(X A_1), GeLU(X A_2)]``:
each rank can apply it to its own columns with no communication. Split the first GEMM by *rows*
instead and each rank holds a partial sum ``X_r A_r``; since ``GeLU(a + b) != GeLU(a) + GeLU(b)`` the
partial sums would have to be all-reduced *before* the GeLU: one more synchronisation per layer. The
second GEMM then takes the column-split activation as its row-split input, and one all-reduce (``g``)
finishes the block. Backward mirrors it: one all-reduce, in ``f`` at the input. One each way.

SwiGLU (Shazeer 2020) has two first projections, gate and up, usually stored fused as ``[gate; up]``
(``[2 ffn, h]``). ``silu(gate) * up`` pairs gate column j with up column j, so rank r must hold *the
same* columns of both: rows ``[r f/t, (r+1) f/t)`` of gate and the same rows of up. Chunking the fused
weight into t contiguous blocks would instead hand rank 0 only gate rows (``swiglu_rows`` vs
``naive_rows``). Megatron-LM stores its fused fc1 per rank as ``[gate_r; up_r]`` for this reason.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.dense import DenseMLP, swiglu
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear, divide, group_size_rank


def swiglu_rows(ffn: int, rank: int, tp: int) -> torch.Tensor:
    """Rows of the fused ``[gate; up]`` weight that rank r holds: its gate block, then the same block of up."""
    n = divide(ffn, tp, "ffn")
    block = torch.arange(rank * n, (rank + 1) * n)
    return torch.cat([block, ffn + block])  # [2 ffn/t]


def naive_rows(ffn: int, rank: int, tp: int) -> torch.Tensor:
    """The trap: rank r's contiguous 1/t of the fused weight (rank 0 gets only gate rows when t >= 2)."""
    n = divide(2 * ffn, tp, "2 * ffn")
    return torch.arange(rank * n, (rank + 1) * n)


class ParallelMLP(nn.Module):
    """``fc2(act(fc1(x)))`` with ``fc1`` column-parallel and ``fc2`` row-parallel: one all-reduce each way.

    ``[s, b, h]`` -> ``[s, b, h]`` (``[s/t, b, h]`` in and out with sequence parallelism).
    """

    def __init__(self, hidden: int, ffn: int = 0, activation: str = "gelu", bias: bool = True, group=None,
                 *, sequence_parallel: bool = False, device=None, dtype=None, _dense: DenseMLP | None = None,
                 _fc1_rows: torch.Tensor | None = None):
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation={activation!r} is not supported: choose 'gelu' or 'swiglu'")
        if _dense is None:
            _dense = DenseMLP(hidden, ffn, activation, bias, device, dtype)
        self.hidden, self.ffn, self.activation = hidden, _dense.ffn, activation
        tp, rank = group_size_rank(group)
        divide(self.ffn, tp, "ffn")
        if activation == "swiglu" and _fc1_rows is None:
            _fc1_rows = swiglu_rows(self.ffn, rank, tp)
        self.fc1 = ColumnParallelLinear.from_dense(_dense.fc1, group, sequence_parallel=sequence_parallel,
                                                   rows=_fc1_rows)  # [ffn/t (x2), h]
        self.fc2 = RowParallelLinear.from_dense(_dense.fc2, group, sequence_parallel=sequence_parallel)  # [h, ffn/t]

    @classmethod
    def from_dense(cls, mlp: DenseMLP, group=None, *, sequence_parallel: bool = False,
                   fc1_rows: torch.Tensor | None = None) -> "ParallelMLP":
        """This rank's shard of ``mlp``. ``fc1_rows`` overrides the split of fc1 (to demonstrate a wrong one)."""
        return cls(mlp.hidden, mlp.ffn, mlp.activation, mlp.fc1.bias is not None, group,
                   sequence_parallel=sequence_parallel, _dense=mlp, _fc1_rows=fc1_rows)

    def act(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y) if self.activation == "swiglu" else F.gelu(y)  # local: elementwise on our columns

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's contribution before the all-reduce, no bias, no communication (``x`` already replicated)."""
        return self.fc2.local(self.act(self.fc1.local(x)))  # [s, b, h], a partial sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc1(x))  # f, then [s, b, ffn/t]
        return self.fc2(y)  # g, then + bias: [s, b, h]
