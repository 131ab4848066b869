"""Chapter 13's trainer: the pipelined MLP's SGD steps on this rank under any of the course's schedules, the
rank's layout, its links and its step loop. ``workers/ch13_pipeline.py`` runs it on the ranks; the calibration
(``workers/calibrate.py``) times its step besides its actions."""
import time

import torch

from workers.layout.grid import RankGrid
from workers.layout.mesh import Mesh, link_names
from workers.layout.rules import Layout
from workers.pipeline.executor import run_schedule, run_split_schedule
from workers.pipeline.model import PipelineConfig, global_names, make_batch, micro_batches as split, stage_module
from workers.pipeline.p2p import P2P
from workers.pipeline.schedules import peak_stash, schedule as make_schedule
from workers.pipeline.validity import peak_stashes
from workers.pipeline.zero_bubble import SPLIT_SCHEDULES, placed_stage, placement_of, rank_of, split_stages


def layout_of(world_size: int, pp: int = 0, virtual_stages: int = 1, micro_batches: int = 8,
              schedule: str = "1f1b") -> Layout:
    """This run's layout: ``pp`` stages (0: the whole world), the rest of the world as identical pipelines (dp)."""
    return Layout(pp=pp or world_size, virtual_stages=virtual_stages, micro_batches=micro_batches, schedule=schedule)


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


def train(ctx, schedule: str = "1f1b", micro_batches: int = 8, pp: int = 0, virtual_stages: int = 1, layers: int = 8,
          hidden: int = 16, micro_batch_size: int = 4, forward_ms: float = 0.0, backward_ms: float = 0.0,
          steps: int = 1, lr: float = 0.1, seed: int = 0, dtype: str = "float32", w_share: float = 0.5,
          metric=None) -> dict:
    """``steps`` SGD steps of the pipelined MLP with ``schedule`` over ``micro_batches`` micro-batches on this rank
    (``workers/ch13_pipeline.py`` says what comes back). ``metric``: where the loss stage sends each step's loss
    (``ctx.metric`` when None)."""
    metric = ctx.metric if metric is None else metric
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
        # step_s: wall time from the last step's end to this one's; step_cpu_s: this thread's CPU over the same span
        out = {"losses": [], "timelines": [], "step_s": [], "step_cpu_s": []}
        last, last_cpu = time.perf_counter(), time.thread_time()
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
                metric(step=step, loss=loss)
            out["timelines"].append(ran["timeline"])
            grads = {n: q.grad.detach().cpu().clone() for n, q in params.items()}
            opt.step()
            out["step_s"].append(time.perf_counter() - last)
            out["step_cpu_s"].append(time.thread_time() - last_cpu)
            last, last_cpu = time.perf_counter(), time.thread_time()
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
