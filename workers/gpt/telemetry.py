"""What the training loop measures every step, and the bitwise checksums the detectors compare.

Norms are the Euclidean norm over every element, computed in float64 so that the telemetry itself adds
no rounding worth talking about. ``global_grad_norm`` is the number ``torch.nn.utils.clip_grad_norm_``
returns (and clips with); ``update_ratio`` is ||theta_after - theta_before|| / ||theta_before||, which for
Adam sits near lr * sqrt(#params) / ||theta|| in a healthy run and jumps when one step moves the weights
much further than the others.
"""
from __future__ import annotations

import torch

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


def float_bits(value: float) -> int:
    """The fp32 bit pattern of a number (for exact fingerprints of a loss)."""
    return int(torch.tensor([value], dtype=torch.float32).view(torch.int32).item()) & 0xFFFFFFFF


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
