"""The GPT: token + position embeddings, pre-LN blocks (attention, MLP), a final LayerNorm and an LM head.

Attention is written out (no fused kernel) because the chapter watches its pre-softmax logits
q.k / sqrt(d): their growth at a high learning rate is the instability that qk-layernorm removes
(Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters", sec. 3.1; Wortsman et al.
2023, "Small-scale proxies for large-scale Transformer training instabilities", sec. 3.1). With qk-layernorm,
q and k are normalised per head before the dot product, so |q.k| / sqrt(d) is bounded by
sqrt(d) * |gain_q| * |gain_k|: only the LayerNorm gains can make the logits grow, and they move slowly.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.gpt.config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden={cfg.hidden} is not divisible by heads={cfg.heads}: choose heads that divide it")
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.q_norm = nn.LayerNorm(cfg.head_dim) if cfg.qk_layernorm else nn.Identity()
        self.k_norm = nn.LayerNorm(cfg.head_dim) if cfg.qk_layernorm else nn.Identity()
        self.register_buffer("causal", torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool)), persistent=False)
        self.max_logit = float("nan")  # largest q.k/sqrt(d) of the last forward (telemetry)

    def forward(self, x):  # [b, s, d]
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 x [b, s, d]
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))  # [b, a, s, d/a]
        q, k = self.q_norm(q), self.k_norm(k)
        logits = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [b, a, s, s]
        mask = self.causal[:s, :s]
        self.max_logit = logits.detach().float()[..., mask].max().item()  # over the positions softmax sees
        att = F.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)  # [b, a, s, s]
        y = (att @ v).transpose(1, 2).reshape(b, s, d)  # [b, s, d]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)  # [.., hidden] -> [.., ffn]
        self.out = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x):  # [b, s, d] -> [b, s, 4d] -> [b, s, d]
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.hidden), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.hidden), MLP(cfg)

    def forward(self, x):  # [b, s, d]
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Parameter(torch.zeros(cfg.seq, cfg.hidden))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)  # untied: its logits' scale is free to drift

    def forward(self, tokens):  # [b, s] -> logits [b, s, V]
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]  # [b, s, d]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [b, s, V]

    def max_attention_logit(self) -> float:
        return max(block.attn.max_logit for block in self.blocks)


def make_model(cfg: GPTConfig = GPTConfig(), seed: int = 0) -> GPT:
    """The model on the CPU in fp32, initialised from ``seed`` without touching the global RNG (nanoGPT's init)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name == "pos":
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
    return model


def layer_groups(model: GPT) -> dict[str, list[nn.Parameter]]:
    """Parameters grouped the way the per-layer telemetry reports them: embeddings, each block, the head."""
    groups = {"embed": [model.embed.weight, model.pos]}
    for i, block in enumerate(model.blocks):
        groups[f"block{i}"] = list(block.parameters())
    groups["head"] = list(model.ln_f.parameters()) + [model.head.weight]
    return groups


def token_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Mean next-token cross-entropy, plus the PaLM z-loss z_loss * mean(log Z)^2 when asked.

    log Z = logsumexp of a position's output logits: the softmax normaliser. Cross-entropy does not care
    where log Z sits (adding c to every logit changes nothing), so without z-loss it is free to drift,
    which Chowdhery et al. 2022 (PaLM, sec. 5) and Wortsman et al. 2023 (sec. 3.2) link to divergence.
    Returns (loss to backpropagate, telemetry); the telemetry's "loss" is the cross-entropy alone.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])  # [b*s, V]
    ce = F.cross_entropy(flat, targets.reshape(-1))
    log_z = torch.logsumexp(flat, dim=-1)  # [b*s]
    total = ce + z_loss * (log_z ** 2).mean() if z_loss else ce
    return total, {"loss": ce.item(), "log_z_mean": log_z.mean().item(), "log_z_max": log_z.abs().max().item()}
