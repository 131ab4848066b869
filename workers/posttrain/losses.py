"""The three post-training losses, each a pure function of tensors (no model inside, so each can be
checked by hand).

- SFT: next-token cross-entropy averaged over the *answer* tokens only: the prompt is given, not learned.
- DPO: Rafailov et al. 2023, "Direct Preference Optimization", eq. 7:
  L = -log sigmoid( beta * [log pi(y_w|x) - log pi_ref(y_w|x)] - beta * [log pi(y_l|x) - log pi_ref(y_l|x)] ).
  beta * log(pi / pi_ref) is the *implicit reward* (sec. 5); the loss only sees the margin between the two.
- GRPO: Shao et al. 2024, "DeepSeekMath", sec. 4.1 (eq. 3, and 4.1.2 outcome supervision): sample a group
  of G answers per prompt, advantage = (r - mean(group)) / std(group): the group is the baseline, so no
  value model is needed. The PPO-style clipped surrogate is kept, with a KL penalty to the reference
  model estimated per token as pi_ref/pi - log(pi_ref/pi) - 1 (eq. 4: unbiased, and never negative).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over the positions where ``loss_mask`` is 1 (all positions if None).

    logits [b, s, V], targets [b, s], loss_mask [b, s] of 0/1. Averaging over the counted tokens (not all
    of them) keeps the loss's scale independent of how long the prompts are.
    """
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")  # [b*s]
    if loss_mask is None:
        return ce.mean()
    mask = loss_mask.reshape(-1).float()
    return (ce * mask).sum() / mask.sum().clamp_min(1.0)


def answer_mask(batch: int, seq: int, prompt_len: int) -> torch.Tensor:
    """1 where the *target* is an answer token. Position j predicts token j + 1, so the first answer token
    (index prompt_len) is the target of position prompt_len - 1. [b, seq]"""
    positions = torch.arange(seq)
    return (positions + 1 >= prompt_len).float().expand(batch, seq)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (eq. 7) from sequence log-probs, each [n]. Returns (mean loss, chosen rewards, rejected rewards),
    the rewards being beta * log(pi / pi_ref), detached (they are for watching, not for backward)."""
    chosen_logratio = policy_chosen - ref_chosen  # [n]
    rejected_logratio = policy_rejected - ref_rejected  # [n]
    loss = -F.logsigmoid(beta * (chosen_logratio - rejected_logratio)).mean()
    return loss, beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean) / (std + eps) within each consecutive group of ``group_size`` answers to one prompt.

    rewards [n_prompts * G] -> advantages [n_prompts * G]. torch's std is the sample (unbiased) one, as
    in TRL's GRPOTrainer. A group whose answers all scored the same carries no signal: advantage 0 (eps
    keeps it from being 0/0).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)  # [n_prompts, G]
    adv = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of DeepSeekMath eq. 4: ratio - log ratio - 1, ratio = pi_ref/pi."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, advantages: torch.Tensor,
              clip_eps: float = 0.2, kl_coef: float = 0.04) -> tuple[torch.Tensor, dict]:
    """GRPO's clipped surrogate with a KL penalty (DeepSeekMath eq. 3), to *minimise*.

    logp, old_logp, ref_logp [n, T] per answer token (policy now, policy that sampled, reference);
    advantages [n], shared by every token of an answer. Returns (loss, {"kl", "clip_frac"}).
    """
    ratio = torch.exp(logp - old_logp.detach())  # [n, T]
    adv = advantages.detach()[:, None]  # [n, 1]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)  # [n, T]
    kl = kl_k3(logp, ref_logp.detach())  # [n, T]
    loss = -(surrogate - kl_coef * kl).mean()
    clipped = ((ratio - 1).abs() > clip_eps).float().mean()
    return loss, {"kl": kl.mean().item(), "clip_frac": clipped.item()}
