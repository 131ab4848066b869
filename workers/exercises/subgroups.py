"""Sub-groups for the rank-side checks of exercises that take a ``group``: the answer must honour it.

Run only with the group equal to the world, an answer that calls its collective on the default (world)
group instead of the group it was given is indistinguishable from a right one. In a composed layout it is
wrong: tensor-parallel groups sit inside a larger world. So at world 4 a check also runs the learner's
function on two layouts of two groups of 2, made from the course's rank grid
(``RankGrid.for_world(4, tp=2)``, ``workers/layout/grid.py``):

    "tp" slices: [0, 1] [2, 3]    consecutive ranks (how tensor-parallel groups are laid out)
    "dp" slices: [0, 2] [1, 3]    non-contiguous ranks (a group's rank is not the global rank)

with *different data in each group* (a seed per group), so that summing or gathering over the world gives
a visibly different result. ``world_sum`` helps a check say exactly that: it predicts what a collective
over the whole world would have produced, from every group's (deterministic) data.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist

from workers.layout.grid import RankGrid

SIZE = 2  # ranks per sub-group
WORDS = {"tp": "consecutive ranks", "dp": "non-contiguous ranks"}
DEFAULT_GROUP = ("used the default (world) group instead of the group it was given: pass group=group to every "
                 "dist call (and to the mappings), and take sizes and ranks from dist.get_world_size(group) and "
                 "dist.get_rank(group); None means the whole world")


@dataclass(frozen=True)
class SubGroup:
    group: object  # the process group this rank is in
    members: tuple[int, ...]  # its global ranks, in group-rank order
    rank: int  # this rank's place in it: dist.get_rank(group)
    size: int
    index: int  # which of the groups (0 .. n_groups - 1): picks this group's data
    n_groups: int
    dim: str

    def describe(self) -> str:
        return (f"with group= a sub-group of {self.size} ranks {list(self.members)} ({WORDS[self.dim]}; "
                f"the world has {self.size * self.n_groups} ranks in {self.n_groups} groups, each with its own data)")


def layouts(world_size: int) -> tuple[str, ...]:
    """The sub-group layouts a check runs at this world size (none below 4 ranks): non-contiguous first, where
    a rank's place in its group differs from its rank in the world on every group."""
    return ("dp", "tp") if world_size >= 2 * SIZE else ()


@contextlib.contextmanager
def sub_group(ctx, dim: str):
    """``with sub_group(ctx, "dp") as sg:`` creates every group of that layout (collective over the world)
    and destroys them on the way out (warm ranks outlive a run)."""
    grid = RankGrid.for_world(ctx.world_size, tp=SIZE)
    group, created = grid.new_groups(dim, ctx.rank, fresh=True)
    members = grid.group(dim, ctx.rank)
    every = grid.groups(dim)
    try:
        yield SubGroup(group, tuple(members), members.index(ctx.rank), len(members), every.index(members),
                       len(every), dim)
    finally:
        for pg in created:
            dist.destroy_process_group(pg)


def in_sub_group(sg: SubGroup, stage):
    """Run ``stage()``; a Wrong it raises is prefixed with where (which sub-group) it was seen."""
    from workers.exercises.support import Wrong

    try:
        stage()
    except Wrong as exc:
        message = str(exc)
        if "default (world) group" not in message:
            message += (". The same answer was right with the whole world as its group, so look first for a "
                        "collective on the default (world) group instead of the group it was given, or a size or "
                        "rank taken from the world (dist.get_world_size() / dist.get_rank() without group=)")
        raise Wrong(f"{sg.describe()}: {message}") from None
