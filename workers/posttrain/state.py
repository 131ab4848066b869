"""What fine-tuning holds in memory, counted from the tensors on the rank after a real optimizer step.

The ledger (``course_utils.posttrain_ledger``) *predicts* bytes from a count of parameters times bytes per
parameter; this module *counts* them: the weights, the ``.grad`` tensors that exist, and every tensor in
the optimizer's ``state``. Chapter 12 checks one against the other on the toy, for full fine-tuning and LoRA.
"""
from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measured_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Counts and bytes of trained / frozen weights, gradients and optimizer state, as held right now.

    Call it after ``opt.step()`` and before the next ``zero_grad``: then every trainable parameter holds
    the gradient it was just stepped with. AdamW keeps, per parameter tensor, ``exp_avg`` (m) and
    ``exp_avg_sq`` (v), each the parameter's shape, and ``step``, a 0-d fp32 counter: the moments are
    the per-parameter cost the ledger counts; the counters are 4 bytes per *tensor*, which it does not.
    """
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    moments = step_counters = state_tensors = 0
    for state in opt.state.values():  # one dict per parameter tensor that has taken a step
        for name, value in state.items():
            if not torch.is_tensor(value):
                continue
            state_tensors += 1
            if name == "step":
                step_counters += tensor_bytes(value)
            else:
                moments += tensor_bytes(value)
    return {
        "trainable_params": sum(p.numel() for p in trained),
        "trainable_tensors": len(trained),
        "frozen_params": sum(p.numel() for p in frozen),
        "trained_weight_bytes": sum(tensor_bytes(p) for p in trained),
        "frozen_weight_bytes": sum(tensor_bytes(p) for p in frozen),
        # over *all* parameters: a frozen weight that somehow got a gradient would show up here
        "grad_bytes": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "frozen_with_grad": sum(1 for p in frozen if p.grad is not None),
        "optimizer_moment_bytes": moments,
        "optimizer_step_bytes": step_counters,
        "optimizer_bytes": moments + step_counters,
        "optimizer_state_params": len(opt.state),  # parameter tensors the optimizer keeps state for
        "optimizer_state_tensors": state_tensors,
    }
