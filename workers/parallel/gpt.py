"""The course's GPT cut for this rank: tensor and sequence parallelism, one pipeline stage of it, and context
parallelism's ring inside the attention (Picotron's ``apply_tensor_parallel``; torchtitan's ``parallelize``).

    dense = make_model(cfg, seed)                               # every rank builds the same dense GPT
    stage = ParallelGPT(dense, Parallelism(tp_group, tp, tp_rank, sequence_parallel=True, vocab_parallel=True))
    logits = stage(tokens, where)                               # [s/cp, b, vocab/tp] on the last stage

Every parameter of a ``ParallelGPT`` is the dense parameter of the same name (``blocks.3.mlp.fc1.weight``) or a TP
shard of it: each layer is the library's ``ParallelBlock`` (``ParallelLayerNorm``, ``ParallelAttention`` with heads
over TP, ``ParallelMLP`` column then row), cut from the dense model's ``DenseBlock``. Activations keep the model's
one layout, ``[s', b, h]`` with s' = s/cp, or s/(cp tp) under sequence parallelism.

A pipeline stage (a *virtual* stage ``vs`` of ``stages`` with interleaving) holds a contiguous run of layers; the
first also holds the embedding and the position table, the last ``ln_f`` and the LM head. The head is tied to the
embedding: with one stage it *is* ``embed.weight``; with several, the last stage holds a copy (``head.weight``,
``tied_to = "embed.weight"``) whose gradient the trainer sums with the embedding's over the embedding group, so the
two copies take the same step (Megatron's ``_allreduce_embedding_grads``).

The two ends over TP, ``Parallelism.vocab_parallel``:

* True (Megatron's default, chapter 15): split by vocabulary (``workers/parallel/vocab.py``). TP rank r holds rows
  ``[r V/tp, (r+1) V/tp)`` of the embedding (``VocabParallelEmbedding``) and, on the last stage, the same rows as
  its copy of the tied head, so the copies the embedding group sums are the same shard. The head leaves the logits
  of this rank's words, ``[s/cp, b, V/tp]`` (``parallel_lm_logits``; Megatron's ``parallel_output=True``), and the
  loss is ``vocab_parallel_cross_entropy`` over the TP group: no rank ever holds the ``[s/cp, b, V]`` logits.
  Under sequence parallelism the embedding's sum is reduce-scattered into this rank's rows, and the head's input
  all-gathered first, as Megatron's output layer does (backward: the ranks' partial gradients reduce-scattered).
* False (chapter 06, which teaches the block): replicated on every TP rank, the logits ``[s/cp, b, V]`` whole and
  the loss a plain cross-entropy.

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
from workers.parallel.comm_stats import PARAMETER, region
from workers.parallel.layers import contiguous_index, group_size_rank, replicated_parameter, shard_parameter
from workers.parallel.vocab import VocabParallelEmbedding, parallel_lm_logits


@dataclass(frozen=True)
class Parallelism:
    """What a stage needs to know about the layout on this rank."""

    tp_group: object = None
    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    ring: object = None  # context parallelism: a workers.context_parallel.ring.Ring (None: cp = 1)
    split: str = "zigzag"
    vocab_parallel: bool = False  # the embedding and the tied head split by vocabulary over TP (module docstring)


class ParallelGPT(nn.Module):
    """Virtual stage ``vs`` of ``stages`` of ``dense``: its layers (and the embedding or the head), cut for ``par``.

    First stage: ``tokens [b, s/cp]`` in; last stage: ``logits [s/cp, b, vocab]`` out (``[s/cp, b, vocab/tp]`` with
    ``vocab_parallel``); between, ``[s', b, h]``.
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
            if par.vocab_parallel:
                self.embed = VocabParallelEmbedding.from_dense(dense.embed, group)  # weight [V/tp, h]
            else:
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
                if par.vocab_parallel:  # the same rows as the first stage's embedding shard on this TP rank
                    rows = contiguous_index(cfg.vocab, *group_size_rank(group), "vocab")
                    self.head.weight = shard_parameter(dense.embed.weight, 0, rows)  # [V/tp, h]
                else:
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
        if self.first:
            x = self.embed_tokens(x, where)  # tokens [b, s/cp] -> [s', b, h]
        for i, block in self.blocks.items():
            x = block(x, lambda y, site, layer=int(i): self.drop(y, where, layer, site))
        if self.last:
            x = self.lm_logits(self.ln_f(x))  # [s', b, h] -> [s/cp, b, vocab] (or vocab/tp)
        return x

    def embed_tokens(self, tokens: torch.Tensor, where: Where) -> torch.Tensor:
        """``tokens [b, s/cp]`` -> ``[s/cp, b, h]``, or this rank's rows ``[s/(cp tp), b, h]`` under sequence
        parallelism: the tokens' rows of the embedding plus their positions' rows of the position table."""
        par = self.par
        pos = self.pos[where.positions]  # [s/cp, h]
        if not (par.vocab_parallel and par.sequence_parallel):
            # split by vocabulary, self.embed all-reduces the ranks' partial rows (g); replicated, it looks them up
            x = (self.embed(tokens) + pos).transpose(0, 1).contiguous()  # [b, s/cp, h] -> [s/cp, b, h]
            if par.sequence_parallel:  # keep my rows; backward gathers the whole gradient back
                x = mappings.scatter_to_sequence_parallel_region(x, par.tp_group)  # [s/(cp tp), b, h]
            return x
        # Sequence parallelism needs only this rank's rows of the sum. All-reducing [s/cp, b, h] (self.embed's g)
        # and keeping my rows sends 2(tp-1)/tp of it per rank and holds all of it first; a reduce-scatter sends
        # (tp-1)/tp, half, and holds only my rows; both gather the gradient back in backward. The reduce-scatter's
        # price here: the position table is then added to my rows only, so its gradient is partial on each rank and
        # is summed over TP (f on the parameter, as for the sequence-parallel LayerNorms), an all-reduce of
        # [s/cp, h] per micro-batch: b times smaller than the (tp-1)/tp [s/cp, b, h] the reduce-scatter saves, so
        # cheaper from b = 3. (Megatron-Core reduce-scatters, reduce_scatter_embeddings, only when the model has no
        # learned position table; with one it all-reduces, adds the positions and scatters.)
        rows = self.embed.partial_rows(tokens).transpose(0, 1).contiguous()  # [s/cp, b, h], 0 for others' words
        x = region(self.embed.comm_scope, mappings.reduce_scatter_to_sequence_parallel_region, rows,
                   group=par.tp_group)  # [s/(cp tp), b, h]: each token's row, summed from the rank that holds it
        pos = region(self.embed.comm_scope + ".pos", mappings.copy_to_tensor_model_parallel_region, pos,
                     group=par.tp_group, kind=PARAMETER)  # [s/cp, h]; backward: the ranks' rows summed
        start = par.tp_rank * x.shape[0]
        return x + pos[start:start + x.shape[0]].unsqueeze(1)  # [s/(cp tp), b, h]

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [s', b, h]`` (after ``ln_f``) -> the tied head's logits ``[s/cp, b, vocab]``, or this rank's words'
        ``[s/cp, b, vocab/tp]`` with ``vocab_parallel``."""
        par, weight = self.par, self.head_weight()
        if not par.vocab_parallel:
            if par.sequence_parallel:  # the head is replicated: every TP rank needs every row (backward: my rows)
                x = mappings.gather_from_sequence_parallel_region(x, False, par.tp_group)  # [s/cp, b, h]
            return F.linear(x, weight)  # [s/cp, b, vocab]
        if par.sequence_parallel:
            # every rank's words read every row: gather them, as Megatron's column-parallel output layer does. Each
            # rank's gradient of x is then a partial sum, over its own words: backward reduce-scatters it (which is
            # also why no f is needed here: the reduce-scatter is the backward's sum)
            x = region("head", mappings.gather_from_sequence_parallel_region, x, True,
                       group=par.tp_group)  # [s/cp, b, h]
            return F.linear(x, weight)  # [s/cp, b, vocab/tp]
        return parallel_lm_logits(x, weight, par.tp_group)  # f, then [s/cp, b, vocab/tp]
