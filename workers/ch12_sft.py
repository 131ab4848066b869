"""Chapter 12: supervised fine-tuning of the tiny GPT on "a+b=cd", full or LoRA, prompt masked or not.

    torchrun --nproc-per-node 1 workers/ch12_sft.py --mask-prompt false --lora-rank 4

Streams loss, answer-token loss and grad norm per step; returns the history, the held-out evaluation
before and after, and the trainable / total parameter counts.
"""
from workers.posttrain.lora import apply_lora, trainable_params
from workers.posttrain.train import evaluate, make_policy, sft
from workers.runtime import entrypoint

LORA_TARGETS = ("qkv", "proj", "fc", "out")  # every Linear inside the blocks; embeddings and head stay frozen


def check_params(world_size, steps, lr, batch, lora_rank, **_):
    if steps < 1:
        return f"steps={steps} trains nothing: use at least 1 step"
    if lr <= 0:
        return f"lr={lr} must be positive"
    if batch < world_size or batch % world_size:
        return f"batch={batch} does not split into {world_size} equal shards: choose a multiple of {world_size}"
    if lora_rank < 0:
        return f"lora_rank={lora_rank} must be 0 (full fine-tuning) or a positive rank"
    return None


def main(ctx, steps: int = 150, lr: float = 3e-3, batch: int = 32, mask_prompt: bool = True, lora_rank: int = 0,
         lora_alpha: float = 8.0, seed: int = 0):
    model = make_policy(seed)
    if lora_rank:
        apply_lora(model, LORA_TARGETS, r=lora_rank, alpha=lora_alpha)
    before = evaluate(model)
    # every rank trains on the same batches (seeded alike): SFT here is the single-replica baseline
    history = sft(model, steps=steps, lr=lr, batch=batch, mask_prompt=mask_prompt, seed=seed, metric=ctx.metric)
    return {"history": history, "before": before, "after": evaluate(model),
            "trainable_params": trainable_params(model), "total_params": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    entrypoint(main)
