"""ZeRO stage 3 by hand (FSDP's algorithm): parameters, gradients and optimizer state all sharded 1/N.

Rajbhandari et al. 2020, "ZeRO", section 5.3 (P_os+g+p, parameter partitioning); Zhao et al. 2023, "PyTorch FSDP",
section 3 (units, flat parameters, the all-gather before and the free after each unit's forward and backward).
ZeRO-2 (``zero2.py``) keeps whole parameters on every rank; stage 3 keeps 1/N of them and rebuilds a unit's
parameters only while it computes:

1. the model is cut into **units** (here: every Transformer block, and a root unit with what is left: the tied
   embedding/LM head, the positions and the final LayerNorm). A unit's parameters are laid out in one flat buffer,
   padded to N equal shards; rank r keeps shard r (an fp32 Parameter the optimizer steps) and the flat buffer's
   storage is freed (``untyped_storage().resize_(0)``, as FSDP does): the model's Parameters stay, as views of a
   buffer that holds no bytes until the next all-gather;
2. **forward**: before a unit runs (a forward-pre hook) its shards are **all-gathered** into the buffer; after it
   (a forward hook) the buffer is freed again when ``reshard_after_forward`` (FSDP's default; off keeps every
   unit whole from its forward to its backward: the ZeRO-2-like trade of memory for one all-gather less);
3. **backward**: a hook on the unit's output fires when its gradient arrives, just before the unit's backward
   nodes run: the shards are all-gathered again (if they were freed); when the last of the unit's parameters has
   its gradient (post-accumulate-grad hooks), the unit's gradients are flattened, pre-scaled by 1/N and
   **reduce-scattered** asynchronously into this rank's shard, the ``.grad`` dropped and the buffer freed;
4. **prefetch**: with ``prefetch=True`` the all-gather of the next unit to run (forward: the next block; backward:
   the one before) is launched asynchronously when a unit starts, so it travels while the unit computes; the
   price is a second unit's parameters alive at once;
5. ``step()`` waits for the reduce-scatters and steps the shards. Nothing is gathered after the step: the next
   forward does it.

Communication per step, ring accounting: every unit all-gathered for forward and again for backward, and its
gradient reduce-scattered: 3 Psi (N-1)/N (section 7.2.2), Psi the padded model; with ``reshard_after_forward=False``
the backward all-gather is not needed: 2 Psi (N-1)/N, the bytes of DDP, for ZeRO-2's memory during backward.

The root unit follows ``reshard_after_forward`` as the blocks do, so the count is the paper's exactly; PyTorch's
FSDP2 keeps its root unit whole from forward to backward instead (it would be gathered again at once).
``timeline`` records, at every gather, free, launch and wait, the bytes of whole parameters, of whole gradients in
``.grad`` and of gradient buckets in flight on this rank: memory over time through one step.

One backward per step (ZeRO-2's rule: its shard is all a rank keeps of a reduced gradient). Elementwise optimizers.

**Where gradients live.** The reduced gradient arrives in one flat buffer per unit (``grad_shard``), but a learner,
``torch.optim`` and a gradient-norm clip think in parameters. So, as FSDP2 does (each parameter's ``.grad`` a
sharded DTensor), every parameter has a **sharded parameter**: an ``nn.Parameter`` that is a view of the elements of
its unit's fp32 shard that belong to it (a 1-D slice, empty when this rank's shard holds none of it), whose
``.grad`` after ``sync_grads()`` is a view of the same elements of ``grad_shard``: no copy, the optimizer writes
straight into the shard. ``parameters()`` lists them in ``model.parameters()`` order; any ``torch.optim``
optimizer can step them. Parameters named in ``replicate`` (FSDP's "replicated" or ignored parameters: small
LayerNorm weights, kept whole on every rank) stay out of the units: whole, in their own dtype, their gradient
all-reduced (averaged) by ``sync_grads()``. ``clip_grad_norm_`` clips across ranks: the squares of every rank's
elements summed over the ranks once (a replicated gradient counted once), then the square root.

**Mixed precision** (``MixedPrecisionPolicy``, FSDP2's four fields): the shard stays fp32, the master copy the
optimizer steps; each all-gather sends it cast to ``param_dtype`` (bf16: half the bytes on the wire) into a
``param_dtype`` buffer, so forward and backward compute in bf16; the unit's bf16 gradients are cast to
``reduce_dtype`` (fp32) before the reduce-scatter, so the mean is taken in fp32; the root's output is cast to
``output_dtype``. That is a cast of the *parameters*, not ``torch.autocast`` (which casts each op's inputs and
keeps some ops, LayerNorm among them, in fp32): one process that computes with a bf16 copy of its fp32 weights
and steps the fp32 copy is the same algorithm (``workers/zero/model.py: train_reference_mixed``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from workers.runtime import all_gather_single, comm_device, reduce_scatter_single


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``, the same fields: ``param_dtype`` the dtype parameters
    are all-gathered and computed in, ``reduce_dtype`` the dtype gradients are reduce-scattered in,
    ``output_dtype`` the root's output dtype, ``cast_forward_inputs`` whether the root's floating inputs are cast to
    ``param_dtype``. None keeps the parameters' own dtype (fp32: no mixed precision)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class Unit:
    """The parameters of one module, sharded: ``shard`` (this rank's 1/N in the parameters' own dtype, fp32: the
    master copy the optimizer steps, through ``sharded``, one view per parameter) and ``full`` (the padded flat
    buffer in the compute dtype that the model's Parameters are views of; its storage allocated only while
    gathered)."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], world_size: int, rank: int,
                 param_dtype: torch.dtype | None = None):
        self.name, self.params = name, params
        self.numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(self.numel / world_size)
        n, S = world_size, self.shard_size
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            padded = torch.cat([flat, flat.new_zeros(S * n - self.numel)])  # [S n]
            self.shard = padded[rank * S:(rank + 1) * S].clone()  # [S], fp32 with a policy: the master copy
            self.full = padded.to(param_dtype or padded.dtype)  # [S n], in the dtype forward computes in
            offset = 0
            for p in params:  # the model's Parameters now live in the unit's buffer
                p.data = self.full[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.nbytes = self.full.nbytes  # whole, padded, in the compute dtype
        self.grad_shard = torch.zeros_like(self.shard)  # [S], the shard's dtype whatever the reduce dtype
        # each parameter's elements in this rank's shard: [start, end) of the shard, a clamp of the parameter's
        # [offset, offset + numel) range to [r S, (r + 1) S); empty (start == end) when the shard holds none of it
        self.slices, offset = [], 0
        for p in params:
            start = min(max(offset - rank * S, 0), S)
            self.slices.append((start, min(max(offset + p.numel() - rank * S, 0), S)))
            offset += p.numel()
        # views, not copies: the optimizer's in-place updates land in the shard the next all-gather sends
        self.sharded = [torch.nn.Parameter(self.shard[a:b]) for a, b in self.slices]  # [b - a] each
        self.gathered = True
        self.work = None  # an all-gather in flight (prefetch)
        self.sending = None  # its input (the shard cast to the compute dtype), alive until the gather is waited for

    def grad_views(self) -> list[torch.Tensor]:
        """Each parameter's elements of ``grad_shard``, as views (the sharded parameters' ``.grad``)."""
        return [self.grad_shard[a:b] for a, b in self.slices]

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.nbytes)
        self.gathered = True


class Zero3Model:
    """``Zero3Model(model, units, torch.optim.AdamW, lr=1e-3, prefetch=True, reshard_after_forward=True)``.

    ``units`` are submodules of ``model`` (its blocks) called once each per forward, in order; every parameter not
    in one of them (nor replicated) is the root unit's. ``mp_policy``: a ``MixedPrecisionPolicy``. ``replicate``:
    ``replicate(name, param) -> bool`` picks the parameters kept whole on every rank (their module must accept
    them in their own dtype next to ``param_dtype`` activations: LayerNorm does). Call ``zero_grad()``,
    ``loss = f(model(x))``, ``loss.backward()``, ``step()`` (which is ``sync_grads()`` then the optimizer's step);
    or, with ``optimizer_class=None``, ``sync_grads()`` and your own ``torch.optim`` optimizer over ``parameters()``
    (then ``zero_grad()`` before the next forward). ``full_parameters()``
    all-gathers every unit for a comparison (outside the step's bookkeeping).
    """

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], optimizer_class: type | None = None, *,
                 prefetch: bool = False, reshard_after_forward: bool = True, group=None,
                 mp_policy: MixedPrecisionPolicy | None = None,
                 replicate: Callable[[str, torch.nn.Parameter], bool] | None = None, **defaults):
        self.model, self.group = model, group
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.policy = mp_policy or MixedPrecisionPolicy()
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        named = dict(model.named_parameters())  # a tied weight once, under its first name
        params = list(named.values())
        self.names = {id(p): name for name, p in named.items()}
        if not params or len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("Zero3Model needs parameters in one dtype on one device; cast the model first.")
        if any(p.device.type != comm_device(dist.get_backend(group), p.device, "all_gather").type for p in params):
            raise ValueError("Zero3Model needs a backend that all-gathers on the parameters' device: NCCL for CUDA "
                             "tensors, gloo for CPU ones.")
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self.policy, field)
            if dtype is not None and not dtype.is_floating_point:
                raise ValueError(f"MixedPrecisionPolicy({field}={dtype}) must be a floating dtype (bfloat16, "
                                 "float16 or float32).")
        if optimizer_class is not None:  # refuse bad options before any collective
            optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in params:  # replicas start equal, then each keeps its shard
                dist.broadcast(p.data, src=src, group=group)
        self.replicated = [p for name, p in named.items() if replicate is not None and replicate(name, p)]
        kept = {id(p) for p in self.replicated}
        in_units = {id(p) for m in units for p in m.parameters()}
        root = [p for p in params if id(p) not in in_units and id(p) not in kept]
        n, r, dtype = self.world_size, self.rank, self.policy.param_dtype
        self.units = [Unit("root", root, n, r, dtype)] + [
            Unit(f"unit{k}", [p for p in m.parameters() if id(p) not in kept], n, r, dtype)
            for k, m in enumerate(units)]
        self.modules = [model] + list(units)
        self.unit_of = {id(p): k for k, u in enumerate(self.units) for p in u.params}
        # the parameters an optimizer steps, in model.parameters() order: a sharded view per unit parameter, the
        # replicated parameters themselves
        sharded = {id(p): sp for u in self.units for p, sp in zip(u.params, u.sharded)}
        self._parameters = [sharded.get(id(p), p) for p in params]
        self.optimizer = optimizer_class(self._parameters, **defaults) if optimizer_class is not None else None
        self.comm = {"all_gather": [], "reduce_scatter": []}  # (bytes handed in, group size) per call
        if self.replicated:
            self.comm["all_reduce"] = []  # the replicated parameters' gradients
        self.timeline: list[dict] = []
        self._hooks = []
        for k, m in enumerate(self.modules):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, k=k: self._pre_forward(k, args)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, k=k: self._post_forward(k, out)))
        for u in self.units:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p: self._grad_ready(p)))
        for u in self.units:
            u.free()
        self._reset()

    # -- what a learner and torch.optim see ----------------------------------------------------------------------

    def parameters(self) -> list[torch.nn.Parameter]:
        """What to hand an optimizer: every parameter's shard on this rank (a view of its unit's fp32 shard; an
        empty one where the shard holds none of it) or, replicated, the parameter itself; ``model.parameters()``'s
        order. Their ``.grad`` is set by ``sync_grads()``."""
        return list(self._parameters)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``parameters()`` with the model's names."""
        return [(self.names[id(p)], sp) for p, sp in zip(self.model.parameters(), self._parameters)]

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Finish the gradient sync of this backward: wait for the reduce-scatters (every unit's mean gradient in
        its ``grad_shard``), point each sharded parameter's ``.grad`` at its elements there (views, no copy), and
        all-reduce the mean of each replicated parameter's gradient in ``reduce_dtype``. Idempotent until the
        next backward."""
        waiting = [u.name for u, left in zip(self.units, self._pending) if left]
        if waiting:
            raise RuntimeError(f"{', '.join(waiting)} received no gradient for some parameter in this backward: every "
                               "parameter must take part in the loss")
        for k, work, _, out in self._rs:
            work.wait()
            self.units[k].grad_shard.copy_(out)  # reduce dtype -> the shard's dtype (fp32)
        self._rs = []
        for u in self.units:
            for sp, view in zip(u.sharded, u.grad_views()):
                sp.grad = view
        if not self._synced:
            n = self.world_size
            for p in self.replicated:
                if p.grad is None:
                    raise RuntimeError(f"the replicated parameter {self.names[id(p)]} received no gradient in this "
                                       "backward: every parameter must take part in the loss")
                buf = p.grad.to(self.policy.reduce_dtype or p.grad.dtype).mul_(1.0 / n)  # the SUM is the mean
                dist.all_reduce(buf, group=self.group)
                self.comm.setdefault("all_reduce", []).append((buf.nbytes, n))
                p.grad.copy_(buf)
        self._synced = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` across the ranks (after ``sync_grads()``): every element of the model's
        gradient lives in one rank's shard, so the squares are summed locally, then over the ranks (one all-reduce
        of one number), and only then the square root; a replicated gradient, whole on every rank, counted once.
        Returns the total norm before clipping, the same on every rank."""
        self.sync_grads()
        grads = [g for u in self.units for g in u.grad_views()]  # padding is zero: it adds nothing
        sharded_sq = sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64))
        total_sq = sharded_sq.to(self.units[0].grad_shard.device)
        dist.all_reduce(total_sq, group=self.group)
        total_sq += sum((p.grad.double().pow(2).sum() for p in self.replicated), torch.zeros((), dtype=torch.float64))
        total = total_sq.sqrt()
        coef = (max_norm / (total + eps)).clamp(max=1.0)
        for g in grads + [p.grad for p in self.replicated]:
            g.mul_(coef.to(g.dtype))
        return total.float()

    # -- bookkeeping ---------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._pending = [len(u.params) for u in self.units]
        self._rs: list = []  # (unit, work, flattened gradient, output) in flight
        self._in_grad = 0
        self._t0 = None
        self._synced = False

    def gathered_bytes(self) -> int:
        """Bytes of whole (unsharded) parameters this rank holds now: every buffer with its storage allocated."""
        return sum(u.nbytes for u in self.units if u.gathered)

    def in_flight_bytes(self) -> int:
        """Bytes of flattened unit gradients whose reduce-scatter has been launched and not yet waited for."""
        return sum(buf.nbytes for _, _, buf, _ in self._rs)

    def _record(self, kind: str, unit: int) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        self.timeline.append({"t": time.perf_counter() - self._t0, "kind": kind, "unit": self.units[unit].name,
                              "params": self.gathered_bytes(), "grads": self._in_grad,
                              "in_flight": self.in_flight_bytes()})

    # -- gather and free -----------------------------------------------------------------------------------------

    def _launch_gather(self, k: int, async_op: bool) -> None:
        u = self.units[k]
        if u.gathered or u.work is not None:
            return
        u.allocate()
        u.sending = u.shard.to(u.full.dtype)  # [S]; the fp32 master itself when there is no policy
        u.work = all_gather_single(u.full, u.sending, group=self.group, async_op=async_op)
        self.comm["all_gather"].append((u.sending.nbytes, self.world_size))
        self._record("gather" if not async_op else "prefetch", k)
        if not async_op:
            u.work, u.sending = None, None

    def _ensure(self, k: int) -> None:
        """Unit ``k`` whole now: wait for its prefetched all-gather, or gather it."""
        u = self.units[k]
        if u.work is not None:
            u.work.wait()
            u.work, u.sending = None, None
            self._record("wait_gather", k)
        elif not u.gathered:
            self._launch_gather(k, async_op=False)

    def _free(self, k: int) -> None:
        self.units[k].free()
        self._record("free", k)

    def _pre_forward(self, k: int, args):
        self._ensure(k)
        if self.prefetch and k + 1 < len(self.units):
            self._launch_gather(k + 1, async_op=True)
        dtype = self.policy.param_dtype
        if k == 0 and dtype is not None and self.policy.cast_forward_inputs:  # FSDP2 casts the root's inputs
            return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return None

    def _post_forward(self, k: int, out):
        if out.requires_grad:  # the unit's backward begins when the gradient of its output arrives
            out.register_hook(lambda grad, k=k: self._pre_backward(k))
        if self.reshard_after_forward:
            self._free(k)
        if k == 0 and self.policy.output_dtype is not None:
            return out.to(self.policy.output_dtype)  # after the hook: the cast's backward feeds the hooked tensor
        return out

    def _pre_backward(self, k: int) -> None:
        self._ensure(k)
        # backward runs the root's head first, then the blocks last to first (the root stays whole until its
        # embedding's gradient, the very last): the next unit to need its parameters is the one before
        after = len(self.units) - 1 if k == 0 else k - 1
        if self.prefetch and after >= 1:
            self._launch_gather(after, async_op=True)

    # -- gradients -----------------------------------------------------------------------------------------------

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        k = self.unit_of[id(p)]
        self._in_grad += p.grad.nbytes
        self._record("grad", k)
        self._pending[k] -= 1
        if self._pending[k] < 0:
            raise RuntimeError(f"a parameter of {self.units[k].name} received a second gradient before step(): "
                               "ZeRO-3 keeps only its shard of a reduced gradient; call step() (or, with your own optimizer, "
                               "zero_grad()) after every backward")
        if self._pending[k] == 0:
            self._reduce_scatter(k)

    def _reduce_scatter(self, k: int) -> None:
        u, n = self.units[k], self.world_size
        buf = torch.cat([p.grad.detach().reshape(-1) for p in u.params])  # [numel], in the compute dtype
        buf = buf.to(self.policy.reduce_dtype or buf.dtype)  # the mean is taken in the reduce dtype
        buf = torch.cat([buf, buf.new_zeros(u.shard_size * n - u.numel)]).mul_(1.0 / n)  # [S n]; the SUM is the mean
        out = torch.empty(u.shard_size, dtype=buf.dtype, device=buf.device)
        work = reduce_scatter_single(out, buf, group=self.group, async_op=True)
        self.comm["reduce_scatter"].append((buf.nbytes, n))
        for p in u.params:  # no whole gradient kept, and the unit's parameters are not needed any more this step
            self._in_grad -= p.grad.nbytes
            p.grad = None
        self._rs.append((k, work, buf, out))
        self._record("reduce_scatter", k)
        self._free(k)

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard.zero_()
            for p, sp in zip(u.params, u.sharded):
                p.grad, sp.grad = None, None
        for p in self.replicated:
            p.grad = None
        self._reset()

    @torch.no_grad()
    def step(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("Zero3Model was made with optimizer_class=None: call sync_grads(), then step your own "
                               "optimizer over Zero3Model.parameters(), then zero_grad()")
        self.sync_grads()
        self._record("step", 0)
        self.optimizer.step()
        for u in self.units:
            for sp in u.sharded:
                sp.grad = None
        self._reset()

    # -- outside the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_named_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, in its master dtype (fp32), by name: what a checkpoint or a comparison with one
        process reads (all-gathers not counted in ``comm``)."""
        by_param = {}
        for u in self.units:
            full = torch.empty(u.shard_size * self.world_size, dtype=u.shard.dtype, device=u.shard.device)  # [S n]
            all_gather_single(full, u.shard, group=self.group)
            offset = 0
            for p in u.params:
                by_param[id(p)] = full[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
        for p in self.replicated:
            by_param[id(p)] = p.detach().clone()
        return {self.names[id(p)]: by_param[id(p)] for p in self.model.parameters()}

    @torch.no_grad()
    def full_parameters(self) -> torch.Tensor:
        """Every parameter, whole, flattened in ``model.parameters()`` order (a gather not counted in ``comm``)."""
        return torch.cat([t.reshape(-1) for t in self.full_named_parameters().values()])

    def state_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        return sum(v.nbytes for st in self.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def shard_bytes(self) -> int:
        return sum(u.shard.nbytes for u in self.units) + sum(p.nbytes for p in self.replicated)

    def grad_shard_bytes(self) -> int:
        return sum(u.grad_shard.nbytes for u in self.units)

    def padded_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def comm_bytes(self) -> dict:
        """Ring wire bytes this rank sent in the calls recorded so far: (N-1)/N of each collective's whole tensor
        (an all-reduce: reduce-scatter then all-gather, twice that)."""
        factor = {"all_gather": lambda b, n: b * n, "reduce_scatter": lambda b, n: b, "all_reduce": lambda b, n: 2 * b}
        return {kind: sum((n - 1) / n * factor[kind](nbytes, n) for nbytes, n in calls)
                for kind, calls in self.comm.items()}
