"""A pipeline-parallel training step on real ranks: GPipe, 1F1B or interleaved 1F1B over real send/recv.

    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule 1f1b --micro-batches 8
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --stages 2 --forward-ms 5 --backward-ms 10
    torchrun --nproc-per-node 4 workers/ch13_pipeline.py --schedule interleaved --chunks 2

``stages`` p (0: the whole world) splits ``layers`` into p contiguous stages; a world larger than p runs
world / p identical pipelines side by side (ranks 0..p-1, p..2p-1, ...: each the same model on the same
batch), so p = 1, 2 and 4 all run on one set of 4 warm ranks. ``chunks`` v > 1 (interleaved only) cuts the
model into p * v chunks instead, chunk c of stage s holding virtual stage c * p + s. Each rank returns its stage's timeline,
peak stashed activations, p2p counts, losses (last stage), gradients of the last step and weights after
``steps`` SGD steps, under the whole model's parameter names (``workers/pipeline/reference.py`` is the
single-process ground truth).
"""
import torch

from workers.pipeline.executor import run_schedule
from workers.pipeline.model import PipelineConfig, global_names, make_batch, micro_batches as split, stage_module
from workers.pipeline.p2p import P2P
from workers.parallel.grid import RankGrid, choose_divisor
from workers.pipeline.schedules import SCHEDULES, peak_stash, schedule as make_schedule, virtual_stage
from workers.runtime import entrypoint


def check_params(world_size, schedule="1f1b", micro_batches=8, stages=0, chunks=1, layers=8, hidden=16,
                 micro_batch_size=4, forward_ms=0.0, backward_ms=0.0, steps=1, lr=0.1, **_):
    p = stages or world_size
    if schedule not in SCHEDULES:
        return f"schedule={schedule!r} is not known: choose one of {', '.join(SCHEDULES)}"
    if p < 1 or world_size % p:
        return f"stages={stages} does not divide world_size={world_size}: {choose_divisor(world_size)}"
    if micro_batches < 1 or micro_batch_size < 1 or hidden < 1:
        return f"micro_batches={micro_batches}, micro_batch_size={micro_batch_size} and hidden={hidden} must be >= 1"
    if schedule == "interleaved":
        if chunks < 2:
            return f"schedule='interleaved' with chunks={chunks} is plain 1F1B: give each stage chunks >= 2 model chunks"
        if p < 2:
            return "the interleaved schedule needs at least 2 stages to go round: choose stages >= 2"
        if micro_batches % p:
            return (f"micro_batches={micro_batches} is not a multiple of the {p} stages: the interleaved schedule "
                    f"sends micro-batches round in groups of p; choose a multiple of {p}")
    elif chunks != 1:
        return f"chunks={chunks} only applies to schedule='interleaved': leave chunks=1 for {schedule!r}"
    if layers % (p * chunks):
        parts = f"{p} equal stages" if chunks == 1 else f"{p * chunks} equal chunks ({p} stages x {chunks})"
        return f"layers={layers} does not split into {parts}: choose layers divisible by {p * chunks}"
    if forward_ms < 0 or backward_ms < 0 or forward_ms > 200 or backward_ms > 400:
        return f"forward_ms={forward_ms} and backward_ms={backward_ms} must be between 0 and 200 / 400 ms"
    if steps < 1 or lr <= 0:
        return f"steps={steps} must be >= 1 and lr={lr} positive"
    return None


def main(ctx, schedule: str = "1f1b", micro_batches: int = 8, stages: int = 0, chunks: int = 1, layers: int = 8,
         hidden: int = 16, micro_batch_size: int = 4, forward_ms: float = 0.0, backward_ms: float = 0.0, steps: int = 1,
         lr: float = 0.1, seed: int = 0):
    """``steps`` SGD steps of the pipelined MLP with ``schedule`` over ``micro_batches`` micro-batches."""
    p, v = stages or ctx.world_size, chunks
    pipeline = RankGrid.for_world(ctx.world_size, pp=p).group("pp", ctx.rank)  # this rank's pipeline, stage order
    stage = pipeline.index(ctx.rank)
    cfg = PipelineConfig(layers=layers, hidden=hidden, micro_batch_size=micro_batch_size,
                         micro_batches=micro_batches, seed=seed)
    # chunk c of this stage is virtual stage c * p + stage of a model cut in p * v
    modules = [stage_module(cfg, virtual_stage(stage, c, p), p * v).to(ctx.device) for c in range(v)]
    params = {n: q for c, mod in enumerate(modules) for n, q in global_names(cfg, virtual_stage(stage, c, p), p * v, mod).items()}
    opt = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=lr)
    actions = make_schedule(schedule, p, micro_batches, stage, v)
    wrap = v > 1  # with chunks the pipeline goes round: rank p-1 feeds rank 0's next chunk
    prev_rank = pipeline[(stage - 1) % p] if stage > 0 or wrap else None
    next_rank = pipeline[(stage + 1) % p] if stage < p - 1 or wrap else None
    out = {"losses": [], "timelines": []}
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
    return {**out, "timeline": out["timelines"][-1], "grads": grads,
            "weights": {n: q.detach().cpu().clone() for n, q in params.items()},
            "peak_stash": ran["peak_stash"], "planned_peak_stash": peak_stash(actions),
            "peak_saved_bytes": ran["peak_saved_bytes"], "chunks": v,
            "sent_bytes": ran["sent_bytes"], "messages": ran["messages"], "actions": [list(a) for a in actions],
            "stage": stage, "num_stages": p, "pipeline": ctx.rank // p, "schedule": schedule,
            "config": cfg.as_dict(), "forward_ms": forward_ms, "backward_ms": backward_ms}


if __name__ == "__main__":
    entrypoint(main)
