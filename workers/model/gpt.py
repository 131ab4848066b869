"""The course's one GPT: token and position embeddings, pre-LN blocks, a final LayerNorm and an LM head.

    tokens [b, s] -> embed + pos -> layers x DenseBlock -> ln_f -> head -> logits [b, s, vocab]

**One activation layout.** Inside the model every activation is sequence-first, ``[s, b, h]`` (Megatron-LM's
layout): sequence parallelism and context parallelism both cut dimension 0, so the dense model, a tensor- or
sequence-parallel shard of it and a context-parallel ring all see the same tensor layout. Only the two ends are
batch-first, as a data loader and a loss hold them: ``tokens [b, s]`` in, ``logits [b, s, vocab]`` out (a
transposed view of the head's ``[s, b, vocab]``).

The blocks are ``workers/model/dense.py``'s ``DenseBlock``: the same modules chapters 04-06 cut over tensor-parallel
ranks, so every parameter of a parallel model is a parameter of this one, or a shard of it, under the same name
(``blocks.3.mlp.fc1.weight``). What the chapters differ in is a flag of ``GPTConfig``:

    tied          the LM head *is* the embedding's weight (one Parameter, two names: ``head.weight``), chapters
                  11 and 15; untied, its logits' scale is free to drift (chapter 09's log Z)
    qkv_bias      a bias on Q, K and V (the K bias has an exactly zero gradient: softmax ignores q.b_k)
    qk_layernorm  LayerNorm on q and k per head (chapter 09)
    logit_probe   attention written out so its largest pre-softmax logit can be read (chapter 09's telemetry)
    dropout       keyed dropout after attention and after the MLP, reproducible by every layout (chapter 15)
    init          "gpt2": nanoGPT's N(0, 0.02) and zero biases; "perturbed": the same with a wider embedding, random
                  biases and LayerNorms moved off (1, 0), so that a wrong gradient anywhere shows (chapter 15's
                  equivalence checks)
    activation    "gelu" (GPT-2) or "swiglu" (Llama); chapter 16 swaps every MLP for an MoE layer (``make_model``'s
                  ``mlp``)

Chapter 13 keeps its small stack of linear stages (it teaches schedules, not a model) and chapter 14 its
attention-only problem (it teaches the ring): neither needs embeddings, a head or a loss over a vocabulary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.dense import BlockConfig, DenseBlock, block_forward, perturb_layernorms  # noqa: F401 (re-exported)

INITS = ("gpt2", "perturbed")


@dataclass(frozen=True, repr=False)
class GPTConfig:
    """The model, in the course's one vocabulary (the planner's ``ModelShape`` spells its shape the same way).

    ``kv_heads`` 0 means as many as ``heads`` and ``ffn`` 0 means 4 x hidden; both are resolved when the config is
    made. ``seq`` is the longest sequence the position table holds.
    """

    vocab: int = 32
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 0
    ffn: int = 0
    layers: int = 2
    activation: str = "gelu"
    bias: bool = True
    qkv_bias: bool = True
    tied: bool = False
    qk_layernorm: bool = False
    logit_probe: bool = False
    dropout: float = 0.0
    init: str = "gpt2"

    def __post_init__(self):
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)

    def replace(self, **changes) -> "GPTConfig":
        """A copy with ``changes``. Use this, not ``dataclasses.replace``: ``kv_heads`` and ``ffn`` left at their
        defaults (as many as heads; 4 x hidden) follow a new ``heads`` or ``hidden``."""
        return GPTConfig(**{**asdict(self), **derived_defaults(self, changes), **changes})

    def with_params(self, params: dict) -> "GPTConfig":
        """This config with a worker's flat keyword parameters applied (names that are not the model's are left out)."""
        names = {f.name for f in fields(self)}
        return self.replace(**{k: v for k, v in params.items() if k in names})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block(self) -> BlockConfig:
        """One layer's shape (dropout is the GPT's keyed dropout, not the block's own)."""
        return BlockConfig(hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, ffn=self.ffn,
                           activation=self.activation, bias=self.bias, causal=True, qkv_bias=self.qkv_bias,
                           qk_layernorm=self.qk_layernorm, logit_probe=self.logit_probe)

    def problem(self) -> str | None:
        """One sentence if this model cannot be built (parallel layouts add their own rules), or None."""
        from workers.model.dense import problem as block_problem
        from workers.runtime import at_least, one_of, refusal

        sizes = refusal(*(at_least(n, getattr(self, n)) for n in ("vocab", "seq", "hidden", "heads", "layers")))
        if sizes:
            return sizes
        return refusal(block_problem(self.block()), one_of("init", self.init, INITS),
                       None if 0.0 <= self.dropout < 1.0 else f"dropout={self.dropout} must be in [0, 1)")

    @property
    def n_params(self) -> int:
        """Parameters, a tied weight once: per layer 4h (two LayerNorms) + QKV + proj + MLP; then embeddings, the
        position table, ln_f and an untied head. GPT-2 sizes with a tied head and no QKV bias: 12 l h^2 + 10 l h +
        (V + s) h + 2h (Megatron's eq. (2) counts 13 l h with the QKV bias)."""
        h, d, b = self.hidden, self.head_dim, int(self.bias)
        qkv = (self.heads + 2 * self.kv_heads) * d
        attention = h * qkv + qkv * int(self.qkv_bias) + self.heads * d * h + h * b
        width = 2 * self.ffn if self.activation == "swiglu" else self.ffn
        mlp = h * width + width * b + self.ffn * h + h * b
        norms = 4 * h + (4 * d if self.qk_layernorm else 0)
        head = 0 if self.tied else self.vocab * h
        return self.layers * (attention + mlp + norms) + (self.vocab + self.seq) * h + 2 * h + head

    def as_dict(self) -> dict:
        return asdict(self)

    def __repr__(self) -> str:
        """The shape, then only what differs from the defaults (kv_heads and ffn when not as many heads and 4h)."""
        derived = {"kv_heads": self.heads, "ffn": 4 * self.hidden}
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name in ("vocab", "seq", "hidden", "heads", "layers")
                 or getattr(self, f.name) != derived.get(f.name, f.default)]
        return f"GPTConfig({', '.join(shown)})"


def derived_defaults(cfg, changes: dict) -> dict:
    """For ``replace``: ``kv_heads`` and ``ffn`` that sit at their defaults go back to 0 (the default) unless changed."""
    out = {}
    if "kv_heads" not in changes and cfg.kv_heads == cfg.heads:
        out["kv_heads"] = 0
    if "ffn" not in changes and cfg.ffn == 4 * cfg.hidden:
        out["ffn"] = 0
    return out


@dataclass
class Where:
    """Which tokens a forward holds, for keyed dropout: the step, and each row's and sample's global index.

    ``positions [s_local]``: the global position of each of this rank's rows, in local order (context
    parallelism's chunks); ``samples [b_local]``: the global index of each of its samples (data parallelism and
    micro-batching); ``seq`` and ``global_batch``: the whole batch's shape, which a mask is drawn for.
    """

    step: int
    positions: torch.Tensor
    samples: torch.Tensor
    global_batch: int
    seq: int

    @classmethod
    def whole(cls, tokens: torch.Tensor, step: int = 0) -> "Where":
        """One process holding the whole batch ``tokens [b, s]``."""
        b, s = tokens.shape
        return cls(step, torch.arange(s), torch.arange(b), b, s)


def keyed_dropout(x: torch.Tensor, p: float, seed: int, where: Where, layer: int, site: int,
                  positions: torch.Tensor) -> torch.Tensor:
    """Dropout of ``x [rows, b, h]`` with this (step, layer, site)'s mask of the whole batch, at ``positions``.

    The mask is drawn for the whole ``[seq, global_batch, hidden]`` tensor from a seeded generator and each rank
    keeps the rows of its tokens and the columns of its samples: the dense run and every layout drop exactly the
    same elements. (Megatron-LM draws each rank's slice from a per-rank CUDA RNG stream: the same distribution,
    not the same mask as a dense run.)
    """
    if p == 0.0:
        return x
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + where.step) * 1009 + layer) * 7 + site)
    keep = torch.rand((where.seq, where.global_batch, x.shape[-1]), generator=gen) >= p  # [S, B, h]
    keep = keep[positions][:, where.samples].to(x.device)  # [rows, b, h]: my tokens, my samples
    return x * keep / (1.0 - p)


class TiedHead(nn.Module):
    """The LM head of a tied model: ``weight`` *is* the embedding's Parameter (one tensor, one gradient that autograd
    sums over both uses). ``model.parameters()`` lists it once; ``named_parameters(remove_duplicate=False)`` twice,
    as ``embed.weight`` and ``head.weight``: a sharded optimizer that walks names steps it twice (chapter 11's trap)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.hidden))
        self.blocks = nn.ModuleList(DenseBlock(cfg.block()) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = TiedHead(self.embed) if cfg.tied else nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.dropout_seed = 0

    def forward(self, tokens: torch.Tensor, where: Where | None = None) -> torch.Tensor:
        """``tokens [b, s]`` -> ``logits [b, s, vocab]``. ``where`` places the tokens in a larger batch (keyed
        dropout; positions of a context-parallel chunk); None: the whole batch, positions 0..s-1."""
        positions = self.pos[: tokens.shape[1]] if where is None else self.pos[where.positions]
        x = (self.embed(tokens) + positions).transpose(0, 1)  # [b, s, h] -> [s, b, h]
        p = self.cfg.dropout if self.training else 0.0
        where = where or Where.whole(tokens)
        for layer, block in enumerate(self.blocks):
            x = block(x, lambda y, site, layer=layer: keyed_dropout(
                y, p, self.dropout_seed, where, layer, site, where.positions))
        return self.head(self.ln_f(x)).transpose(0, 1)  # [s, b, V] -> [b, s, V]

    def max_attention_logit(self) -> float:
        """The largest pre-softmax attention logit of the last forward (``logit_probe`` models)."""
        return max(block.attention.max_logit for block in self.blocks)


def make_model(cfg: GPTConfig = GPTConfig(), seed: int = 0, *, dtype: torch.dtype = torch.float32, device="cpu",
               mlp: Callable[[int], nn.Module] | None = None) -> GPT:
    """The model from ``seed`` without touching the caller's RNG, initialised by ``cfg.init``, in ``dtype``.

    ``mlp(i)``, if given, makes block i's MLP (chapter 16's MoE layer) after the dense model is initialised, so the
    other weights are those of the same GPT without it.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
        if cfg.init == "gpt2":  # nanoGPT: every matrix and the position table N(0, 0.02), biases 0
            for name, p in model.named_parameters():
                if p.dim() >= 2 or name == "pos":
                    nn.init.normal_(p, mean=0.0, std=0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)
        elif cfg.init == "perturbed":  # nothing at a symmetric point, so that a wrong gradient anywhere shows
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    nn.init.normal_(p, mean=0.0, std=0.02 if name != "embed.weight" else 0.1)
                elif name.endswith("bias") and ".ln" not in name and not name.startswith("ln"):
                    nn.init.normal_(p, mean=0.0, std=0.02)  # non-zero biases: a bias gradient summed twice shows
            perturb_layernorms(model, seed)  # LayerNorm off (1, 0), so a wrong LayerNorm gradient shows
        else:
            raise ValueError(f"init={cfg.init!r} is not one of {', '.join(INITS)}")
        model.dropout_seed = seed
    model = model.to(device=device, dtype=dtype)
    if mlp is not None:
        for i, block in enumerate(model.blocks):
            block.mlp = mlp(i)
    return model
