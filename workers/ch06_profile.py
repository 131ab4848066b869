"""Where the time of one tensor-parallel block goes: LayerNorm, attention, MLP, communication, backward.

    torchrun --nproc-per-node 2 workers/ch06_profile.py --seqs 64 128 256 --hidden 128
    torchrun --nproc-per-node 1 workers/ch06_profile.py --dtype bfloat16 --hidden 4096 --heads 32 \\
        --seqs 1024 4096 --trace-dir /tmp/traces          # on a GPU

For each sequence length: ``warmup`` untimed steps, then ``repeats`` timed forward + backward steps of
``ParallelBlock``. Each forward stage is timed (``block.segment``): with ``time.perf_counter`` on the
CPU, with CUDA events on a GPU (no synchronisation inside the step; the events are read after it). The
communication inside attention and the MLP is timed separately by the communication ledger (its
markers synchronise the GPU, which costs a little) and subtracted from those stages. Backward is timed
as a whole, with its communication alongside. Medians over the repeats are returned.

CPU caveats, honestly: on this machine several ranks share two cores, so ranks slow each other down;
gloo's all-reduce time includes waiting for the slowest rank; matmuls on a CPU are much slower relative
to memory-bound work than on a GPU, so the shares differ from a GPU's. The *method* is the one you would
use on a GPU; the numbers are CPU numbers. ``trace_dir`` also writes a ``torch.profiler`` Chrome trace of
one more step per rank (open it in chrome://tracing or Perfetto).
"""
import contextlib
import statistics
import time

import torch

from workers.layout.mesh import Mesh
from workers.model.dense import BlockConfig
from workers.parallel.attention import destroy_owned_groups
from workers.parallel.block import ParallelBlock
from workers.parallel.comm_stats import CommLedger, name_scopes
from workers.parallel.harness import problem
from workers.runtime import at_least, divides_world, entrypoint, one_of, refusal

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STAGES = ("ln1", "attention", "residual1", "ln2", "mlp", "residual2")


def check_params(world_size, tp=0, hidden=128, heads=8, seq=128, seqs=(), batch=2, sequence_parallel=False,
                 repeats=5, warmup=2, dtype="float32", **_):
    bad = refusal(one_of("dtype", dtype, list(DTYPES)), at_least("repeats", repeats), at_least("warmup", warmup, 0),
                  divides_world("tp", tp or world_size, world_size))
    if bad:
        return bad
    cfg = BlockConfig(hidden=hidden, heads=heads)
    found = (problem("block", cfg, tp or world_size, int(s), batch, sequence_parallel=sequence_parallel)
             for s in (list(seqs) or [seq]))
    return next((bad for bad in found if bad), None)  # the first sequence length that does not fit, once


class SegmentTimer:
    """``with timer("mlp"):`` records one interval: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device, annotate: bool = False):
        self.cuda = device.type == "cuda"
        self.annotate = annotate
        self.pending: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        label = torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()
        with label:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
            else:
                start = time.perf_counter()
                yield
                end = time.perf_counter()
        self.pending.append((name, start, end))

    def collect(self) -> dict[str, float]:
        """Seconds per segment for the step just run (synchronises the GPU once)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for name, start, end in self.pending:
            dt = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[name] = out.get(name, 0.0) + dt
        self.pending = []
        return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _shares(step: dict) -> dict:
    total = sum(step[f"{k}_s"] for k in STAGES)
    return {"ln": (step["ln1_s"] + step["ln2_s"]) / total,
            "attention": (step["attention_s"] - step["comm_attention_forward_s"]) / total,
            "mlp": (step["mlp_s"] - step["comm_mlp_forward_s"]) / total,
            "communication": step["comm_forward_s"] / total,
            "other": (step["residual1_s"] + step["residual2_s"]) / total}


def profile_one(ctx, cfg: BlockConfig, seq: int, batch: int, *, sequence_parallel: bool, repeats: int, warmup: int,
                dtype: torch.dtype, trace_dir: str, group=None, tp: int = 1) -> dict:
    torch.manual_seed(0)
    block = ParallelBlock(cfg, group, sequence_parallel=sequence_parallel, device=ctx.device, dtype=dtype)
    name_scopes(block)
    timer = SegmentTimer(ctx.device)
    local_seq = seq // tp if sequence_parallel else seq
    x = torch.randn(local_seq, batch, cfg.hidden, device=ctx.device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    steps = []
    try:
        for i in range(warmup + repeats):
            block.segment = timer
            with CommLedger(timed=True, device=ctx.device) as ledger:
                _sync(ctx.device)
                t0 = time.perf_counter()
                y = block(x)
                _sync(ctx.device)
                t1 = time.perf_counter()
                y.backward(grad)
                _sync(ctx.device)
                t2 = time.perf_counter()
            segments = timer.collect()
            if i < warmup:
                continue
            comm_attn, comm_mlp = ledger.seconds("attention"), ledger.seconds("mlp")
            comm = ledger.seconds()
            steps.append({"forward_s": t1 - t0, "backward_s": t2 - t1, **{f"{k}_s": v for k, v in segments.items()},
                          "comm_forward_s": comm["forward"], "comm_backward_s": comm["backward"],
                          "comm_attention_forward_s": comm_attn["forward"], "comm_mlp_forward_s": comm_mlp["forward"]})
        trace = ""
        if trace_dir:
            import os

            os.makedirs(trace_dir, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if ctx.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            block.segment = SegmentTimer(ctx.device, annotate=True)
            with torch.profiler.profile(activities=activities) as prof:
                block(x).backward(grad)
                _sync(ctx.device)
            trace = os.path.join(trace_dir, f"tp_block_s{seq}_rank{ctx.rank}.json")
            prof.export_chrome_trace(trace)
    finally:
        destroy_owned_groups(block)
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    # The shares of one typical step (the one whose stages took the median total), so they add up to 100%;
    # a step slowed down by another process on the shared cores is then left out rather than mixed in.
    typical = sorted(steps, key=lambda s: sum(s[f"{k}_s"] for k in STAGES))[len(steps) // 2]
    share = _shares(typical)
    return {"seq": seq, "batch": batch, **med, "forward_share": share, "repeats": repeats, "trace": trace,
            "device": str(ctx.device) if ctx.device.type == "cpu" else torch.cuda.get_device_name(ctx.device)}


def main(ctx, hidden: int = 128, heads: int = 8, seq: int = 128, seqs: list = (), batch: int = 2,
         sequence_parallel: bool = False, repeats: int = 5, warmup: int = 2, dtype: str = "float32",
         trace_dir: str = "", tp: int = 0):
    """Median per-segment times of ``repeats`` forward + backward steps, for each sequence length.

    ``tp``: tensor-parallel groups of that size, each profiling its own block at the same time (``tp=1`` on 2
    ranks: two TP-1 blocks side by side, one core each on this machine); 0 (the default) means the whole world.
    """
    cfg = BlockConfig(hidden=hidden, heads=heads)
    profiles = []
    with Mesh.for_world(("tp",), tp=tp or ctx.world_size) as mesh:
        for s in [int(v) for v in (list(seqs) or [seq])]:
            profiles.append(profile_one(ctx, cfg, s, batch, sequence_parallel=sequence_parallel, repeats=repeats,
                                        warmup=warmup, dtype=DTYPES[dtype], trace_dir=trace_dir,
                                        group=mesh.group("tp"), tp=mesh.size("tp")))
            ctx.metric(step=len(profiles), seq=s, forward_ms=profiles[-1]["forward_s"] * 1e3)
        return {"profiles": profiles, "config": cfg.as_dict(), "threads": torch.get_num_threads(),
                **mesh.describe("tp")}


if __name__ == "__main__":
    entrypoint(main)
