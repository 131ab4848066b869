"""Collective matmul on real ranks: the sequence-parallel MLP with its all-gather and reduce-scatter blocking, and cut
into ring steps that overlap the matmul (``workers/parallel/collective_matmul.py``; Wang et al. 2023).

    torchrun --nproc-per-node 4 workers/ch06_collective_matmul.py
    torchrun --nproc-per-node 4 workers/ch06_collective_matmul.py --dtype float32 --hidden 256 --seq 256 --repeats 5

Every rank builds the same dense MLP from ``seed``, keeps its shard (``ParallelMLP.from_dense(sequence_parallel=True)``)
and runs one forward/backward on its rows of the same input three ways (``MODES``): ``blocking`` (the module's own
all-gather, matmuls, reduce-scatter), ``decomposed`` (the rings, each transfer in flight while a chunk multiplies)
and ``serialized`` (the same rings, each transfer waited for at once). For each it returns its part of the output,
of the input gradient and every parameter gradient, in ``harness.forward_backward``'s format (so
``course_utils.tp_check.compare`` holds each to the dense MLP), and its timeline (compute chunks and waits).
``float64`` (the default) is for equality; ``float32`` with ``repeats`` > 0 for timing: each mode's wall time per
forward+backward step, ``repeats`` times after one warm-up, with the last step's timeline. On CPU ranks these are
CPU timings (``timing_device`` says which): gloo's transfers and the matmuls share the same cores.
"""
import time

import torch
import torch.distributed as dist

from workers import provenance
from workers.layout.mesh import Mesh
from workers.model import dense as D
from workers.model.dense import BlockConfig
from workers.parallel.collective_matmul import Timeline, blocking_mlp, decomposed_mlp
from workers.parallel.harness import DTYPES, problem, shard
from workers.parallel.layers import contiguous_index
from workers.parallel.plan import shard_record
from workers.runtime import at_least, divides_world, entrypoint, one_of, refusal

MODES = {
    "blocking": blocking_mlp,
    "decomposed": decomposed_mlp,
    "serialized": lambda mlp, x, timeline: decomposed_mlp(mlp, x, timeline, overlap=False),
}


def check_params(world_size, tp=0, hidden=16, ffn=0, activation="gelu", seq=8, batch=2, dtype="float64", repeats=0,
                 **_):
    bad = refusal(one_of("dtype", dtype, list(DTYPES)), at_least("repeats", repeats, 0),
                  divides_world("tp", tp or world_size, world_size))
    if bad:
        return bad
    cfg = BlockConfig(hidden=hidden, heads=1, ffn=ffn, activation=activation)
    return problem("mlp", cfg, tp or world_size, seq, batch, sequence_parallel=True)  # seq splits into equal shards


def _step(forward, mlp, x_rows, grad_rows, timeline):
    for p in mlp.parameters():
        p.grad = None
    x = x_rows.clone().requires_grad_()
    y = forward(mlp, x, timeline)  # [s/t, b, h]
    y.backward(grad_rows)
    return y.detach(), x.grad


def main(ctx, hidden: int = 16, ffn: int = 0, activation: str = "gelu", bias: bool = True, seq: int = 8,
         batch: int = 2, seed: int = 0, dtype: str = "float64", repeats: int = 0, tp: int = 0):
    """One forward/backward of the sequence-parallel MLP per mode, and ``repeats`` timed steps of each.

    ``tp``: tensor-parallel groups of that size (0: one group, the whole world); ``ffn`` 0 means 4 x hidden.
    """
    cfg = BlockConfig(hidden=hidden, heads=1, ffn=ffn, activation=activation, bias=bias)
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        group, size = mesh.group("tp"), mesh.size("tp")
        mlp = shard("mlp", D.build("mlp", cfg, seed), group, sequence_parallel=True).to(ctx.device, DTYPES[dtype])
        x_full, g_full = D.inputs("mlp", cfg, seq, batch, seed)  # [s, b, h] each, the same on every rank
        rows = contiguous_index(seq, size, mesh.rank_in("tp"), "seq")
        x_rows, grad_rows = (t.index_select(0, rows).to(ctx.device, DTYPES[dtype]) for t in (x_full, g_full))
        out = {}
        for mode, forward in MODES.items():
            timeline = Timeline(ctx.device)
            dist.barrier(group)
            timeline.reset()
            y, grad_x = _step(forward, mlp, x_rows, grad_rows, timeline)
            out[mode] = {"output": {"dim": 0, "index": rows, "value": y},
                         "grad_input": {"dim": 0, "index": rows, "value": grad_x},
                         "grads": shard_record(mlp, "grad"), "timeline": timeline.events}
        if repeats:
            out.update(_timed(ctx, mlp, x_rows, grad_rows, group, repeats))
        return {**out, "config": cfg.as_dict(), "seq": seq, "batch": batch, "dtype": dtype, **mesh.describe("tp")}


def _timed(ctx, mlp, x_rows, grad_rows, group, repeats: int) -> dict:
    """Wall seconds of each mode's forward+backward, the modes interleaved so that a burst of load on the shared
    cores falls on all of them; the first round is a warm-up. Then one untimed round with timelines (on CUDA a
    timeline synchronises at every mark, which would slow the timed steps)."""
    seconds = {mode: [] for mode in MODES}
    for round_ in range(repeats + 1):
        for mode, forward in MODES.items():
            dist.barrier(group)
            ctx.synchronize()
            start = time.perf_counter()
            _step(forward, mlp, x_rows, grad_rows, None)
            ctx.synchronize()
            if round_:
                seconds[mode].append(time.perf_counter() - start)
    timelines = {}
    for mode, forward in MODES.items():
        timelines[mode] = Timeline(ctx.device)
        dist.barrier(group)
        timelines[mode].reset()
        _step(forward, mlp, x_rows, grad_rows, timelines[mode])
    device = "CPU" if ctx.device.type == "cpu" else str(ctx.device)
    return {"step_seconds": seconds, "timed_timelines": {mode: t.events for mode, t in timelines.items()},
            "timing_device": f"{device} wall time, {ctx.backend}, {dist.get_world_size()} ranks with "
                             f"{torch.get_num_threads()} intra-op thread(s) each",
            "provenance": provenance.record(device=ctx.device)}


if __name__ == "__main__":
    entrypoint(main)
