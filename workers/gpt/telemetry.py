"""What the training loop measures every step, and the bitwise checksums the detectors compare.

Norms are the Euclidean norm over every element, computed in float64 so that the telemetry itself adds
no rounding worth talking about. ``global_grad_norm`` is the number ``torch.nn.utils.clip_grad_norm_``
returns (and clips with); ``update_ratio`` is ||theta_after - theta_before|| / ||theta_before||, which for
Adam sits near lr * sqrt(#params) / ||theta|| in a healthy run and jumps when one step moves the weights
much further than the others. ``newly_nonzero`` finds the gradient elements that reach a weight for the
first time in the run (in fp16 without loss scaling, where most gradients underflow, that is an event).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHECKSUM_MODULUS = 2 ** 61 - 1  # a Mersenne prime: position weights below it never collide


def global_grad_norm(params) -> float:
    grads = [p.grad.detach().double() for p in params if p.grad is not None]
    return float(torch.sqrt(sum((g * g).sum() for g in grads))) if grads else 0.0


def group_grad_norms(groups: dict[str, list]) -> dict[str, float]:
    return {name: global_grad_norm(params) for name, params in groups.items()}


def flat_params(params) -> torch.Tensor:
    """Every parameter flattened into one fp32 CPU tensor, in order (a copy)."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


def update_ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    return float((after.double() - before.double()).norm() / before.double().norm().clamp_min(1e-30))


def zero_grad_fraction(params) -> float:
    """Fraction of gradient elements that are exactly zero: the fingerprint of fp16 underflow."""
    grads = [p.grad.detach().reshape(-1) for p in params if p.grad is not None]
    flat = torch.cat(grads)
    return float((flat == 0).double().mean())


def newly_nonzero(grad: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Mask of the flat gradient's elements that are nonzero now and were exactly 0 at every earlier step
    (``seen``: the elements that had a nonzero gradient before). Adam has no history for such an element
    (m = v = 0), so its first step on it is lr * (1 - b1) / (1 - b1^t) / sqrt((1 - b2) / (1 - b2^t)) in size
    whatever the gradient's size: a gradient of one rounding unit moves the weight as far as a real one."""
    return (grad != 0) & ~seen


def sign_agreement(grad: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float | None:
    """Fraction of the elements in ``mask`` where ``grad`` has the sign of ``reference`` (None if none):
    0.5 is a coin toss, the gradient carries no information about the direction."""
    if not bool(mask.any()):
        return None
    return float((torch.sign(grad[mask]) == torch.sign(reference[mask])).double().mean())


def bitwise_checksum(tensor: torch.Tensor) -> int:
    """A checksum of a float32 tensor's bits: sum of bits_i * (i + 1), mod 2^61 - 1.

    Every bit counts (a flipped low mantissa bit changes it) and so does every position (two swapped
    elements change it), unlike a plain float sum, which rounds small changes away and ignores order.
    Integer arithmetic, so the order of the additions does not matter: the same bits give the same
    checksum on every rank and in every replay.
    """
    bits = tensor.detach().to("cpu", torch.float32).reshape(-1).contiguous().view(torch.int32).to(torch.int64)
    bits = bits & 0xFFFFFFFF  # the unsigned 32-bit word
    if bits.numel() >= 2 ** 20:
        raise ValueError("bitwise_checksum handles up to 2^20 elements: checksum the tensor in chunks")
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
    # split each word in 16-bit halves: products < 2^36, sums of < 2^20 of them < 2^56, no int64 overflow
    low, high = int(((bits & 0xFFFF) * weights).sum()), int(((bits >> 16) * weights).sum())
    return (high * 65536 + low) % CHECKSUM_MODULUS


def params_checksum(params) -> int:
    return bitwise_checksum(flat_params(params))


def flip_bit_(tensor: torch.Tensor, index: int, bit: int) -> tuple[float, float]:
    """Toggle bit ``bit`` of element ``index`` of a float32 tensor in place; returns (old, new) values."""
    flat = tensor.data.view(-1)
    old = float(flat[index])
    word = flat[index:index + 1].view(torch.int32)
    word ^= torch.tensor([1 << bit if bit < 31 else -(1 << 31)], dtype=torch.int32, device=tensor.device)
    return old, float(flat[index])


def columns(records: list[dict], keys) -> dict:
    """Per-step records -> {key: [value per step]}; nested dicts (per-layer norms) become {name: [...]}."""
    out = {}
    for key in keys:
        values = [r[key] for r in records]
        if values and isinstance(values[0], dict):
            out[key] = {name: [v[name] for v in values] for name in values[0]}
        else:
            out[key] = values
    return out


def layer_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Parameters grouped the way the per-layer telemetry reports them: embeddings, each block, the head."""
    groups = {"embed": [model.embed.weight, model.pos]}
    for i, block in enumerate(model.blocks):
        groups[f"block{i}"] = list(block.parameters())
    groups["head"] = list(model.ln_f.parameters()) + [model.head.weight]
    return groups


def token_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Mean next-token cross-entropy, plus the PaLM z-loss z_loss * mean(log Z)^2 when asked.

    log Z = logsumexp of a position's output logits: the softmax normaliser. Cross-entropy does not care
    where log Z sits (adding c to every logit changes nothing), so without z-loss it is free to drift,
    which Chowdhery et al. 2022 (PaLM, sec. 5) and Wortsman et al. 2023 (sec. 3.2) link to divergence.
    Returns (loss to backpropagate, telemetry); the telemetry's "loss" is the cross-entropy alone.
    """
    flat = logits.float().reshape(-1, logits.shape[-1])  # [b*s, V]
    ce = F.cross_entropy(flat, targets.reshape(-1))
    log_z = torch.logsumexp(flat, dim=-1)  # [b*s]
    total = ce + z_loss * (log_z ** 2).mean() if z_loss else ce
    return total, {"loss": ce.item(), "log_z_mean": log_z.mean().item(), "log_z_max": log_z.abs().max().item()}
