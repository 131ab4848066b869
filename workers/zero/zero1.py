"""ZeRO stage 1 by hand: each data-parallel rank keeps the optimizer state of 1/N of the parameters.

Rajbhandari et al. 2020, "ZeRO", section 5.1 (P_os, optimizer state partitioning) and section 7.2.1
(communication). A training step of N data-parallel ranks becomes:

1. backward, as usual: every rank has the full gradient of its own micro-batch;
2. **reduce-scatter** the gradients: rank r receives the average over ranks of its shard only;
3. the wrapped optimizer steps **only rank r's shard** (so only that shard has Adam moments, fp32
   master weights, ...);
4. **all-gather** the updated shards, so every rank holds the full, updated parameters again.

Steps 2 + 4 move the same bytes as DDP's all-reduce (an all-reduce *is* a reduce-scatter followed by an
all-gather), which is why the paper says P_os costs no extra communication, while the optimizer state
per GPU drops from K*Psi to K*Psi/N.

Partitioning, the one design choice. ``partition="flat"`` (default, DeepSpeed's choice): all parameters
of a group are laid end to end in one buffer, padded to a multiple of N, and rank r owns elements
[r*S, (r+1)*S). Every rank holds exactly S = ceil(Psi/N) elements of state, so the measured bytes equal
the ledger's K*Psi/N (when N divides Psi), and shards are perfectly balanced. The price: a shard may cut
a tensor in two, so the wrapped optimizer sees 1-D slices. That is exact for *elementwise* optimizers
(SGD, Adam, AdamW, Adagrad, RMSprop: each element's update depends only on that element) and wrong for
optimizers that look at a whole tensor (LAMB's per-tensor trust ratio, Adafactor's row/column factors,
Muon's orthogonalised matrices). ``partition="params"`` (torch's ZeroRedundancyOptimizer's choice)
gives each rank whole tensors, assigned largest first to the least-loaded rank; the wrapped optimizer
sees each tensor with its own shape, so any optimizer is exact, but shards are only as balanced as the
tensor sizes allow (a 50k x 4k embedding is one indivisible piece).

Either way each rank's tensors sit in one contiguous, equally sized region of a flat buffer, so the
gradient sync is one reduce-scatter and the parameter sync one all-gather per parameter group. The
model's parameters become views of that buffer (``p.data`` re-pointed), and their ``.grad`` views of a
flat gradient buffer, so backward accumulates straight into it (as DDP's ``gradient_as_bucket_view``).
A parameter that appears twice (tied embedding and LM head) is one tensor: it is placed and stepped once.

``master_weights=True`` is mixed-precision training as the paper counts it: the model is bf16/fp16
(2 bytes of weights, 2 of gradients) and each rank keeps an fp32 copy of its shard only, which the
wrapped optimizer steps; with Adam that is K = 4 + 4 + 4 = 12 bytes per parameter, sharded.
``shard=False`` turns the same machinery into plain data parallelism (every rank steps everything after
an all-reduce): the DDP baseline, measured with the same code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.runtime import all_gather_single, host_staged, reduce_scatter_single

PARTITIONS = ("flat", "params")
GRAD_SYNCS = ("reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Piece:
    """A stretch [start, stop) of a group's flat buffer that this rank steps, seen with ``shape``."""

    start: int
    stop: int
    shape: tuple


def flat_partition(numels: list[int], n: int) -> tuple[list[int], int, list[list[tuple[int, int]]]]:
    """Parameters end to end; rank r owns [r*S, (r+1)*S) of them. Returns (offsets, S, ranges per rank)."""
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    total = sum(numels)
    shard = max(1, math.ceil(total / n))
    ranges = [[(r * shard, min((r + 1) * shard, total))] if r * shard < total else [] for r in range(n)]
    return offsets, shard, ranges


def params_partition(numels: list[int], n: int) -> tuple[list[int], int, list[list[tuple[int, int]]]]:
    """Whole tensors, largest first to the least-loaded rank (LPT). Rank r's tensors are laid out in its
    region [r*S, (r+1)*S), S = the largest load. Returns (offsets, S, ranges per rank)."""
    owner, load = [0] * len(numels), [0] * n
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + numels[i]
    shard = max(1, max(load))
    offsets, fill = [0] * len(numels), [r * shard for r in range(n)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for i, numel in enumerate(numels):  # in model order within each rank's region
        r = owner[i]
        offsets[i] = fill[r]
        ranges[r].append((fill[r], fill[r] + numel))
        fill[r] += numel
    return offsets, shard, ranges


def group_problem(params: list[torch.nn.Parameter], index: int) -> str | None:
    """One sentence if parameter group ``index`` cannot share one flat buffer (one dtype, one device), else None."""
    for what in ("dtype", "device"):
        kinds = sorted({str(getattr(p, what)) for p in params})
        if len(kinds) > 1:
            return (f"parameter group {index} mixes {what}s {', '.join(kinds)}; put the parameters of each "
                    f"{what} in a parameter group of their own.")
    return None


def _options(spec: dict) -> dict:
    """A parameter group's own options (lr, weight_decay, ...), without its parameters."""
    return {k: v for k, v in spec.items() if k != "params"}


class _FlatGroup:
    """One parameter group laid out in two flat buffers (parameters, gradients) of n_shards * S elements."""

    def __init__(self, params: list[torch.nn.Parameter], partition: str, n_shards: int, rank: int):
        # ``Zero1Optimizer`` has checked that ``params`` share one dtype and one device (``group_problem``).
        self.params = params
        numels = [p.numel() for p in params]
        split = flat_partition if partition == "flat" else params_partition
        self.offsets, self.shard_size, ranges = split(numels, n_shards)
        self.owned_ranges = ranges  # per rank, for reports
        size = self.shard_size * n_shards
        p0 = params[0]
        self.flat_params = torch.zeros(size, dtype=p0.dtype, device=p0.device)  # [N*S]
        self.flat_grads = torch.zeros(size, dtype=p0.dtype, device=p0.device)  # [N*S]
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                self.flat_params[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat_params[off:off + p.numel()].view_as(p)  # the model now reads the flat buffer
                p.grad = self.flat_grads[off:off + p.numel()].view_as(p)  # backward accumulates into it
        if partition == "flat":
            self.pieces = [Piece(a, b, (b - a,)) for a, b in ranges[rank]]
        else:
            by_start = {off: tuple(p.shape) for p, off in zip(params, self.offsets)}
            self.pieces = [Piece(a, b, by_start[a]) for a, b in ranges[rank]]

    def shard(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        return buffer[rank * self.shard_size:(rank + 1) * self.shard_size]

    def collect_grads(self) -> None:
        """Make every ``.grad`` a view of the flat buffer again (after ``zero_grad(set_to_none=True)`` or a
        fresh backward allocated new ones). A parameter without a gradient counts as a zero gradient."""
        for p, off in zip(self.params, self.offsets):
            view = self.flat_grads[off:off + p.numel()].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view


class Zero1Optimizer:
    """``Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)``: shard any optimizer's state.

    ``params`` is an iterable of tensors or of parameter groups (dicts with "params" and per-group
    options), as for any torch optimizer. ``step()`` averages the gradients over the data-parallel ranks,
    steps this rank's shard, and re-synchronises the parameters; ``zero_grad()`` clears the flat gradient
    buffer. Replicas are made equal at construction (broadcast from the group's first rank), as DDP does.
    ``average=False`` sums the ranks' gradients instead of averaging them: for a loss each rank has already
    divided by the whole global batch's token count (chapter 15), where the sum is the gradient.
    """

    def __init__(self, params, optimizer_class: type, *, partition: str = "flat", grad_sync: str = "reduce_scatter",
                 master_weights: bool = False, shard: bool = True, group=None, average: bool = True, **defaults):
        if partition not in PARTITIONS:
            raise ValueError(f"partition={partition!r} is not known; use 'flat' (balanced, elementwise optimizers) "
                             "or 'params' (whole tensors, any optimizer).")
        if grad_sync not in GRAD_SYNCS:
            raise ValueError(f"grad_sync={grad_sync!r} is not known; use 'reduce_scatter' or 'all_reduce'.")
        self.group, self.average = group, average
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sharded = shard
        self.n_shards = self.world_size if shard else 1
        self.shard_rank = self.rank if shard else 0
        self.partition, self.grad_sync, self.master_weights = partition, grad_sync, master_weights
        self.groups: list[_FlatGroup] = []
        self.inner_params: list[list[torch.nn.Parameter]] = []
        # Every check comes before the first flatten: the broadcast below overwrites the other ranks' weights,
        # so a construction refused halfway would hand the learner a model already changed on ranks 1..N-1.
        specs = self._validated_groups(params)
        self._check_optimizer_options(optimizer_class, specs, master_weights, defaults)
        inner_groups = []
        for spec, unique in specs:
            flat = _FlatGroup(unique, partition, self.n_shards, self.shard_rank)
            src = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast(flat.flat_params, src=src, group=group)  # replicas start equal, as in DDP
            inner = []
            for piece in flat.pieces:
                view = flat.flat_params[piece.start:piece.stop].view(piece.shape)
                if master_weights:  # an fp32 copy of this rank's shard: the optimizer steps it
                    inner.append(torch.nn.Parameter(view.detach().float().clone()))
                else:  # the optimizer steps the model's own memory in place
                    inner.append(torch.nn.Parameter(view))
            self.groups.append(flat)
            self.inner_params.append(inner)
            inner_groups.append({**_options(spec), "params": inner})
        kept = [g for g in inner_groups if g["params"]]
        self.optimizer = optimizer_class(kept, **defaults) if kept else None  # a rank may own nothing (tiny models)

    @classmethod
    def _validated_groups(cls, params) -> list[tuple[dict, list[torch.nn.Parameter]]]:
        """``(group spec, its parameters to step)`` for every group that has one, after every check.

        A tensor listed twice in one group is a tied weight (embedding and LM head): kept once. A tensor in
        two groups would be stepped twice with two sets of options: refused.
        """
        specs, group_of = [], {}
        for index, spec in enumerate(cls._param_groups(params)):
            unique = []
            for p in spec["params"]:
                if not p.requires_grad:
                    continue
                if id(p) in group_of:
                    if group_of[id(p)] == index:
                        continue  # listed twice in this group (a tied weight): one tensor, stepped once
                    raise ValueError(f"a parameter of group {index} is already in group {group_of[id(p)]}; "
                                     "list each tensor in one parameter group only.")
                group_of[id(p)] = index
                unique.append(p)
            if unique:
                problem = group_problem(unique, index)
                if problem:
                    raise ValueError(problem)
                specs.append((spec, unique))
        if not specs:
            raise ValueError("Zero1Optimizer got no parameter that requires a gradient; pass model.parameters().")
        return specs

    @staticmethod
    def _check_optimizer_options(optimizer_class: type, specs, master_weights: bool, defaults: dict) -> None:
        """Let the wrapped optimizer refuse its options (a negative lr, betas out of range) now, on stand-ins.

        Built for real it would refuse them only after the broadcast, and not at all on a rank that owns no
        element (tiny models): that rank would go on alone and wait forever in the first step's collective.
        """
        stand_ins = []
        for spec, unique in specs:
            dtype = torch.float32 if master_weights else unique[0].dtype  # what the real shard will hold
            stand_in = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=unique[0].device))
            stand_ins.append({**_options(spec), "params": [stand_in]})
        optimizer_class(stand_ins, **defaults)

    @staticmethod
    def _param_groups(params) -> list[dict]:
        params = list(params)
        if params and isinstance(params[0], dict):
            return [dict(g, params=list(g["params"])) for g in params]
        return [{"params": params}]

    # -- the step ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n, r = self.world_size, self.shard_rank
        self.last_shard_grads = []  # this rank's synchronised shard of each group's gradient (for reports)
        for flat, inner in zip(self.groups, self.inner_params):
            flat.collect_grads()
            if self.sharded and self.grad_sync == "reduce_scatter":  # rank r receives the sum of its shard only
                shard_grad = torch.empty_like(flat.shard(flat.flat_grads, r))  # [S]
                host_staged("reduce_scatter", reduce_scatter_single, shard_grad, flat.flat_grads, self.group)
                if self.average:
                    shard_grad.div_(n)  # the SUM over ranks -> the mean: the gradient of the global batch's mean loss
            else:  # DDP, or ZeRO-1 over an all-reduce (3 Psi on the wire instead of 2 Psi): every .grad averaged
                dist.all_reduce(flat.flat_grads, group=self.group)
                if self.average:
                    flat.flat_grads.div_(n)
                shard_grad = flat.shard(flat.flat_grads, r)
            self.last_shard_grads.append(shard_grad)
            base = r * flat.shard_size
            for piece, p in zip(flat.pieces, inner):
                g = shard_grad[piece.start - base:piece.stop - base].view(piece.shape)
                p.grad = g.float() if self.master_weights else g
        if self.optimizer is not None:
            self.optimizer.step()
        for flat, inner in zip(self.groups, self.inner_params):
            for piece, p in zip(flat.pieces, inner):
                p.grad = None  # the shard's averaged gradient is not needed any more
                if self.master_weights:  # the stepped fp32 shard, rounded back into the model's dtype
                    flat.flat_params[piece.start:piece.stop].copy_(p.detach().reshape(-1))
            if self.sharded:  # every rank gets every updated shard (in place: the input is our own slice)
                host_staged("all_gather", all_gather_single, flat.flat_params, flat.shard(flat.flat_params, r),
                            self.group)
        return loss

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer (the ``.grad`` views stay, so the next backward accumulates into it).
        ``set_to_none`` is accepted for compatibility and ignored: the buffer is reused, not freed."""
        for flat in self.groups:
            flat.flat_grads.zero_()
            flat.collect_grads()

    # -- what this rank holds -------------------------------------------------------------------------------

    def owned_numel(self) -> int:
        """Parameter elements this rank steps (and keeps optimizer state for)."""
        return sum(p.numel() for inner in self.inner_params for p in inner)

    def state_bytes(self) -> dict:
        """Bytes of optimizer state on this rank, measured: the ``nbytes`` of every tensor the wrapped optimizer
        holds in ``optimizer.state``, plus the fp32 master shard when ``master_weights``.

        ``elementwise`` counts state tensors with one entry per parameter element (Adam's exp_avg and
        exp_avg_sq, SGD's momentum_buffer): the K of the ZeRO ledger. ``scalars`` counts the rest (Adam's
        ``step`` counter, one 4-byte tensor per tensor stepped), which the ledger leaves out.
        """
        elementwise = scalars = 0
        if self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        if value.dim() > 0 and value.numel() == p.numel():
                            elementwise += value.nbytes
                        else:
                            scalars += value.nbytes
        master = sum(p.nbytes for inner in self.inner_params for p in inner) if self.master_weights else 0
        return {"elementwise": elementwise, "master": master, "scalars": scalars,
                "total": elementwise + master + scalars}

    def buffer_bytes(self) -> dict:
        """Bytes of the flat parameter and gradient buffers on this rank (padding included)."""
        return {"params": sum(f.flat_params.nbytes for f in self.groups),
                "grads": sum(f.flat_grads.nbytes for f in self.groups)}

    def partition_table(self) -> list[list[int]]:
        """Elements owned by each rank, per group: [[group0 rank0, rank1, ...], ...]."""
        return [[sum(b - a for a, b in ranges) for ranges in f.owned_ranges] for f in self.groups]
