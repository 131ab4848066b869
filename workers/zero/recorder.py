"""Every collective a rank runs, caught where torch dispatches it: the bytes each ZeRO stage really sends.

    with CollectiveRecorder() as rec:
        loss.backward(); opt.step()
    rec.summary()   # {"all_reduce": {"calls": 1, "message_bytes": ..., "wire_bytes": ...}, ...}

``torch.distributed``'s collectives (``all_reduce``, ``reduce_scatter_tensor``/``_single``, ``all_gather_into_tensor``
/``_single``, ``broadcast``) reach the dispatcher as ``c10d`` operators (``c10d.allreduce_``,
``c10d._reduce_scatter_base_``, ``c10d._allgather_base_``, ...), so a ``TorchDispatchMode`` sees each one, whoever
calls it: the hand-written stages, a backward hook (the CPU autograd engine runs hooks on the calling thread, so
the mode is active there), or PyTorch's own FSDP2. Nothing in the stages reports its own traffic here: what is
counted is what was dispatched. Bytes follow ``workers/parallel/comm_stats.py``: ``message_bytes`` is the logical
tensor (an all-gather's output, a reduce-scatter's input), ``wire_bytes`` what one rank sends in a ring.

A collective launched on a GPU with NCCL also dispatches through these operators; the mode sees the call, not
its completion.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from workers.parallel.comm_stats import wire_factor

# c10d operator -> (collective, which argument holds the logical message)
OPERATORS = {"allreduce_": ("all_reduce", "tensors"), "_reduce_scatter_base_": ("reduce_scatter", 1),
             "_allgather_base_": ("all_gather", 0), "broadcast_": ("broadcast", "tensors"),
             "reduce_scatter_": ("reduce_scatter", "lists"), "allgather_": ("all_gather", "lists")}


def _tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a)
    return out


class CollectiveRecorder(TorchDispatchMode):
    """Records (collective, message bytes) for every c10d collective dispatched while active. ``group_size``: the
    ranks of the group the stages communicate over (default: the world)."""

    def __init__(self, group_size: int | None = None):
        super().__init__()
        self.group_size = group_size or dist.get_world_size()
        self.calls: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::"):
            op = name.split("::", 1)[1]
            collective, where = OPERATORS.get(op, (op, "tensors"))
            if isinstance(where, int):
                message = args[where].nbytes
            elif where == "lists":  # [[outputs per rank]], [inputs]: the gathered or reduced whole
                message = sum(t.nbytes for t in _tensors(args[0]))
            else:
                message = sum(t.nbytes for t in _tensors(args[:1]))
            n = self.group_size
            self.calls.append({"collective": collective, "message_bytes": message,
                               "wire_bytes": wire_factor(collective, n) * message if collective != "broadcast"
                               else (message if n > 1 else 0.0)})
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        out: dict = {}
        for c in self.calls:
            row = out.setdefault(c["collective"], {"calls": 0, "message_bytes": 0, "wire_bytes": 0.0})
            row["calls"] += 1
            row["message_bytes"] += c["message_bytes"]
            row["wire_bytes"] += c["wire_bytes"]
        return out
