"""Tensor-parallel groups inside one world: ``with TensorParallelGroups(tp_size) as tp: ... tp.group``.

Running TP 1, 2 and 4 as groups of consecutive ranks inside one world of 4 lets a notebook compare all
three on one set of warm ranks. Two rules of ``dist.new_group`` shape this class:

* it is collective over the *world*: every rank creates every group, in the same order, even the groups
  it is not a member of (those calls return a placeholder);
* warm ranks outlive a run, so groups must be destroyed on the way out or they pile up.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from workers.runtime import collective_timeout


class TensorParallelGroups:
    """Split the world into groups of ``tp_size`` consecutive ranks (0: one group, the whole world).

    ``tp.group`` is this rank's group (None means the default group: the whole world, unless ``fresh``),
    ``tp.ranks`` its members, ``tp.index`` which group it is and ``tp.rank`` this rank's place in it.
    New groups wait as long as the world's collectives (``runtime.collective_timeout``) unless ``timeout_s``
    says otherwise. ``fresh=True`` or a ``timeout_s`` creates new groups even when one group is the whole
    world: a group with its own (short) timeout, never the default group, which a check may want to avoid.
    """

    def __init__(self, tp_size: int = 0, *, timeout_s: float | None = None, fresh: bool = False):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.size = tp_size or world
        if self.size < 1 or world % self.size:
            raise ValueError(f"tp_size={tp_size} does not divide the world size {world}: choose a divisor of {world}")
        self.index, self.rank = divmod(rank, self.size)
        self.ranks = list(range(self.index * self.size, (self.index + 1) * self.size))
        self.group = None
        self._created = []
        if self.size != world or fresh or timeout_s is not None:
            timeout = collective_timeout() if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            for start in range(0, world, self.size):
                pg = dist.new_group(list(range(start, start + self.size)), timeout=timeout)
                if start == self.index * self.size:
                    self.group = pg
                    self._created.append(pg)

    def __enter__(self) -> "TensorParallelGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def destroy(self) -> None:
        for pg in self._created:
            dist.destroy_process_group(pg)
        self._created = []

    def describe(self) -> dict:
        return {"tp_size": self.size, "tp_group": self.index, "tp_group_ranks": self.ranks}
