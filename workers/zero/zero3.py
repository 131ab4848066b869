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
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from workers.runtime import all_gather_single, comm_device, reduce_scatter_single


class Unit:
    """The parameters of one module, sharded: ``shard`` (this rank's 1/N, stepped by the optimizer) and ``full``
    (the padded flat buffer the model's Parameters are views of; its storage allocated only while gathered)."""

    def __init__(self, name: str, params: list[torch.nn.Parameter], world_size: int, rank: int):
        self.name, self.params = name, params
        self.numel = sum(p.numel() for p in params)
        self.shard_size = math.ceil(self.numel / world_size)
        n, S = world_size, self.shard_size
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.full = torch.cat([flat, flat.new_zeros(S * n - self.numel)])  # [S n]
            self.shard = torch.nn.Parameter(self.full[rank * S:(rank + 1) * S].clone())  # [S]
            offset = 0
            for p in params:  # the model's Parameters now live in the unit's buffer
                p.data = self.full[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.nbytes = self.full.nbytes  # whole, padded
        self.grad_shard = torch.zeros_like(self.shard.detach())
        self.gathered = True
        self.work = None  # an all-gather in flight (prefetch)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.nbytes)
        self.gathered = True


class Zero3Model:
    """``Zero3Model(model, units, torch.optim.AdamW, lr=1e-3, prefetch=True, reshard_after_forward=True)``.

    ``units`` are submodules of ``model`` (its blocks) called once each per forward, in order; every parameter not
    in one of them is the root unit's. Call ``zero_grad()``, ``loss = f(model(x))``, ``loss.backward()``, ``step()``.
    ``full_parameters()`` all-gathers every unit for a comparison (outside the step's bookkeeping).
    """

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], optimizer_class: type, *,
                 prefetch: bool = False, reshard_after_forward: bool = True, group=None, **defaults):
        self.model, self.group = model, group
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = list(model.parameters())  # a tied weight once
        if not params or len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("Zero3Model needs parameters in one dtype on one device; cast the model first.")
        if any(p.device.type != comm_device(dist.get_backend(group), p.device, "all_gather").type for p in params):
            raise ValueError("Zero3Model needs a backend that all-gathers on the parameters' device: NCCL for CUDA "
                             "tensors, gloo for CPU ones.")
        optimizer_class([torch.nn.Parameter(torch.zeros(1))], **defaults)  # refuse bad options before any collective
        src = dist.get_global_rank(group, 0) if group is not None else 0
        with torch.no_grad():
            for p in params:  # replicas start equal, then each keeps its shard
                dist.broadcast(p.data, src=src, group=group)
        in_units = {id(p) for m in units for p in m.parameters()}
        root = [p for p in params if id(p) not in in_units]
        n, r = self.world_size, self.rank
        self.units = [Unit("root", root, n, r)] + [Unit(f"unit{k}", list(m.parameters()), n, r)
                                                   for k, m in enumerate(units)]
        self.modules = [model] + list(units)
        self.unit_of = {id(p): k for k, u in enumerate(self.units) for p in u.params}
        self.optimizer = optimizer_class([u.shard for u in self.units], **defaults)
        self.comm = {"all_gather": [], "reduce_scatter": []}  # (bytes handed in, group size) per call
        self.timeline: list[dict] = []
        self._hooks = []
        for k, m in enumerate(self.modules):
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args, k=k: self._pre_forward(k)))
            self._hooks.append(m.register_forward_hook(lambda mod, args, out, k=k: self._post_forward(k, out)))
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda p: self._grad_ready(p)))
        for u in self.units:
            u.free()
        self._reset()

    # -- bookkeeping ---------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        self._pending = [len(u.params) for u in self.units]
        self._rs: list = []  # (unit, work, flattened gradient, output) in flight
        self._in_grad = 0
        self._t0 = None

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
        u.work = all_gather_single(u.full, u.shard.detach(), group=self.group, async_op=async_op)
        self.comm["all_gather"].append((u.shard.nbytes, self.world_size))
        self._record("gather" if not async_op else "prefetch", k)
        if not async_op:
            u.work = None

    def _ensure(self, k: int) -> None:
        """Unit ``k`` whole now: wait for its prefetched all-gather, or gather it."""
        u = self.units[k]
        if u.work is not None:
            u.work.wait()
            u.work = None
            self._record("wait_gather", k)
        elif not u.gathered:
            self._launch_gather(k, async_op=False)

    def _free(self, k: int) -> None:
        self.units[k].free()
        self._record("free", k)

    def _pre_forward(self, k: int) -> None:
        self._ensure(k)
        if self.prefetch and k + 1 < len(self.units):
            self._launch_gather(k + 1, async_op=True)

    def _post_forward(self, k: int, out):
        if out.requires_grad:  # the unit's backward begins when the gradient of its output arrives
            out.register_hook(lambda grad, k=k: self._pre_backward(k))
        if self.reshard_after_forward:
            self._free(k)
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
                               "ZeRO-3 keeps only its shard of a reduced gradient; call step() after every backward")
        if self._pending[k] == 0:
            self._reduce_scatter(k)

    def _reduce_scatter(self, k: int) -> None:
        u, n = self.units[k], self.world_size
        buf = torch.cat([p.grad.detach().reshape(-1) for p in u.params])
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
            for p in u.params:
                p.grad = None
        self._reset()

    @torch.no_grad()
    def step(self) -> None:
        waiting = [u.name for u, left in zip(self.units, self._pending) if left]
        if waiting:
            raise RuntimeError(f"{', '.join(waiting)} received no gradient for some parameter in this backward: every "
                               "parameter must take part in the loss")
        for k, work, _, out in self._rs:
            work.wait()
            self.units[k].grad_shard.copy_(out)
        self._rs = []
        self._record("step", 0)
        for u in self.units:
            u.shard.grad = u.grad_shard
        self.optimizer.step()
        for u in self.units:
            u.shard.grad = None
        self._reset()

    # -- outside the step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_parameters(self) -> torch.Tensor:
        """Every parameter, whole, flattened in ``model.parameters()`` order (a gather not counted in ``comm``)."""
        out = []
        for u in self.units:
            full = torch.empty(u.shard_size * self.world_size, dtype=u.shard.dtype, device=u.shard.device)
            all_gather_single(full, u.shard.detach(), group=self.group)
            out.append(full[:u.numel])
        by_param = {}
        for u, full in zip(self.units, out):
            offset = 0
            for p in u.params:
                by_param[id(p)] = full[offset:offset + p.numel()]
                offset += p.numel()
        return torch.cat([by_param[id(p)] for p in self.model.parameters()])

    def state_bytes(self) -> int:
        return sum(v.nbytes for st in self.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def shard_bytes(self) -> int:
        return sum(u.shard.nbytes for u in self.units)

    def grad_shard_bytes(self) -> int:
        return sum(u.grad_shard.nbytes for u in self.units)

    def padded_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def comm_bytes(self) -> dict:
        """Ring wire bytes this rank sent in the calls recorded so far: (N-1)/N of each collective's whole tensor."""
        return {kind: sum((n - 1) / n * (nbytes if kind == "reduce_scatter" else nbytes * n) for nbytes, n in calls)
                for kind, calls in self.comm.items()}
