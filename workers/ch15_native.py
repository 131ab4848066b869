"""Chapter 15, production side by side: the chapter's GPT trained with PyTorch's own composable APIs.

    torchrun --nproc-per-node 2 workers/ch15_native.py --api tp
    torchrun --nproc-per-node 4 workers/ch15_native.py --api fsdp
    torchrun --nproc-per-node 4 workers/ch15_native.py --api pipelining --micro-batches 4
    torchrun --nproc-per-node 4 workers/ch15_native.py --api tp_fsdp --tp 2
    torchrun --nproc-per-node 2 workers/ch15_native.py --api tp --qkv fused      # the fused-QKV trap

Same model (``workers/composed/model.py``, dropout 0), same data, same AdamW as ``workers/composed/train.py:
reference_run``, in float64: each API's run must equal that one process within ``equivalence.TOLERANCE``, as the
course's hand-written composition (``workers/ch15_composed.py``) does. How each API maps onto the course's pieces:

* ``api="tp"``: ``torch.distributed.tensor.parallel.parallelize_module`` with a *plan* per layer, torchtitan's
  (``torchtitan/models/llama3/infra/parallelize.py: apply_tp``, without its sequence parallelism):
  ``ColwiseParallel`` on ``wq``, ``wk``, ``wv`` and ``mlp.fc1`` is chapter 04's ``ColumnParallelLinear`` (the
  weight's rows cut over tp ranks; the input's gradient all-reduced in backward: Megatron's *f*), and
  ``RowwiseParallel`` on ``attention.proj`` and ``mlp.fc2`` is ``RowParallelLinear`` (the columns cut; the output
  all-reduced in forward: *g*). ``PrepareModuleInput`` on the attention makes its input a replicated DTensor once,
  so the three projections' input gradients are summed as one partial DTensor and all-reduced once (Megatron's
  fused QKV gets the same single all-reduce). The parameters become ``DTensor`` shards (``Shard(0)``,
  ``Shard(1)``); the embedding, LayerNorms and tied head stay replicated plain tensors, as in the course. The dense
  model's *fused* ``qkv`` cannot be handed to ``ColwiseParallel``: it cuts [Q; K; V] into contiguous blocks, so
  rank 0 holds queries where it needs keys (``qkv="fused"`` runs that without an error, and its loss and
  gradients are wrong: the fused-QKV trap, ``workers/composed/native.py: NativeAttention``). torchtitan keeps q,
  k, v separate; this worker splits the dense weight into ``wq``, ``wk``, ``wv`` and reports their gradients
  concatenated back into the dense ``qkv``.
* ``api="fsdp"``: ``torch.distributed.fsdp.fully_shard`` (FSDP2) on every block and on the root is ZeRO-3, two
  stages past chapter 11's ZeRO-1 (``workers/zero/zero1.py``, which shards the AdamW state only, reduce-scatters
  the gradients and all-gathers the updated parameters): each rank keeps a ``Shard(0)`` of every parameter, its
  gradient and its AdamW state; a block's parameters are all-gathered before its forward and again before its
  backward, and its gradients reduce-scattered after it (torchtitan's ``apply_fsdp``). The model keeps the dense
  fused ``qkv``: FSDP shards whatever parameters a module has, so nothing has to be split for it. Its gradients are
  summed, not averaged, over the ranks (``set_gradient_divide_factor(1.0)``: see the loss below).
* ``api="pipelining"``: ``torch.distributed.pipelining`` (it runs on gloo and CPU tensors: the stages' sends are
  point-to-point, which gloo has): a ``PipelineStage`` per rank holding a run of layers
  (``workers/composed/native.py: NativeStage``) and ``Schedule1F1B`` / ``ScheduleGPipe`` are chapter 13's
  ``workers/pipeline`` stages, schedules and executor; the schedule cuts the batch into micro-batches, sends
  activations and their gradients between stages and calls the loss function per micro-batch. The tied
  embedding is not something a stage can express (a parameter lives on one stage): as the course and
  Megatron do, the last stage holds a copy and the two copies' gradients are all-reduced over the first and last
  ranks after the schedule.
* ``api="tp_fsdp"``: both on a 2-D ``DeviceMesh`` (dp, tp): TP inside each pair of ranks, then FSDP2 over the
  data-parallel dimension on top of the TP-sharded DTensors (torchtitan's 2-D parallelism: ``apply_tp`` then
  ``apply_fsdp`` on ``world_mesh["dp"]``). The mesh is built from the course grid's groups
  (``DeviceMesh.from_group``), which are destroyed at the end, so it runs on warm ranks.

The loss is normalised as in the course: each rank (and each micro-batch) contributes its tokens' summed
cross-entropy divided by the valid tokens of the *global* batch, so the gradients must be *summed* over the data,
never averaged. Each rank returns the loss of every step, every gradient of every step and the parameters after
the last, whole (DTensors gathered with ``full_tensor()``) and under the dense model's names; a pipeline rank
returns those of its stage. ``collectives`` counts, for the first step's forward and backward, the collectives
``CommDebugMode`` saw: with tp, 2 all-reduces per layer each way (Megatron's 4); with FSDP2, an all-gather per
unit in forward, again in backward (not the root's, which stays gathered), and a reduce-scatter per unit.

CPU ranks only (gloo): the model and the meshes are on the CPU, as the course's ranks are.
"""
import contextlib

import torch
import torch.distributed as dist

from workers.composed.model import MODEL, make_dense
from workers.model.batch import make_batch, token_losses
from workers.composed.native import NativeStage, dense_names, full
from workers.layout import DIMS, Mesh, RankGrid
from workers.composed.train import BETAS, EPS, WEIGHT_DECAY
from workers.runtime import at_least, batch_over_world, divides, divides_world, entrypoint, one_of, refusal

APIS = ("tp", "fsdp", "pipelining", "tp_fsdp")
SCHEDULES = ("1f1b", "gpipe")
QKV = ("split", "fused")


def check_params(world_size, api="tp", steps=3, global_batch=8, lr=0.01, micro_batches=2, schedule="1f1b",
                 qkv="split", tp=2, **_):
    cfg = MODEL
    why = refusal(
        one_of("api", api, APIS), at_least("steps", steps), at_least("global_batch", global_batch),
        None if lr > 0 else f"lr={lr} must be positive",
        (name := one_of("qkv", qkv, QKV)) and f"{name} ('split' is torchtitan's wq, wk and wv, 'fused' the trap)",
        "qkv='fused' only matters where a tensor-parallel plan cuts the attention: use api='tp' or 'tp_fsdp'"
        if qkv == "fused" and api in APIS and api not in ("tp", "tp_fsdp") else None)
    if why:
        return why
    if api == "tp":  # every rank is a TP rank
        return divides("world_size", world_size, "heads", cfg.heads)
    if api == "fsdp":  # every rank is a DP rank: it takes global_batch / world_size samples
        return batch_over_world(global_batch, world_size)
    if api == "tp_fsdp":
        return refusal(divides_world("tp", tp, world_size), divides("tp", tp, "heads", cfg.heads)) or \
            batch_over_world(global_batch, world_size // tp, per="dp")  # dp = world_size / tp ranks share the batch
    # pipelining: one stage of equal layers per rank
    return refusal(one_of("schedule", schedule, SCHEDULES),
                   f"pipelining puts layers={cfg.layers} on world_size stages: run it on 2 or 4 ranks, not {world_size}"
                   if world_size < 2 or cfg.layers % world_size else None,
                   divides("micro_batches", micro_batches, "global_batch", global_batch),
                   f"micro_batches={micro_batches} is fewer than the {world_size} stages, which torch's Schedule1F1B "
                   f"refuses: choose micro_batches >= {world_size}"
                   if schedule == "1f1b" and micro_batches < world_size else None)


def _adamw(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def _record(model) -> dict:
    """Every gradient, whole, by the dense model's names (a collective for DTensors: every rank calls it)."""
    return dense_names({n: full(p.grad) for n, p in model.named_parameters()})


def _placements(model) -> dict:
    return {n: str(tuple(p.placements)) if hasattr(p, "placements") else "plain tensor (replicated)"
            for n, p in model.named_parameters()}


def _tp_plan(fused: bool) -> dict:
    """One block's plan, torchtitan's ``apply_tp`` without sequence parallelism."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    attention = {"attention.qkv": ColwiseParallel()} if fused else {
        "attention": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel()}
    return {**attention, "attention.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel()}


def _apply_tp(model: NativeStage, tp_mesh, fused: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, _tp_plan(fused))


def _apply_fsdp(model, dp_mesh) -> None:
    """FSDP2 on every block, then the root (which takes the embedding, position table, ``ln_f``: the tied head)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for block in model.blocks.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    # FSDP2 *averages* gradients over its ranks (divides the reduce-scatter by dp). Our loss is already the global
    # mean (each rank's summed CE over the global batch's valid tokens), so the gradients must be summed: divide
    # by 1. Per FSDP module (the setting is per parameter group, not inherited). In float64 FSDP2 then reduces
    # with a plain SUM; in float32 it would reduce with ReduceOp.PREMUL_SUM(1/factor), an NCCL op ("Cannot use
    # ReduceOp.PREMUL_SUM with Gloo", measured on torch 2.13), unless told to use plain sums.
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


@contextlib.contextmanager
def _counting(into: dict, phase: str, on: bool):
    """``into[phase]``: how many of each collective ran inside, by kind (``CommDebugMode`` sees DTensor's
    all-reduces and FSDP2's all-gathers and reduce-scatters; the loss's all-reduce is outside)."""
    if not on:
        yield
        return
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        yield
    counts = {}
    for op, n in mode.get_comm_counts().items():  # c10d_functional.all_reduce, c10d._allgather_base_, ...
        name = getattr(op, "__name__", str(op))
        key = next((k for k in ("all_reduce", "all_gather", "reduce_scatter")
                    if k.replace("_", "") in name.replace("_", "").lower()), name)
        counts[key] = counts.get(key, 0) + n
    into[phase] = counts


def _sharded(ctx, cfg, dense, api, qkv, tp, steps, global_batch, lr, data_seed, **_) -> dict:
    """``tp``, ``fsdp`` and ``tp_fsdp``: one module over a (dp, tp) mesh; data-parallel rank d takes the samples
    [d B/dp, (d+1) B/dp) of every step's global batch, each TP rank of its group the same ones."""
    tp = {"tp": ctx.world_size, "fsdp": 1}.get(api, tp)
    dp = ctx.world_size // tp
    sizes = {"tp": {"tp": tp}, "fsdp": {"dp": dp}, "tp_fsdp": {"dp": dp, "tp": tp}}[api]
    names = tuple(d for d in DIMS if d in sizes)  # (dp, tp) outermost first: torchtitan's order
    mesh = Mesh(RankGrid.for_world(ctx.world_size, **sizes), ctx.rank, names, fresh=True)
    try:
        world_mesh = mesh.device_mesh(names)
        sub = {d: world_mesh if names == (d,) else world_mesh[d] for d in names}  # 1-D meshes, as torchtitan's
        # fsdp keeps the dense fused qkv: FSDP2 shards whatever parameters a module has. Not the GPT itself,
        # though: its forward reaches into each block (block_forward calls block.ln1, block.attention, ...) without
        # calling the block, and FSDP2 gathers a module's parameters in hooks on its forward, which would never run
        # ("got mixed torch.Tensor and DTensor" in the first LayerNorm). NativeStage calls every block.
        fused = qkv == "fused" or api == "fsdp"
        model = NativeStage(dense, range(cfg.layers), first=True, last=True, fused=fused)
        if "tp" in sizes:
            _apply_tp(model, sub["tp"], fused)
        if "dp" in sizes:
            _apply_fsdp(model, sub["dp"])
        optimizer = _adamw(model, lr)
        d = mesh.coords["dp"]
        mine = slice(d * global_batch // dp, (d + 1) * global_batch // dp)
        losses, grads, comm = [], [], {}
        for step in range(steps):
            tokens, valid = make_batch(cfg, global_batch, step, data_seed)  # [B, s + 1], [B, s]
            optimizer.zero_grad(set_to_none=True)
            with _counting(comm, "forward", step == 0):
                logits = model(tokens[mine, :-1])  # [s, B/dp, V]
                loss = token_losses(logits, tokens[mine, 1:], valid[mine]) / valid.sum()  # my tokens / GLOBAL count
            with _counting(comm, "backward", step == 0):
                loss.backward()
            total = loss.detach().clone()
            if dp > 1:
                dist.all_reduce(total, group=mesh.group("dp"))  # the global batch's mean: the sum of the ranks' parts
            losses.append(total.item())
            grads.append(_record(model))
            optimizer.step()
        params = dense_names({n: full(p) for n, p in model.named_parameters()})
        return {"losses": losses, "grads": grads, "params": params, "placements": _placements(model), "mesh": sizes,
                "collectives": comm}
    finally:
        mesh.destroy()


def _pipelining(ctx, cfg, dense, micro_batches, schedule, steps, global_batch, lr, data_seed, **_) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = ctx.rank, ctx.world_size
    first, last = rank == 0, rank == world - 1
    per = cfg.layers // world
    stage_module = NativeStage(dense, range(rank * per, (rank + 1) * per), first=first, last=last)
    # The tied embedding's two copies: the embedding on the first stage, head.weight on the last (Megatron's
    # embedding group, made by the mesh: every rank takes part, as dist.new_group requires).
    mesh = Mesh(RankGrid.for_world(world, pp=world), rank, ("embedding",))
    embedding_group = mesh.group("embedding")
    try:
        tied = stage_module.embed.weight if first else stage_module.head.weight if last else None
        count = {}  # the global batch's valid tokens, set before each step: the loss's denominator

        def loss_fn(logits, target):  # one micro-batch: logits [s, b/m, V], target [b/m, s] with -1 at padding
            return token_losses(logits, target.clamp(min=0), target >= 0) / count["valid"]

        stage = PipelineStage(stage_module, rank, world, ctx.device)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        # scale_grads=False: torch would divide the gradients by m (for a loss averaged per micro-batch); ours is
        # already each micro-batch's share of the global mean, so the micro-batches' gradients must be summed.
        pipe = kind(stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
        optimizer = _adamw(stage_module, lr)
        losses, grads = [], []
        for step in range(steps):
            tokens, valid = make_batch(cfg, global_batch, step, data_seed)
            count["valid"] = valid.sum()
            optimizer.zero_grad(set_to_none=True)
            micro_losses = []
            if first:
                pipe.step(tokens[:, :-1])  # the schedule cuts the batch into m micro-batches along dim 0
            elif last:
                pipe.step(target=tokens[:, 1:].masked_fill(~valid, -1), losses=micro_losses)
            else:
                pipe.step()
            if tied is not None:  # sum the two copies' gradients: both take the same step, so they stay equal
                dist.all_reduce(tied.grad, group=embedding_group)
            total = torch.stack(micro_losses).sum() if last else torch.zeros((), dtype=torch.float64)
            dist.broadcast(total, src=world - 1)  # every rank reports the loss
            losses.append(total.item())
            grads.append(_record(stage_module))
            optimizer.step()
        params = dense_names({n: full(p) for n, p in stage_module.named_parameters()})
        tied_equal = None
        if first or last:  # the two copies after the last step, compared on the last rank
            other = tied.detach().clone()
            dist.broadcast(other, src=0, group=embedding_group)
            tied_equal = bool(torch.equal(other, tied.detach()))
    finally:
        mesh.destroy()
    return {"losses": losses, "grads": grads, "params": params, "stage": rank, "mesh": {"pp": world},
            "layers": list(range(rank * per, (rank + 1) * per)), "tied_copies_equal": tied_equal, "placements": {}}


def main(ctx, api: str = "tp", steps: int = 3, global_batch: int = 8, lr: float = 0.01, micro_batches: int = 2,
         schedule: str = "1f1b", qkv: str = "split", tp: int = 2, seed: int = 0, data_seed: int = 1):
    """``steps`` AdamW steps of chapter 15's GPT (float64, dropout 0) with torch's ``api``."""
    if ctx.device.type != "cpu":
        raise RuntimeError(f"workers/ch15_native.py runs on CPU ranks (gloo), not on {ctx.device}: "
                           "start it with COURSE_DEVICE=cpu COURSE_BACKEND=gloo")
    cfg = MODEL
    dense = make_dense(cfg, seed, torch.float64)
    run = _pipelining if api == "pipelining" else _sharded
    out = run(ctx, cfg, dense, api=api, qkv=qkv, tp=tp, micro_batches=micro_batches, schedule=schedule, steps=steps,
              global_batch=global_batch, lr=lr, data_seed=data_seed)
    return {"api": api, "qkv": qkv, "torch": torch.__version__, **out}


if __name__ == "__main__":
    entrypoint(main)
