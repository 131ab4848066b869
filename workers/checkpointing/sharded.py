"""The model chapter 08's DCP demo shards (``workers/ch08_dcp.py``): one definition for the ranks and the tests,
which rebuild it at another world size and compare."""
from __future__ import annotations

import torch
import torch.nn as nn


def make_mlp(width: int, layers: int, seed: int) -> nn.Sequential:
    """``layers`` Linears (width -> width + 1 -> ... -> width + 1) with GELU between: an odd row count (7 at the
    default width), so Shard(0) splits every tensor unevenly over 2 ranks (4 rows + 3 rows)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mods: list[nn.Module] = []
        for i in range(layers):
            mods += [nn.Linear(width + (i > 0), width + 1)] + ([nn.GELU()] if i < layers - 1 else [])
        return nn.Sequential(*mods)
