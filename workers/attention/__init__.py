"""FlashAttention for chapter 07: a float64 reference, a tiled PyTorch version and Triton kernels.

``triton_kernels`` is not imported here: it imports triton, which a CPU-only learner may not have.
``flash_attention(..., impl="triton")`` imports it on demand.
"""
from workers.attention.api import flash_attention, online_softmax_merge, triton_available
from workers.attention.reference import attention_reference, attention_reference_grads, causal_mask
from workers.attention.tiled import online_softmax_update, tiled_flash_attention

__all__ = ["flash_attention", "online_softmax_merge", "triton_available", "attention_reference",
           "attention_reference_grads", "causal_mask", "online_softmax_update", "tiled_flash_attention"]
