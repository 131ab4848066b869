"""The course's one model: ``GPTConfig`` and ``GPT`` (``gpt.py``), built from the dense layers of ``dense.py``.

Chapters 06, 09, 11, 12, 15 and 16 train this GPT; chapters 04-06 cut its layers (``DenseBlock``,
``DenseAttention``, ``DenseMLP``) over tensor-parallel ranks. The rank side is layered
model -> parallelize -> layout and mesh -> collectives (``docs/CONTRIBUTING.md``); this package is the top and
imports nothing parallel.
"""
from workers.model.dense import BlockConfig, DenseAttention, DenseBlock, DenseMLP
from workers.model.gpt import GPT, GPTConfig, Where, block_forward, keyed_dropout, make_model

__all__ = ["GPT", "GPTConfig", "Where", "make_model", "block_forward", "keyed_dropout", "BlockConfig",
           "DenseAttention", "DenseBlock", "DenseMLP"]
