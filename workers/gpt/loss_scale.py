"""fp16 training by hand: an fp16 copy of the model for forward and backward, fp32 master weights for the
optimizer, and (optionally) dynamic loss scaling, the recipe of Micikevicius et al. 2018, "Mixed Precision
Training", sec. 3.2, which torch.amp.GradScaler implements.

fp16 has 5 exponent bits: its smallest normal number is 2^-14 ~ 6.1e-5 and its smallest subnormal
2^-24 ~ 6.0e-8. Gradients of a mean loss over thousands of tokens are small; in an fp16 backward the
ones below 2^-24 round to exactly zero (underflow) and their parameters stop learning. Multiplying the
loss by S before backward shifts every gradient up by log2(S) binades; dividing the fp32 copy by S
afterwards undoes it. Too large an S overflows to inf: then the step is skipped and S halved; after
``growth_interval`` clean steps S doubles again.
"""
from __future__ import annotations

import copy

import torch


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 50, enabled: bool = True):
        self.scale = float(init_scale) if enabled else 1.0
        self.enabled, self.growth_interval = enabled, growth_interval
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.enabled:
            return
        if found_inf:
            self.scale, self.clean_steps = self.scale / 2, 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]


class HalfCopy:
    """The fp16 model the forward and backward run in; the fp32 ``master`` is what the optimizer steps."""

    def __init__(self, master: torch.nn.Module):
        self.master = master
        self.model = copy.deepcopy(master).half()

    def refresh(self) -> None:
        """Round the master weights into the fp16 copy (before every forward)."""
        with torch.no_grad():
            for h, m in zip(self.model.parameters(), self.master.parameters()):
                h.copy_(m)
        self.model.zero_grad(set_to_none=True)

    def grads_to_master(self, scale: float) -> bool:
        """master.grad = fp16 grad / scale, in fp32; returns True if any gradient is inf or NaN (overflow)."""
        found_inf = False
        for h, m in zip(self.model.parameters(), self.master.parameters()):
            g = h.grad.float() if h.grad is not None else torch.zeros_like(m)
            found_inf = found_inf or not bool(torch.isfinite(g).all())
            m.grad = g / scale
        return found_inf
