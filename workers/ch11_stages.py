"""ZeRO stages 0-3 side by side on real ranks (issue 16): the bytes each rank holds at the four moments of a step and
the bytes it sends, measured, for the ledger and the ZeRO paper to be held to.

    torchrun --nproc-per-node 4 workers/ch11_stages.py --stage 3

One model (chapter 11's tied GPT, fp32, AdamW), one data stream, one implementation per stage, all by hand:
stage 0 is data parallelism with a full optimizer on every rank (``Zero1Optimizer(shard=False)``: one all-reduce
of the flat gradient), stage 1 ``Zero1Optimizer`` (optimizer state sharded), stage 2 ``Zero2Optimizer``
(gradients too, reduce-scattered from inside backward), stage 3 ``Zero3Model`` (parameters too, FSDP's
algorithm). At init and after each step's forward, backward and step, each rank adds up the bytes of the tensors
it holds, from the tensors: parameters (whole buffers and shards), gradients (whole ``.grad`` and shards) and
AdamW's moments; a stage-2 or stage-3 gradient bucket whose reduce-scatter is still in flight is reported apart
(``in_flight``: it is freed when the collective completes, a time no ledger models). Every collective of the
last step is caught where torch dispatches it (``workers/zero/recorder.py``); at stage 3 the last step's hook
timeline (whole parameters and gradients after every gather, free and gradient) comes back too. Each rank also
trains the single-process reference and reports the largest difference.
"""
from __future__ import annotations

import contextlib

import torch

from workers.runtime import entrypoint, one_of, refusal
from workers.zero.model import OPTIMIZER_CLASSES, model_config, flat_params, loss_fn, make_batches, make_model, \
    run_problem, shard_rows, train_reference
from workers.zero.recorder import CollectiveRecorder
from workers.zero.zero1 import Zero1Optimizer
from workers.zero.zero2 import Zero2Optimizer
from workers.zero.zero3 import Zero3Model

STAGES = (0, 1, 2, 3)
MOMENTS = ("init", "forward", "backward", "step")


def check_params(world_size, stage: int = 3, global_batch: int = 8, steps: int = 2, hidden: int = 32,
                 heads: int = 4, bucket_cap_mb: float = 0.01, **_):
    return refusal((why := one_of("stage", stage, STAGES)) and f"{why} (ZeRO's stages, 0 being plain DDP)",
                   run_problem(world_size, global_batch, steps, hidden, heads),
                   None if bucket_cap_mb > 0 else
                   f"bucket_cap_mb={bucket_cap_mb} must be positive (DDP's default is 25)")


class Stage:
    """One stage's trainer behind one interface: ``zero_grad``, ``step``, ``held()`` and ``weights()``."""

    def __init__(self, stage: int, model, cls, hyper: dict, bucket_cap_mb: float, prefetch: bool, reshard: bool):
        self.stage, self.model = stage, model
        if stage <= 1:
            self.impl = Zero1Optimizer(model.parameters(), cls, shard=stage == 1,
                                       grad_sync="reduce_scatter" if stage == 1 else "all_reduce", **hyper)
            self.padded = sum(f.flat_params.numel() for f in self.impl.groups)
        elif stage == 2:
            self.impl = Zero2Optimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **hyper)
            self.padded = sum(f.numel() for f in self.impl.flat_params)
        else:
            self.impl = Zero3Model(model, list(model.blocks), cls, prefetch=prefetch, reshard_after_forward=reshard,
                                   **hyper)
            self.padded = self.impl.padded_bytes() // 4

    def zero_grad(self) -> None:
        self.impl.zero_grad()

    def step(self) -> None:
        self.impl.step()

    def held(self) -> dict:
        """Bytes this rank holds now, by state, counted from the tensors."""
        impl = self.impl
        whole_grads = sum(p.grad.nbytes for p in self.model.parameters() if p.grad is not None)
        if self.stage <= 1:
            buffers = impl.buffer_bytes()
            return {"params": buffers["params"], "grads": buffers["grads"], "optimizer": impl.state_bytes()["elementwise"],
                    "in_flight": 0}
        if self.stage == 2:
            return {"params": sum(f.nbytes for f in impl.flat_params), "grads": impl.grad_shard_bytes() + whole_grads,
                    "optimizer": impl.state_bytes(), "in_flight": impl.in_flight_bytes()}
        return {"params": impl.shard_bytes() + impl.gathered_bytes(), "grads": impl.grad_shard_bytes() + whole_grads,
                "optimizer": impl.state_bytes(), "in_flight": impl.in_flight_bytes()}

    def weights(self) -> torch.Tensor:
        return self.impl.full_parameters().cpu().double() if self.stage == 3 else flat_params(self.model)


def main(ctx, stage: int = 3, steps: int = 2, global_batch: int = 8, bucket_cap_mb: float = 0.01,
         prefetch: bool = False, reshard_after_forward: bool = True, vocab: int = 64, seq: int = 16, hidden: int = 32,
         heads: int = 4, layers: int = 2, seed: int = 0):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    base = 100 * seed
    batches = make_batches(cfg, global_batch, steps, seed=base + 1)
    model = make_model(cfg, seed=base + ctx.rank, device=ctx.device)  # own weights: the stage equalises them
    cls, hyper = OPTIMIZER_CLASSES["adamw"]
    trainer = Stage(stage, model, cls, hyper, bucket_cap_mb, prefetch, reshard_after_forward)
    reference = train_reference(cfg, "adamw", batches, seed=base)
    moments = [{"step": 0, "moment": "init", **trainer.held()}]
    errors = []
    for step, batch in enumerate(batches, start=1):
        last = step == steps
        recorder = CollectiveRecorder()
        if stage == 3:
            trainer.impl.timeline.clear()  # the last step's hooks only
        with recorder if last else contextlib.nullcontext():
            trainer.zero_grad()
            loss = loss_fn(model, shard_rows(batch, ctx.rank, ctx.world_size).to(ctx.device))
            moments.append({"step": step, "moment": "forward", **trainer.held()})
            loss.backward()
            moments.append({"step": step, "moment": "backward", **trainer.held()})
            trainer.step()
            moments.append({"step": step, "moment": "step", **trainer.held()})
        errors.append((trainer.weights() - reference[step]).abs().max().item())
        ctx.metric(step=step, loss=loss.item(), max_abs_error=errors[-1])
    return {"stage": stage, "world_size": ctx.world_size, "n_params": cfg.n_params, "padded_numel": trainer.padded,
            "moments": moments, "comm": recorder.summary(), "calls": recorder.calls, "max_abs_error": errors,
            "timeline": trainer.impl.timeline if stage == 3 else [],  # whole params/grads after every hook
            "steps": steps, "config": {**cfg.as_dict(), "prefetch": prefetch,
                                       "reshard_after_forward": reshard_after_forward}}


if __name__ == "__main__":
    entrypoint(main)
