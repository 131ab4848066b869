"""Chapter 16: chapter 09's tiny GPT with an MoE FFN in every block, trained on expert-parallel ranks.

    torchrun --nproc-per-node 2 workers/ch16_moe_train.py --aux-coeff 0.01 --steps 150
    torchrun --nproc-per-node 4 workers/ch16_moe_train.py --ep 2 --experts 8 --capacity-factor 1.25

Every step streams the loss, the busiest expert's load over a perfectly even one and the dropped fraction
(``ctx.metric``); the run returns, per step, tokens per expert in every layer, the fraction dropped and the
fraction that would be dropped at capacity factors 1, 1.25, 1.5, 2, the load-balancing loss, and each rank's
CPU seconds in its experts (``workers/moe/train.py``).
"""
from workers.moe.config import MoEConfig
from workers.moe.layer import expert_mesh
from workers.model import GPTConfig
from workers.moe.train import CAPACITY_FACTORS, MoETrainer
from workers.runtime import at_least, batch_over_world, divides, entrypoint, refusal


def check_params(world_size, ep=0, experts=8, top_k=2, capacity_factor=0.0, aux_coeff=0.01, z_coeff=0.0,
                 shared_experts=0, ffn=64, steps=150, global_batch=16, lr=3e-3, hidden=32, heads=4, layers=2,
                 seq=32, vocab=32, **_):
    ep = ep or world_size
    moe = MoEConfig(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                    aux_coeff=aux_coeff, z_coeff=z_coeff, shared_experts=shared_experts)
    return refusal(at_least("steps", steps), None if lr > 0 else f"lr={lr} must be positive",
                   batch_over_world(global_batch, world_size),
                   divides("heads", heads, "hidden", hidden) if hidden >= 1 else None,  # else the MoE layer refuses it
                   moe.problem(ep=ep, world=world_size))


def main(ctx, ep: int = 0, experts: int = 8, top_k: int = 2, capacity_factor: float = 0.0, aux_coeff: float = 0.01,
         z_coeff: float = 0.0, shared_experts: int = 0, ffn: int = 64, steps: int = 150, global_batch: int = 16,
         lr: float = 3e-3, hidden: int = 32, heads: int = 4, layers: int = 2, seq: int = 32, vocab: int = 32,
         seed: int = 0, data_seed: int = 1234):
    """``steps`` AdamW steps; every rank returns the same per-step records (they are all-reduced)."""
    gcfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers)
    moe = MoEConfig(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                    aux_coeff=aux_coeff, z_coeff=z_coeff, shared_experts=shared_experts)
    records = []
    with expert_mesh(ctx.world_size, ep or ctx.world_size, ctx.rank) as mesh:
        trainer = MoETrainer(gcfg, moe, mesh, steps=steps, global_batch=global_batch, lr=lr, seed=seed,
                             data_seed=data_seed, device=ctx.device)
        for step in range(steps):
            rec = trainer.step()
            ctx.metric(step, loss=rec["loss"], max_load=max(rec["max_load"]), dropped=max(rec["dropped"]))
            records.append(rec)
    columns = {key: [r[key] for r in records] for key in records[0]}
    return {"model": gcfg.__dict__ | {"ffn": ffn}, "moe": moe.as_dict(), "ep": mesh.size("ep"), "world": ctx.world_size,
            "capacity_factors": list(CAPACITY_FACTORS), "steps": steps, "global_batch": global_batch, **columns}


if __name__ == "__main__":
    entrypoint(main)
