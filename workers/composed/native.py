"""Chapter 15's GPT rebuilt for PyTorch's own composable APIs, and the way back to the dense model's names.

``workers/ch15_native.py`` trains the chapter's model with ``parallelize_module`` (tensor parallelism),
``fully_shard`` (FSDP2) and ``torch.distributed.pipelining``. Those APIs cut *modules*: a plan names a submodule
(``"attention.wq"``) and a style (``ColwiseParallel``), a pipeline stage is a module of its own. This file holds
what they need and the course's dense model does not give them:

* ``NativeAttention``: ``DenseAttention`` with the fused ``qkv`` split into three projections, ``wq``, ``wk``,
  ``wv`` (torchtitan's ``Attention``), and a forward that counts the heads it holds from its weights, so the same
  code runs whole (8 heads) and as a tensor-parallel shard (8 / tp heads). ``fused=True`` keeps the fused
  ``qkv`` instead: the layout ``ColwiseParallel`` cuts wrongly (the fused-QKV trap, see ``NativeAttention``).
* ``NativeStage``: a run of the dense model's layers (all of them, or one pipeline stage's), with the embedding
  on the first stage and ``ln_f`` and the tied head on the last, under the dense model's parameter names
  (``blocks.2.mlp.fc1.weight``; a ``ModuleDict`` keyed by the layer number keeps a stage's names global).
* ``dense_names`` / ``full``: DTensor shards gathered to whole tensors and renamed to the dense model's names
  (``wq``, ``wk``, ``wv`` concatenated back into ``qkv``), so that a run compares to ``train.reference_run``.
The ``DeviceMesh`` those APIs take comes from the course's one group holder, ``workers/layout/mesh.py: Mesh``
(``device_mesh``: torch's mesh over groups made and destroyed with the run, DTensor's caches emptied).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import GPT, block_forward
from workers.model.dense import DenseAttention, attention_core, merge_heads, split_heads

PROJECTIONS = ("wq", "wk", "wv")  # torchtitan's names; their rows concatenated are the dense qkv, [Q; K; V]


def _copy_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[s, b, n d]`` -> ``[b, n, s, d]``; n is whatever the width holds (all heads, or this rank's)."""
    s, b, _ = t.shape
    return t.reshape(s, b, -1, head_dim).permute(1, 2, 0, 3)


class NativeAttention(nn.Module):
    """``DenseAttention``'s function, with projections a tensor-parallel *plan* can cut.

    Split (default): ``wq``, ``wk``, ``wv``, each ``[heads d, h]``, copied from the fused weight's three blocks of
    rows. ``ColwiseParallel`` on each gives rank r heads ``[r heads/tp, (r+1) heads/tp)`` of queries, keys *and*
    values: the heads it needs. ``proj`` (torchtitan's ``wo``) with ``RowwiseParallel`` sums the heads' parts.

    Fused (``fused=True``): the dense ``qkv``, ``[3 heads d, h]`` laid out [Q; K; V]. ``ColwiseParallel`` cuts it
    into tp *contiguous* blocks of rows: with tp = 2, rank 0 gets every query head and the first half of the keys,
    rank 1 the rest of the keys and every value. Splitting that into thirds runs without an error (the widths
    divide) and computes another function: the fused-QKV trap. Megatron avoids it by interleaving the fused weight
    per head group ([q_g; k_g; v_g] for each group g), which a contiguous cut then splits correctly.
    """

    def __init__(self, dense: DenseAttention, fused: bool = False):
        super().__init__()
        if dense.kv_heads != dense.heads:
            raise ValueError("NativeAttention copies multi-head attention (kv_heads = heads)")
        self.head_dim, self.causal, self.fused = dense.head_dim, dense.causal, fused
        weight, bias = dense.qkv.weight.detach(), dense.qkv.bias
        if fused:
            self.qkv = _copy_linear(weight, None if bias is None else bias.detach())
        else:
            ws = weight.chunk(3, dim=0)  # [Q; K; V]: three [heads d, h] blocks of rows
            bs = bias.detach().chunk(3) if bias is not None else (None,) * 3
            for name, w, b in zip(PROJECTIONS, ws, bs):
                setattr(self, name, _copy_linear(w, b))
        proj_bias = None if dense.proj.bias is None else dense.proj.bias.detach()
        self.proj = _copy_linear(dense.proj.weight.detach(), proj_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        d = self.head_dim
        if self.fused:
            qkv = self.qkv(x)  # [s, b, 3 n d]: under ColwiseParallel a contiguous 1/tp of [Q; K; V]
            n = qkv.shape[-1] // (3 * d)
            q, k, v = split_heads(qkv, n, n, d)  # right only when the block holds n whole q, k and v heads
        else:
            q, k, v = (_heads(getattr(self, name)(x), d) for name in PROJECTIONS)  # [b, n, s, d], n = heads / tp
        return self.proj(merge_heads(attention_core(q, k, v, self.causal)))


class NativeBlock(nn.Module):
    """One pre-LN layer, ``DenseBlock``'s attribute names (``ln1``, ``attention``, ``ln2``, ``mlp``)."""

    def __init__(self, dense_block: nn.Module, fused: bool = False):
        super().__init__()
        self.ln1 = copy.deepcopy(dense_block.ln1)
        self.attention = NativeAttention(dense_block.attention, fused)
        self.ln2 = copy.deepcopy(dense_block.ln2)
        self.mlp = copy.deepcopy(dense_block.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(self, x, lambda y, site: y)  # dropout 0: the APIs have no keyed dropout to match


class NativeStage(nn.Module):
    """Layers ``layers`` of ``dense``: ``tokens [b, s]`` in on the first stage, ``logits [s, b, vocab]`` out of the
    last, ``[s, b, h]`` between. The whole model is ``NativeStage(dense, range(layers), first=True, last=True)``.

    The head is tied to the embedding. On a stage that holds both, it *is* ``embed.weight``; a last stage without
    the embedding holds a copy, ``head.weight``, whose gradient the caller sums with the first stage's (Megatron's
    embedding group) so that both copies take the same step.
    """

    def __init__(self, dense: GPT, layers, *, first: bool, last: bool, fused: bool = False):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = copy.deepcopy(dense.embed)
            self.pos = nn.Parameter(dense.pos.detach().clone())
        self.blocks = nn.ModuleDict({str(i): NativeBlock(dense.blocks[i], fused) for i in layers})
        if last:
            self.ln_f = copy.deepcopy(dense.ln_f)
            if not first:
                self.head = _copy_linear(dense.embed.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # [b, s] -> [s, b, h]
            x = (self.embed(x) + self.pos[: x.shape[1]]).transpose(0, 1).contiguous()
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = F.linear(self.ln_f(x), self.embed.weight if self.first else self.head.weight)  # [s, b, vocab]
        return x


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``t``; a DTensor is gathered whole first (a collective over its mesh: every rank calls it)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def dense_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors by the native model's names -> by the dense model's: ``attention.{wq,wk,wv}.*`` concatenated back
    into ``attention.qkv.*``; ``head.weight`` (the last stage's copy of the tied embedding) left out, since its
    gradient was summed into ``embed.weight``'s and its value equals it."""
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")  # "blocks.0.attention.wq", "weight"
        module, _, proj = prefix.rpartition(".")
        if name == "head.weight":
            continue
        if proj in PROJECTIONS:
            if proj == "wq":
                out[f"{module}.qkv.{leaf}"] = torch.cat([tensors[f"{module}.{p}.{leaf}"] for p in PROJECTIONS])
            continue
        out[name] = t
    return out
