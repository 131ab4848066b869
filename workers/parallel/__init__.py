"""Tensor-parallel building blocks in Megatron-LM's vocabulary (chapter 03 onwards): the package's public surface.

``mappings``: the collectives inside autograd (``f``/``g`` and their relatives), each a
``torch.autograd.Function`` plus a one-line public function. ``reference``: the single-process ground
truth they are tested against. The layers built on them (chapters 04-06): ``ColumnParallelLinear``,
``RowParallelLinear``, ``ParallelMLP``, ``ParallelAttention``, ``ParallelBlock``, each with ``from_dense``; the model's
two ends split by vocabulary (``vocab.py``): ``VocabParallelEmbedding``, ``parallel_lm_logits`` (the tied head) and
``vocab_parallel_cross_entropy`` (the loss from logits never gathered). Collective matmul
(``collective_matmul.py``): ``all_gather_matmul`` and ``matmul_reduce_scatter``, sequence parallelism's two
collectives cut into ring steps that overlap the matmuls (Wang et al. 2023). And
``RankGrid`` (``grid.py``), the one layout of the world every chapter's process groups are sliced from.
"""
from workers.parallel.mappings import (CONJUGATE, MAPPINGS, all_to_all, copy_to_tensor_model_parallel_region,
                                       gather_from_sequence_parallel_region,
                                       gather_from_tensor_model_parallel_region, record_communication,
                                       reduce_from_tensor_model_parallel_region,
                                       reduce_scatter_to_sequence_parallel_region,
                                       scatter_to_sequence_parallel_region,
                                       scatter_to_tensor_model_parallel_region)
from workers.layout.grid import RankGrid  # noqa: E402  (after mappings: the layers import them)
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from workers.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter  # noqa: E402
from workers.parallel.mlp import ParallelMLP  # noqa: E402
from workers.parallel.attention import ParallelAttention  # noqa: E402
from workers.parallel.block import ParallelBlock  # noqa: E402
from workers.parallel.vocab import (VocabParallelEmbedding, parallel_lm_logits,  # noqa: E402
                                    vocab_parallel_cross_entropy)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention", "ParallelBlock", "RankGrid",
           "VocabParallelEmbedding", "parallel_lm_logits", "vocab_parallel_cross_entropy",
           "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "all_to_all", "record_communication", "MAPPINGS",
           "CONJUGATE", "all_gather_matmul", "matmul_reduce_scatter"]
