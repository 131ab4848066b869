"""Tensor-parallel building blocks in Megatron-LM's vocabulary (chapter 03 onwards).

``mappings``: the collectives inside autograd (``f``/``g`` and their relatives), each a
``torch.autograd.Function`` plus a one-line public function. ``reference``: the single-process ground
truth they are tested against.
"""
from workers.parallel.mappings import (CONJUGATE, MAPPINGS, all_to_all, copy_to_tensor_model_parallel_region,
                                       gather_from_sequence_parallel_region,
                                       gather_from_tensor_model_parallel_region, record_communication,
                                       reduce_from_tensor_model_parallel_region,
                                       reduce_scatter_to_sequence_parallel_region,
                                       scatter_to_sequence_parallel_region,
                                       scatter_to_tensor_model_parallel_region)

__all__ = ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "all_to_all", "record_communication", "MAPPINGS",
           "CONJUGATE"]
