"""The three post-training loops on the tiny GPT (``workers/gpt``), each a few seconds on one CPU core.

``sft``: teacher-forced answers, prompt masked or not, full fine-tuning or LoRA (whatever requires grad).
``dpo``: preference pairs (chosen = the right sum, rejected = a near miss) against a frozen reference.
``grpo``: sample G answers per prompt, reward them by program, group-relative advantages, clipped
surrogate + KL to the reference. At world size n each rank samples its own prompts; gradients are
averaged (``workers.gpt.reduce``) and rewards all-gathered, so every rank logs the same global numbers.
Every loop returns its history (a list of per-step dicts) and streams each step through ``metric``.
"""
from __future__ import annotations

import copy
import math

import torch

from workers.gpt.reduce import average_gradients, gather_objects
from workers.model import GPTConfig, make_model
from workers.posttrain import task
from workers.posttrain.losses import answer_mask, dpo_loss, grpo_advantages, grpo_loss, kl_k3, sft_loss
from workers.posttrain.sampling import answer_logprobs, sample_answers
from workers.runtime import batch_over_world

TOY = GPTConfig(vocab=len(task.CHARS), seq=task.SEQ_LEN, hidden=48, heads=4, layers=2)


def _quiet(**_):
    pass


def make_policy(seed: int = 0, cfg: GPTConfig = TOY):
    return make_model(cfg, seed=seed)


def frozen_copy(model):
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def adamw(model, lr: float) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad only: a frozen weight gets no m and no v (LoRA's saving)."""
    return torch.optim.AdamW(_trainable(model), lr=lr, weight_decay=0.0)


def _step(model, opt, loss, max_grad_norm: float) -> float:
    """Backward, average over ranks, clip, step; returns the global grad norm before clipping."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    params = _trainable(model)
    average_gradients(params)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    return float(norm)


@torch.no_grad()
def evaluate(model, pairs=None) -> dict:
    """On held-out prompts: answer-token loss (teacher forced), greedy exact-match accuracy, and the rate of
    greedy answers holding a forbidden (non-digit) token."""
    pairs = task.split_pairs()[1] if pairs is None else pairs
    seqs = task.sequences(pairs)  # [n, 6]
    prompt, answer = seqs[:, :task.PROMPT_LEN], seqs[:, task.PROMPT_LEN:]
    loss = -answer_logprobs(model, prompt, answer).mean().item()
    greedy = sample_answers(model, prompt, task.ANSWER_LEN, torch.Generator(), greedy=True)
    return {"heldout_loss": loss, "accuracy": task.reward(prompt, greedy).mean().item(),
            "forbidden_rate": task.forbidden(greedy).mean().item()}


@torch.no_grad()
def expected_reward(model, pairs=None) -> float:
    """The mean probability that a sampled answer is right, over ``pairs`` (default: the training prompts),
    computed exactly: the reward is 1 for one answer only, so E[reward | prompt] = pi(right answer | prompt),
    the product of its two tokens' probabilities. No sampling noise: GRPO's progress, read without the
    +-0.04 that 128 sampled rewards a step carry."""
    seqs = task.sequences(task.split_pairs()[0] if pairs is None else pairs)  # [n, 6]
    logp = answer_logprobs(model, seqs[:, :task.PROMPT_LEN], seqs[:, task.PROMPT_LEN:])  # [n, 2]
    return logp.sum(-1).exp().mean().item()


def sft(model, steps: int = 150, lr: float = 3e-3, batch: int = 32, mask_prompt: bool = True, seed: int = 0,
        max_grad_norm: float = 1.0, metric=_quiet, opt=None, rank: int = 0, world_size: int = 1) -> list[dict]:
    """Supervised fine-tuning on "a+b=cd". Logs the loss trained on and the answer-token loss (what matters).

    Pass ``opt`` (from ``adamw(model, lr)``) to look at its state afterwards; ``lr`` is then the optimizer's.
    Data parallel with ``world_size`` > 1: every rank draws the same global batch of ``batch`` rows (same
    seed) and trains on its own ``batch / world_size`` consecutive rows. Every row holds the same number of
    counted tokens (2 answer tokens, or all 5), so the mean of the shards' mean losses is the batch's mean
    loss, and averaging the gradients (``_step``) gives the full batch's gradient: the same run as world 1,
    up to fp32 rounding. The logged losses are that mean over ranks, so every rank logs the same numbers.
    Left at world_size 1 (what DPO and GRPO's SFT phase do), each rank trains on the whole batch."""
    if why := batch_over_world(batch, world_size, "batch"):
        raise ValueError(why)
    shard = batch // world_size
    train_pairs = task.split_pairs()[0]
    g = torch.Generator().manual_seed(seed)
    opt = adamw(model, lr) if opt is None else opt
    history = []
    for step in range(steps):
        seqs = task.sequences(task.batch_pairs(train_pairs, batch, g))  # [b, 6]: the global batch
        seqs = seqs[rank * shard:(rank + 1) * shard]  # [b/n, 6]: this rank's shard
        inputs, targets = seqs[:, :-1], seqs[:, 1:]  # [b/n, 5] each
        logits = model(inputs)  # [b/n, 5, V]
        answers = answer_mask(shard, inputs.shape[1], task.PROMPT_LEN)  # [b/n, 5]
        loss = sft_loss(logits, targets, answers if mask_prompt else None)
        answer_loss = sft_loss(logits.detach(), targets, answers).item()
        norm = _step(model, opt, loss, max_grad_norm)  # gradients averaged over the ranks
        losses = [(loss.item(), answer_loss)]
        if world_size > 1:
            losses = gather_objects(losses[0])  # every rank's shard losses: their mean is the batch's
        rec = {"step": step, "loss": sum(a for a, _ in losses) / len(losses),
               "answer_loss": sum(b for _, b in losses) / len(losses), "grad_norm": norm}
        history.append(rec)
        metric(**rec)
    return history


def preference_pairs(pairs, g: torch.Generator):
    """(prompt [n, 4], chosen [n, 2], rejected [n, 2]): rejected is the sum off by 1 or 2, a plausible slip."""
    prompt, chosen = task.prompts(pairs), task.sequences(pairs)[:, task.PROMPT_LEN:]
    offsets = torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, (len(pairs),), generator=g)]
    sums = torch.tensor([a + b for a, b in pairs])
    wrong = torch.where((sums + offsets < 0) | (sums + offsets > 18), sums - offsets, sums + offsets)
    rejected = torch.stack([wrong // 10, wrong % 10], dim=1)
    return prompt, chosen, rejected


def dpo(policy, reference, steps: int = 60, lr: float = 1e-3, beta: float = 0.1, batch: int = 32, seed: int = 0,
        max_grad_norm: float = 1.0, metric=_quiet) -> list[dict]:
    """DPO against a frozen ``reference``; logs loss, implicit rewards of chosen/rejected and their margin."""
    train_pairs = task.split_pairs()[0]
    g = torch.Generator().manual_seed(seed + 1)
    opt = adamw(policy, lr)
    history = []
    for step in range(steps):
        prompt, chosen, rejected = preference_pairs(task.batch_pairs(train_pairs, batch, g), g)
        pc = answer_logprobs(policy, prompt, chosen).sum(-1)  # [b]: sequence log-prob = sum over tokens
        pr = answer_logprobs(policy, prompt, rejected).sum(-1)
        with torch.no_grad():
            rc = answer_logprobs(reference, prompt, chosen).sum(-1)
            rr = answer_logprobs(reference, prompt, rejected).sum(-1)
        loss, r_chosen, r_rejected = dpo_loss(pc, pr, rc, rr, beta)
        norm = _step(policy, opt, loss, max_grad_norm)
        rec = {"step": step, "loss": loss.item(), "chosen_reward": r_chosen.mean().item(),
               "rejected_reward": r_rejected.mean().item(), "margin": (r_chosen - r_rejected).mean().item(),
               "pref_accuracy": (r_chosen > r_rejected).float().mean().item(), "grad_norm": norm}
        history.append(rec)
        metric(**rec)
    return history


def grpo(policy, reference, steps: int = 40, lr: float = 1e-3, group_size: int = 8, prompts_per_rank: int = 16,
         kl_coef: float = 0.04, clip_eps: float = 0.2, temperature: float = 1.0, inner_steps: int = 2,
         seed: int = 0, rank: int = 0, max_grad_norm: float = 1.0, warmup: int = 5, metric=_quiet) -> list[dict]:
    """GRPO on the toy task. Each step: this rank's prompts x G samples, rewards, per-group advantages,
    ``inner_steps`` optimiser steps on the same samples (so the ratio moves off 1 and clipping matters).

    The learning rate warms up linearly over ``warmup`` steps: a fresh Adam moves every weight by about lr
    on its first step whatever the gradient, which would throw the policy far from the reference at once.
    The logged ``kl`` is KL(sampling policy || reference), estimated on the step's own samples."""
    train_pairs = task.split_pairs()[0]
    g = torch.Generator().manual_seed(seed * 1000 + rank + 7)  # each rank its own prompts and samples
    opt = adamw(policy, lr)
    history = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(warmup, 1))
        prompt = task.prompts(task.batch_pairs(train_pairs, prompts_per_rank, g))  # [p, 4]
        prompt = prompt.repeat_interleave(group_size, dim=0)  # [p*G, 4]: a group is consecutive rows
        answers = sample_answers(policy, prompt, task.ANSWER_LEN, g, temperature)  # [p*G, 2]
        rewards = task.reward(prompt, answers)  # [p*G]
        adv = grpo_advantages(rewards, group_size)
        with torch.no_grad():
            old_logp = answer_logprobs(policy, prompt, answers)  # [p*G, 2]
            ref_logp = answer_logprobs(reference, prompt, answers)
            sampling_kl = kl_k3(old_logp, ref_logp).mean().item()
        for _ in range(inner_steps):
            logp = answer_logprobs(policy, prompt, answers)
            loss, info = grpo_loss(logp, old_logp, ref_logp, adv, clip_eps, kl_coef)
            norm = _step(policy, opt, loss, max_grad_norm)
        everyone = gather_objects(rewards.tolist())  # the global batch's rewards, on every rank
        all_rewards = [r for per_rank in everyone for r in per_rank]
        kl = sum(gather_objects(sampling_kl)) / len(everyone)
        rec = {"step": step, "loss": loss.item(), "reward": sum(all_rewards) / len(all_rewards), "kl": kl,
               "clip_frac": info["clip_frac"], "grad_norm": norm, "samples": len(all_rewards),
               "forbidden_rate": task.forbidden(answers).mean().item()}
        if not math.isfinite(rec["loss"]):
            rec["loss"] = float("nan")
        history.append(rec)
        metric(**rec)
    return history
