"""The rank grid: every process group of every chapter is a slice of one ``arange(world).view(dp, pp, cp, tp)``.

Picotron's ``ProcessGroupManager`` idea, kept as plain data so it can be read and tested without a process
group: the world's ranks laid out in a 4-D grid, outermost dimension first::

    DIMS = ("dp", "pp", "cp", "tp")        tp innermost: a tensor-parallel group is consecutive ranks

    world 8 as dp=2, pp=2, cp=1, tp=2      rank = ((dp * PP + pp) * CP + cp) * TP + tp
        dp 0: pp 0 -> ranks 0 1            tp groups (vary tp, fix the rest):  [0 1] [2 3] [4 5] [6 7]
              pp 1 -> ranks 2 3            pp groups (vary pp):                [0 2] [1 3] [4 6] [5 7]
        dp 1: pp 0 -> ranks 4 5            dp groups (vary dp):                [0 4] [1 5] [2 6] [3 7]
              pp 1 -> ranks 6 7

A group "along" a dimension is the set of ranks whose other coordinates are equal. The innermost dimension
gets the neighbouring ranks, which on a real machine share the fastest links: that is why tensor parallelism,
which talks in every layer, is innermost. Megatron-LM (``--order tp-cp-ep-dp-pp``) and torchtitan
(``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``) also put tp innermost but put pp *outermost*, because
across nodes a pipeline's point-to-point sends are the lightest traffic. This course keeps Picotron's order,
dp outermost, so one pipeline (chapter 13) or one ring (chapter 14) is a run of consecutive ranks, as the
chapters draw them; on CPU ranks the order costs nothing. Everything that builds groups reads the order from
``DIMS``, so changing it is one line, and ``tests/test_grid.py`` checks the groups against torch's own
``DeviceMesh`` for the same shape.

Expert parallelism (chapter 16) is not a dimension of its own: as in torchtitan, the ``ep`` ranks that exchange
tokens are carved out of the data and context parallel ranks. ``group("ep", r)`` is r's run of ``ep`` consecutive
members of its dp x cp group, ``group("edp", r)`` the members at the same place in the other runs (the ranks that
hold the same experts: expert data parallelism). With only dp, world 4 at ep 2: ep groups [0 1] [2 3], edp groups
[0 2] [1 3].

``dist.new_group`` is collective over the whole world: every rank must create every group along a dimension,
in the same order, even those it is not in. ``RankGrid.new_groups`` does exactly that and returns the one this
rank belongs to, plus the list of groups to destroy when the run ends (warm ranks outlive a run); ``mesh.py:
Mesh`` keeps them for a run.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

DIMS = ("dp", "pp", "cp", "tp")  # outermost first
EXPERT_GROUPS = ("ep", "edp")  # carved out of dp x cp, not dimensions of their own


@dataclass(frozen=True)
class RankGrid:
    """A world of ``dp * pp * cp * tp`` ranks. Build it with ``RankGrid.for_world(world, tp=2, ...)``."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @staticmethod
    def problem(world: int, **sizes: int) -> str | None:
        """Why these degrees do not lay out ``world`` ranks (one sentence naming every degree), or None.

        ``sizes`` may leave out any dimension (it is then 1), except ``dp`` which, when left out, takes
        whatever the others leave of the world.
        """
        ep = sizes.pop("ep", 1)
        unknown = sorted(set(sizes) - set(DIMS))
        if unknown:
            return f"unknown parallel dimension(s) {', '.join(unknown)}: the grid has {', '.join(DIMS)} (and ep)"
        bad = [f"{d}={s}" for d, s in sizes.items() if not isinstance(s, int) or s < 1]
        if bad:
            return f"{', '.join(bad)} must be whole numbers >= 1"
        rest = math.prod(sizes.get(d, 1) for d in DIMS if d != "dp")
        degrees = " x ".join(f"{d}={sizes[d]}" for d in DIMS if d in sizes)
        if "dp" in sizes:
            if rest * sizes["dp"] != world:
                return f"{degrees} makes {rest * sizes['dp']} ranks, not the world's {world}: choose degrees whose product is {world}"
        elif world % rest:
            return f"{degrees} ({rest} ranks per data-parallel replica) does not divide the world size {world}"
        dp_cp = sizes.get("dp", world // rest) * sizes.get("cp", 1)
        if not isinstance(ep, int) or ep < 1 or dp_cp % ep:
            return f"ep={ep} does not divide dp x cp = {dp_cp}: expert parallelism is carved out of them"
        return None

    @classmethod
    def for_world(cls, world: int, **sizes: int) -> "RankGrid":
        """The grid of ``world`` ranks with these degrees; ``dp`` defaults to what the others leave."""
        problem = cls.problem(world, **sizes)
        if problem:
            raise ValueError(problem)
        rest = math.prod(sizes.get(d, 1) for d in DIMS if d != "dp")
        return cls(**{"dp": world // rest, **sizes})

    @property
    def edp(self) -> int:
        """How many ranks hold the same experts: dp x cp / ep."""
        return self.dp * self.cp // self.ep

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's place along each dimension: ``{"dp": ., "pp": ., "cp": ., "tp": .}``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a grid of {self.world} ranks")
        out = {}
        for d, size in reversed(list(zip(DIMS, self.shape))):  # innermost varies fastest
            rank, out[d] = divmod(rank, size)
        return {d: out[d] for d in DIMS}

    def rank_at(self, **coords: int) -> int:
        """The rank at these coordinates (a dimension left out is 0)."""
        rank = 0
        for d, size in zip(DIMS, self.shape):
            rank = rank * size + coords.get(d, 0)
        return rank

    def group(self, dim: str | tuple[str, ...], rank: int) -> list[int]:
        """The members of ``rank``'s group along ``dim``, in order of their index along it.

        ``dim`` may name several dimensions, ``("dp", "cp")``: the ranks that differ only along those (the
        group a gradient is summed over when both data and context parallelism replicate a parameter, torch's
        ``mesh["dp", "cp"]._flatten()``), in rank order.
        """
        if dim in EXPERT_GROUPS:
            replicas = self.group(("dp", "cp"), rank)  # the ranks expert parallelism is carved out of
            place = replicas.index(rank)
            if dim == "ep":
                first = place - place % self.ep
                return replicas[first:first + self.ep]
            return replicas[place % self.ep::self.ep]
        dims = self._dims(dim)
        here = self.coords(rank)
        members = [here]
        for d in dims:
            members = [{**c, d: i} for c in members for i in range(getattr(self, d))]
        return sorted(self.rank_at(**c) for c in members)

    def groups(self, dim: str | tuple[str, ...]) -> list[list[int]]:
        """Every group along ``dim``, each once, ordered by its first rank: the order every rank creates them in."""
        if dim not in EXPERT_GROUPS:
            self._size(dim)
        return [list(g) for g in sorted({tuple(self.group(dim, r)) for r in range(self.world)})]

    def new_groups(self, dim: str | tuple[str, ...], rank: int, *, timeout_s: float | None = None, fresh: bool = False):
        """Create every group along ``dim`` (collective over the world); return ``(this rank's group, created)``.

        A dimension that spans the whole world needs no new group: this returns ``(None, [])``, None being
        torch's default group, unless ``fresh`` asks for a group of its own. New groups wait as long as the
        world's collectives unless ``timeout_s`` says otherwise. ``created`` is what the caller destroys.
        """
        if self.size(dim) == self.world and not fresh:
            return None, []
        return make_groups(self.groups(dim), rank, timeout_s=timeout_s)

    def describe(self) -> dict:
        return {d: getattr(self, d) for d in DIMS} | ({"ep": self.ep} if self.ep > 1 else {})

    def _dims(self, dim: str | tuple[str, ...]) -> tuple[str, ...]:
        dims = (dim,) if isinstance(dim, str) else tuple(dim)
        for d in dims:
            if d not in DIMS:
                raise ValueError(f"unknown parallel dimension {d!r}: the grid has {', '.join(DIMS)}")
        if not dims or len(set(dims)) != len(dims):
            raise ValueError(f"{dim!r} must name one or more different dimensions of {', '.join(DIMS)}")
        return dims

    def size(self, dim: str | tuple[str, ...]) -> int:
        """How many ranks a group along ``dim`` holds."""
        if dim in EXPERT_GROUPS:
            return self.ep if dim == "ep" else self.edp
        return math.prod(getattr(self, d) for d in self._dims(dim))

    def _size(self, dim: str | tuple[str, ...]) -> int:
        return self.size(dim)


def make_groups(member_lists, rank: int, *, timeout_s: float | None = None):
    """Create a process group for each list of ranks, in the given order, on every rank (``dist.new_group`` is
    collective over the world); return ``(the group holding rank or None, the groups rank holds)``, what the caller
    destroys. The one place the course makes groups: ``RankGrid.new_groups``, ``Mesh``'s embedding groups and the
    KV-head copies of ``ParallelAttention`` call it. A group waits as long as the world's collectives unless
    ``timeout_s`` says otherwise, never torch's 30 minutes."""
    import torch.distributed as dist  # only the ranks need torch.distributed; the layout itself is plain data

    from workers.runtime import collective_timeout

    timeout = collective_timeout() if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    mine, created = None, []
    for members in member_lists:
        pg = dist.new_group(list(members), timeout=timeout)
        if rank in members:
            mine = pg
            created.append(pg)
    return mine, created
