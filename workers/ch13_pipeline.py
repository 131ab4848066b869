"""A pipeline-parallel training step on real ranks: GPipe, 1F1B or interleaved 1F1B over real send/recv.

    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule 1f1b --micro-batches 8
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --pp 2 --forward-ms 5 --backward-ms 10
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule interleaved --virtual-stages 2

The degrees are the course's one layout's (``workers/layout/rules.py``): ``pp`` p stages (0: the whole world)
split ``layers`` into p contiguous stages; a world larger than p runs world / p identical pipelines side by side
(the layout's dp: ranks 0..p-1, p..2p-1, ...: each the same model on the same batch), so p = 1, 2 and 4 all run on
one set of 4 warm ranks. ``virtual_stages`` v > 1 (interleaved only) cuts the model into p * v chunks instead,
chunk c of stage s holding virtual stage c * p + s. Each rank returns its stage's timeline, peak stashed
activations, p2p counts, losses (last stage), gradients of the last step and weights after ``steps`` SGD steps,
under the whole model's parameter names (``workers/pipeline/reference.py`` is the single-process ground truth).
"""
import time

import torch

from workers.layout.grid import RankGrid
from workers.layout.rules import Layout, equal_stages_problem, problem
from workers.pipeline.executor import run_schedule
from workers.pipeline.model import PipelineConfig, global_names, make_batch, micro_batches as split, stage_module
from workers.pipeline.p2p import P2P
from workers.pipeline.schedules import peak_stash, schedule as make_schedule, virtual_stage
from workers.runtime import at_least, entrypoint, refusal


def layout_of(world_size: int, pp: int = 0, virtual_stages: int = 1, micro_batches: int = 8,
              schedule: str = "1f1b") -> Layout:
    """This run's layout: ``pp`` stages (0: the whole world), the rest of the world as identical pipelines (dp)."""
    return Layout(pp=pp or world_size, virtual_stages=virtual_stages, micro_batches=micro_batches, schedule=schedule)


def check_params(world_size, schedule="1f1b", micro_batches=8, pp=0, virtual_stages=1, layers=8, hidden=16,
                 micro_batch_size=4, forward_ms=0.0, backward_ms=0.0, steps=1, lr=0.1, **_):
    # The layout's rules (the one rule set: degrees against the world, the schedule, micro-batches, layers per
    # chunk), then what this chapter adds: equal stages, and its own parameters.
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
    return refusal(degrees, at_least("layers", layers), at_least("hidden", hidden),
                   at_least("micro_batch_size", micro_batch_size),
                   None if 0 <= forward_ms <= 200 and 0 <= backward_ms <= 400 else
                   f"forward_ms={forward_ms} and backward_ms={backward_ms} must be between 0 and 200 / 400 ms",
                   at_least("steps", steps), None if lr > 0 else f"lr={lr} must be positive")


def main(ctx, schedule: str = "1f1b", micro_batches: int = 8, pp: int = 0, virtual_stages: int = 1, layers: int = 8,
         hidden: int = 16, micro_batch_size: int = 4, forward_ms: float = 0.0, backward_ms: float = 0.0, steps: int = 1,
         lr: float = 0.1, seed: int = 0):
    """``steps`` SGD steps of the pipelined MLP with ``schedule`` over ``micro_batches`` micro-batches."""
    layout = layout_of(ctx.world_size, pp, virtual_stages, micro_batches, schedule)
    p, v = layout.pp, layout.virtual_stages
    pipeline = RankGrid.for_world(ctx.world_size, pp=p).group("pp", ctx.rank)  # this rank's pipeline, stage order
    stage = pipeline.index(ctx.rank)
    cfg = PipelineConfig(layers=layers, hidden=hidden, micro_batch_size=micro_batch_size,
                         micro_batches=micro_batches, seed=seed)
    # chunk c of this stage is virtual stage c * p + stage of a model cut in p * v
    modules = [stage_module(cfg, virtual_stage(stage, c, p), p * v).to(ctx.device) for c in range(v)]
    params = {n: q for c, mod in enumerate(modules) for n, q in global_names(cfg, virtual_stage(stage, c, p), p * v, mod).items()}
    opt = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=lr)
    actions = make_schedule(schedule, p, micro_batches, stage, v)
    wrap = v > 1  # with virtual stages the pipeline goes round: rank p-1 feeds rank 0's next chunk
    prev_rank = pipeline[(stage - 1) % p] if stage > 0 or wrap else None
    next_rank = pipeline[(stage + 1) % p] if stage < p - 1 or wrap else None
    out = {"losses": [], "timelines": [], "step_s": []}  # step_s: wall time from the last step's end to this one's
    last = time.perf_counter()
    for step in range(steps):
        x, y = (t.to(ctx.device) for t in make_batch(cfg, step))  # [B, h]: every rank derives the same batch
        p2p = P2P(prev_rank=prev_rank, next_rank=next_rank, shape=(micro_batch_size, hidden), device=ctx.device,
                  comm_device=ctx.comm_device("send"))
        opt.zero_grad(set_to_none=True)
        ran = run_schedule(actions, modules, p2p, stage=stage, num_stages=p, inputs=split(cfg, x), targets=split(cfg, y),
                           forward_s=forward_ms / 1e3, backward_s=backward_ms / 1e3)
        if stage == p - 1:
            loss = sum(ran["losses"]) / micro_batches  # mean over the global batch
            out["losses"].append(loss)
            ctx.metric(step=step, loss=loss)
        out["timelines"].append(ran["timeline"])
        grads = {n: q.grad.detach().cpu().clone() for n, q in params.items()}
        opt.step()
        out["step_s"].append(time.perf_counter() - last)
        last = time.perf_counter()
    return {**out, "timeline": out["timelines"][-1], "grads": grads,
            "weights": {n: q.detach().cpu().clone() for n, q in params.items()},
            "peak_stash": ran["peak_stash"], "planned_peak_stash": peak_stash(actions),
            "peak_saved_bytes": ran["peak_saved_bytes"], "virtual_stages": v,
            "sent_bytes": ran["sent_bytes"], "messages": ran["messages"], "actions": [list(a) for a in actions],
            "stage": stage, "pp": p, "pipeline": ctx.rank // p, "schedule": schedule,
            "config": cfg.as_dict(), "forward_ms": forward_ms, "backward_ms": backward_ms}


if __name__ == "__main__":
    entrypoint(main)
