"""Memory at the four moments of a training step, for DDP and ZeRO-1: after init, forward, backward, step.

    torchrun --nproc-per-node 1 workers/ch11_memory.py                       # ~1.1B parameters, on a GPU
    torchrun --nproc-per-node 2 workers/ch11_memory.py --hidden 256 --layers 4 --vocab 1024 --seq 256

Two kinds of numbers, always labelled apart:

- ``accounted``: bytes of the tensors this rank holds, added up from the tensors themselves, on any device:
  the flat parameter and gradient buffers, the optimizer's state tensors (and fp32 master shard), and the
  activations: the tensors autograd saved for backward (``saved_tensors_hooks``), parameters excluded, that
  are *still alive* at that moment (each is tracked by a weak reference, so a graph kept by
  ``retain_graph=True`` or a stray reference shows up after backward). Each saved tensor counts its own
  bytes (numel x element size), not its whole storage (the embedding saves a view of the batch), and memory
  two saved tensors share (SDPA's output and the output projection's input are one buffer) counts once.
  This is what the ledger predicts, counted rather than modelled.
- ``cuda_allocated`` (GPU only): ``torch.cuda.memory_allocated`` at each moment and the peak since the
  previous moment (``max_memory_allocated``): what the caching allocator really handed out, including
  temporaries (logits, casts, collective buffers) that the ledger does not model.

The default shape is a ~1.1B-parameter GPT (l=20, h=2048, V=32000, s=2048): bf16 weights and gradients,
fp32 master weights and AdamW moments (K = 12 bytes per parameter, Rajbhandari et al. 2020, sec 3.1).
"""
from __future__ import annotations

import contextlib

import torch

from workers.provenance import record as provenance_record
from workers.runtime import at_least, divides, entrypoint, one_of, refusal
from workers.zero.memory import SavedActivations
from workers.zero.model import OPTIMIZER_CLASSES, model_config, loss_fn, make_batches, make_model, shard_rows
from workers.zero.zero1 import GRAD_SYNCS, Zero1Optimizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MOMENTS = ("init", "forward", "backward", "step")
# Deliberate mistakes, to show that the activation count is measured: "retain_graph" calls
# loss.backward(retain_graph=True) (the graph keeps its saved tensors while ``loss`` lives); "stash" keeps every
# block's output in a list during the step, as a logging forward hook might. "none" is the correct loop.
LEAKS = ("none", "retain_graph", "stash")
EMPTY_WHY = {"micro_batch": "gives each rank no rows, so the loss is a mean over nothing (NaN)",
             "layers": "builds a model without transformer layers, so there are no layer activations to measure",
             "steps": "runs no training step, so there is no forward, backward or step to measure"}
CPU_LIMIT_BYTES = 4e9  # refuse CPU runs whose model states alone would exceed this (the default shape is for a GPU)


def model_state_estimate(layers: int, hidden: int, vocab: int, seq: int, dtype: str) -> float:
    n = model_config(vocab, seq, hidden, 1, layers).n_params
    return n * (2 * (2 if dtype == "bfloat16" else 4) + (12 if dtype == "bfloat16" else 8))


def check_params(world_size, layers: int = 20, hidden: int = 2048, heads: int = 16, vocab: int = 32000,
                 seq: int = 2048, micro_batch: int = 2, steps: int = 2, dtype: str = "bfloat16",
                 optimizer: str = "adamw", zero: int = 1, grad_sync: str = "reduce_scatter", leak: str = "none",
                 **_):
    empty = [(low := at_least(name, value)) and (f"{low}: it {EMPTY_WHY[name]}" if name in EMPTY_WHY else low)
             for name, value in (("micro_batch", micro_batch), ("layers", layers), ("steps", steps),
                                 ("hidden", hidden), ("vocab", vocab), ("seq", seq))]
    why = refusal(*empty, divides("heads", heads, "hidden", hidden) if hidden >= 1 else None,
                  one_of("leak", leak, LEAKS),
                  one_of("grad_sync", grad_sync, GRAD_SYNCS), one_of("dtype", dtype, DTYPES),
                  one_of("optimizer", optimizer, OPTIMIZER_CLASSES),
                  (stage := one_of("zero", zero, (0, 1))) and
                  f"{stage} (0 is DDP and 1 is ZeRO-1, the two this worker builds)")
    if why:
        return why
    if not torch.cuda.is_available():  # the estimate needs the valid shape and dtype checked above
        need = model_state_estimate(layers, hidden, vocab, seq, dtype) * world_size
        if need > CPU_LIMIT_BYTES:
            return (f"without a GPU this shape needs about {need / 1e9:.0f} GB of CPU memory for the model states of "
                    f"{world_size} rank(s); pass a small shape such as hidden=256, layers=4, vocab=1024, seq=256")
    return None


# A CPU-sized run for a terminal (and for the test that runs every worker under plain torchrun):
#   torchrun --nproc-per-node 2 workers/ch11_memory.py --layers 2 --hidden 128 --heads 4 --vocab 512 --seq 128
# The defaults are the ~1.1B-parameter shape measured on the GPU (tools/gpu/ch11_memory.sh).
CPU_EXAMPLE_ARGS = ["--layers", "2", "--hidden", "128", "--heads", "4", "--vocab", "512", "--seq", "128"]


def main(ctx, layers: int = 20, hidden: int = 2048, heads: int = 16, vocab: int = 32000, seq: int = 2048,
         micro_batch: int = 2, steps: int = 2, dtype: str = "bfloat16", optimizer: str = "adamw",
         zero: int = 1, grad_sync: str = "reduce_scatter", leak: str = "none"):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    torch_dtype = DTYPES[dtype]
    cuda = ctx.device.type == "cuda"

    def allocated() -> dict:
        if not cuda:
            return {}
        ctx.synchronize()
        out = {"cuda_allocated": torch.cuda.memory_allocated(ctx.device),
               "cuda_peak": torch.cuda.max_memory_allocated(ctx.device)}
        torch.cuda.reset_peak_memory_stats(ctx.device)
        return out

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    baseline = allocated().get("cuda_allocated", 0)  # whatever this process held before (the gloo/NCCL buffers)
    model = make_model(cfg, seed=0, dtype=torch_dtype, device=ctx.device)
    cls, hyper = OPTIMIZER_CLASSES[optimizer]
    opt = Zero1Optimizer(model.parameters(), cls, shard=zero == 1, grad_sync=grad_sync,
                         master_weights=torch_dtype != torch.float32, **hyper)
    param_ptrs = {f.flat_params.untyped_storage().data_ptr() for f in opt.groups}
    batches = make_batches(cfg, micro_batch * ctx.world_size, steps)
    stash: list[torch.Tensor] = []  # leak="stash": the block outputs a logging hook would keep
    handles = [b.register_forward_hook(lambda _m, _i, out: stash.append(out)) for b in model.blocks] \
        if leak == "stash" else []

    def accounted(activations: int) -> dict:
        buffers, state = opt.buffer_bytes(), opt.state_bytes()
        return {"params": buffers["params"], "grads": buffers["grads"], "optimizer": state["total"],
                "activations": activations}

    moments = []

    def record(step: int, moment: str, saved: SavedActivations) -> None:
        # activations: the bytes of this step's saved tensors that are still alive now (weak references)
        moments.append({"step": step, "moment": moment, "accounted": accounted(saved.alive_bytes()),
                        "saved_tensors_alive": saved.alive_count(), **allocated()})

    record(0, "init", SavedActivations(param_ptrs))  # no forward has run: nothing saved yet
    for step, batch in enumerate(batches, start=1):
        stash.clear()
        tokens = shard_rows(batch, ctx.rank, ctx.world_size).to(ctx.device)
        saved = SavedActivations(param_ptrs)
        with saved.hooks():
            loss = loss_fn(model, tokens)
        record(step, "forward", saved)
        loss.backward(retain_graph=leak == "retain_graph")  # without it, backward frees the saved tensors
        record(step, "backward", saved)  # ``loss`` (and its graph's nodes) still referenced, as in a real loop
        opt.step()
        opt.zero_grad()
        record(step, "step", saved)
        ctx.metric(step=step, loss=loss.item())
        del loss
    for h in handles:
        h.remove()
    stash.clear()
    out = {
        "n_params": sum(p.numel() for p in model.parameters()),
        "owned_numel": opt.owned_numel(),
        "moments": moments,
        "baseline_cuda_allocated": baseline,
        "config": {**cfg.as_dict(), "micro_batch": micro_batch, "dtype": dtype, "optimizer": optimizer,
                   "zero": zero, "grad_sync": grad_sync, "world_size": ctx.world_size, "leak": leak},
        "device": str(ctx.device),
        "backend": ctx.backend,
    }
    out["provenance"] = provenance_record("workers.ch11_memory", device=ctx.device)
    if cuda:
        with contextlib.suppress(Exception):
            out["cuda_total_memory"] = torch.cuda.get_device_properties(ctx.device).total_memory
    return out


if __name__ == "__main__":
    entrypoint(main)
