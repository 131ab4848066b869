"""Plausible wrong answers for chapter 09, each with a fragment of the message the check must give.

The ranks receive each checksum answer's source alone, without this module: those import what they use inside
themselves."""
from tests.wrong_answers import tries


def checksum_float_sum(params):
    # The first idea: add the parameters up. A float32 sum rounds a one-ulp change away and ignores order.
    import torch.distributed as dist

    total = float(sum(p.detach().float().sum() for p in params))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_bits_without_positions(params):
    # Integer bits catch the flipped bit, but a plain sum of them cannot see two elements trade places.
    import torch
    import torch.distributed as dist

    total = sum(int((p.detach().reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF).sum()) for p in params)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_only_mine(params):
    # A good checksum, but never exchanged: each rank sees only itself and can compare with nobody.
    import torch

    total, offset = 0, 0
    for p in params:
        bits = p.detach().reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        weights = torch.arange(offset + 1, offset + bits.numel() + 1, dtype=torch.int64)
        total += int(((bits & 0xFFFF) * weights).sum()) + 65536 * int(((bits >> 16) * weights).sum())
        offset += bits.numel()
    return [total]


def checksum_first_param_only(params):
    # Integer bits weighted by position, as asked, but of params[0] only: the other tensors never count.
    import torch
    import torch.distributed as dist

    bits = params[0].detach().reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
    total = int(((bits & 0xFFFF) * weights).sum()) + 65536 * int(((bits >> 16) * weights).sum())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_all_but_last(params):
    # A good checksum over params[:-1]: an off-by-one that drops the last tensor (often the output head).
    import torch
    import torch.distributed as dist

    total, offset = 0, 0
    for p in params[:-1]:
        bits = p.detach().reshape(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        weights = torch.arange(offset + 1, offset + bits.numel() + 1, dtype=torch.int64)
        total += int(((bits & 0xFFFF) * weights).sum()) + 65536 * int(((bits >> 16) * weights).sum())
        offset += bits.numel()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_float64_sum(params):
    # A sum of the values in float64: sees a low bit of an ordinary weight, rounds away one of a weight near 1e-12.
    import torch.distributed as dist

    total = sum(float(p.detach().double().sum()) for p in params)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_hash_of_values(params):
    # Python's hash of every value in order: position- and bit-sensitive, except that -0.0 == 0.0 hash alike.
    import torch.distributed as dist

    total = hash(tuple(v for p in params for v in p.detach().reshape(-1).tolist()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_sum_of_logs(params):
    # A "product of the values" kept from underflowing as a sum of logs: log(0) = -inf for every zero bias.
    import torch.distributed as dist

    total = sum(float(p.detach().double().abs().log().sum()) for p in params)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def checksum_in_place(params):
    # Weights each element's bits by its position in place, to spare a copy: the view is the parameter's memory.
    import torch
    import torch.distributed as dist

    total, offset = 0, 0
    for p in params:
        bits = p.detach().reshape(-1).view(torch.int32)
        bits.mul_(torch.arange(offset + 1, offset + bits.numel() + 1, dtype=torch.int32))
        total += int(bits.to(torch.int64).sum())
        offset += bits.numel()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, total)
    return everyone


def divergence_exact(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if a != b:  # rtol ignored: rounding counts as divergence
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_largest(trace_a, trace_b, rtol):
    diffs = [abs(a - b) for a, b in zip(trace_a, trace_b)]
    if len(trace_a) != len(trace_b):
        return min(len(trace_a), len(trace_b))
    big = [i for i, d in enumerate(diffs) if d > rtol * max(abs(trace_a[i]), abs(trace_b[i]))]
    return max(big, key=lambda i: diffs[i]) if big else None


def divergence_zip_only(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if abs(a - b) > rtol * max(abs(a), abs(b)):
            return i
    return None  # a shorter trace is never noticed


def divergence_only_b_short(trace_a, trace_b, rtol):
    # Foresees a replay (trace_b) that stopped early, never a reference (trace_a) shorter than the replay.
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) <= rtol * max(abs(a), abs(b)):
            return i
    return len(trace_b) if len(trace_b) < len(trace_a) else None


def divergence_indexes_a(trace_a, trace_b, rtol):
    # Walks trace_a's indices into both traces: fine while trace_b is at least as long.
    for i in range(len(trace_a)):
        if not abs(trace_a[i] - trace_b[i]) <= rtol * max(abs(trace_a[i]), abs(trace_b[i])):
            return i
    return len(trace_a) if len(trace_a) < len(trace_b) else None


def divergence_zero_is_none(trace_a, trace_b, rtol):
    # `or None` to turn "no index" into None: 0, the first step, is falsy too.
    first = next((i for i, (a, b) in enumerate(zip(trace_a, trace_b))
                  if not abs(a - b) <= rtol * max(abs(a), abs(b))), None)
    if first is None and len(trace_a) != len(trace_b):
        first = min(len(trace_a), len(trace_b))
    return first or None


def divergence_minus_one(trace_a, trace_b, rtol):
    # C's convention for "not found".
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) <= rtol * max(abs(a), abs(b)):
            return i
    return -1 if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_blind_to_inf(trace_a, trace_b, rtol):
    # NaN-proof (not <=), but an overflowed step passes: |inf - b| = inf <= rtol * inf
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) <= rtol * max(abs(a), abs(b)):
            return i
    if len(trace_a) != len(trace_b):
        return min(len(trace_a), len(trace_b))
    return None


def divergence_nan_pairs_agree(trace_a, trace_b, rtol):
    # Two NaNs at the same step taken as agreement (both runs blew up alike).
    import math

    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if math.isnan(a) and math.isnan(b):
            continue
        if not abs(a - b) <= rtol * max(abs(a), abs(b)):
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_pads_in_place(trace_a, trace_b, rtol):
    # Pads the shorter trace with NaN so that zip covers both: right index, but the caller's list grows.
    for short, other in ((trace_a, trace_b), (trace_b, trace_a)):
        short.extend([float("nan")] * (len(other) - len(short)))
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) <= rtol * max(abs(a), abs(b)):
            return i
    return None


def divergence_blind_to_nan(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if abs(a - b) > rtol * max(abs(a), abs(b)):  # NaN > x is False: a NaN step passes
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_absolute(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) <= rtol:  # rtol used as an absolute tolerance
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_tolerance_from_a(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) <= rtol * abs(a):  # relative to trace_a's value only: not symmetric
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_tolerance_from_b(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a / b - 1) <= rtol:  # a ratio: relative to trace_b's value, and 0 / 0 where both are 0
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_relative_difference(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) / max(abs(a), abs(b)) <= rtol:  # right operand, but 0 / 0 where both values are 0
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def divergence_strict(trace_a, trace_b, rtol):
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not abs(a - b) < rtol * max(abs(a), abs(b)):  # < where <= is meant: equal values "diverge" at rtol 0
            return i
    return None if len(trace_a) == len(trace_b) else min(len(trace_a), len(trace_b))


def z_loss_unstable(logits, coeff):
    import torch

    log_z = torch.log(torch.exp(logits.float()).sum(dim=-1))  # exp overflows above e^88.7 in fp32
    return coeff * (log_z ** 2).mean()


def z_loss_in_bf16(logits, coeff):
    import torch

    return coeff * (torch.logsumexp(logits, dim=-1).float() ** 2).mean()  # log Z rounded to bf16


def z_loss_half_detached(logits, coeff):
    import torch

    log_z = torch.logsumexp(logits.float(), dim=-1)
    return coeff * (log_z * log_z.detach()).mean()  # the right value, half the gradient


def z_loss_not_squared(logits, coeff):
    import torch

    return coeff * torch.logsumexp(logits.float(), dim=-1).mean()


def z_loss_over_dim_1(logits, coeff):
    # Written for [tokens, vocab] logits: dim=1 is the vocabulary only in 2-D.
    import torch

    return coeff * (torch.logsumexp(logits.float(), dim=1) ** 2).mean()


def z_loss_in_logits_dtype(logits, coeff):
    # Computed in float32, then cast back to the logits' dtype "to match the model".
    import torch

    return (coeff * (torch.logsumexp(logits.float(), dim=-1) ** 2).mean()).to(logits.dtype)


def z_loss_max_logit(logits, coeff):
    return coeff * (logits.float().amax(dim=-1) ** 2).mean()


def z_loss_summed(logits, coeff):
    import torch

    return coeff * (torch.logsumexp(logits.float(), dim=-1) ** 2).sum()


def z_loss_square_of_mean(logits, coeff):
    import torch

    return coeff * torch.logsumexp(logits.float(), dim=-1).mean() ** 2


# The classes of input each answer shows the check trying (tests/test_exercise_coverage.py).
tries("output")(checksum_only_mine)
tries("bits")(checksum_float64_sum)
tries("bits")(checksum_hash_of_values)
tries("non-finite")(checksum_sum_of_logs)
tries("mutation")(checksum_in_place)
tries("ragged")(divergence_only_b_short)
tries("output")(divergence_zero_is_none)
tries("output")(divergence_minus_one)
tries("non-finite")(divergence_nan_pairs_agree)
tries("non-finite")(divergence_blind_to_inf)
tries("mutation")(divergence_pads_in_place)
tries("non-finite")(divergence_blind_to_nan)
tries("non-finite")(z_loss_unstable)
tries("layouts")(z_loss_over_dim_1)
tries("output")(z_loss_in_logits_dtype)


WRONG = [
    ("cross_rank_checksum", checksum_float_sum, "a float sum rounds such a change away"),
    ("cross_rank_checksum", checksum_first_param_only, "does not read every parameter (only the first?"),
    ("cross_rank_checksum", checksum_all_but_last, "does not read every parameter"),
    ("cross_rank_checksum", checksum_bits_without_positions, "Weight each element by its position"),
    ("cross_rank_checksum", checksum_only_mine, "not only your own"),
    ("cross_rank_checksum", checksum_float64_sum, "a sum of values, even in float64"),
    ("cross_rank_checksum", checksum_hash_of_values, "-0.0 == 0.0, hash(-0.0) == hash(0.0)"),
    ("cross_rank_checksum", checksum_sum_of_logs, "checksum is -inf, not a finite number"),
    ("cross_rank_checksum", checksum_in_place, "the parameters changed during the call"),
    ("first_divergence", divergence_exact, "that is rounding, not divergence"),
    ("first_divergence", divergence_largest, "return the first step that differs"),
    ("first_divergence", divergence_zip_only, "zip stops silently"),
    ("first_divergence", divergence_blind_to_nan, "so that NaN counts as a divergence"),
    ("first_divergence", divergence_absolute, "rtol is relative"),
    ("first_divergence", divergence_tolerance_from_a, "taken against the wrong operand"),
    ("first_divergence", divergence_tolerance_from_b, "taken against the wrong operand"),
    ("first_divergence", divergence_relative_difference, "divided by zero"),
    ("first_divergence", divergence_strict, "with <=, not <"),
    ("first_divergence", divergence_only_b_short, "trace_a stops after 2 steps"),
    ("first_divergence", divergence_indexes_a, "raised IndexError"),
    ("first_divergence", divergence_zero_is_none, "0 is a valid index"),
    ("first_divergence", divergence_minus_one, "return None, not -1"),
    ("first_divergence", divergence_nan_pairs_agree, "although both traces hold NaN there"),
    ("first_divergence", divergence_blind_to_inf, "an infinity at step 1 went unnoticed"),
    ("first_divergence", divergence_pads_in_place, "changed the traces it was given"),
    ("z_loss", z_loss_not_squared, "you did not square log Z"),
    ("z_loss", z_loss_max_logit, "not the largest logit"),
    ("z_loss", z_loss_summed, "you summed over positions"),
    ("z_loss", z_loss_square_of_mean, "you squared the mean of log Z"),
    ("z_loss", z_loss_unstable, "an unstable log(sum(exp))"),
    ("z_loss", z_loss_in_bf16, "cast the logits to float32 first"),
    ("z_loss", z_loss_half_detached, "the value is right but its gradient"),
    ("z_loss", z_loss_over_dim_1, "you took logsumexp over dim=1"),
    ("z_loss", z_loss_in_logits_dtype, "return it in float32"),
]
