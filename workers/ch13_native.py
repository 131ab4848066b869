"""Chapter 13, production side by side: the chapter's model and data through PyTorch's own pipeline schedules.

    torchrun --nproc-per-node 4 workers/ch13_native.py --schedule 1f1b --micro-batches 8
    torchrun --nproc-per-node 4 workers/ch13_native.py --schedule interleaved --virtual-stages 2
    torchrun --nproc-per-node 4 workers/ch13_native.py --schedule zb-h1 --pp 2 --micro-batches 4
    torchrun --nproc-per-node 4 workers/ch13_native.py --schedule zb-v --virtual-stages 2 --pp 2 --micro-batches 4
    torchrun --nproc-per-node 4 workers/ch13_native.py --schedule dualpipev --virtual-stages 2 --micro-batches 8

The same model (``workers/pipeline/model.py``: Linear + tanh layers from one seed), the same global batches, the
same cut as ``workers/ch13_pipeline.py`` (p stages of contiguous layers; p v chunks, chunk c of rank s holding
virtual stage c p + s round the ranks, or s and 2p-1-s in a V), each chunk wrapped in
``torch.distributed.pipelining.PipelineStage`` and run by PyTorch's schedule instead of the course's executor:

    schedule        PyTorch                          the course's table beside it
    "1f1b"          Schedule1F1B                     schedules.one_f_one_b_schedule
    "interleaved"   ScheduleInterleaved1F1B (v >= 2) schedules.interleaved_schedule
    "zb-h1"         ScheduleInterleavedZeroBubble    zero_bubble.zb_h1_schedule at v = 1; at v >= 2 PyTorch's
                                                     looped ZB-H1 (its "ZB1P"), which the course does not build
    "zb-v"          ScheduleZBVZeroBubble            zero_bubble.zb_v_schedule
    "dualpipev"     ScheduleDualPipeV                zero_bubble.dualpipev_schedule

The loss is the course's, matched exactly (``scaling``): "loss" hands the schedule ``loss_fn(y, t) / m`` with
``scale_grads=False``, the course's executor (Megatron's: each micro-batch's mean squared error over m, the
gradients summed); "grads" hands it the plain per-micro-batch mean with ``scale_grads=True``, PyTorch's default,
which divides the summed gradients by m after the last backward (its ``REDUCE_GRAD`` action). Both are the mean over
the global batch, the reference's (``workers/pipeline/reference.py``); in float64 they differ from it by the order
of the additions only.

A world larger than p runs world / p identical pipelines side by side (ranks 0..p-1, p..2p-1, ...), each on a group
of its own from the course's one group holder (``workers/layout/mesh.py``), so p = 2 and 4 run on one set of 4 warm
ranks. Each rank returns its stage's gradients (last step) and weights (after ``steps`` SGD steps) under the whole
model's names, the losses (on the rank holding the last virtual stage: rank 0 in a V), and the schedule's own
tables: ``torch_table`` (``pipeline_order``, PyTorch's spelling), ``table`` (the same as course tuples,
``workers/pipeline/native.py``), ``table_with_comms`` (``pipeline_order_with_comms``, what the runtime executes;
None for the single-stage ``Schedule1F1B``, which runs its own loop), ``course_table`` (the course's table for the
same schedule and sizes), ``comparison`` (rank by rank) and ``table_problem`` (the course's validity checker on
PyTorch's table).

What the course checks before launch is what its model needs (p divides the world, equal chunks, the chunks a
schedule holds). What PyTorch's schedules demand of the micro-batches (Schedule1F1B: m >= p; DualPipeV: m >= 2p;
the interleaved ones: m a multiple of its rounds) is left to PyTorch: its exception's text comes back as
``refused`` on every rank, with ``refused_in`` ("schedule" or "step") and the rank that raised, instead of a crash.
The ranks agree on it after each phase (an all-gather over the world), so no rank waits in a collective for one
that gave up. A step that fails on one rank half-way leaves its neighbours in a receive until the pipeline group's
timeout (the world's collective timeout): then they fail too, and the first failure, by rank, is reported.
"""
import torch
import torch.distributed as dist

from workers.layout.grid import RankGrid
from workers.layout.mesh import Mesh
from workers.layout.rules import Layout, equal_stages_problem, problem
from workers.pipeline import native
from workers.pipeline.model import PipelineConfig, global_names, loss_fn, make_batch, stage_module
from workers.pipeline.validity import table_problem
from workers.pipeline.zero_bubble import rank_of
from workers.runtime import at_least, entrypoint, one_of, refusal

DTYPES = ("float32", "float64")
SCALINGS = ("loss", "grads")


def check_params(world_size, schedule="1f1b", micro_batches=8, pp=0, virtual_stages=1, layers=8, hidden=16,
                 micro_batch_size=4, steps=1, lr=0.1, dtype="float64", scaling="loss", **_):
    known = refusal(one_of("schedule", schedule, native.NATIVE_SCHEDULES), one_of("dtype", dtype, DTYPES),
                    one_of("scaling", scaling, SCALINGS), at_least("micro_batches", micro_batches),
                    at_least("layers", layers), at_least("hidden", hidden),
                    at_least("micro_batch_size", micro_batch_size), at_least("steps", steps),
                    None if isinstance(lr, (int, float)) and lr > 0 else f"lr={lr} must be positive",
                    None if isinstance(pp, int) and pp >= 0 else f"pp={pp} must be at least 0 (0: the whole world)")
    if known:
        return known
    p, v = pp or world_size, virtual_stages
    # The course's one rule set for the degrees. m is left out (None): PyTorch's schedules say what they need of it.
    # ScheduleInterleavedZeroBubble takes any v (the course's ZB-H1 holds one chunk), so the rules see its v = 1.
    looped_zb = schedule == "zb-h1"
    degrees = refusal(problem(Layout(pp=p, virtual_stages=1 if looped_zb else v, micro_batches=None, schedule=schedule),
                              world_size), at_least("virtual_stages", v) if looped_zb else None)
    if degrees:
        return degrees
    return equal_stages_problem(Layout(pp=p, virtual_stages=v), layers)  # the course cuts equal chunks, as here


def _agree(error: str | None) -> tuple[str | None, int | None]:
    """Every rank's error (or None), gathered over the world: the first one by rank, and that rank, on every rank."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((r for r, e in enumerate(errors) if e is not None), None)
    return (None, None) if first is None else (errors[first], first)


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _make_schedule(schedule: str, stages: list, m: int, scaling: str):
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, native.NATIVE_CLASSES[schedule])
    if scaling == "loss":  # the course's executor: each micro-batch's mean over m, the gradients summed
        def micro_loss(y, target):
            return loss_fn(y, target) / m
    else:  # PyTorch's default: the plain mean per micro-batch, the summed gradients divided by m at the end
        micro_loss = loss_fn
    kwargs = {"loss_fn": micro_loss, "scale_grads": scaling == "grads"}
    return cls(stages[0], m, **kwargs) if schedule == "1f1b" else cls(stages, m, **kwargs)


def main(ctx, schedule: str = "1f1b", micro_batches: int = 8, pp: int = 0, virtual_stages: int = 1, layers: int = 8,
         hidden: int = 16, micro_batch_size: int = 4, steps: int = 1, lr: float = 0.1, seed: int = 0,
         dtype: str = "float64", scaling: str = "loss"):
    """``steps`` SGD steps of chapter 13's model with PyTorch's ``schedule`` over ``micro_batches`` micro-batches."""
    from torch.distributed.pipelining import PipelineStage

    p, m = pp or ctx.world_size, micro_batches
    placement = native.placement_of(schedule)
    v = native.chunks_of(schedule, virtual_stages)
    num_virtual = p * v
    grid = RankGrid.for_world(ctx.world_size, pp=p)
    pipeline = grid.group("pp", ctx.rank)  # this rank's pipeline, in stage order
    stage = pipeline.index(ctx.rank)
    cfg = PipelineConfig(layers=layers, hidden=hidden, micro_batch_size=micro_batch_size, micro_batches=m, seed=seed)
    torch_dtype = getattr(torch, dtype)
    device = ctx.comm_device("send")  # gloo sends CPU tensors only: on a shared GPU the tiny model stays on the host
    held = native.held_stages(schedule, p, v, stage)
    modules = [stage_module(cfg, vs, num_virtual).to(device, torch_dtype) for vs in held]
    params = {n: q for vs, mod in zip(held, modules) for n, q in global_names(cfg, vs, num_virtual, mod).items()}
    opt = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=lr)
    loss_stage = rank_of(num_virtual - 1, p, placement)[0]
    first_here, last_here = 0 in held, num_virtual - 1 in held
    out = {"losses": [], "grads": {}, "refused": None, "refused_in": None, "refused_by": None}
    # a whole-world pipeline talks on the default group (the mesh's group is then None), as PyTorch's default
    with Mesh(grid, ctx.rank, ("pp",)) as mesh:
        error, pipe = None, None
        try:
            stages = [PipelineStage(mod, vs, num_virtual, device, group=mesh.group("pp"))
                      for vs, mod in zip(held, modules)]
            pipe = _make_schedule(schedule, stages, m, scaling)
        except Exception as exc:  # PyTorch's refusal of these sizes: reported, not raised
            error = _said(exc)
        out["refused"], out["refused_by"] = _agree(error)
        out["refused_in"] = "schedule" if out["refused"] else None
        for step in range(steps if out["refused"] is None else 0):
            x, y = (t.to(device, torch_dtype) for t in make_batch(cfg, step))  # [B, h] each, the same on every rank
            opt.zero_grad(set_to_none=True)
            micro_losses, error = [], None
            try:
                args = (x,) if first_here else ()  # the schedule cuts [B, h] into m [B/m, h] rows in order
                more = {"target": y, "losses": micro_losses} if last_here else {}
                pipe.step(*args, **more)
            except Exception as exc:
                error = _said(exc)
            out["refused"], out["refused_by"] = _agree(error)
            if out["refused"]:
                out["refused_in"] = "step"
                break
            if last_here:  # "loss": each is its micro-batch's share already; "grads": plain means, averaged here
                total = sum(t.item() for t in micro_losses)
                out["losses"].append(total if scaling == "loss" else total / m)
                ctx.metric(step=step, loss=out["losses"][-1])
            out["grads"] = {n: q.grad.detach().cpu().clone() for n, q in params.items()}
            opt.step()
    ours = native.course_table(schedule, p, m, v)
    tables = {"course_table": ours, "torch_table": None, "table": None, "table_with_comms": None,
              "comparison": None, "table_problem": None}
    if pipe is not None:  # PyTorch's plan for every rank (each rank computes all of them, as the course's tables)
        order = pipe.pipeline_order
        rows = native.course_rows(order, p, v, placement)
        with_comms = getattr(pipe, "pipeline_order_with_comms", None)  # None: Schedule1F1B runs its own loop
        tables.update(torch_table=native.spelled(order, p), table=rows,
                      table_with_comms=None if with_comms is None else native.course_rows(with_comms, p, v, placement,
                                                                                          comms=True),
                      comparison=None if ours is None else native.compare_rows(rows, ours),
                      table_problem=table_problem(rows, m, placement))
    return {**out, **tables, "weights": {n: q.detach().cpu().clone() for n, q in params.items()},
            "held": held, "stage": stage, "pp": p, "pipeline": ctx.rank // p, "virtual_stages": v,
            "schedule": schedule, "torch_class": native.NATIVE_CLASSES[schedule], "placement": placement,
            "loss_stage": loss_stage, "scaling": scaling, "dtype": dtype, "torch": torch.__version__,
            "config": cfg.as_dict()}


if __name__ == "__main__":
    entrypoint(main)
