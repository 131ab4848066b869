"""ZeRO-3 by hand next to PyTorch's FSDP2 (issue 16): the same model, data and AdamW, compared step by step.

    torchrun --nproc-per-node 4 workers/ch11_fsdp2.py

``torch.distributed.fsdp.fully_shard`` on every block and then on the root (torchtitan's ``apply_fsdp``) against
``workers/zero/zero3.py: Zero3Model`` with the same units, both on chapter 11's tied GPT, both against the
single-process reference (``train_reference``). Each rank reports, per step, both losses and the largest
difference of each from the reference and from each other; every all-gather and reduce-scatter of the first step
(kind, bytes in, bytes out), caught by wrapping ``torch.distributed.all_gather_single`` and
``reduce_scatter_single``, the two functions FSDP2's ``_fsdp_collectives`` calls; and the bytes each keeps between
steps (its shards of the parameters and AdamW's state).

What differs, by design:

* FSDP2 shards every parameter on its first dimension (``Shard(0)``: ``torch.chunk``'s rows, so the last ranks
  may keep fewer, unpadded) and pads each parameter to a multiple of N rows in its messages; the hand version cuts
  each unit's flat buffer into N equal padded shards. At the chapter's sizes every first dimension divides by 2
  and 4: the same messages and the same bytes kept. On an uneven model FSDP2's messages are the larger.
* FSDP2 keeps the root unit whole from its forward to its backward by default (``reshard_after_forward=None``
  on the root: its parameters would be gathered again at once): one all-gather fewer per step than the hand
  version, which follows the ZeRO paper's 3 Psi. (Passing ``True`` to the root as well gives the hand version's
  calls, one for one: measured on torch 2.13.)
* FSDP2 averages with a SUM then a division by N after the reduce-scatter (gloo has no AVG; hence
  ``set_force_sum_reduction_for_comms``), the hand version pre-scales by 1/N: the same mean, rounded differently.
* FSDP2 prefetches the next unit's all-gather during backward by default (and in forward only when told,
  ``set_modules_to_forward_prefetch``); the hand version's ``prefetch`` switch does both.

CPU ranks (gloo), fp32. The mesh is made from the course grid's groups and destroyed at the end (warm ranks).
"""
from __future__ import annotations

import torch

from workers.layout import Mesh, RankGrid
from workers.runtime import entrypoint
from workers.zero.model import OPTIMIZER_CLASSES, model_config, flat_params, loss_fn, make_batches, make_model, \
    run_problem, shard_rows, train_reference
from workers.zero.fsdp2 import full_flat, fully_shard_gpt, recording
from workers.zero.zero3 import Zero3Model


def check_params(world_size, global_batch: int = 8, steps: int = 3, hidden: int = 32, heads: int = 4, **_):
    return run_problem(world_size, global_batch, steps, hidden, heads)


def main(ctx, steps: int = 3, global_batch: int = 8, reshard_after_forward: bool = True, vocab: int = 64,
         seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2, seed: int = 0):
    cfg = model_config(vocab, seq, hidden, heads, layers)
    base = 100 * seed
    batches = make_batches(cfg, global_batch, steps, seed=base + 1)
    reference = train_reference(cfg, "adamw", batches, seed=base)
    cls, hyper = OPTIMIZER_CLASSES["adamw"]

    hand_model = make_model(cfg, seed=base)
    hand = Zero3Model(hand_model, list(hand_model.blocks), cls, reshard_after_forward=reshard_after_forward, **hyper)

    mesh = Mesh(RankGrid.for_world(ctx.world_size), ctx.rank, ("dp",), fresh=True)
    try:
        native = make_model(cfg, seed=base)  # every rank the same weights: fully_shard keeps its slice of them
        fully_shard_gpt(native, mesh.device_mesh(("dp",)), reshard_after_forward)
        native_opt = cls(native.parameters(), **hyper)
        out = {"hand_loss": [], "fsdp2_loss": [], "hand_error": [], "fsdp2_error": [], "between": [],
               "fsdp2_calls": [], "hand_calls": []}
        for step, batch in enumerate(batches):
            rows = shard_rows(batch, ctx.rank, ctx.world_size)
            hand.zero_grad()
            hand.comm = {"all_gather": [], "reduce_scatter": []}
            loss = loss_fn(hand_model, rows)
            loss.backward()
            hand.step()
            out["hand_loss"].append(loss.item())
            if step == 0:
                out["hand_calls"] = [(kind, nbytes, nbytes * ctx.world_size if kind == "all_gather" else
                                      nbytes // ctx.world_size) for kind, calls in hand.comm.items()
                                     for nbytes, _ in calls]
            native_opt.zero_grad(set_to_none=True)
            with recording(out["fsdp2_calls"], on=step == 0):
                loss = loss_fn(native, rows)
                loss.backward()
            native_opt.step()
            out["fsdp2_loss"].append(loss.item())
            mine, theirs = hand.full_parameters().cpu().double(), full_flat(native)
            out["hand_error"].append((mine - reference[step + 1]).abs().max().item())
            out["fsdp2_error"].append((theirs - reference[step + 1]).abs().max().item())
            out["between"].append((mine - theirs).abs().max().item())
        local = [p.to_local() for p in native.parameters()]
        out["fsdp2_kept"] = {"params": sum(t.nbytes for t in local),
                             "optimizer": sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
                                              for st in native_opt.state.values() for v in st.values()
                                              if isinstance(v, torch.Tensor) and v.dim() > 0)}
        out["hand_kept"] = {"params": hand.shard_bytes(), "optimizer": hand.state_bytes()}
        out["n_params"] = flat_params(make_model(cfg, seed=base)).numel()
        out["units"] = [u.name for u in hand.units]
        return out
    finally:
        mesh.destroy()


if __name__ == "__main__":
    entrypoint(main)
