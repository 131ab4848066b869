"""Build a dense module, shard it on this rank, run it: what the chapter 04-06 workers share.

Every rank builds the same dense module from one seed (no communication), keeps its shard with
``from_dense``, runs forward and backward on its part of the same input, and returns its part of the
output and input gradient, every parameter gradient with the indices of the dense entries it holds, and
the communication ledger. The notebook (``course_utils.tp_check``) rebuilds the full tensors and compares
them with ``dense.reference``, computed in one process.

Which part of a tensor a rank holds is described as ``{"dim", "index", "value"}`` (dim -1: all of it),
the format of ``plan.shard_record``, so one ``plan.assemble`` rebuilds activations and parameters alike.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.parallel import dense as D
from workers.parallel import mappings
from workers.parallel.attention import ParallelAttention, destroy_owned_groups, head_problem, naive_qkv_rows
from workers.parallel.block import ParallelBlock
from workers.parallel.comm_stats import CommLedger, name_scopes, region
from workers.parallel.faults import FAULTS, inject
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear, contiguous_index, group_size_rank
from workers.parallel.mlp import ParallelMLP, naive_rows
from workers.parallel.plan import shard_record

KINDS = ("column", "row", "mlp", "attention", "block")


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def problem(kind: str, cfg: D.BlockConfig, tp: int, seq: int, batch: int, *, sequence_parallel: bool = False,
            gather_output: bool = False, input_is_parallel: bool = True, fault: str = "") -> str | None:
    """One sentence saying what to change, or None: the rules of tensor (and sequence) parallelism."""
    if kind not in KINDS:
        return f"module={kind!r} is not one of {', '.join(KINDS)}"
    if seq < 1 or batch < 1:
        return f"seq={seq} and batch={batch} must be at least 1"
    bad = D.problem(cfg)
    if bad:
        return bad
    if fault and fault not in FAULTS:
        return f"fault={fault!r} is not a known fault: choose '' or one of {', '.join(FAULTS)}"
    if kind in ("column", "row", "mlp", "block") and cfg.ffn % tp:
        return (f"ffn_hidden={cfg.ffn} is not divisible by the tensor-parallel size {tp}: "
                f"choose a tensor-parallel size that divides {cfg.ffn}")
    if kind in ("attention", "block"):
        bad = head_problem(cfg.n_heads, cfg.kv_heads, tp)
        if bad:
            return bad
    if sequence_parallel:
        if kind in ("column", "row"):
            return "sequence_parallel applies to a whole MLP, attention or block, not to a single linear layer"
        if seq % tp:
            return (f"seq={seq} is not divisible by the tensor-parallel size {tp}: sequence parallelism gives each "
                    f"rank seq/{tp} rows; choose a multiple of {tp}")
    if gather_output and kind != "column":
        return "gather_output only applies to module='column'"
    if not input_is_parallel and kind != "row":
        return "input_is_parallel=False only applies to module='row'"
    return None


def shard(kind: str, module: nn.Module, group=None, *, sequence_parallel: bool = False, gather_output: bool = False,
          input_is_parallel: bool = True, split: str = "right") -> nn.Module:
    """This rank's parallel version of a dense module. ``split="naive"``: the contiguous-chunk trap for fused weights."""
    tp, rank = group_size_rank(group)
    sp = dict(sequence_parallel=sequence_parallel)
    if kind == "column":
        return ColumnParallelLinear.from_dense(module, group, gather_output=gather_output)
    if kind == "row":
        return RowParallelLinear.from_dense(module, group, input_is_parallel=input_is_parallel)
    if kind == "mlp":
        rows = naive_rows(module.ffn, rank, tp) if (split == "naive" and module.activation == "swiglu") else None
        return ParallelMLP.from_dense(module, group, fc1_rows=rows, **sp)
    if kind == "attention":
        rows = (naive_qkv_rows(module.n_heads, module.n_kv_heads, module.head_dim, rank, tp) if split == "naive"
                else None)
        return ParallelAttention.from_dense(module, group, qkv_rows=rows, **sp)
    if kind == "block":
        return ParallelBlock.from_dense(module, group, **sp)
    raise ValueError(f"no module kind {kind!r}")


def _part(value: torch.Tensor, dim: int, index: torch.Tensor | None) -> dict:
    if dim < 0:
        return {"dim": -1, "index": torch.empty(0, dtype=torch.long), "value": value}
    return {"dim": dim, "index": index, "value": value.index_select(dim, index.to(value.device))}


def layouts(kind: str, cfg: D.BlockConfig, seq: int, group=None, *, sequence_parallel: bool = False,
            gather_output: bool = False, input_is_parallel: bool = True):
    """(dim, index) of this rank's part of the input and of the output: -1 means replicated."""
    tp, rank = group_size_rank(group)
    replicated = (-1, None)
    rows = (0, contiguous_index(seq, tp, rank, "seq")) if sequence_parallel else replicated
    if kind == "column":
        return replicated, (replicated if gather_output else (2, contiguous_index(cfg.ffn, tp, rank, "ffn_hidden")))
    if kind == "row":
        return (2, contiguous_index(cfg.ffn, tp, rank, "ffn_hidden")) if input_is_parallel else replicated, replicated
    return rows, rows


def forward_backward(kind: str, cfg: D.BlockConfig, *, seq: int, batch: int, seed: int = 0, group=None,
                     device="cpu", dtype=torch.float32, sequence_parallel: bool = False, gather_output: bool = False,
                     input_is_parallel: bool = True, split: str = "right", fault: str = "") -> dict:
    """One forward and backward of this rank's shard; everything needed to compare it with the dense module."""
    dense = D.build(kind, cfg, seed)
    model = shard(kind, dense, group, sequence_parallel=sequence_parallel, gather_output=gather_output,
                  input_is_parallel=input_is_parallel, split=split).to(device=device, dtype=dtype)
    name_scopes(model)
    x_full, g_full = D.inputs(kind, cfg, seq, batch, seed)
    (in_dim, in_idx), (out_dim, out_idx) = layouts(kind, cfg, seq, group, sequence_parallel=sequence_parallel,
                                                   gather_output=gather_output, input_is_parallel=input_is_parallel)
    x = _part(x_full, in_dim, in_idx)["value"].to(device=device, dtype=dtype).requires_grad_()
    grad_output = _part(g_full, out_dim, out_idx)["value"].to(device=device, dtype=dtype)
    try:
        with inject(fault), CommLedger() as ledger:
            y = model(x)  # this rank's part of the output
            y.backward(grad_output)
    finally:
        destroy_owned_groups(model)
    return {"output": {"dim": out_dim, "index": _part(g_full, out_dim, out_idx)["index"], "value": y.detach()},
            "grad_input": {"dim": in_dim, "index": _part(x_full, in_dim, in_idx)["index"], "value": x.grad},
            "grads": shard_record(model, "grad"), "comm": ledger.records(), "comm_summary": ledger.summary()}


# -- training: a few optimizer steps ---------------------------------------------------------------

def training_data(cfg: D.BlockConfig, seq: int, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 999)
    x = torch.randn(seq, batch, cfg.hidden, generator=gen)
    target = torch.randn(seq, batch, cfg.hidden, generator=gen)
    return x, target


def train(model: nn.Module, x: torch.Tensor, target: torch.Tensor, steps: int, lr: float, *, elements: int,
          group=None, sequence_parallel: bool = False, on_step=None) -> list[float]:
    """Adam on the mean squared error. With SP each rank sums its own rows; ``g`` adds the ranks' sums."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - target) ** 2).sum() / elements
        if sequence_parallel:  # one logical loss: forward all-reduce, identity backward (chapter 03's g)
            loss = region("loss", mappings.reduce_from_tensor_model_parallel_region, loss, group=group)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def train_dense(cfg: D.BlockConfig, *, seq: int, batch: int, steps: int, lr: float, seed: int = 0,
                dtype=torch.float64) -> list[float]:
    """The single-process reference run (float64 by default, from the same float32 initial weights)."""
    model = D.build("block", cfg, seed).to(dtype)
    x, target = training_data(cfg, seq, batch, seed)
    return train(model, x.to(dtype), target.to(dtype), steps, lr, elements=target.numel())


def train_parallel(cfg: D.BlockConfig, *, seq: int, batch: int, steps: int, lr: float, seed: int = 0, group=None,
                   device="cpu", sequence_parallel: bool = False, fault: str = "", on_step=None) -> dict:
    model = shard("block", D.build("block", cfg, seed), group, sequence_parallel=sequence_parallel).to(device)
    name_scopes(model)
    x, target = training_data(cfg, seq, batch, seed)
    elements = target.numel()
    if sequence_parallel:
        tp, rank = group_size_rank(group)
        rows = contiguous_index(seq, tp, rank, "seq")
        x, target = x[rows], target[rows]
    try:
        with inject(fault), CommLedger() as ledger:
            losses = train(model, x.to(device), target.to(device), steps, lr, elements=elements, group=group,
                           sequence_parallel=sequence_parallel, on_step=on_step)
    finally:
        destroy_owned_groups(model)
    return {"losses": losses, "params": shard_record(model, "value"), "comm_summary": ledger.summary()}
