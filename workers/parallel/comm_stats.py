"""Which collectives a tensor-parallel model runs, in which layer, in which pass, and how many bytes.

    with CommLedger() as ledger:
        y = block(x)
        y.backward(g)
    ledger.count("all_reduce", "forward")      # 2 for a Megatron block
    ledger.summary()                           # one row per (scope, collective, pass)

The collectives themselves are seen by ``mappings.record_communication`` (chapter 03): every mapping
notes its collective, its pass and the bytes each rank contributes. What this module adds is *where*:
the layers call their mappings through ``region(scope, mapping, x)``, which drops a marker into the
ledger when the mapping runs forward, and, through two identity autograd functions placed on either side
of the mapping, when its backward starts and ends. Every collective between an opening and a closing
marker belongs to that scope. Outside an active ledger ``region`` is just the mapping call.

Bytes. ``bytes`` is what one rank hands to the collective; ``message_bytes`` is the size of the logical
tensor being reduced or gathered (b*s*h*element size for the activations of a transformer layer);
``wire_bytes`` is what one rank sends with the ring algorithms nccl-tests assumes (n ranks):

    all_reduce      2(n-1)/n * message        reduce_scatter  (n-1)/n * message
    all_gather      (n-1)/n * message         all_to_all      (n-1)/n * message

so sequence parallelism's reduce-scatter + all-gather moves exactly the bytes of the all-reduce it replaces.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from workers.parallel import mappings

_active: list["CommLedger"] = []  # ledgers open on this rank (empty outside ``with CommLedger()``)

ACTIVATION, PARAMETER = "activation", "parameter"


def wire_factor(collective: str, n: int) -> float:
    """Bytes one rank sends per byte of message, for the ring algorithms (nccl-tests' busbw factors)."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def message_bytes(collective: str, contributed: int, n: int) -> int:
    """The logical tensor's size: an all-gather's contribution is one rank's 1/n of it."""
    return contributed * n if collective == "all_gather" else contributed


class CommLedger:
    """Collectives of the tensor-parallel regions, attributed to the scope (layer) that ran them.

    ``timed=True`` also records when each region's communication started and ended (synchronising the
    GPU at each marker, which costs time: use it for profiles, not for speed runs).
    """

    def __init__(self, timed: bool = False, device: torch.device | None = None):
        self.timed = timed
        self.device = device
        self.entries: list[dict] = []
        self.marks: list[tuple[int, str | None, str, int, str, float]] = []  # (index, scope, kind, n, pass, t)
        self._recording = None

    def __enter__(self) -> "CommLedger":
        self._recording = mappings.record_communication()
        self.entries = self._recording.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)
        self._recording.__exit__(*exc)

    def mark(self, scope: str | None, kind: str, n: int, pass_: str) -> None:
        t = 0.0
        if self.timed:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t = time.perf_counter()
        self.marks.append((len(self.entries), scope, kind, n, pass_, t))

    # -- reading the ledger -------------------------------------------------------------------------
    def records(self) -> list[dict]:
        """Every collective with its scope, kind ("activation" or "parameter"), group size and wire bytes."""
        out = []
        for i, entry in enumerate(self.entries):
            scope, kind, n = "(outside any layer)", ACTIVATION, None
            for index, s, k, size, _, _ in self.marks:
                if index > i:
                    break
                if s is None:
                    scope, kind, n = "(outside any layer)", ACTIVATION, None
                else:
                    scope, kind, n = s, k, size
            n = entry.get("group_size") or n or dist.get_world_size()  # the mapping saw the group it ran in
            msg = message_bytes(entry["collective"], entry["bytes"], n)
            out.append({**entry, "scope": scope, "kind": kind, "group_size": n, "message_bytes": msg,
                        "wire_bytes": wire_factor(entry["collective"], n) * msg})
        return out

    def count(self, collective: str | None = None, pass_: str | None = None, scope: str | None = None,
              kind: str | None = ACTIVATION) -> int:
        return len(self._select(collective, pass_, scope, kind))

    def wire_bytes(self, collective: str | None = None, pass_: str | None = None, scope: str | None = None,
                   kind: str | None = ACTIVATION) -> float:
        return sum(r["wire_bytes"] for r in self._select(collective, pass_, scope, kind))

    def _select(self, collective, pass_, scope, kind) -> list[dict]:
        return [r for r in self.records()
                if (collective is None or r["collective"] == collective) and (pass_ is None or r["pass"] == pass_)
                and (scope is None or r["scope"] == scope or r["scope"].startswith(scope + "."))
                and (kind is None or r["kind"] == kind)]

    def summary(self) -> list[dict]:
        """One row per (scope, kind, collective, pass): calls, message bytes and wire bytes per rank."""
        rows: dict = defaultdict(lambda: {"calls": 0, "message_bytes": 0, "wire_bytes": 0.0})
        for r in self.records():
            row = rows[(r["scope"], r["kind"], r["collective"], r["pass"])]
            row["calls"] += 1
            row["message_bytes"] += r["message_bytes"]
            row["wire_bytes"] += r["wire_bytes"]
        return [{"scope": s, "kind": k, "collective": c, "pass": p, **v} for (s, k, c, p), v in rows.items()]

    def intervals(self) -> list[tuple[str, str, float]]:
        """(scope, pass, seconds) of every region's communication, in order (``timed=True`` only).

        Only regions that ran a collective count: in a group of one the mappings return their input, and the
        microseconds between the markers are bookkeeping, not communication.
        """
        out, open_at = [], {}
        for index, scope, _, _, pass_, t in self.marks:
            if scope is not None:
                open_at[pass_] = (scope, t, index)
            elif pass_ in open_at:
                name, start, first = open_at.pop(pass_)
                if index > first:  # entries were recorded between the two markers
                    out.append((name, pass_, t - start))
        return out

    def seconds(self, scope: str | None = None) -> dict[str, float]:
        """Time spent inside the regions' communication per pass, optionally under one scope (``timed=True``)."""
        total = {"forward": 0.0, "backward": 0.0}
        for name, pass_, dt in self.intervals():
            if scope is None or name == scope or name.startswith(scope + "."):
                total[pass_] += dt
        return total


class _BackwardMark(torch.autograd.Function):
    """Identity both ways; its backward drops a marker into the open ledgers (scope None closes one)."""

    @staticmethod
    def forward(ctx, input_, scope, kind, n):
        ctx.scope, ctx.kind, ctx.n = scope, kind, n
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output):
        for ledger in _active:
            ledger.mark(ctx.scope, ctx.kind, ctx.n, "backward")
        return grad_output, None, None, None


def region(scope: str, mapping, input_: torch.Tensor, *args, group=None, kind: str = ACTIVATION, **kwargs):
    """``mapping(input_, *args, group=group, **kwargs)``, with its collectives attributed to ``scope``.

    Autograd runs a backward node as soon as its gradient is ready, highest sequence number first; the
    three nodes here (closing mark, mapping, opening mark) are created one after the other, so in the
    backward pass they run back to back: open, the mapping's collective, close.
    """
    if not _active:
        return mapping(input_, *args, group=group, **kwargs)
    n = dist.get_world_size(group)
    if input_.requires_grad:
        input_ = _BackwardMark.apply(input_, None, kind, n)  # closes the scope, after the mapping's backward
    for ledger in _active:
        ledger.mark(scope, kind, n, "forward")
    output = mapping(input_, *args, group=group, **kwargs)
    for ledger in _active:
        ledger.mark(None, kind, n, "forward")
    if output.requires_grad:
        output = _BackwardMark.apply(output, scope, kind, n)  # opens the scope, before the mapping's backward
    return output


def name_scopes(module: torch.nn.Module, prefix: str = "") -> torch.nn.Module:
    """Give every parallel layer its path in ``module`` as its communication scope ("mlp.fc2", ...)."""
    for name, child in module.named_modules(prefix=prefix):
        if hasattr(child, "comm_scope"):
            child.comm_scope = name or type(child).__name__
    return module
