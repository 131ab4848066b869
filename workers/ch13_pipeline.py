"""A pipeline-parallel training step on real ranks: GPipe, 1F1B, interleaved 1F1B, or a zero-bubble schedule
(ZB-H1, ZB-H2, ZB-V, DualPipeV) over real send/recv.

    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule 1f1b --micro-batches 8
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --pp 2 --forward-ms 5 --backward-ms 10
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule interleaved --virtual-stages 2
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule zb-h1 --dtype float64
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule dualpipev --virtual-stages 2 --layers 16

The degrees are the course's one layout's (``workers/layout/rules.py``): ``pp`` p stages (0: the whole world)
split ``layers`` into p contiguous stages; a world larger than p runs world / p identical pipelines side by side
(the layout's dp: ranks 0..p-1, p..2p-1, ...: each the same model on the same batch), so p = 1, 2 and 4 all run on
one set of 4 warm ranks. ``virtual_stages`` v > 1 (interleaved only) cuts the model into p * v chunks instead,
chunk c of stage s holding virtual stage c * p + s. Each rank returns its stage's timeline, peak stashed
activations, p2p counts, losses (last stage), gradients of the last step and weights after ``steps`` SGD steps,
under the whole model's parameter names (``workers/pipeline/reference.py`` is the single-process ground truth).

The zero-bubble schedules (``workers/pipeline/zero_bubble.py``) split each backward into B (the input gradient) and
W (the weight gradient), computed by hand (``split_backward.py``); ``backward_ms`` pads B to (1 - ``w_share``) of it
and W to ``w_share`` of it, so the chapter's 20 / 40 ms at the default 0.5 give the paper's T_F = T_B = T_W. ZB-V and DualPipeV hold two chunks per rank in a V
(``virtual_stages=2``): rank s holds virtual stages s and 2p-1-s, so rank p-1 hands its chunk 0's output to its
chunk 1 without a message, and the loss, the last virtual stage, is on rank 0: its losses come back from stage 0
(``loss_stage``). ``dtype="float64"`` runs every stage in double precision, for comparisons to 1e-12.
"""
import time

import torch

from workers.layout.grid import RankGrid
from workers.layout.mesh import Mesh, link_names
from workers.layout.rules import Layout, equal_stages_problem, problem
from workers.pipeline.executor import run_schedule, run_split_schedule
from workers.pipeline.model import PipelineConfig, global_names, make_batch, micro_batches as split, stage_module
from workers.pipeline.p2p import P2P
from workers.pipeline.schedules import peak_stash, schedule as make_schedule
from workers.pipeline.validity import peak_stashes
from workers.pipeline.zero_bubble import (SPLIT_SCHEDULES, placed_stage, placement_of, rank_of,
                                          split_stages)
from workers.runtime import at_least, entrypoint, one_of, refusal

DTYPES = ("float32", "float64")


def layout_of(world_size: int, pp: int = 0, virtual_stages: int = 1, micro_batches: int = 8,
              schedule: str = "1f1b") -> Layout:
    """This run's layout: ``pp`` stages (0: the whole world), the rest of the world as identical pipelines (dp)."""
    return Layout(pp=pp or world_size, virtual_stages=virtual_stages, micro_batches=micro_batches, schedule=schedule)


def check_params(world_size, schedule="1f1b", micro_batches=8, pp=0, virtual_stages=1, layers=8, hidden=16,
                 micro_batch_size=4, forward_ms=0.0, backward_ms=0.0, w_share=0.5, steps=1, lr=0.1, dtype="float32",
                 **_):
    # The layout's rules (the one rule set: degrees against the world, the schedule and its chunks per rank,
    # micro-batches, layers per chunk), then what this chapter adds: equal stages, and its own parameters.
    if pp < 0:
        degrees = f"pp={pp} must be at least 0 (0: the whole world)"
    else:
        layout = layout_of(world_size, pp, virtual_stages, micro_batches, schedule)
        # the rule set names layers itself when chunks cannot be equal or outnumber them; equal stages otherwise
        equal = (equal_stages_problem(layout, layers)
                 if 1 <= layout.pp * max(virtual_stages, 1) <= layers and virtual_stages >= 1 else None)
        plain = ("virtual_stages=1 would make it plain 1F1B: choose schedule='1f1b', or virtual_stages=2 or more"
                 if schedule == "interleaved" and virtual_stages == 1 else None)
        degrees = refusal(problem(layout, world_size, PipelineConfig(layers=layers) if layers >= 1 else None),
                          plain, equal)
    return refusal(degrees, one_of("dtype", dtype, DTYPES), at_least("layers", layers), at_least("hidden", hidden),
                   at_least("micro_batch_size", micro_batch_size),
                   None if 0 <= forward_ms <= 200 and 0 <= backward_ms <= 400 else
                   f"forward_ms={forward_ms} and backward_ms={backward_ms} must be between 0 and 200 / 400 ms",
                   None if isinstance(w_share, (int, float)) and 0 <= w_share <= 1 else
                   f"w_share={w_share!r} must be between 0 and 1 (the weight gradient's share of a backward)",
                   at_least("steps", steps), None if lr > 0 else f"lr={lr} must be positive")


def links_of(pipeline: list[int], stage: int, p: int, v: int, placement: str) -> list[tuple]:
    """Per chunk, (previous, next) rank of its virtual stage's neighbours; None where the neighbour does not exist or
    is on this same rank (a hand-off in memory). Round the ranks ("loop"), or down and back up the V ("v")."""
    last = (2 * p if placement == "v" else p * v) - 1
    links = []
    for c in range(v):
        vs = placed_stage(stage, c, p, placement)
        ends = [rank_of(n, p, placement)[0] if 0 <= n <= last else None for n in (vs - 1, vs + 1)]
        links.append(tuple(None if r is None or r == stage else pipeline[r] for r in ends))
    return links


def main(ctx, schedule: str = "1f1b", micro_batches: int = 8, pp: int = 0, virtual_stages: int = 1, layers: int = 8,
         hidden: int = 16, micro_batch_size: int = 4, forward_ms: float = 0.0, backward_ms: float = 0.0, steps: int = 1,
         lr: float = 0.1, seed: int = 0, dtype: str = "float32", w_share: float = 0.5):
    """``steps`` SGD steps of the pipelined MLP with ``schedule`` over ``micro_batches`` micro-batches."""
    layout = layout_of(ctx.world_size, pp, virtual_stages, micro_batches, schedule)
    p, v = layout.pp, layout.virtual_stages
    zero_bubble, placement = schedule in SPLIT_SCHEDULES, placement_of(schedule)
    grid = RankGrid.for_world(ctx.world_size, pp=p)
    pipeline = grid.group("pp", ctx.rank)  # this rank's pipeline, stage order
    stage = pipeline.index(ctx.rank)
    cfg = PipelineConfig(layers=layers, hidden=hidden, micro_batch_size=micro_batch_size,
                         micro_batches=micro_batches, seed=seed)
    torch_dtype = getattr(torch, dtype)
    # chunk c of this stage is virtual stage c * p + stage of a model cut in p * v (in a V: stage, then 2p-1-stage)
    held = [placed_stage(stage, c, p, placement) for c in range(v)]
    modules = [stage_module(cfg, vs, p * v).to(ctx.device, torch_dtype) for vs in held]
    params = {n: q for vs, mod in zip(held, modules) for n, q in global_names(cfg, vs, p * v, mod).items()}
    opt = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=lr)
    if zero_bubble:
        table = split_stages(schedule, p, micro_batches)  # every rank's row: the executor checks the whole table
        actions = table[stage]
        links = links_of(pipeline, stage, p, v, placement)
    else:
        actions = make_schedule(schedule, p, micro_batches, stage, v)
        wrap = v > 1  # with virtual stages the pipeline goes round: rank p-1 feeds rank 0's next chunk
        links = [(pipeline[(stage - 1) % p] if stage > 0 or wrap else None,
                  pipeline[(stage + 1) % p] if stage < p - 1 or wrap else None)]
    loss_stage = rank_of((2 * p if placement == "v" else p * v) - 1, p, placement)[0]  # where the last virtual stage is
    # on gloo a link's two directions travel on two groups (pipeline/p2p.py says why); NCCL keeps the default group
    mesh = Mesh(grid, ctx.rank, link_names(ctx.backend, p))
    try:
        out = {"losses": [], "timelines": [], "step_s": []}  # step_s: wall time from the last step's end to this one's
        last = time.perf_counter()
        for step in range(steps):
            # [B, h]: every rank derives the same batch
            x, y = (t.to(ctx.device, torch_dtype) for t in make_batch(cfg, step))
            p2p = [P2P(prev_rank=prev, next_rank=nxt, shape=(micro_batch_size, hidden), device=ctx.device,
                       comm_device=ctx.comm_device("send"), dtype=torch_dtype, links=mesh.links())
                   for prev, nxt in links]
            opt.zero_grad(set_to_none=True)
            if zero_bubble:  # B padded to (1 - w_share) of backward_ms, W to w_share of it
                ran = run_split_schedule(table, modules, p2p, stage=stage, num_stages=p, placement=placement,
                                         inputs=split(cfg, x), targets=split(cfg, y), forward_s=forward_ms / 1e3,
                                         backward_s=backward_ms * (1 - w_share) / 1e3,
                                         weight_s=backward_ms * w_share / 1e3)
            else:
                ran = run_schedule(actions, modules, p2p[0], stage=stage, num_stages=p, inputs=split(cfg, x),
                                   targets=split(cfg, y), forward_s=forward_ms / 1e3, backward_s=backward_ms / 1e3)
            if stage == loss_stage:
                loss = sum(ran["losses"]) / micro_batches  # mean over the global batch
                out["losses"].append(loss)
                ctx.metric(step=step, loss=loss)
            out["timelines"].append(ran["timeline"])
            grads = {n: q.grad.detach().cpu().clone() for n, q in params.items()}
            opt.step()
            out["step_s"].append(time.perf_counter() - last)
            last = time.perf_counter()
    finally:
        mesh.destroy()
    planned = peak_stashes(actions)
    return {**out, "timeline": out["timelines"][-1], "grads": grads,
            "weights": {n: q.detach().cpu().clone() for n, q in params.items()},
            "peak_stash": ran["peak_stash"], "planned_peak_stash": peak_stash(actions) if not zero_bubble
            else planned["activations"], "peak_saved_bytes": ran["peak_saved_bytes"], "virtual_stages": v,
            "peak_weight_stash": ran.get("peak_weight_stash", 0), "planned_peak_weight_stash": planned["weight"],
            "sent_bytes": ran["sent_bytes"], "messages": ran["messages"], "received": ran["received"],
            "posted_ahead": ran["posted_ahead"], "sent_on": ran["sent_on"], "actions": [list(a) for a in actions],
            "stage": stage, "pp": p, "pipeline": ctx.rank // p, "schedule": schedule, "placement": placement,
            "loss_stage": loss_stage, "dtype": dtype,
            "config": cfg.as_dict(), "forward_ms": forward_ms, "backward_ms": backward_ms, "w_share": w_share}


if __name__ == "__main__":
    entrypoint(main)
