"""Chapter 16: one MoE layer on expert-parallel ranks, forward and backward, against the one-process reference.

    torchrun --nproc-per-node 4 workers/ch16_moe.py --ep 2 --experts 8 --top-k 2 --capacity-factor 1.0
    torchrun --nproc-per-node 4 workers/ch16_moe.py --ep 4 --sweep true
    torchrun --nproc-per-node 2 workers/ch16_moe.py --ep 2 --fault combine_order_not_restored

Every rank builds the whole layer from ``seed``, keeps the router, the shared experts and its ``experts / ep``
routed experts (``workers/moe/layer.py``), routes its share of a batch of ``tokens`` tokens (``data_seed``;
rank r holds rows ``[r T/W, (r+1) T/W)``), sends them to their experts with two all-to-alls, and backpropagates
its loss: the mean over its tokens of ``y . g`` (``g`` a fixed random direction per token) plus the auxiliary
losses. Gradients are averaged (``reduce_gradients``: dense ones over the world, experts over their expert-data-
parallel group, both divided by the world). Each rank returns its output rows, its input's gradient, the gradient
of every parameter it holds, its routing (experts, kept choices), counts, split sizes and timings, for every case
(``sweep``: experts 4 and 8, top-1 and top-2, dropless and capacity factor 1). ``workers/moe/equivalence.py``
compares them with ``reference_forward``. ``skew`` > 0 pushes every token towards expert 0 (an imbalanced batch).

With ``world > ep`` the experts are also data-parallel: EP groups of ``ep`` consecutive ranks, each holding all
the experts once.
"""
import time

import torch.distributed as dist

from workers.moe.batch import DTYPES, balance, batch, cases
from workers.moe.faults import FAULTS, inject
from workers.moe.layer import MoELayer, build_weights, expert_mesh, reduce_gradients
from workers.runtime import entrypoint, one_of, refusal


def check_params(world_size, ep=0, experts=4, top_k=2, capacity_factor=0.0, aux_coeff=0.1, z_coeff=0.01,
                 shared_experts=0, hidden=16, ffn=32, tokens=32, fault="none", sweep=False, dtype="float64",
                 balanced=False, skew=0.0, **_):
    ep = ep or world_size
    one = dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
               aux_coeff=aux_coeff, z_coeff=z_coeff, shared_experts=shared_experts)
    layer = None  # the first case (of a sweep's) that the layer cannot take
    for cfg in cases(sweep, **one):
        layer = layer or cfg.problem(ep=ep, world=world_size, tokens=tokens)
    return refusal(
        (f"balanced=True routes token t to experts t and t+1 through the first {experts} coordinates: it needs "
         f"hidden >= experts, top_k <= 2 and skew=0 (here hidden={hidden}, top_k={top_k}, skew={skew})")
        if balanced and (hidden < experts or top_k > 2 or skew) else None,
        one_of("fault", fault, FAULTS), one_of("dtype", dtype, DTYPES), layer)


def main(ctx, ep: int = 0, experts: int = 4, top_k: int = 2, capacity_factor: float = 0.0, aux_coeff: float = 0.1,
         z_coeff: float = 0.01, shared_experts: int = 0, hidden: int = 16, ffn: int = 32, tokens: int = 32,
         seed: int = 0, data_seed: int = 1, skew: float = 0.0, fault: str = "none", sweep: bool = False,
         dtype: str = "float64", balanced: bool = False, repeats: int = 1, report: bool = True):
    """One forward and backward per case; ``repeats`` > 1 times it: every rank starts each forward at a barrier,
    and ``timings`` lists, per repeat, the wall seconds of the forward's routing and dispatch, its experts (and
    their CPU seconds), its combine all-to-all (the wait for the slowest rank), the forward and the step (the rest
    of the record is the last repeat's)."""
    ep = ep or ctx.world_size
    world, rank = ctx.world_size, ctx.rank
    out = []
    with expert_mesh(world, ep, rank) as mesh, inject(fault):
        one = dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                   aux_coeff=aux_coeff, z_coeff=z_coeff, shared_experts=shared_experts)
        for cfg in cases(sweep, **one):
            weights = build_weights(cfg, seed, DTYPES[dtype])
            weights = balance(cfg, weights) if balanced else weights
            layer = MoELayer(cfg, mesh, weights=weights, device=ctx.device, dtype=DTYPES[dtype])
            x_all, g_all = batch(cfg, tokens, data_seed, skew, DTYPES[dtype], weights, balanced)
            per = tokens // world
            rows = slice(rank * per, (rank + 1) * per)
            timings = []  # per repeat: where this rank's forward went, and the whole step (wall seconds)
            for _ in range(repeats):
                layer.zero_grad(set_to_none=True)
                x = x_all[rows].clone().to(ctx.device).requires_grad_(True)  # [T/W, h]
                if repeats > 1 and world > 1:
                    dist.barrier()  # every rank starts the timed forward together
                t0 = time.perf_counter()
                y = layer(x)  # [T/W, h]
                forward_s = time.perf_counter() - t0
                loss = (y * g_all[rows].to(ctx.device)).sum(dim=-1).mean() + layer.aux_loss
                loss.backward()
                reduce_gradients(layer.parameters(), layer.expert_parameters(), mesh,
                                 router_params=layer.router.parameters())
                step_s = time.perf_counter() - t0
                rec = layer.last
                timings.append({"dispatch_s": rec.dispatch_s, "expert_s": rec.expert_s,
                                "expert_cpu_s": rec.expert_cpu_s, "combine_s": rec.combine_s,
                                "forward_s": forward_s, "step_s": step_s})
            kept = int(rec.keep.sum())
            case = {"config": cfg.as_dict(), "rows": [rows.start, rows.stop], "ep_rank": layer.ep_rank,
                    "local_experts": layer.local, "experts": rec.experts.cpu(), "keep": rec.keep.cpu(),
                    "counts": rec.counts.cpu(), "kept": kept, "dropped": rec.keep.numel() - kept,
                    "send_splits": rec.send_splits, "recv_splits": rec.recv_splits,
                    "tokens_per_local_expert": rec.tokens_per_local_expert, "expert_cpu_s": rec.expert_cpu_s,
                    "combine_s": rec.combine_s, "timings": timings,
                    "step_s": step_s, "loss": float(loss), "aux": rec.aux, "z": rec.z,
                    # the bytes this rank's dispatch all-to-all moved to other ranks (the combine sends recv back)
                    "dispatch_bytes": (sum(rec.send_splits) - rec.send_splits[layer.ep_rank]) * hidden * x.element_size(),
                    "combine_bytes": (sum(rec.recv_splits) - rec.recv_splits[layer.ep_rank]) * hidden * x.element_size()}
            if report:
                # the rank backpropagated its own mean loss; the global loss is the mean of the world's: / world
                case.update(y=y.detach().cpu(), input_grad=(x.grad / world).cpu(),
                            grads={n: p.grad.detach().cpu() for n, p in layer.named_parameters()})
            out.append(case)
    return {"world": world, "ep": ep, "edp": world // ep, "fault": fault, "tokens": tokens, "seed": seed,
            "data_seed": data_seed, "skew": skew, "balanced": balanced, "dtype": dtype, "cases": out}


if __name__ == "__main__":
    entrypoint(main)
