"""The model chapter 15 composes: a small tied-embedding GPT, dense (the reference) and cut along four dimensions.

    tokens [b, s] -> embed + pos -> layers x pre-LN block -> ln_f -> logits = h @ embed^T    [s, b, vocab]

Activations are sequence-first, ``[s, b, h]``, Megatron's layout, so that sequence parallelism and context
parallelism both cut dimension 0. The dense model (``DenseGPT``) is built from chapters 04-06's ``DenseBlock``;
the parallel one (``ComposedStage``) from the same library's ``ParallelLayerNorm``, ``ParallelAttention``
(heads over TP) and ``ParallelMLP`` (column then row), with chapter 14's ring attention inside the attention
when cp > 1, so every parameter of a stage is the dense parameter of the same name, or a TP shard of it.

Where each piece lives. A pipeline stage (a *virtual* stage with interleaving) holds a contiguous run of layers;
the first also holds the embedding and the position table, the last ``ln_f`` and the LM head. The head is tied
to the embedding: with one stage it *is* ``embed.weight``; with several, the last stage holds a copy
(``head.weight``, ``tied_to = "embed.weight"``) whose gradient is summed with the embedding's over the
embedding group after backward, so the two copies take the same step and stay equal (Megatron's
``_allreduce_embedding_grads``). The embedding and head are replicated over TP (Megatron splits them by vocab;
at vocab 32 nothing is gained, and the replicated head keeps the loss a plain cross-entropy).

Dropout that the layouts can reproduce. A mask is drawn for the whole ``[seq, global_batch, hidden]`` tensor of
one (step, layer, site) from a seeded generator, and each rank keeps the rows of its tokens and the columns of its
samples (``keyed_dropout``): the dense run and every layout drop exactly the same elements. Inside a TP group the
replicated region must use the *same* mask on every rank (the ranks compute the same thing); under sequence
parallelism each rank must use *its own slice* of it. The two drills break one each.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.context_parallel.attention import ring_attention
from workers.parallel import mappings
from workers.parallel.attention import ParallelAttention
from workers.parallel.block import ParallelLayerNorm
from workers.parallel.dense import (BlockConfig, DenseBlock, attention_core, merge_heads, perturb_layernorms,
                                    split_heads)
from workers.parallel.layers import replicated_parameter
from workers.parallel.mlp import ParallelMLP


@dataclass(frozen=True)
class ComposedConfig:
    """The model's shape. 8 heads so that tp = 8 is a layout; 4 layers so that pp = 4 is; seq 16 so that cp = 4
    cuts it into 8 zigzag chunks of 2 tokens."""

    vocab: int = 32
    seq: int = 16
    hidden: int = 32
    heads: int = 8
    layers: int = 4
    dropout: float = 0.0  # hidden dropout after attention and after the MLP (the residual branches)

    @property
    def kv_heads(self) -> int:
        return self.heads

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block(self) -> BlockConfig:
        return BlockConfig(hidden=self.hidden, n_heads=self.heads, ffn_hidden=self.ffn, causal=True)

    def problem(self) -> str | None:
        if min(self.vocab, self.seq, self.hidden, self.heads, self.layers) < 1:
            return "vocab, seq, hidden, heads and layers must all be >= 1"
        if self.hidden % self.heads:
            return f"heads={self.heads} does not divide hidden={self.hidden}: the head size must be a whole number"
        if not 0.0 <= self.dropout < 1.0:
            return f"dropout={self.dropout} must be in [0, 1)"
        return None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Where:
    """What a stage needs besides its input: the step (dropout keys) and which tokens and samples it holds.

    ``positions [s_local]``: the global position of each of this rank's rows, in local order (context
    parallelism's chunks); ``samples [b_local]``: the global index of each of its samples (data parallelism and
    micro-batching).
    """

    step: int
    positions: torch.Tensor
    samples: torch.Tensor
    global_batch: int
    seq: int


def keyed_dropout(x: torch.Tensor, p: float, seed: int, where: Where, layer: int, site: int,
                  positions: torch.Tensor) -> torch.Tensor:
    """Dropout of ``x [rows, b, h]`` with this (step, layer, site)'s mask of the whole batch, at ``positions``."""
    if p == 0.0:
        return x
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + where.step) * 1009 + layer) * 7 + site)
    keep = torch.rand((where.seq, where.global_batch, x.shape[-1]), generator=gen) >= p  # [S, B, h]
    keep = keep[positions][:, where.samples].to(x.device)  # [rows, b, h]: my tokens, my samples
    return x * keep / (1.0 - p)


ATTENTION_SITE, MLP_SITE = 0, 1


def block_forward(block: nn.Module, x: torch.Tensor, drop) -> torch.Tensor:
    """The pre-LN layer, for a ``DenseBlock`` and a ``ComposedBlock`` alike (same attribute names)."""
    h = x + drop(block.attention(block.ln1(x)), ATTENTION_SITE)
    return h + drop(block.mlp(block.ln2(h)), MLP_SITE)


class DenseGPT(nn.Module):
    """The single-process reference: ``tokens [b, s]`` -> ``logits [s, b, vocab]``."""

    def __init__(self, cfg: ComposedConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.hidden))
        self.blocks = nn.ModuleList(DenseBlock(cfg.block()) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)

    def forward(self, tokens: torch.Tensor, where: Where, seed: int = 0) -> torch.Tensor:
        x = (self.embed(tokens) + self.pos[where.positions]).transpose(0, 1)  # [b, s, h] -> [s, b, h]
        for layer, block in enumerate(self.blocks):
            x = block_forward(block, x, lambda y, site, layer=layer: keyed_dropout(
                y, self.cfg.dropout, seed, where, layer, site, where.positions))
        return F.linear(self.ln_f(x), self.embed.weight)  # [s, b, vocab]: the head is the embedding


def make_dense(cfg: ComposedConfig, seed: int = 0, dtype=torch.float64) -> DenseGPT:
    """The model every rank cuts its shards from and the reference trains, from ``seed`` (the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DenseGPT(cfg)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, mean=0.0, std=0.02 if name != "embed.weight" else 0.1)
            elif name.endswith("bias") and ".ln" not in name and not name.startswith("ln"):
                nn.init.normal_(p, mean=0.0, std=0.02)  # non-zero biases: a bias gradient summed twice shows
        perturb_layernorms(model, seed)  # LayerNorm off (1, 0), so a wrong LayerNorm gradient shows
    return model.to(dtype)


def token_losses(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the valid tokens. ``logits [s, b, V]``, ``targets`` and ``valid [b, s]``."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1), reduction="none")  # [s*b]
    return (ce * valid.t().reshape(-1).to(ce.dtype)).sum()


def make_batch(cfg: ComposedConfig, global_batch: int, step: int, seed: int = 1):
    """Step ``step``'s global batch: ``tokens [B, seq + 1]`` and ``valid [B, seq]``.

    Ragged: sample i has a random number of valid targets (at least a quarter of seq), the rest is padding. So
    micro-batches hold different numbers of tokens, and a loss averaged per micro-batch is not the batch's mean.
    """
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    tokens = torch.randint(cfg.vocab, (global_batch, cfg.seq + 1), generator=g)
    lengths = torch.randint(max(1, cfg.seq // 4), cfg.seq + 1, (global_batch,), generator=g)
    valid = torch.arange(cfg.seq)[None, :] < lengths[:, None]  # [B, seq]
    return tokens, valid


# -- the parallel pieces ---------------------------------------------------------------------------------------

class ContextParallelAttention(ParallelAttention):
    """``ParallelAttention`` (heads over TP) whose local heads attend over the whole sequence with ring attention.

    Set ``ring`` (a ``workers.context_parallel.ring.Ring``) and ``split`` after construction; ``ring=None`` is
    plain local attention. Ring attention runs every block in float64 and returns the input's dtype.
    """

    ring = None
    split = "zigzag"

    def core(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.qkv_weights()
        qkv = self.qkv.local(x, weight, bias)  # [s/cp, b, 3 (heads/tp) d]
        q, k, v = split_heads(qkv, self.n_local_heads, self.n_local_kv_heads, self.head_dim)  # [b, heads/tp, s/cp, d]
        if self.ring is None or self.ring.cp == 1:
            out = attention_core(q, k, v, self.causal)
        else:
            out = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.ring, self.split, self.causal)
        return merge_heads(out)  # [s/cp, b, (heads/tp) d]


@dataclass(frozen=True)
class Parallelism:
    """What a stage needs to know about the layout on this rank."""

    tp_group: object = None
    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    ring: object = None
    split: str = "zigzag"
    drill: str = "none"


class ComposedBlock(nn.Module):
    """One layer of ``DenseBlock``'s parameters, cut by TP (and SP), attention over CP. ``[s', b, h]`` both ways,
    s' = s/cp, or s/(cp tp) with sequence parallelism."""

    def __init__(self, dense: DenseBlock, layer: int, par: Parallelism, dropout: float, seed: int):
        super().__init__()
        sp, group = par.sequence_parallel, par.tp_group
        ln_sp = sp and par.drill != "layernorm_not_reduced"  # the drill: LayerNorm grads left partial under SP
        self.ln1 = ParallelLayerNorm(dense.ln1, group, ln_sp)
        self.attention = ContextParallelAttention.from_dense(dense.attention, group, sequence_parallel=sp)
        self.attention.ring, self.attention.split = par.ring, par.split
        self.ln2 = ParallelLayerNorm(dense.ln2, group, ln_sp)
        self.mlp = ParallelMLP.from_dense(dense.mlp, group, sequence_parallel=sp)
        self.layer, self.par, self.dropout, self.seed = layer, par, dropout, seed

    def drop(self, y: torch.Tensor, where: Where, site: int) -> torch.Tensor:
        par, positions, seed = self.par, where.positions, self.seed
        if par.sequence_parallel:  # my rows of the cp-local sequence: my slice of the mask ...
            rows = y.shape[0]
            start = 0 if par.drill == "dropout_shared" else par.tp_rank * rows  # ... not rank 0's (the drill)
            positions = positions[start:start + rows]
        elif par.drill == "dropout_per_rank":  # a replicated region with a mask of its own on every TP rank
            seed = seed + 7919 * par.tp_rank
        return keyed_dropout(y, self.dropout, seed, where, self.layer, site, positions)

    def forward(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        return block_forward(self, x, lambda y, site: self.drop(y, where, site))


class ComposedStage(nn.Module):
    """Virtual stage ``vs`` of ``stages``: its layers of ``dense`` (and the embedding or the head), cut for ``par``.

    Parameter names are the dense model's (``blocks.3.mlp.fc1.weight``), except the last stage's copy of the
    tied embedding, ``head.weight``, which carries ``tied_to = "embed.weight"``.
    First stage: ``tokens [b, s/cp]`` in; last stage: ``logits [s/cp, b, vocab]`` out; between, ``[s', b, h]``.
    """

    def __init__(self, dense: DenseGPT, vs: int, stages: int, par: Parallelism, seed: int = 0):
        super().__init__()
        cfg = dense.cfg
        per = cfg.layers // stages
        self.first, self.last, self.par, self.cfg = vs == 0, vs == stages - 1, par, cfg
        self.layers = list(range(vs * per, (vs + 1) * per))
        if self.first:
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden, _weight=replicated_parameter(dense.embed.weight))
            self.pos = replicated_parameter(dense.pos)
        self.blocks = nn.ModuleDict({str(i): ComposedBlock(dense.blocks[i], i, par, cfg.dropout, seed)
                                     for i in self.layers})
        if self.last:
            self.ln_f = ParallelLayerNorm(dense.ln_f, par.tp_group,
                                          par.sequence_parallel and par.drill != "layernorm_not_reduced")
            if not self.first:
                self.head = nn.Module()
                self.head.weight = replicated_parameter(dense.embed.weight)
                self.head.weight.tied_to = "embed.weight"

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.first else self.head.weight

    def forward(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        par = self.par
        if self.first:  # tokens [b, s/cp] -> [s/cp, b, h]
            x = (self.embed(x) + self.pos[where.positions]).transpose(0, 1).contiguous()
            if par.sequence_parallel:  # keep my rows; backward gathers the whole gradient back
                x = mappings.scatter_to_sequence_parallel_region(x, par.tp_group)  # [s/(cp tp), b, h]
        for block in self.blocks.values():
            x = block(x, where)
        if self.last:
            x = self.ln_f(x)
            if par.sequence_parallel:  # the head is replicated: every TP rank needs every row (backward: my rows)
                x = mappings.gather_from_sequence_parallel_region(x, False, par.tp_group)  # [s/cp, b, h]
            x = F.linear(x, self.head_weight())  # [s/cp, b, vocab]
        return x


def dense_shapes(cfg: ComposedConfig) -> dict[str, tuple]:
    """Every parameter's full shape, by name: what the shards are put back into."""
    return {name: tuple(p.shape) for name, p in make_dense(cfg, 0, torch.float32).named_parameters()}
