"""One layout for the whole run: how many ranks along each parallel dimension, and everything that depends on it.

Chapter 15 composes the course's parallelisms on one world of ranks. A layout names them all:

    dp x tp x pp x cp      data, tensor, pipeline and context parallel degrees (product = world size)
    zero                   0: every data-parallel rank keeps the whole optimizer state; 1: ZeRO-1 shards it
    sequence_parallel      LayerNorms, dropouts and residuals on sequence shards inside each TP group
    micro_batches          m, per data-parallel rank and optimizer step (gradient accumulation; the pipeline's m)
    schedule, chunks       the pipeline schedule (GPipe, 1F1B, interleaved 1F1B with v = chunks)
    split                  which tokens each context-parallel rank holds ("zigzag" balances causal work)

The name ``DPxTPxPPxCP`` (``2x2x2x1``) is the order papers quote degrees in. The ranks themselves are laid out
in the course's one rank grid (``workers/parallel/grid.py``), ``arange(world).view(dp, pp, cp, tp)``, tp
innermost; ``Mesh`` builds every group of it and hands them to torch as a ``DeviceMesh`` with those four
named dimensions, plus the two groups the composition needs that no single dimension gives:

    dp_cp       the ranks that hold the same parameters with different tokens (data *and* context parallel
                replicas): gradients are summed, and ZeRO shards optimizer state, over this group
                (Megatron's ``get_data_parallel_group(with_context_parallel=True)``)
    embedding   the first and last pipeline stage of one pipeline, which both hold the tied embedding
                (Megatron's ``get_embedding_group``): its two copies' gradients are summed over it

``problem`` checks a layout against a model before anything is built: it returns one sentence naming every
offending degree, so that a learner's choice is refused before a process group exists.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from workers.context_parallel.split import SPLITS, num_chunks
from workers.parallel.grid import DIMS, RankGrid
from workers.pipeline.schedules import SCHEDULES

ZERO_STAGES = (0, 1)  # what the trainer implements; 2 and 3 arrive with the ZeRO-2/3 chapter
DEGREES = ("dp", "tp", "pp", "cp")  # the order a layout is written in, "DPxTPxPPxCP"


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    micro_batches: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    split: str = "zigzag"

    @classmethod
    def parse(cls, name: str, **options) -> "Layout":
        """``Layout.parse("2x2x2x1", zero=1)``: degrees in the order dp x tp x pp x cp."""
        parts = name.lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise ValueError(f"layout {name!r} is not four degrees DPxTPxPPxCP, like '2x2x2x1'")
        return cls(**dict(zip(DEGREES, map(int, parts))), **options)

    @property
    def name(self) -> str:
        return "x".join(str(getattr(self, d)) for d in DEGREES)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grid(self) -> RankGrid:
        return RankGrid(dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp)

    @property
    def virtual_stages(self) -> int:
        """The pipeline's p * v model chunks (v = 1 except for the interleaved schedule)."""
        return self.pp * self.chunks

    def as_dict(self) -> dict:
        return asdict(self)


def problem(layout: Layout, world: int, *, layers: int, heads: int, kv_heads: int, ffn: int, seq: int,
            global_batch: int) -> str | None:
    """Why ``layout`` cannot train this model on ``world`` ranks, naming every offending degree; or None."""
    bad = [f"{d}={getattr(layout, d)}" for d in DEGREES
           if not isinstance(getattr(layout, d), int) or getattr(layout, d) < 1]
    if bad:
        return f"{', '.join(bad)} must be whole numbers >= 1"
    if layout.zero not in ZERO_STAGES:
        return f"zero={layout.zero} is not implemented here: choose one of {', '.join(map(str, ZERO_STAGES))}"
    if layout.schedule not in SCHEDULES:
        return f"schedule={layout.schedule!r} is not known: choose one of {', '.join(SCHEDULES)}"
    if layout.split not in SPLITS:
        return f"split={layout.split!r} is not known: choose one of {', '.join(SPLITS)}"
    reasons = []
    if layout.world != world:
        reasons.append(f"dp x tp x pp x cp = {layout.name} makes {layout.world} ranks, not the world's {world}")
    tp, pp, cp, m = layout.tp, layout.pp, layout.cp, layout.micro_batches
    if heads % tp:
        reasons.append(f"tp={tp} does not divide heads={heads}")
    elif kv_heads % tp and tp % kv_heads:
        reasons.append(f"tp={tp} and kv_heads={kv_heads} do not divide one another")
    if ffn % tp:
        reasons.append(f"tp={tp} does not divide ffn={ffn}")
    if layout.schedule == "interleaved":
        if layout.chunks < 2 or pp < 2:
            reasons.append(f"the interleaved schedule needs pp >= 2 and chunks >= 2, not pp={pp}, chunks={layout.chunks}")
        if m % pp:
            reasons.append(f"micro_batches={m} is not a multiple of pp={pp} (the interleaved schedule sends "
                           "micro-batches round in groups of pp)")
    elif layout.chunks != 1:
        reasons.append(f"chunks={layout.chunks} needs schedule='interleaved'")
    if layers % (pp * layout.chunks):
        what = f"pp={pp}" if layout.chunks == 1 else f"pp x chunks = {pp * layout.chunks}"
        reasons.append(f"{what} does not divide layers={layers}")
    n = num_chunks(cp, layout.split)
    if seq % n:
        reasons.append(f"cp={cp} cuts seq={seq} into {n} chunks ({layout.split}), which does not divide it")
    elif layout.sequence_parallel and (seq // cp) % tp:
        reasons.append(f"tp={tp} does not divide the {seq // cp} tokens each cp={cp} rank holds (sequence parallelism)")
    if m < 1:
        reasons.append(f"micro_batches={m} must be >= 1")
    elif global_batch % (layout.dp * m):
        reasons.append(f"dp x micro_batches = {layout.dp} x {m} does not divide global_batch={global_batch}")
    if not reasons:
        return None
    return "; ".join(reasons) + ": choose degrees that fit"


class Mesh:
    """This rank's process groups for ``layout``, made together (every rank makes every group, in one order).

    ``mesh`` is torch's ``DeviceMesh`` over the grid's dimensions ``DIMS`` (dp, pp, cp, tp), built from the
    groups made here (``DeviceMesh.from_group``) rather than by ``init_device_mesh``, which makes groups of its
    own that no one can hand back: warm ranks outlive a run, and every group made here is destroyed by
    ``destroy()``. ``group(dim)`` is this rank's group along a dimension of the mesh, or ``"dp_cp"`` or
    ``"embedding"``; ``coords`` its place in the grid.
    """

    def __init__(self, layout: Layout, rank: int, device_type: str = "cpu"):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        self.layout, self.rank, self.grid = layout, rank, layout.grid
        self.coords = self.grid.coords(rank)
        self._groups, self._created = {}, []
        try:
            for dim in DIMS:
                self._make(dim, dim)
            self._make("dp_cp", ("dp", "cp"))
            self._make_embedding_groups(dist)
            ranks = torch.arange(self.grid.world).view(*self.grid.shape)  # [dp, pp, cp, tp]
            self.mesh = DeviceMesh.from_group([self._groups[d] for d in DIMS], device_type, mesh=ranks,
                                              mesh_dim_names=DIMS)
        except BaseException:
            self.destroy()
            raise

    def _make(self, name: str, dims) -> None:
        mine, created = self.grid.new_groups(dims, self.rank, fresh=True)
        self._groups[name] = mine
        self._created += created

    def _make_embedding_groups(self, dist) -> None:
        """The first and last stage of every pipeline (only when they differ: pp > 1)."""
        from workers.runtime import collective_timeout

        self._groups["embedding"] = None
        if self.layout.pp == 1:
            return
        for pipeline in self.grid.groups("pp"):
            members = [pipeline[0], pipeline[-1]]
            pg = dist.new_group(members, timeout=collective_timeout())
            if self.rank in members:
                self._groups["embedding"] = pg
                self._created.append(pg)

    def group(self, name: str):
        return self._groups[name]

    def members(self, name: str) -> list[int]:
        if name == "embedding":
            pipeline = self.grid.group("pp", self.rank)
            return [pipeline[0], pipeline[-1]] if self.layout.pp > 1 and self.rank in (pipeline[0], pipeline[-1]) else []
        return self.grid.group(("dp", "cp") if name == "dp_cp" else name, self.rank)

    def destroy(self) -> None:
        import torch.distributed as dist

        for pg in self._created:
            dist.destroy_process_group(pg)
        self._created = []
