"""The dense (single-process) modules that tensor parallelism shards: the reference for chapters 04-06.

Every parallel module in ``layers.py``, ``mlp.py``, ``attention.py`` and ``block.py`` is built from one of
these with ``from_dense`` and must compute the same function with the same gradients. The parallel
modules keep the same attribute names (``attention.qkv``, ``mlp.fc2``, ``ln1`` ...), so a parameter of
the parallel model and the dense parameter it is a shard of share one name.

Layout is Megatron's: activations are ``[s, b, h]`` (sequence first), so that sequence parallelism
splits the first dimension. Weights follow ``torch.nn.Linear``: ``[out_features, in_features]``.

``build`` and ``inputs`` are deterministic functions of a seed: every rank builds the same dense model
(and the test process builds it again to compute the reference), with no communication.
"""
from __future__ import annotations

import math
from dataclasses import InitVar, asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.runtime import renamed


@dataclass(frozen=True)
class BlockConfig:
    """One transformer layer's shape, in the course's one vocabulary: ``hidden, heads, kv_heads, ffn``.

    ``kv_heads`` 0 means as many as ``heads`` (multi-head attention) and ``ffn`` 0 means 4 x hidden (GPT-2's MLP);
    both are resolved when the config is made, so ``cfg.kv_heads`` and ``cfg.ffn`` are always the real sizes.
    The GPT's flags that live in a layer: ``qkv_bias`` (None: as ``bias``), ``qk_layernorm`` (LayerNorm on q and k
    per head, Dehghani et al. 2023) and ``logit_probe`` (attention written out so its largest pre-softmax logit
    can be read, chapter 09's telemetry; otherwise PyTorch's fused ``scaled_dot_product_attention``).
    Chapters 04-06 used Megatron's keywords ``n_heads``, ``n_kv_heads`` and ``ffn_hidden``: they are still
    accepted, with a warning, for one release.
    """

    hidden: int = 32
    heads: int = 4
    kv_heads: int = 0
    ffn: int = 0
    activation: str = "gelu"  # "gelu" (h -> 4h -> h) or "swiglu" (fused [gate; up] -> down)
    bias: bool = True
    causal: bool = True
    hidden_dropout: float = 0.0
    layernorm_eps: float = 1e-5
    qkv_bias: bool | None = None
    qk_layernorm: bool = False
    logit_probe: bool = False
    n_heads: InitVar[int | None] = None  # the old keywords (one release)
    n_kv_heads: InitVar[int | None] = None
    ffn_hidden: InitVar[int | None] = None

    def __post_init__(self, n_heads, n_kv_heads, ffn_hidden):
        for old, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_hidden", ffn_hidden)):
            if value is not None:
                object.__setattr__(self, renamed(old), value)
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.qkv_bias is None:
            object.__setattr__(self, "qkv_bias", self.bias)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def replace(self, **changes) -> "BlockConfig":
        """A copy with ``changes``; ``kv_heads`` and ``ffn`` left at their defaults follow ``heads`` and ``hidden``."""
        from workers.model.gpt import derived_defaults

        return BlockConfig(**{**asdict(self), **derived_defaults(self, changes), **changes})

    def as_dict(self) -> dict:
        return asdict(self)


def problem(cfg: BlockConfig) -> str | None:
    """One sentence if the dense shape itself is impossible (tensor parallelism adds its own rules)."""
    if cfg.hidden < 1 or cfg.heads < 1:
        return f"hidden={cfg.hidden} and heads={cfg.heads} must be positive"
    if cfg.hidden % cfg.heads:
        return f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}: the head size must be a whole number"
    if cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads:
        return (f"heads={cfg.heads} is not a multiple of kv_heads={cfg.kv_heads}: in grouped-query attention "
                "every KV head serves the same number of query heads")
    if cfg.activation not in ("gelu", "swiglu"):
        return f"activation={cfg.activation!r} is not supported: choose 'gelu' or 'swiglu'"
    if not 0.0 <= cfg.hidden_dropout < 1.0:
        return f"hidden_dropout={cfg.hidden_dropout} must be in [0, 1)"
    return None


# -- attention ----------------------------------------------------------------------------------------

def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V per head, for ``q [b, hq, s, d]`` and ``k, v [b, hkv, s, d]``.

    Grouped-query attention: query head j reads KV head ``j // (hq // hkv)``, so each KV head is repeated
    for its group of consecutive query heads. The same function runs on every rank on that rank's heads.
    """
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)  # [b, hq, s, d]
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # [b, hq, s, d]


def split_heads(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int):
    """``[s, b, (n_q + 2 n_kv) d]`` laid out [Q; K; V] -> q ``[b, n_q, s, d]``, k and v ``[b, n_kv, s, d]``."""
    s, b, _ = qkv.shape
    q, k, v = qkv.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q = q.reshape(s, b, n_q, head_dim).permute(1, 2, 0, 3)  # [b, n_q, s, d]
    k = k.reshape(s, b, n_kv, head_dim).permute(1, 2, 0, 3)  # [b, n_kv, s, d]
    v = v.reshape(s, b, n_kv, head_dim).permute(1, 2, 0, 3)
    return q, k, v


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """``[b, n, s, d]`` -> ``[s, b, n d]``."""
    b, n, s, d = out.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)


class DenseAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention with one fused QKV projection, laid out [Q; K; V].

    ``qkv.weight`` is ``[(heads + 2 kv_heads) * d, h]``: first every query head's d rows, then every key head's,
    then every value head's. ``proj`` maps the concatenated heads back to h.

    ``qk_layernorm``: q and k normalised per head before q.k (Dehghani et al. 2023, "Scaling Vision Transformers
    to 22 Billion Parameters", sec. 3.1), so |q.k| / sqrt(d) is bounded by sqrt(d) |gain_q| |gain_k|: only the
    LayerNorm gains can make the logits grow, and they move slowly. ``logit_probe``: attention written out
    (q.k / sqrt(d), mask, softmax) instead of the fused kernel, keeping the largest pre-softmax logit of the last
    forward in ``max_logit`` (telemetry, not state that outlives a run): its growth at a high learning rate is the
    instability qk-layernorm removes (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 3.1).
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int = 0, bias: bool = True, causal: bool = True,
                 device=None, dtype=None, *, qkv_bias: bool | None = None, qk_layernorm: bool = False,
                 logit_probe: bool = False):
        super().__init__()
        self.hidden, self.heads, self.kv_heads = hidden, heads, kv_heads or heads
        self.head_dim, self.causal, self.logit_probe = hidden // heads, causal, logit_probe
        self.qkv = nn.Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim,
                             bias=bias if qkv_bias is None else qkv_bias, device=device, dtype=dtype)
        self.proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias, device=device, dtype=dtype)
        if qk_layernorm:
            self.q_norm = nn.LayerNorm(self.head_dim, device=device, dtype=dtype)
            self.k_norm = nn.LayerNorm(self.head_dim, device=device, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.max_logit = float("nan")

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q.k / sqrt(d)) v for ``q [b, heads, s, d]``, ``k, v [b, kv_heads, s, d]`` -> ``[b, heads, s, d]``."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.logit_probe:
            return attention_core(q, k, v, self.causal)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [b, heads, s, d]
        logits = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [b, heads, s, s]
        s = logits.shape[-1]
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool, device=logits.device).tril()
            self.max_logit = logits.detach().float()[..., mask].max().item()  # over the positions softmax sees
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            self.max_logit = logits.detach().float().max().item()
        return F.softmax(logits, dim=-1) @ v  # [b, heads, s, d]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [s, b, h]
        q, k, v = split_heads(self.qkv(x), self.heads, self.kv_heads, self.head_dim)  # [b, heads|kv_heads, s, d]
        return self.proj(merge_heads(self.core(q, k, v)))  # [s, b, h]


# -- MLP ------------------------------------------------------------------------------------------------

def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2f]`` holding [gate; up] -> ``silu(gate) * up``, ``[..., f]`` (Shazeer 2020, "GLU Variants")."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class DenseMLP(nn.Module):
    """h -> ffn -> h. GeLU: ``fc1`` is ``[ffn, h]``. SwiGLU: ``fc1`` is the fused ``[gate; up]``, ``[2 ffn, h]``."""

    def __init__(self, hidden: int, ffn: int = 0, activation: str = "gelu", bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.hidden, self.ffn, self.activation = hidden, ffn or 4 * hidden, activation
        width = 2 * self.ffn if activation == "swiglu" else self.ffn
        self.fc1 = nn.Linear(hidden, width, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(self.ffn, hidden, bias=bias, device=device, dtype=dtype)

    def act(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y) if self.activation == "swiglu" else F.gelu(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h]
        return self.fc2(self.act(self.fc1(x)))


# -- dropout that a sharded model can reproduce exactly ----------------------------------------------

class SharedMaskDropout(nn.Module):
    """Dropout whose mask is drawn for the *whole* ``[s, b, h]`` tensor from a seeded generator.

    Call ``k`` of a module built with seed ``seed`` draws its mask from ``Generator().manual_seed(seed + k)``.
    A sequence-parallel rank that holds rows ``[r s/t, (r+1) s/t)`` keeps that slice of the same mask, so
    the sharded block drops exactly the elements the dense one drops and the two can be compared bit for
    bit. Megatron-LM does it more cheaply (each rank draws only its own slice from a per-rank CUDA RNG
    stream, ``tensor_parallel/random.py``): same distribution, not the same mask as a dense run.
    """

    def __init__(self, p: float = 0.0, seed: int = 0):
        super().__init__()
        self.p, self.seed, self.calls = p, seed, 0

    def forward(self, x: torch.Tensor, rows: slice | None = None, full_rows: int | None = None) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        gen = torch.Generator(device=x.device).manual_seed(self.seed + self.calls)
        self.calls += 1
        shape = (full_rows or x.shape[0], *x.shape[1:])
        keep = torch.rand(shape, generator=gen, device=x.device) >= self.p  # [s, b, h]
        if rows is not None:
            keep = keep[rows]  # [s/t, b, h]
        return x * keep / (1.0 - self.p)


# -- the block --------------------------------------------------------------------------------------

ATTENTION_SITE, MLP_SITE = 0, 1  # the two residual branches a dropout mask is drawn for


def block_forward(block: nn.Module, x: torch.Tensor, drop) -> torch.Tensor:
    """The pre-LN layer on ``x [s, b, h]``, for a ``DenseBlock`` and every block with the same attribute names
    (``ln1``, ``attention``, ``ln2``, ``mlp``); ``drop(y, site)`` is the residual branches' dropout."""
    h = x + drop(block.attention(block.ln1(x)), ATTENTION_SITE)
    return h + drop(block.mlp(block.ln2(h)), MLP_SITE)


class DenseBlock(nn.Module):
    """Pre-LN transformer layer (GPT-2 / Megatron-LM): ``h = x + drop(attn(ln1(x)))``, ``y = h + drop(mlp(ln2(h)))``.

    ``forward(x, drop)``: ``drop(y, site)`` replaces the block's own dropout (the GPT's keyed dropout); the GPT calls
    each block as a module, so hooks on a block (FSDP2's, ZeRO-3's, a forward hook) see every layer run.
    """

    def __init__(self, cfg: BlockConfig, device=None, dtype=None, dropout_seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.layernorm_eps, device=device, dtype=dtype)
        self.attention = DenseAttention(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.bias, cfg.causal, device, dtype,
                                        qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_layernorm,
                                        logit_probe=cfg.logit_probe)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.layernorm_eps, device=device, dtype=dtype)
        self.mlp = DenseMLP(cfg.hidden, cfg.ffn, cfg.activation, cfg.bias, device, dtype)
        self.dropout = SharedMaskDropout(cfg.hidden_dropout, dropout_seed)

    def forward(self, x: torch.Tensor, drop=None) -> torch.Tensor:  # [s, b, h]
        return block_forward(self, x, drop or (lambda y, site: self.dropout(y)))


# -- deterministic construction and inputs ---------------------------------------------------------------

def perturb_layernorms(module: nn.Module, seed: int) -> None:
    """LayerNorm starts at weight 1, bias 0: move it off that point so a test would see a wrong gradient there."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=gen).to(m.weight))
                m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=gen).to(m.bias))


def build(kind: str, cfg: BlockConfig, seed: int = 0, device="cpu", dtype=torch.float32) -> nn.Module:
    """The dense module ``kind`` ("column", "row", "mlp", "attention", "block"), identical on every process.

    Weights are drawn on the CPU from ``seed`` (so every rank and the test process agree), then moved.
    "column" is ``Linear(h, ffn)`` and "row" is ``Linear(ffn, h)``: the two halves of the MLP.
    """
    torch.manual_seed(seed)
    if kind == "column":
        module = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias)
    elif kind == "row":
        module = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias)
    elif kind == "mlp":
        module = DenseMLP(cfg.hidden, cfg.ffn, cfg.activation, cfg.bias)
    elif kind == "attention":
        module = DenseAttention(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.bias, cfg.causal, qkv_bias=cfg.qkv_bias)
    elif kind == "block":
        module = DenseBlock(cfg, dropout_seed=seed + 1)
        perturb_layernorms(module, seed)
    else:
        raise ValueError(f"no dense module {kind!r}: choose column, row, mlp, attention or block")
    return module.to(device=device, dtype=dtype)


def input_features(kind: str, cfg: BlockConfig) -> int:
    return cfg.ffn if kind == "row" else cfg.hidden


def output_features(kind: str, cfg: BlockConfig) -> int:
    return cfg.ffn if kind == "column" else cfg.hidden


def inputs(kind: str, cfg: BlockConfig, seq: int, batch: int, seed: int = 0, dtype=torch.float32):
    """``(x, grad_output)`` for one forward/backward: ``x [s, b, in]`` and the gradient arriving at the output."""
    gen = torch.Generator().manual_seed(seed + 12345)
    x = torch.randn(seq, batch, input_features(kind, cfg), generator=gen)
    grad_output = torch.randn(seq, batch, output_features(kind, cfg), generator=gen)
    return x.to(dtype), grad_output.to(dtype)


def reference(kind: str, cfg: BlockConfig, seq: int, batch: int, seed: int = 0, dtype=torch.float64) -> dict:
    """The single-process ground truth: output, input gradient and every parameter's gradient, by name.

    Computed in float64 by default, from the same float32 weights and inputs the ranks use, so the
    comparison measures the ranks' float32 error and nothing else.
    """
    module = build(kind, cfg, seed).to(dtype)
    x, grad_output = inputs(kind, cfg, seq, batch, seed)
    x = x.to(dtype).requires_grad_()
    out = module(x)
    out.backward(grad_output.to(dtype))
    return {"output": out.detach(), "grad_input": x.grad.detach(),
            "grads": {name: p.grad.detach() for name, p in module.named_parameters()},
            "params": {name: p.detach() for name, p in module.named_parameters()}}
