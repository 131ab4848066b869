"""Plausible wrong answers for chapter 12, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def merge_without_scale(W, A, B, alpha, r):
    return W + B @ A  # the alpha / r scale forgotten


def merge_scaled_by_alpha(W, A, B, alpha, r):
    return W + alpha * B @ A


def merge_in_place(W, A, B, alpha, r):
    W += (alpha / r) * B @ A  # right value, but the frozen base weight is overwritten
    return W


def merge_floor_division(W, A, B, alpha, r):
    return W + (alpha // r) * (B @ A)  # the same as / while r divides alpha, 2 instead of 2.67 for alpha=8, r=3


def dpo_sign_flipped(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch.nn.functional as F

    return -F.logsigmoid(beta * ((policy_rejected - ref_rejected) - (policy_chosen - ref_chosen))).mean()


def dpo_without_beta(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch.nn.functional as F

    return -F.logsigmoid((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)).mean()


def dpo_without_reference(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch.nn.functional as F

    return -F.logsigmoid(beta * (policy_chosen - policy_rejected)).mean()


def dpo_rejected_detached(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch.nn.functional as F

    margin = (policy_chosen - ref_chosen) - (policy_rejected.detach() - ref_rejected)  # the right value, half the signal
    return -F.logsigmoid(beta * margin).mean()


def dpo_log_of_sigmoid(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch

    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -torch.log(torch.sigmoid(beta * margin)).mean()  # log(0) = -inf once the margin is about -100


def merge_nan_entry(W, A, B, alpha, r):
    merged = W + (alpha / r) * (B @ A)
    merged[0, -1] = float("nan")  # one entry gone bad (an fp16 overflow, a 0/0 upstream): the rest is right
    return merged


def dpo_reference_margin_in_place(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch.nn.functional as F

    ref_margin = ref_chosen  # a second name, not a copy
    ref_margin -= ref_rejected  # the caller's ref_chosen now holds the reference's margin
    return -F.logsigmoid(beta * ((policy_chosen - policy_rejected) - ref_margin)).mean()


def dpo_per_pair(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    import torch.nn.functional as F

    return -F.logsigmoid(beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)))  # no mean


def advantages_in_place(rewards, group_size):
    groups = rewards.view(-1, group_size)  # a view: the caller's memory
    std = groups.std(1, keepdim=True)
    groups -= groups.mean(1, keepdim=True)
    groups /= std + 1e-4
    return rewards


def advantages_global(rewards, group_size):
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


def advantages_no_std(rewards, group_size):
    groups = rewards.view(-1, group_size)
    return (groups - groups.mean(1, keepdim=True)).view(-1)


def advantages_no_eps(rewards, group_size):
    groups = rewards.view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / groups.std(1, keepdim=True)).view(-1)


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("mutation")(merge_in_place)
tries("sizes")(merge_floor_division)
tries("non-finite")(dpo_log_of_sigmoid)
tries("non-finite")(merge_nan_entry)
tries("mutation")(dpo_reference_margin_in_place)
tries("output")(dpo_per_pair)
tries("mutation")(advantages_in_place)
tries("layouts")(advantages_global)
tries("non-finite")(advantages_no_eps)


WRONG = [
    ("lora_merge", merge_without_scale, "you forgot the scale alpha / r"),
    ("lora_merge", merge_scaled_by_alpha, "you scaled by alpha instead of alpha / r"),
    ("lora_merge", merge_in_place, "you changed W in place"),
    ("lora_merge", merge_floor_division, "(floor division) instead of alpha / r"),
    ("lora_merge", merge_nan_entry, "NaN or infinite entries"),
    ("dpo_loss", dpo_sign_flipped, "the sign is flipped"),
    ("dpo_loss", dpo_without_beta, "beta is missing"),
    ("dpo_loss", dpo_without_reference, "the reference is not subtracted"),
    ("dpo_loss", dpo_rejected_detached, "gradient with respect to policy_rejected is zero"),
    ("dpo_loss", dpo_log_of_sigmoid, "Use F.logsigmoid"),
    ("dpo_loss", dpo_reference_margin_in_place, "you changed the log-probs in place"),
    ("dpo_loss", dpo_per_pair, "return a scalar tensor (the mean loss over pairs)"),
    ("grpo_advantages", advantages_global, "you normalised over the whole batch"),
    ("grpo_advantages", advantages_no_std, "did not divide by the group's std"),
    ("grpo_advantages", advantages_no_eps, "add a small eps"),
    ("grpo_advantages", advantages_in_place, "changed the rewards it was given"),
]
