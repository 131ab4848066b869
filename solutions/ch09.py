"""Reference answers for chapter 09's exercises (each self-contained: it may travel to the ranks as source)."""


def cross_rank_checksum(params):
    """Every rank's bitwise checksum of its parameters, by rank, on every rank."""
    import torch
    import torch.distributed as dist

    modulus = 2 ** 61 - 1
    total, offset = 0, 0
    for p in params:
        bits = p.detach().to("cpu", torch.float32).reshape(-1).contiguous().view(torch.int32).to(torch.int64)
        bits = bits & 0xFFFFFFFF  # the unsigned 32-bit word: every bit counts
        weights = torch.arange(offset + 1, offset + bits.numel() + 1, dtype=torch.int64)  # every position counts
        low, high = int(((bits & 0xFFFF) * weights).sum()), int(((bits >> 16) * weights).sum())  # no overflow
        total = (total + high * 65536 + low) % modulus
        offset += bits.numel()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def first_divergence(trace_a, trace_b, rtol):
    """The first index where the traces differ by more than rtol (relative), else None."""
    import math

    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        # an infinity needs its own test: |inf - 2| = inf <= rtol * inf holds for any rtol > 0
        if not (math.isfinite(a) and math.isfinite(b)):
            return i
        if not abs(a - b) <= rtol * max(abs(a), abs(b)):  # written so that NaN counts as a divergence
            return i
    if len(trace_a) != len(trace_b):
        return min(len(trace_a), len(trace_b))  # a trace that stopped early diverges where it stopped
    return None


def z_loss(logits, coeff):
    """PaLM's auxiliary loss: coeff * mean over positions of log Z^2, log Z = logsumexp over the vocabulary."""
    import torch

    log_z = torch.logsumexp(logits.float(), dim=-1)  # [...] one normaliser per position
    return coeff * (log_z ** 2).mean()
