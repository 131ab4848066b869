"""torch.distributed.checkpoint (DCP): each rank saves only its shard; any world size loads it back.

    torchrun --nproc-per-node 2 workers/ch08_dcp.py --part save --ckpt-dir /tmp/dcp     # FSDP2 shards, world 2
    torchrun --nproc-per-node 1 workers/ch08_dcp.py --part load --ckpt-dir /tmp/dcp     # full tensors, world 1
    torchrun --nproc-per-node 2 workers/ch08_dcp.py --part async --ckpt-dir /tmp/dcp_t  # blocking vs async save

``save``: a small MLP sharded with FSDP2 (``fully_shard``): every parameter, and AdamW's moments with it, is a
DTensor placed ``Shard(0)`` on a 1-D CPU DeviceMesh, so rank r holds rows [r*ceil(d/n), ...) of each. A few
AdamW steps, then ``dcp.save`` of ``get_state_dict(model, optimizer)``: one ``__R_0.distcp`` file per rank with
only its rows, and a ``.metadata`` file that says which rows of which tensor are where. The rank also returns
the full tensors (``DTensor.full_tensor()``, an all-gather) so the notebook can compare with the world-1 load.

``load``: a plain, unsharded model and AdamW at any world size; ``get_state_dict`` gives DCP the shapes to fill,
``dcp.load`` reads each tensor's rows from every shard file that holds some (resharding: planned from the
metadata, nothing gathered in memory first), ``set_state_dict`` puts them in. No conversion step.

``async``: ``dcp.save`` blocks until the files are written; ``dcp.async_save`` returns once the state is
*staged* (copied to host memory), writes from a background thread, and returns a Future that completes when
the checkpoint is durable. Training may change the weights as soon as the call returns; the checkpoint keeps
the staged values (checked here), and each rank records whether the Future was still pending (and, on rank 0,
whether ``.metadata``, the file DCP writes last, was still missing) at the moment the call returned. The
background save runs its collectives on a process group of its own:
two threads issuing collectives on one group could interleave them differently on different ranks.

Everything stays on the CPU (gloo): what DCP does here is host memory and files, the same on a GPU machine,
where the state would be copied to host memory first (that copy is what async staging overlaps).
"""
from __future__ import annotations

import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from workers.checkpointing.sharded import make_mlp
from workers.runtime import at_least, collective_timeout, entrypoint, one_of, refusal

PARTS = ("save", "load", "async")


def check_params(world_size, part, ckpt_dir, width, layers, repeats, **_):
    return refusal(one_of("part", part, PARTS),
                   None if ckpt_dir else
                   "ckpt_dir is empty: give the directory the checkpoint is written to or read from",
                   at_least("width", width), at_least("layers", layers), at_least("repeats", repeats))


def _cpu_group(ctx):
    """The group DCP and the CPU mesh talk over: the world's own under gloo; under NCCL (one GPU per rank) a gloo
    group of its own, since the shards here are CPU tensors (that path is untested: the course machine has no GPU)."""
    return None if ctx.backend == "gloo" else dist.new_group(backend="gloo", timeout=collective_timeout())


def _cpu_mesh(ctx, group) -> DeviceMesh:
    if group is None:
        return init_device_mesh("cpu", (ctx.world_size,))
    return DeviceMesh.from_group(group, "cpu")


def _sharded(ctx, group, width: int, layers: int, seed: int, steps: int):
    """An FSDP2 model + AdamW after ``steps`` steps on a fixed batch (each rank its own rows of it)."""
    model = make_mlp(width, layers, seed)
    mesh = _cpu_mesh(ctx, group)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(4 * ctx.world_size, width, generator=g)  # [4n, width]
    mine = x[4 * ctx.rank:4 * (ctx.rank + 1)]  # [4, width]
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(mine).pow(2).mean().backward()  # FSDP2 reduce-scatters the gradients to the shards
        optimizer.step()
    return model, optimizer


def _full(sd: dict) -> dict:
    """Nested state dict with every DTensor gathered to a plain tensor (a collective: every rank calls it)."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif hasattr(v, "full_tensor"):
            out[k] = v.full_tensor().detach().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        else:
            out[k] = v
    return out


def _files(path: str) -> dict:
    return {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}


def _save(ctx, ckpt_dir, width, layers, seed, steps) -> dict:
    group = _cpu_group(ctx)
    model, optimizer = _sharded(ctx, group, width, layers, seed, steps)
    msd, osd = get_state_dict(model, optimizer)  # keys are parameter names (FQNs), values DTensors
    shards = {k: {"local_shape": list(v.to_local().shape), "global_shape": list(v.shape),
                  "placements": str(v.placements)} for k, v in msd.items()}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir, process_group=group)
    full = {"model": _full(msd), "optim": _full(osd["state"])}
    dist.barrier()
    return {"shards": shards, "full": full, "files": _files(ckpt_dir) if ctx.rank == 0 else {}}


def _load(ctx, ckpt_dir, width, layers, seed) -> dict:
    model = make_mlp(width, layers, seed + 99)  # other values everywhere: the load must overwrite all of them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, optimizer)  # also creates AdamW's (zero) state, so DCP knows its shapes
    state = {"model": msd, "optim": osd}
    # in place: each tensor's rows are read from every shard file that holds some of them
    dcp.load(state, checkpoint_id=ckpt_dir, process_group=_cpu_group(ctx))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, optimizer)
    meta = dcp.FileSystemReader(ckpt_dir).read_metadata()
    chunks = {k[len("model."):]: [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]
              for k, m in meta.state_dict_metadata.items() if k.startswith("model.") and hasattr(m, "chunks")}
    return {"full": {"model": _full(msd), "optim": _full(osd["state"])}, "chunks": chunks}


def _async(ctx, ckpt_dir, width, layers, seed, repeats) -> dict:
    model, optimizer = _sharded(ctx, _cpu_group(ctx), width, layers, seed, steps=1)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    ckpt_group = dist.new_group(backend="gloo", timeout=collective_timeout())  # the background save's own group
    local_bytes = sum(v.to_local().numel() * v.element_size() for v in msd.values())
    times = {"blocking": [], "async_call": [], "async_durable": []}
    pending_at_return, metadata_at_return = [], []
    for i in range(repeats):
        blocking_dir, async_dir = os.path.join(ckpt_dir, f"blocking_{i}"), os.path.join(ckpt_dir, f"async_{i}")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=blocking_dir, process_group=ckpt_group)
        times["blocking"].append(time.perf_counter() - t0)
        before = {k: v.to_local().clone() for k, v in msd.items()}  # this rank's rows as the async save sees them
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=async_dir, process_group=ckpt_group)
        times["async_call"].append(time.perf_counter() - t0)  # training is blocked only this long
        pending_at_return.append(not future.done())  # still writing in the background: not yet a checkpoint
        metadata_at_return.append(os.path.exists(os.path.join(async_dir, ".metadata")))  # written last, by rank 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # "the next step" changes the weights while the files are being written
        future.result()
        times["async_durable"].append(time.perf_counter() - t0)
        dist.barrier()
        if ctx.rank == 0 and i < repeats - 1:  # keep only the last pair on disk
            shutil.rmtree(blocking_dir, ignore_errors=True)
            shutil.rmtree(async_dir, ignore_errors=True)
    reloaded = {"model": {k: torch.zeros_like(v) for k, v in msd.items()}}  # DTensors, same sharding
    dcp.load(reloaded, checkpoint_id=async_dir, process_group=ckpt_group)
    snapshot_ok = all(torch.equal(reloaded["model"][k].to_local(), before[k]) for k in before)
    dist.destroy_process_group(ckpt_group)
    return {"timings_s": times, "local_model_bytes": local_bytes, "snapshot_ok": snapshot_ok,
            "pending_at_return": pending_at_return, "metadata_at_return": metadata_at_return,
            "files": _files(async_dir) if ctx.rank == 0 else {}}


def main(ctx, part: str = "save", ckpt_dir: str = "build/ch08/dcp", width: int = 6, layers: int = 2, steps: int = 2,
         seed: int = 0, repeats: int = 3):
    """``save`` (sharded, any world), ``load`` (unsharded, any world), or ``async`` timing (width ~1024: real sizes)."""
    if part == "save":
        return _save(ctx, ckpt_dir, width, layers, seed, steps)
    if part == "load":
        return _load(ctx, ckpt_dir, width, layers, seed)
    return _async(ctx, ckpt_dir, width, layers, seed, repeats)


if __name__ == "__main__":
    entrypoint(main)
