"""Chapter 15: one small GPT trained with data, tensor, pipeline and context parallelism at once, and ZeRO.

    torchrun --nproc-per-node 8 workers/ch15_composed.py --dp 2 --tp 2 --pp 2 --cp 1 --micro-batches 2
    torchrun --nproc-per-node 8 workers/ch15_composed.py --dp 2 --tp 2 --cp 2 --zero 1 --sequence-parallel true
    torchrun --nproc-per-node 4 workers/ch15_composed.py --dp 1 --pp 4 --micro-batches 4 --fault tied_not_reduced

On a node of 8 GPUs the same command runs unchanged with NCCL (``workers/runtime.py`` picks it when every rank
has a GPU): ``torchrun --nproc-per-node 8 workers/ch15_composed.py --dp 2 --tp 2 --pp 2 --dtype float32``.

``dp`` 0 takes what the other degrees leave of the world. Every rank builds the same dense model from ``seed``
and keeps its shards (``workers/composed/``; under TP the embedding and the tied head too, split by vocabulary, and
the loss computed from each rank's vocab/tp logits: ``vocab`` must be divisible by ``tp``); each step's batch comes
from ``data_seed``. Each rank returns its
place in the mesh, the losses (last stage), the gradients of every step and the final parameters as shards
(the ranks at dp = cp = 0), a digest of every parameter after every step, its pipeline timeline and timings.
``workers/composed/train.py: reference_run`` is the one-process ground truth. Per step it also reports the bytes
it sent along each dimension, its memory at the four moments (parameters, gradients, optimizer state, the peak
of activations saved for backward) and, under CP, the attention scores it computed; ``forward_ms`` and
``backward_ms`` pad each stage's work per micro-batch to a calibrated time, so its timeline shows the bubble.
"""
import time

import torch
import torch.distributed as dist

from workers.composed.model import model_config
from workers.composed.faults import fault_problem, inject
from workers.composed.train import ComposedTrainer, layout_problem, record
from workers.layout import DIMS, Layout
from workers.pipeline.zero_bubble import SPLIT_SCHEDULES
from workers.runtime import at_least, entrypoint, one_of, refusal

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _layout(dp, tp, pp, cp, zero, sequence_parallel, micro_batches, schedule, virtual_stages, split) -> Layout:
    return Layout(dp=dp or None, tp=tp, pp=pp, cp=cp, zero=zero, sequence_parallel=sequence_parallel,
                  micro_batches=micro_batches, schedule=schedule, virtual_stages=virtual_stages, split=split)


def check_params(world_size, dp=0, tp=1, pp=1, cp=1, zero=0, sequence_parallel=False, micro_batches=1,
                 schedule="1f1b", virtual_stages=1, split="zigzag", steps=3, global_batch=8, lr=0.01, dropout=0.0,
                 vocab=32, seq=16, hidden=32, heads=8, layers=4, fault="none", dtype="float64", forward_ms=0.0,
                 backward_ms=0.0, **_):
    run = refusal(None if 0 <= forward_ms <= 200 and 0 <= backward_ms <= 400 else
                  f"forward_ms={forward_ms} and backward_ms={backward_ms} must be between 0 and 200 / 400 ms",
                  at_least("steps", steps), at_least("global_batch", global_batch),
                  None if lr > 0 else f"lr={lr} must be positive", one_of("dtype", dtype, DTYPES),
                  None if dp >= 0 else f"dp={dp} must be >= 0 (0 takes what the other degrees leave)",
                  # the layout knows the split-backward schedules too; this trainer's stages run whole backwards
                  None if schedule not in SPLIT_SCHEDULES else
                  f"schedule={schedule!r} splits the backward, which chapter 13's pipeline runs: here choose "
                  "'gpipe', '1f1b' or 'interleaved'")
    cfg = model_config(vocab, seq, hidden, heads, layers, dropout)
    layout = _layout(dp, tp, pp, cp, zero, sequence_parallel, micro_batches, schedule, virtual_stages, split)
    return (run or cfg.problem() or layout_problem(layout, world_size, cfg, global_batch)
            or fault_problem(fault, layout.resolve(world_size), dropout))


def main(ctx, dp: int = 0, tp: int = 1, pp: int = 1, cp: int = 1, zero: int = 0, sequence_parallel: bool = False,
         micro_batches: int = 1, schedule: str = "1f1b", virtual_stages: int = 1, split: str = "zigzag", steps: int = 3,
         global_batch: int = 8, lr: float = 0.01, dropout: float = 0.0, vocab: int = 32, seq: int = 16,
         hidden: int = 32, heads: int = 8, layers: int = 4, fault: str = "none", dtype: str = "float64",
         seed: int = 0, data_seed: int = 1, report: bool = True, forward_ms: float = 0.0, backward_ms: float = 0.0,
         timed: bool = False):
    """``steps`` AdamW steps of the composed GPT on this layout (with ``fault`` injected, if any)."""
    with inject(fault):
        return _train(ctx, cfg=model_config(vocab, seq, hidden, heads, layers, dropout),
                      layout=_layout(dp, tp, pp, cp, zero, sequence_parallel, micro_batches, schedule, virtual_stages,
                                     split).resolve(ctx.world_size),
                      steps=steps, global_batch=global_batch, lr=lr, seed=seed, data_seed=data_seed, dtype=dtype,
                      report=report, forward_ms=forward_ms, backward_ms=backward_ms, timed=timed, fault=fault)


def _train(ctx, *, cfg, layout, steps, global_batch, lr, seed, data_seed, dtype, report, forward_ms, backward_ms, timed,
           fault) -> dict:
    t0 = time.perf_counter()
    trainer = ComposedTrainer(layout, cfg, rank=ctx.rank, device=ctx.device, comm_device=ctx.comm_device("send"),
                              global_batch=global_batch, lr=lr, seed=seed, data_seed=data_seed, dtype=DTYPES[dtype])
    setup_s = time.perf_counter() - t0
    try:
        steps_out, step_s, last = [], [], time.perf_counter()  # step_s: wall time from the last step's end to this one's
        for step in range(steps):
            out = trainer.step(step, forward_ms / 1e3, backward_ms / 1e3, timed)
            ctx.metric(step, **({"loss": out["loss"]} if out["loss"] is not None else {}))  # every rank: progress
            if not report:
                out["grads"] = None
            steps_out.append(out)
            step_s.append(time.perf_counter() - last)
            last = time.perf_counter()
        params = record(trainer.named, "value") if trainer.reporter and report else None
        mesh = trainer.device_mesh  # torch's DeviceMesh: the groups each dimension's pieces were handed
        mesh_groups = {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in DIMS}
    finally:
        trainer.close()
    return {"coords": trainer.coords, "stage": trainer.stage, "reporter": trainer.reporter, "mesh_groups": mesh_groups,
            "sharded": sorted(n for n, p in trainer.named.items() if hasattr(p, "partition_dim")),
            "layers": [m.layers for m in trainer.modules], "losses": [s["loss"] for s in steps_out],
            "grads": [s["grads"] for s in steps_out], "params": params,
            "digests": [s["digests"] for s in steps_out], "timelines": [s["timeline"] for s in steps_out],
            "p2p": [s["p2p"] for s in steps_out], "peak_saved_bytes": [s["peak_saved_bytes"] for s in steps_out],
            "comm": [s["comm"] for s in steps_out], "memory": [s["memory"] for s in steps_out],
            "score_entries": [s["score_entries"] for s in steps_out],
            "schedule_s": [s["schedule_s"] for s in steps_out], "sync_s": [s["sync_s"] for s in steps_out],
            "comm_s": [s["comm_s"] for s in steps_out], "step_s": step_s,
            "setup_s": setup_s, "mesh_s": trainer.build_s, "layout": layout.as_dict(), "layout_name": layout.name,
            "config": {**cfg.as_dict(), "steps": steps, "global_batch": global_batch, "lr": lr, "seed": seed,
                       "data_seed": data_seed, "dtype": dtype, "fault": fault}}


if __name__ == "__main__":
    entrypoint(main)
