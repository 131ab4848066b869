"""The course's GPT cut for this rank: tensor and sequence parallelism, one pipeline stage of it, and context
parallelism's ring inside the attention (Picotron's ``apply_tensor_parallel``; torchtitan's ``parallelize``).

    dense = make_model(cfg, seed)                               # every rank builds the same dense GPT
    stage = ParallelGPT(dense, Parallelism(tp_group, tp, tp_rank, sequence_parallel=True))
    logits = stage(tokens, where)                               # [s/cp, b, vocab] on the last stage

Every parameter of a ``ParallelGPT`` is the dense parameter of the same name (``blocks.3.mlp.fc1.weight``) or a TP
shard of it: each layer is the library's ``ParallelBlock`` (``ParallelLayerNorm``, ``ParallelAttention`` with heads
over TP, ``ParallelMLP`` column then row), cut from the dense model's ``DenseBlock``. Activations keep the model's
one layout, ``[s', b, h]`` with s' = s/cp, or s/(cp tp) under sequence parallelism.

A pipeline stage (a *virtual* stage ``vs`` of ``stages`` with interleaving) holds a contiguous run of layers; the
first also holds the embedding and the position table, the last ``ln_f`` and the LM head. The head is tied to the
embedding: with one stage it *is* ``embed.weight``; with several, the last stage holds a copy (``head.weight``,
``tied_to = "embed.weight"``) whose gradient the trainer sums with the embedding's over the embedding group, so the
two copies take the same step (Megatron's ``_allreduce_embedding_grads``). The embedding and head are replicated
over TP (Megatron splits them by vocabulary; at vocab 32 nothing is gained, and a replicated head keeps the loss a
plain cross-entropy).

Dropout is the model's keyed dropout (``workers/model/gpt.py: keyed_dropout``), one mask for the whole
``[seq, global_batch, hidden]`` tensor of a (step, layer, site): inside a TP group the replicated region uses the
*same* mask on every rank (the ranks compute the same thing); under sequence parallelism each rank uses *its own
rows* of it (``dropout_positions``). Chapter 15's injected faults replace exactly those two methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.gpt import GPT, Where, keyed_dropout
from workers.parallel import mappings
from workers.parallel.block import ParallelBlock, ParallelLayerNorm
from workers.parallel.layers import replicated_parameter


@dataclass(frozen=True)
class Parallelism:
    """What a stage needs to know about the layout on this rank."""

    tp_group: object = None
    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    ring: object = None  # context parallelism: a workers.context_parallel.ring.Ring (None: cp = 1)
    split: str = "zigzag"


class ParallelGPT(nn.Module):
    """Virtual stage ``vs`` of ``stages`` of ``dense``: its layers (and the embedding or the head), cut for ``par``.

    First stage: ``tokens [b, s/cp]`` in; last stage: ``logits [s/cp, b, vocab]`` out; between, ``[s', b, h]``.
    """

    def __init__(self, dense: GPT, par: Parallelism = Parallelism(), vs: int = 0, stages: int = 1):
        super().__init__()
        cfg = dense.cfg
        per = cfg.layers // stages
        self.first, self.last, self.par, self.cfg = vs == 0, vs == stages - 1, par, cfg
        self.seed = dense.dropout_seed
        self.layers = list(range(vs * per, (vs + 1) * per))
        sp, group = par.sequence_parallel, par.tp_group
        if self.first:
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden, _weight=replicated_parameter(dense.embed.weight))
            self.pos = replicated_parameter(dense.pos)
        self.blocks = nn.ModuleDict({str(i): ParallelBlock.from_dense(dense.blocks[i], group, sequence_parallel=sp)
                                     for i in self.layers})
        for block in self.blocks.values():
            block.attention.ring, block.attention.split = par.ring, par.split
        if self.last:
            self.ln_f = ParallelLayerNorm(dense.ln_f, group, sp)
            if not self.first:
                self.head = nn.Module()
                self.head.weight = replicated_parameter(dense.embed.weight)
                self.head.weight.tied_to = "embed.weight"

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.first else self.head.weight

    def dropout_positions(self, where: Where, rows: int) -> torch.Tensor:
        """The global positions of the rows a residual branch holds here: this rank's slice of the cp-local sequence
        under sequence parallelism, all of them otherwise (the replicated region)."""
        if not self.par.sequence_parallel:
            return where.positions
        start = self.par.tp_rank * rows
        return where.positions[start:start + rows]

    def dropout_seed(self) -> int:
        """The mask's seed: the same on every TP rank, as the dense model's."""
        return self.seed

    def drop(self, y: torch.Tensor, where: Where, layer: int, site: int) -> torch.Tensor:
        p = self.cfg.dropout if self.training else 0.0
        return keyed_dropout(y, p, self.dropout_seed(), where, layer, site, self.dropout_positions(where, y.shape[0]))

    def forward(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        par = self.par
        if self.first:  # tokens [b, s/cp] -> [s/cp, b, h]
            x = (self.embed(x) + self.pos[where.positions]).transpose(0, 1).contiguous()
            if par.sequence_parallel:  # keep my rows; backward gathers the whole gradient back
                x = mappings.scatter_to_sequence_parallel_region(x, par.tp_group)  # [s/(cp tp), b, h]
        for i, block in self.blocks.items():
            x = block(x, lambda y, site, layer=int(i): self.drop(y, where, layer, site))
        if self.last:
            x = self.ln_f(x)
            if par.sequence_parallel:  # the head is replicated: every TP rank needs every row (backward: my rows)
                x = mappings.gather_from_sequence_parallel_region(x, False, par.tp_group)  # [s/cp, b, h]
            x = F.linear(x, self.head_weight())  # [s/cp, b, vocab]
        return x
