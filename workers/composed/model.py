"""Chapter 15's model and data: the course's GPT (``workers/model/gpt.py``), tied, and ragged batches.

The dense model (``make_dense``, from ``MODEL``) is the reference every layout is held to and the model every rank
cuts its shards from (``workers/parallel/gpt.py: ParallelGPT``: tensor and sequence parallelism, a pipeline stage,
context parallelism's ring). Activations are sequence-first, ``[s, b, h]``, the model's one layout, so that
sequence parallelism and context parallelism both cut dimension 0. Batches are ragged (``make_batch``): samples
hold different numbers of valid tokens, so a loss averaged per micro-batch is not the batch's mean.
"""
from __future__ import annotations

import torch

from workers.model import GPT, GPTConfig, make_model

# 8 heads so that tp = 8 is a layout; 4 layers so that pp = 4 is; seq 16 so that cp = 4 cuts it into 8 zigzag chunks
# of 2 tokens. Initialised off every symmetric point ("perturbed"), so that a wrong gradient anywhere shows.
MODEL = GPTConfig(vocab=32, seq=16, hidden=32, heads=8, layers=4, tied=True, init="perturbed")


def model_config(vocab: int = 32, seq: int = 16, hidden: int = 32, heads: int = 8, layers: int = 4,
                 dropout: float = 0.0) -> GPTConfig:
    """The chapter's model at a worker's shape."""
    return MODEL.replace(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers, dropout=dropout)


def make_dense(cfg: GPTConfig, seed: int = 0, dtype=torch.float64) -> GPT:
    """The model every rank cuts its shards from and the reference trains, from ``seed`` (the caller's RNG untouched)."""
    return make_model(cfg, seed, dtype=dtype)


def dense_shapes(cfg: GPTConfig) -> dict[str, tuple]:
    """Every parameter's full shape, by name: what the shards are put back into."""
    return {name: tuple(p.shape) for name, p in make_dense(cfg, 0, torch.float32).named_parameters()}
