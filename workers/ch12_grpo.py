"""Chapter 12: GRPO on the verifiable toy task, after a short SFT (so the sampled answers are sometimes right
and the rewards have signal); the SFT model is the frozen reference.

    torchrun --nproc-per-node 2 workers/ch12_grpo.py --lr 1e-3 --kl-coef 0.04

World n: every rank runs the same SFT (same seed, so the same weights), then samples its own
``prompts_per_rank`` prompts x ``group_size`` answers; gradients are averaged and rewards all-gathered.
Streams loss, reward, KL to the reference, clip fraction and grad norm; returns the history, the
held-out evaluation of the SFT model (``before``) and of the GRPO policy (``after``), and the expected
reward on the training prompts before and after (exact, not sampled).
"""
from workers.posttrain.train import evaluate, expected_reward, frozen_copy, grpo, make_policy, sft
from workers.runtime import at_least, entrypoint, refusal


def check_params(world_size, steps, sft_steps, lr, group_size, prompts_per_rank, kl_coef, clip_eps, inner_steps,
                 temperature, **_):
    return refusal(at_least("steps", steps), at_least("sft_steps", sft_steps, 0),
                   None if lr > 0 else f"lr={lr} must be positive",
                   (why := at_least("group_size", group_size, 2)) and
                   f"{why}: one answer leaves nothing to compare within a group (GRPO uses 64)",
                   at_least("prompts_per_rank", prompts_per_rank), at_least("inner_steps", inner_steps),
                   at_least("kl_coef", kl_coef, 0),
                   None if 0 < clip_eps < 1 else f"clip_eps={clip_eps} must be between 0 and 1 (try 0.2)",
                   None if temperature > 0 else
                   f"temperature={temperature} must be positive (1.0 samples the policy as it is)")


def main(ctx, steps: int = 40, sft_steps: int = 150, lr: float = 1e-3, group_size: int = 8,
         prompts_per_rank: int = 16, kl_coef: float = 0.04, clip_eps: float = 0.2, inner_steps: int = 2,
         temperature: float = 1.0, seed: int = 0):
    policy = make_policy(seed)
    sft(policy, steps=sft_steps, seed=seed)
    reference = frozen_copy(policy)
    before = evaluate(policy)
    reward_before = expected_reward(policy)
    # prompts split across ranks: halve prompts_per_rank when doubling ranks to keep the global batch
    history = grpo(policy, reference, steps=steps, lr=lr, group_size=group_size, prompts_per_rank=prompts_per_rank,
                   kl_coef=kl_coef, clip_eps=clip_eps, temperature=temperature, inner_steps=inner_steps, seed=seed,
                   rank=ctx.rank, metric=ctx.metric)
    return {"history": history, "before": before, "after": evaluate(policy),
            "expected_reward": {"before": reward_before, "after": expected_reward(policy)}}


if __name__ == "__main__":
    entrypoint(main)
