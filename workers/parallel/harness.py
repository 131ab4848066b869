"""Build a dense module, shard it on this rank, run it: what the chapter 04-06 workers share.

Every rank builds the same dense module from one seed (no communication), keeps its shard with
``from_dense``, runs forward and backward on its part of the same input, and returns its part of the
output and input gradient, every parameter gradient with the indices of the dense entries it holds, and
the communication ledger. The notebook (``course_utils.tp_check``) rebuilds the full tensors and compares
them with ``dense.reference``, computed in one process.

Which part of a tensor a rank holds is described as ``{"dim", "index", "value"}`` (dim -1: all of it),
the format of ``plan.shard_record``, so one ``plan.assemble`` rebuilds activations and parameters alike.

Chapter 06 also trains: ``train_parallel`` cuts the course's GPT (``workers/model/gpt.py``, two layers of the
block's shape, ``gpt_config``) with ``ParallelGPT`` and runs a few Adam steps; ``train_dense`` is the same training
in one process, which ``tp_check.compare_training`` holds the ranks' losses and final parameters to. The data and
the loss are chapter 15's (``workers/model/batch.py``: a ragged batch, the cross-entropy summed over the valid
tokens), so the two chapters train the one model the same way.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.model.batch import make_batch, token_losses
from workers.model import dense as D
from workers.model.gpt import GPTConfig, Where, make_model
from workers.parallel.attention import ParallelAttention, destroy_owned_groups, head_problem, naive_qkv_rows
from workers.parallel.block import ParallelBlock
from workers.parallel.comm_stats import CommLedger, name_scopes
from workers.parallel.faults import FAULTS, inject
from workers.parallel.gpt import ParallelGPT, Parallelism
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear, contiguous_index, group_size_rank
from workers.parallel.mlp import ParallelMLP, naive_rows
from workers.parallel.plan import shard_record
from workers.runtime import at_least, divides, one_of, refusal

KINDS = ("column", "row", "mlp", "attention", "block")


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def problem(kind: str, cfg: D.BlockConfig, tp: int, seq: int, batch: int, *, sequence_parallel: bool = False,
            gather_output: bool = False, input_is_parallel: bool = True, fault: str = "") -> str | None:
    """One sentence saying what to change, or None: the rules of tensor (and sequence) parallelism.

    The heads follow the course's one rule (``head_problem``, from ``workers/layout/rules.py``); every size that is
    cut over the ``tp`` ranks of a group must be divisible by it.
    """
    bad = refusal(one_of("module", kind, KINDS), at_least("seq", seq), at_least("batch", batch),
                  one_of("fault", fault, ("",) + FAULTS)) or D.problem(cfg)
    if bad:
        return bad
    sp_single = "sequence_parallel applies to a whole MLP, attention or block, not to a single linear layer"
    return refusal(
        divides("tp", tp, "ffn", cfg.ffn) if kind in ("column", "row", "mlp", "block") else None,
        head_problem(cfg.heads, cfg.kv_heads, tp) if kind in ("attention", "block") else None,
        (sp_single if kind in ("column", "row") else _rows_problem(tp, seq)) if sequence_parallel else None,
        "gather_output only applies to module='column'" if gather_output and kind != "column" else None,
        "input_is_parallel=False only applies to module='row'" if not input_is_parallel and kind != "row" else None)


def _rows_problem(tp: int, seq: int) -> str | None:
    bad = divides("tp", tp, "seq", seq)
    return bad and f"{bad} (sequence parallelism gives each rank seq/tp rows)"


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
        rows = (naive_qkv_rows(module.heads, module.kv_heads, module.head_dim, rank, tp) if split == "naive"
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
        return replicated, (replicated if gather_output else (2, contiguous_index(cfg.ffn, tp, rank, "ffn")))
    if kind == "row":
        return (2, contiguous_index(cfg.ffn, tp, rank, "ffn")) if input_is_parallel else replicated, replicated
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


# -- training: the course's GPT, a few optimizer steps --------------------------------------------------

TRAIN_LAYERS, TRAIN_VOCAB = 2, 32  # a couple of the chapter's blocks, and a vocabulary as small as chapter 15's


def gpt_config(cfg: D.BlockConfig, seq: int) -> GPTConfig:
    """The GPT chapter 06 trains: ``TRAIN_LAYERS`` layers of the block's shape, the LM head tied to the embedding,
    initialised off every symmetric point ("perturbed": random biases, LayerNorms off (1, 0), a wider embedding),
    so that a gradient summed twice or left partial anywhere shows. The block's ``hidden_dropout`` becomes the
    model's keyed dropout (the same mask on every layout)."""
    return GPTConfig(vocab=TRAIN_VOCAB, seq=seq, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                     ffn=cfg.ffn, layers=TRAIN_LAYERS, activation=cfg.activation, bias=cfg.bias,
                     qkv_bias=cfg.qkv_bias, tied=True, dropout=cfg.hidden_dropout, init="perturbed")


def training_batch(gpt: GPTConfig, batch: int, seed: int = 0):
    """The one batch every step trains on: ``(inputs [b, s], targets [b, s], valid [b, s])``, the same on every rank.

    Chapter 15's ragged batch (``make_batch``): each sample has its own number of valid targets, so the loss is the
    mean over the valid tokens of the whole batch, not of each sample.
    """
    tokens, valid = make_batch(gpt, batch, step=0, seed=seed + 1)  # [b, s + 1], [b, s]
    return tokens[:, :-1], tokens[:, 1:], valid


def train(forward, parameters, batch, steps: int, lr: float, *, on_step=None) -> list[float]:
    """Adam on the mean cross-entropy of the valid next tokens; ``forward(inputs, where)`` gives ``logits [s, b, V]``.

    Every rank of a tensor-parallel group holds the whole batch and ends with the whole logits (the head is
    replicated; sequence parallelism gathers the rows before it), so each computes the same, complete loss: its
    backward needs no collective of its own, only those inside the model.
    """
    inputs, targets, valid = batch
    b, s = inputs.shape
    opt = torch.optim.Adam(parameters, lr=lr)
    losses = []
    for step in range(steps):
        where = Where(step, torch.arange(s), torch.arange(b), b, s)  # the step keys the dropout masks
        opt.zero_grad(set_to_none=True)
        loss = token_losses(forward(inputs, where), targets, valid) / valid.sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def train_dense(gpt: GPTConfig, *, batch: int, steps: int, lr: float, seed: int = 0,
                dtype=torch.float64) -> tuple[list[float], dict]:
    """The single-process reference: the same GPT from the same float32 initial weights, trained in ``dtype``
    (float64 by default, so the comparison measures the ranks' float32 error and nothing else). Returns the losses
    and the final parameters by name."""
    model = make_model(gpt, seed, dtype=torch.float32).to(dtype)
    inputs, targets, valid = training_batch(gpt, batch, seed)
    losses = train(lambda x, where: model(x, where).transpose(0, 1), model.parameters(),  # [b, s, V] -> [s, b, V]
                   (inputs, targets, valid), steps, lr)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def train_parallel(cfg: D.BlockConfig, *, seq: int, batch: int, steps: int, lr: float, seed: int = 0, group=None,
                   device="cpu", dtype=torch.float32, sequence_parallel: bool = False, fault: str = "",
                   on_step=None) -> dict:
    """``steps`` Adam steps of this rank's cut of the GPT (``ParallelGPT``); its losses and final parameter shards."""
    gpt = gpt_config(cfg, seq)
    tp, rank = group_size_rank(group)
    model = ParallelGPT(make_model(gpt, seed, dtype=torch.float32),
                        Parallelism(group, tp, rank, sequence_parallel)).to(device=device, dtype=dtype)
    name_scopes(model)
    inputs, targets, valid = training_batch(gpt, batch, seed)
    try:
        with inject(fault), CommLedger() as ledger:
            losses = train(lambda x, where: model(x.to(device), where), model.parameters(),
                           (inputs, targets.to(device), valid.to(device)), steps, lr, on_step=on_step)
    finally:
        destroy_owned_groups(model)
    return {"losses": losses, "params": shard_record(model, "value"), "comm_summary": ledger.summary(),
            "model": gpt.as_dict()}
