"""Chapter 12: DPO on the toy task, after a short SFT; the SFT model is the frozen reference.

    torchrun --nproc-per-node 1 workers/ch12_dpo.py --beta 0.1

Streams loss, the implicit rewards beta * log(pi / pi_ref) of chosen and rejected answers, their margin and
the preference accuracy; returns the history and the held-out evaluation before and after.
"""
from workers.posttrain.train import dpo, evaluate, frozen_copy, make_policy, sft
from workers.runtime import at_least, entrypoint, refusal


def check_params(world_size, steps, sft_steps, lr, beta, batch, **_):
    return refusal(at_least("steps", steps), at_least("sft_steps", sft_steps, 0),
                   None if lr > 0 else f"lr={lr} must be positive",
                   None if beta > 0 else f"beta={beta} must be positive: it scales the implicit reward (try 0.1)",
                   (why := at_least("batch", batch)) and f"{why} pair")


def main(ctx, steps: int = 60, sft_steps: int = 150, lr: float = 1e-3, beta: float = 0.1, batch: int = 32,
         seed: int = 0):
    policy = make_policy(seed)
    sft(policy, steps=sft_steps, seed=seed)
    reference = frozen_copy(policy)
    before = evaluate(policy)
    history = dpo(policy, reference, steps=steps, lr=lr, beta=beta, batch=batch, seed=seed, metric=ctx.metric)
    return {"history": history, "before": before, "after": evaluate(policy)}


if __name__ == "__main__":
    entrypoint(main)
