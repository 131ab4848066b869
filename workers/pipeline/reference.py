"""The ground truth: the same model, unsplit, on the same global batch, in one process.

Mean squared error over the whole global batch equals the mean over the m equal micro-batches of each
micro-batch's mean, which is what the pipeline accumulates (each micro-batch's loss scaled by 1/m, as
Megatron divides by the number of micro-batches): the gradients must agree to fp32 rounding.
"""
from __future__ import annotations

import torch

from workers.pipeline.model import PipelineConfig, loss_fn, make_batch, make_model


def reference_step(cfg: PipelineConfig, steps: int = 1, lr: float = 0.1) -> dict:
    """``steps`` SGD steps of the whole model: losses per step, the last step's gradients, the final weights."""
    return reference_step_in(cfg, torch.float32, steps, lr)


def reference_step_in(cfg: PipelineConfig, dtype: torch.dtype, steps: int = 1, lr: float = 0.1) -> dict:
    """``reference_step`` with the model and the batch in ``dtype`` (the seeded float32 weights, converted): in
    float64 a pipeline's gradients differ from these only by the order of the additions, about 1e-16 relative."""
    model = make_model(cfg).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        x, y = (t.to(dtype) for t in make_batch(cfg, step))  # [B, h], [B, h]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights}
