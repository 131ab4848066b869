"""Tensor-parallel groups inside one world: ``with TensorParallelGroups(tp_size) as tp: ... tp.group``.

Running TP 1, 2 and 4 as groups of consecutive ranks inside one world of 4 lets a notebook compare all
three on one set of warm ranks. Two rules of ``dist.new_group`` shape this class:

* it is collective over the *world*: every rank creates every group, in the same order, even the groups
  it is not a member of (those calls return a placeholder);
* warm ranks outlive a run, so groups must be destroyed on the way out or they pile up.
"""
from __future__ import annotations

import torch.distributed as dist

from workers.parallel.grid import RankGrid


class TensorParallelGroups:
    """Split the world into groups of ``tp_size`` consecutive ranks (0: one group, the whole world).

    The groups are the ``tp`` slices of ``RankGrid.for_world(world, tp=tp_size)`` (workers/parallel/grid.py).

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
        grid = RankGrid.for_world(world, tp=self.size)  # the other ranks are data-parallel replicas
        self.index, self.rank = grid.coords(rank)["dp"], grid.coords(rank)["tp"]
        self.ranks = grid.group("tp", rank)
        self.group, self._created = None, []
        if self.size != world or fresh or timeout_s is not None:
            self.group, self._created = grid.new_groups("tp", rank, timeout_s=timeout_s, fresh=True)

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
