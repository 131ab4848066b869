"""ZeRO-3 through the sequence Stanford CS336's FSDP tests use (assignment 2): wrap, forward, backward, gradient
sync, a standard ``torch.optim`` step, gather the full parameters; against one process after every step.

Rank side of ``tests/test_zero3_grads.py``. Every rank wraps chapter 11's tied GPT in ``Zero3Model`` with no
optimizer of its own (optionally the LayerNorm weights replicated, optionally a mixed-precision policy), trains it
with ``torch.optim.SGD`` over ``Zero3Model.parameters()`` on its B/n rows, and reports, per step:

* each parameter's gradient, the sharded ``.grad`` of every rank put end to end in rank order, against the one
  process's mean gradient (a replicated one compared whole, and across ranks);
* each parameter's weights from ``full_named_parameters()`` against the one process's;
* the first step's aliasing: every sharded ``.grad`` and parameter a view into its unit's flat buffers (same
  storage, at its own offset, and a write through the view seen in the buffer);
* with ``max_norm``: the total norm ``clip_grad_norm_`` returns, against ``torch.nn.utils.clip_grad_norm_`` on the
  one process's gradients (which the reference then clips, so the weights compare after clipping too).

The reference computes with a copy of fp32 master weights cast to ``param_dtype`` (replicated ones kept fp32),
steps the masters with the gradients cast to fp32: FSDP2's mixed precision without the sharding (a cast of the
parameters; in fp32 plain one-process training).
"""
import torch
import torch.distributed as dist

from workers.zero.model import OPTIMIZER_CLASSES, loss_fn, make_batches, make_model, model_config, shard_rows
from workers.zero.zero3 import MixedPrecisionPolicy, Zero3Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _is_norm(name: str, _p=None) -> bool:
    return ".ln" in name or name.startswith("ln")


def _reference(cfg, batches, dtype, keep, max_norm, seed):
    """One process, whole batch: per step ({name: mean gradient, after clipping}, {name: weights}, total norm)."""
    master, compute = make_model(cfg, seed=seed), make_model(cfg, seed=seed)
    named = list(master.named_parameters())
    cls, hyper = OPTIMIZER_CLASSES["sgd"]
    opt = cls([p for _, p in named], **hyper)
    out = []
    for batch in batches:
        with torch.no_grad():
            for (name, p), q in zip(named, compute.parameters()):
                q.data = p.detach().to(torch.float32 if keep(name) else dtype)
                q.grad = None
        loss_fn(compute, batch).backward()
        for (_, p), q in zip(named, compute.parameters()):
            p.grad = q.grad.float()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm).item() if max_norm else None
        grads = {name: p.grad.detach().clone() for name, p in named}
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((grads, {name: p.detach().clone() for name, p in named}, norm))
    return out


def _aliasing(fsdp) -> dict:
    """Are the sharded .grad and parameters views of the flat buffers, at their own offsets (no copy)?"""
    shared, offsets, writes, empty = True, True, True, 0
    for u in fsdp.units:
        size = u.grad_shard.element_size()
        for sp, (a, b) in zip(u.sharded, u.slices):
            g = sp.grad
            shared &= g.untyped_storage().data_ptr() == u.grad_shard.untyped_storage().data_ptr()
            shared &= sp.untyped_storage().data_ptr() == u.shard.untyped_storage().data_ptr()
            if a == b:
                empty += 1
                continue
            offsets &= g.data_ptr() == u.grad_shard.data_ptr() + a * size
            offsets &= sp.data_ptr() == u.shard.data_ptr() + a * size
            before = u.grad_shard.clone()
            g.add_(1.0)  # through the view: exactly its elements of the flat buffer move
            writes &= torch.equal(u.grad_shard[a:b], before[a:b] + 1.0)
            writes &= torch.equal(u.grad_shard[:a], before[:a]) and torch.equal(u.grad_shard[b:], before[b:])
            u.grad_shard.copy_(before)
    return {"same_storage": bool(shared), "own_offsets": bool(offsets), "writes_through": bool(writes),
            "empty_views": empty}


def main(ctx, param_dtype: str = "float32", replicate_norms: bool = False, max_norm: float = 0.0, steps: int = 3,
         seed: int = 0, vocab: int = 64, hidden: int = 32, heads: int = 4):
    cfg = model_config(vocab=vocab, hidden=hidden, heads=heads)
    dtype = DTYPES[param_dtype]
    keep = _is_norm if replicate_norms else (lambda name: False)
    batches = make_batches(cfg, 8, steps, seed=100 * seed + 1)
    reference = _reference(cfg, batches, dtype, keep, max_norm, 100 * seed)

    # 1. wrap: no optimizer inside, a standard one outside, over the sharded parameters
    model = make_model(cfg, seed=100 * seed + ctx.rank)  # own weights: the wrap's broadcast equalises them
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    fsdp = Zero3Model(model, list(model.blocks), mp_policy=policy, replicate=_is_norm if replicate_norms else None)
    cls, hyper = OPTIMIZER_CLASSES["sgd"]
    optimizer = cls(fsdp.parameters(), **hyper)
    names = [name for name, _ in fsdp.named_parameters()]
    out = {"grad_error": [], "weight_error": [], "replicas_equal": [], "norm": [], "reference_norm": [],
           "compute_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "grad_dtypes": [], "replicated": [n for n in names if keep(n)], "names": names}
    for step, batch in enumerate(batches):
        grads_ref, weights_ref, norm_ref = reference[step]
        fsdp.zero_grad()
        loss = loss_fn(model, shard_rows(batch, ctx.rank, ctx.world_size))  # 2. forward
        loss.backward()  # 3. backward
        fsdp.sync_grads()  # 4. gradient sync
        if step == 0:
            out["aliasing"] = _aliasing(fsdp)
        if max_norm:
            out["norm"].append(fsdp.clip_grad_norm_(max_norm).item())
            out["reference_norm"].append(norm_ref)
        grad_error, equal = {}, True
        for name, sp in fsdp.named_parameters():
            mine = sp.grad.detach().clone()
            pieces = [None] * ctx.world_size
            dist.all_gather_object(pieces, mine)
            if keep(name):  # replicated: whole on every rank, and the same on every rank
                equal &= all(torch.equal(pieces[0], q) for q in pieces)
                whole = mine
            else:
                whole = torch.cat(pieces)  # the ranks' shards in rank order: the whole gradient (padding not in it)
            grad_error[name] = (whole.double() - grads_ref[name].reshape(whole.shape).double()).abs().max().item()
        out["grad_dtypes"] = sorted({str(sp.grad.dtype) for _, sp in fsdp.named_parameters()})
        optimizer.step()  # 5. a standard torch.optim step on the sharded parameters
        full = fsdp.full_named_parameters()  # 6. gather full parameters
        out["weight_error"].append({name: (full[name].double() - weights_ref[name].double()).abs().max().item()
                                    for name in names})
        out["grad_error"].append(grad_error)
        out["replicas_equal"].append(bool(equal))
    return out
