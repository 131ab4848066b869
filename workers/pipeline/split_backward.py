"""The backward of one stage of ``model.py``'s stack, split by hand into B and W (Qi et al. 2023, section 2).

A layer is z = x W^T + b, y = tanh(z) (the model's last layer stops at z). Given dy = dL/dy:

    dz = dy * (1 - y^2)          tanh' = 1 - tanh^2, read off the forward's output (the last layer: dz = dy)
    B:  dx = dz W                [mb, h_out] @ [h_out, h_in]: the input gradient, what the previous stage waits for
    W:  dW = dz^T x, db = sum dz  the weight gradient: nobody waits for it, so it can run later, in a bubble

B walks the stage's layers from the last to the first; each layer's dz needs the next layer's dx, so B cannot
be cut further. W needs, for every layer, its input x and its dz, and nothing else: that is what B leaves behind.

Memory, per micro-batch and stage of L layers, in [mb, h] tensors:
    F -> B   the forward's stash: each layer's input x (the previous layer's y) and the stage's output, L + 1.
    B -> W   each layer's input x (kept from the forward) and its dz (new), 2L; the tanh outputs that only B
             needed are freed. For this stack W's stash is larger than the forward's; in a transformer it is the
             other way round (attention scores and MLP activations that B needs dwarf the inputs of the linear
             layers), which is why the paper finds ZB-H1 fits in 1F1B's memory.

``forward`` / ``backward_input`` / ``backward_weight`` run under ``torch.no_grad``: no autograd graph is kept, the
stash is the tensors listed above and nothing else. They compute what autograd computes, in the same order
(``F.linear`` forward, ``tanh_backward``'s dy (1 - y^2), dz W and dz^T x as mm, a sum over rows for db), so B then W
equals ``torch.autograd.backward`` bit for bit in float64 (``tests/test_ch13_zero_bubble.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def stage_layers(module) -> list:
    """The ``model.Layer`` list of a stage (an ``nn.Sequential`` of them, as ``model.stage_module`` cuts it)."""
    layers = list(module)
    if not all(hasattr(layer, "linear") and hasattr(layer, "last") for layer in layers):
        raise TypeError("split_backward runs model.py's Layer stack (Linear + tanh); this stage holds "
                        f"{[type(layer).__name__ for layer in layers]}")
    return layers


@torch.no_grad()
def forward(layers, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The stage's output and its stash: per layer (input x, tanh output y or None on the model's last layer)."""
    stash = []
    for layer in layers:
        z = F.linear(x, layer.linear.weight, layer.linear.bias)  # [mb, h_in] -> [mb, h_out]
        y = z if layer.last else torch.tanh(z)
        stash.append((x, None if layer.last else y))
        x = y
    return x, stash


@torch.no_grad()
def backward_input(layers, stash: list, dy: torch.Tensor, need_input_grad: bool = True):
    """B: the input gradient dx (None when the stage's input is data, which needs none) and W's stash, per layer
    (x, dz). The forward's stash is no longer needed afterwards."""
    for_w = []
    for n in range(len(layers) - 1, -1, -1):
        x, y = stash[n]
        # dy * (1 - y^2), through autograd's own elementwise kernel: written out in torch ops it rounds differently
        # in the last bit (the kernel may fuse the multiply and the subtraction)
        dz = dy if y is None else torch.ops.aten.tanh_backward(dy, y)  # [mb, h_out]
        for_w.append((x, dz))
        if n > 0 or need_input_grad:
            dy = dz.mm(layers[n].linear.weight)  # [mb, h_out] @ [h_out, h_in] -> [mb, h_in]
    return (dy if need_input_grad else None), for_w[::-1]


@torch.no_grad()
def backward_weight(layers, for_w: list) -> None:
    """W: accumulate dW = dz^T x and db = sum dz into ``.grad`` (set on the first micro-batch, added after)."""
    for layer, (x, dz) in zip(layers, for_w):
        # [h_out, mb] @ [mb, h_in] -> [h_out, h_in]: the product autograd's linear backward forms, in its order
        for param, grad in ((layer.linear.weight, dz.t().mm(x)), (layer.linear.bias, dz.sum(0))):
            if param.grad is None:
                param.grad = grad.clone(memory_format=torch.contiguous_format)
            else:
                param.grad += grad


def stash_bytes(*stashes) -> int:
    """Bytes of the distinct tensors the stashes hold (one tensor held twice counted once)."""
    seen, total = set(), 0
    for stash in stashes:
        for pair in stash:
            for t in pair:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total
