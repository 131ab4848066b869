"""What autograd keeps for the backward pass: the activation memory of one block, measured (chapter 06).

Korthikanti et al. 2022 (*Reducing Activation Recomputation in Large Transformer Models*,
arXiv:2205.05198, sec. 4.1, eq. 1) count the bytes one transformer layer stores for its backward as
``sbh(34 + 5as/h)`` with 16-bit activations and 1-byte dropout masks. ``saved_for_backward`` measures the
same quantity on a real module: every tensor autograd saves during one forward passes through
``torch.autograd.graph.saved_tensors_hooks``, and is counted with its own bytes (``numel * element_size``),

* once: the same memory saved twice (the same start, the same size, maybe under another shape, as the
  attention probabilities are, by softmax as ``[b, a, s, s]`` and by the batched P.V as ``[b*a, s, s]``)
  counts once;
* without the parameters (a weight saved for the input gradient is not an activation; its storage is the
  parameter's, so any view of it is left out too);
* labelled with the innermost named submodule running when it was saved (``ln1``, ``attention.qkv``,
  ``attention``, ``mlp.fc2``...), so that each can be matched with a term of the formula.

``recompute=True`` runs the module under ``torch.utils.checkpoint`` (full recomputation, Korthikanti
sec. 5): the forward keeps only the module's input, and the backward runs the forward again.
``math_attention=True`` forces PyTorch's reference ("math") attention, which stores the s x s
probabilities; the default CPU kernel, like FlashAttention on a GPU, stores none.

Runs in any process (no communication); ``torchrun`` is not needed.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

TOP = "(module input)"  # the label of a tensor saved outside every named submodule (the checkpoint's input)


def _labels(module: nn.Module):
    """Forward hooks that keep a stack of the named submodules running; returns (stack, handles)."""
    stack: list[str] = []
    handles = []
    for name, sub in module.named_modules():
        if not name:
            continue

        def push(_mod, _args, name=name):
            stack.append(name)

        def pop(_mod, _args, _out):
            stack.pop()

        handles.append(sub.register_forward_pre_hook(push))
        handles.append(sub.register_forward_hook(pop, always_call=True))
    return stack, handles


@contextlib.contextmanager
def _attention_kernel(math: bool):
    if not math:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def saved_for_backward(module: nn.Module, x: torch.Tensor, *, recompute: bool = False,
                       math_attention: bool = False) -> dict:
    """One forward of ``module(x)``; the tensors autograd saved for its backward, and their bytes.

    Returns ``{"total_bytes", "input_bytes", "by_segment": {label: bytes}, "tensors": [...], "output"}``;
    each entry of ``tensors`` is ``{"segment", "shape", "dtype", "bytes", "counted"}`` in the order saved
    (``counted`` False: the same memory was already counted). ``output`` is the module's output, still in
    the graph, for a backward.
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    stack, handles = _labels(module)
    seen: set[tuple[int, int]] = set()
    tensors: list[dict] = []

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in params:
            nbytes = t.numel() * t.element_size()
            key = (t.data_ptr(), nbytes)  # the same memory, whatever shape it is viewed with
            tensors.append({"segment": stack[-1] if stack else TOP, "shape": tuple(t.shape),
                            "dtype": str(t.dtype).replace("torch.", ""), "bytes": nbytes, "counted": key not in seen})
            seen.add(key)
        return t

    try:
        with _attention_kernel(math_attention), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if recompute:
                from torch.utils.checkpoint import checkpoint

                output = checkpoint(module, x, use_reentrant=False)
            else:
                output = module(x)
    finally:
        for h in handles:
            h.remove()
    by_segment: dict[str, int] = {}
    for t in tensors:
        by_segment[t["segment"]] = by_segment.get(t["segment"], 0) + (t["bytes"] if t["counted"] else 0)
    return {"total_bytes": sum(by_segment.values()), "input_bytes": x.numel() * x.element_size(),
            "by_segment": by_segment, "tensors": tensors, "output": output}


def recompute_gradient_error(module: nn.Module, x: torch.Tensor, *, math_attention: bool = False) -> float:
    """Largest difference between the gradients (input and every parameter) with and without recomputation.

    Zero, or float rounding, when recomputation reproduces the forward exactly. (A module whose forward
    draws random numbers from a source checkpoint does not restore, such as ``SharedMaskDropout``'s
    per-call generator, would differ: measure it with dropout off.)
    """
    grads = []
    for recompute in (False, True):
        module.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        out = saved_for_backward(module, xi, recompute=recompute, math_attention=math_attention)["output"]
        with _attention_kernel(math_attention):
            out.backward(torch.ones_like(out))
        grads.append([xi.grad] + [p.grad for p in module.parameters()])
    module.zero_grad(set_to_none=True)
    return max((a - b).abs().max().item() for a, b in zip(*grads))
