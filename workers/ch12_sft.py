"""Chapter 12: supervised fine-tuning of the tiny GPT on "a+b=cd", full or LoRA, prompt masked or not.

    torchrun --nproc-per-node 1 workers/ch12_sft.py --mask-prompt false --lora-rank 4 --lr 0.01

At world n it is data parallel: every rank draws the same global batch and trains on its own batch / n
rows; gradients are averaged, so the run is world 1's up to fp32 rounding (``workers.posttrain.train.sft``).
Streams loss, answer-token loss and grad norm per step (means over the ranks); returns the history, the
held-out evaluation before and after, the trainable / total parameter counts, and what the rank holds after
the last step (weights, gradients, AdamW state, counted from the tensors). With LoRA it also merges a copy
of the trained model and returns how far the merged model's logits are from the adapter model's.
"""
from workers.posttrain import task
from workers.posttrain.lora import (LORA_ALPHA, LORA_TARGETS, LoRALinear, apply_lora, merged_copy_and_gap,
                                    trainable_params)
from workers.posttrain.state import measured_state_bytes
from workers.posttrain.train import adamw, evaluate, make_policy, sft
from workers.runtime import at_least, batch_over_world, entrypoint, refusal


def check_params(world_size, steps, lr, batch, lora_rank, lora_alpha, lora_targets, **_):
    unknown = [t for t in lora_targets if t not in LORA_TARGETS]
    why = refusal(at_least("steps", steps), None if lr > 0 else f"lr={lr} must be positive",
                  batch_over_world(batch, world_size, "batch"),
                  (low := at_least("lora_rank", lora_rank, 0)) and f"{low} (0: full fine-tuning, r >= 1: LoRA)",
                  None if lora_alpha > 0 else
                  f"lora_alpha={lora_alpha} must be positive: it scales the adapter's update by alpha / r (try 8.0)",
                  f"lora_targets={list(lora_targets)} must name some of the model's Linear layers: "
                  f"{', '.join(LORA_TARGETS)}" if unknown or not lora_targets else None)
    if why:
        return why
    ignored = [name for name, given, default in (("lora_targets", tuple(lora_targets), LORA_TARGETS),
                                                 ("lora_alpha", lora_alpha, LORA_ALPHA)) if given != default]
    if not lora_rank and ignored:
        names = " and ".join(ignored)
        return (f"{names} only {'applies' if len(ignored) == 1 else 'apply'} to LoRA, and lora_rank=0 is full "
                f"fine-tuning: pass lora_rank >= 1 (e.g. 4) to train adapters, or leave {names} out")
    return None


def main(ctx, steps: int = 150, lr: float = 3e-3, batch: int = 32, mask_prompt: bool = True, lora_rank: int = 0,
         lora_alpha: float = LORA_ALPHA, lora_targets: tuple = LORA_TARGETS, seed: int = 0):
    model = make_policy(seed)
    base_params = sum(p.numel() for p in model.parameters())
    if lora_rank:
        apply_lora(model, tuple(lora_targets), r=lora_rank, alpha=lora_alpha)
    before = evaluate(model)
    opt = adamw(model, lr)  # built here, not inside sft, so that its state can be counted afterwards
    # data parallel: each rank its shard of the same global batch, gradients averaged (replicas stay equal)
    history = sft(model, steps=steps, batch=batch, mask_prompt=mask_prompt, seed=seed, metric=ctx.metric, opt=opt,
                  rank=ctx.rank, world_size=ctx.world_size)
    out = {"history": history, "before": before, "after": evaluate(model),
           "trainable_params": trainable_params(model), "total_params": sum(p.numel() for p in model.parameters()),
           "base_params": base_params,
           # after the last step, before any zero_grad: the gradients and Adam state as training holds them
           "state_bytes": measured_state_bytes(model, opt)}
    if lora_rank:
        tokens = task.sequences(task.all_pairs())[:, :-1]  # [100, 5]: every prompt, train and held-out
        merged, gap, scale = merged_copy_and_gap(model, tokens)
        out["merge"] = {"max_abs_logit_diff": gap, "max_abs_logit": scale,
                        "merged_params": sum(p.numel() for p in merged.parameters()),
                        "lora_modules_left": sum(isinstance(m, LoRALinear) for m in merged.modules())}
    return out


if __name__ == "__main__":
    entrypoint(main)
