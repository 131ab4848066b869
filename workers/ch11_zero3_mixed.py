"""ZeRO-3 with a mixed-precision policy, against one process and against PyTorch's FSDP2 with the same policy.

    torchrun --nproc-per-node 4 workers/ch11_zero3_mixed.py --param-dtype bfloat16 --reduce-dtype float32

FSDP2's ``MixedPrecisionPolicy`` as every large run uses it: parameters all-gathered and computed in
``param_dtype`` (bf16), gradients reduce-scattered in ``reduce_dtype`` (fp32), the fp32 shard kept as the master
copy the optimizer steps, the root's output cast to ``output_dtype``. Every rank trains chapter 11's tied GPT on its
B/n rows with ``Zero3Model(..., mp_policy=...)`` and with ``fully_shard(..., mp_policy=...)`` on the same data, and
alone the single-process reference (``train_reference_mixed``: a bf16 copy of fp32 master weights, whole batch).

Each rank reports, per step, both losses and the largest weight difference of each from the reference and from
each other; the bytes it holds at the four moments of a step (after wrapping, forward, backward and the step:
shards, whole gathered parameters, gradients, optimizer state); and every collective's bytes of one step, for
both (the hand version's own count; FSDP2's caught on their way to ``torch.distributed``).
"""
from __future__ import annotations

import torch

from workers.layout import Mesh, RankGrid
from workers.runtime import entrypoint, one_of, refusal
from workers.zero.fsdp2 import full_flat, fully_shard_gpt, recording
from workers.zero.model import OPTIMIZER_CLASSES, loss_fn, make_batches, make_model, model_config, run_problem, \
    shard_rows, train_reference_mixed
from workers.zero.zero3 import MixedPrecisionPolicy, Zero3Model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_params(world_size, global_batch: int = 8, steps: int = 3, hidden: int = 32, heads: int = 4,
                 param_dtype: str = "bfloat16", reduce_dtype: str = "float32", optimizer: str = "sgd", **_):
    return refusal(run_problem(world_size, global_batch, steps, hidden, heads),
                   one_of("param_dtype", param_dtype, DTYPES), one_of("reduce_dtype", reduce_dtype, DTYPES),
                   one_of("optimizer", optimizer, OPTIMIZER_CLASSES))


def held(fsdp: Zero3Model, model) -> dict:
    """Bytes this rank holds now, by state, counted from the tensors: fp32 shards and whole ``param_dtype``
    buffers; fp32 gradient shards, whole ``.grad`` (``param_dtype``) and buckets in flight; optimizer state."""
    whole_grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return {"params": fsdp.shard_bytes(), "gathered": fsdp.gathered_bytes(),
            "grads": fsdp.grad_shard_bytes() + whole_grads + fsdp.in_flight_bytes(), "optimizer": fsdp.state_bytes()}


def main(ctx, steps: int = 3, global_batch: int = 8, param_dtype: str = "bfloat16", reduce_dtype: str = "float32",
         optimizer: str = "sgd", fsdp2: bool = True, vocab: int = 64, seq: int = 16, hidden: int = 32,
         heads: int = 4, layers: int = 2, seed: int = 0):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    base = 100 * seed
    batches = make_batches(cfg, global_batch, steps, seed=base + 1)
    compute, reduce = DTYPES[param_dtype], DTYPES[reduce_dtype]
    reference, reference_losses = train_reference_mixed(cfg, optimizer, batches, seed=base, param_dtype=compute)
    cls, hyper = OPTIMIZER_CLASSES[optimizer]
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce, output_dtype=torch.float32)

    model = make_model(cfg, seed=base)
    hand = Zero3Model(model, list(model.blocks), cls, mp_policy=policy, **hyper)
    out = {"hand_loss": [], "hand_error": [], "moments": [{"step": 0, "moment": "init", **held(hand, model)}]}
    for step, batch in enumerate(batches, start=1):
        rows = shard_rows(batch, ctx.rank, ctx.world_size)
        hand.zero_grad()
        hand.comm = {"all_gather": [], "reduce_scatter": []}
        loss = loss_fn(model, rows)
        out["moments"].append({"step": step, "moment": "forward", **held(hand, model)})
        loss.backward()
        out["moments"].append({"step": step, "moment": "backward", **held(hand, model)})
        hand.step()
        out["moments"].append({"step": step, "moment": "step", **held(hand, model)})
        out["hand_loss"].append(loss.item())
        out["hand_error"].append((hand.full_parameters().double() - reference[step]).abs().max().item())
        ctx.metric(step=step, loss=loss.item(), max_abs_error=out["hand_error"][-1])
    out["hand_calls"] = [(kind, nbytes, nbytes * ctx.world_size if kind == "all_gather" else nbytes // ctx.world_size)
                         for kind, calls in hand.comm.items() for nbytes, _ in calls]  # the last step's
    out["hand_comm_bytes"] = hand.comm_bytes()
    out["padded_numel"] = sum(u.shard_size * ctx.world_size for u in hand.units)
    out["reference_loss"] = reference_losses
    out["n_params"] = cfg.n_params
    out["units"] = [{"name": u.name, "numel": u.numel, "shard_size": u.shard_size, "bytes": u.nbytes}
                    for u in hand.units]
    if fsdp2:
        out.update(_fsdp2_side(ctx, cfg, batches, reference, cls, hyper, compute, reduce, base, hand))
    return {**out, "world_size": ctx.world_size, "steps": steps, "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype, "optimizer": optimizer}


def _fsdp2_side(ctx, cfg, batches, reference, cls, hyper, compute, reduce, base, hand) -> dict:
    """FSDP2 on the same model, data and policy; the last step's collectives recorded."""
    out = {"fsdp2_loss": [], "fsdp2_error": [], "between": [], "fsdp2_calls": []}
    mesh = Mesh(RankGrid.for_world(ctx.world_size), ctx.rank, ("dp",), fresh=True)
    try:
        native = make_model(cfg, seed=base)
        fully_shard_gpt(native, mesh.device_mesh(("dp",)), True, param_dtype=compute, reduce_dtype=reduce,
                        output_dtype=torch.float32)
        opt = cls(native.parameters(), **hyper)
        for step, batch in enumerate(batches, start=1):
            opt.zero_grad(set_to_none=True)
            calls = []
            with recording(calls):
                loss = loss_fn(native, shard_rows(batch, ctx.rank, ctx.world_size))
                loss.backward()
            opt.step()
            theirs = full_flat(native)
            out["fsdp2_calls"] = calls
            out["fsdp2_loss"].append(loss.item())
            out["fsdp2_error"].append((theirs - reference[step]).abs().max().item())
        out["between"].append((hand.full_parameters().double() - theirs).abs().max().item())
        out["fsdp2_kept"] = {"params": sum(p.to_local().nbytes for p in native.parameters()),
                             "optimizer": sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                                              for st in opt.state.values() for v in st.values()
                                              if isinstance(v, torch.Tensor) and v.dim() > 0),
                             "param_dtype": str(next(native.parameters()).dtype).replace("torch.", "")}
        return out
    finally:
        mesh.destroy()


if __name__ == "__main__":
    entrypoint(main)
