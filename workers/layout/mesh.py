"""The one holder of a run's process groups: made together, kept for the run, destroyed together.

    with Mesh.for_world(tp=2) as mesh:                # tensor-parallel groups of 2 consecutive ranks
        y = reduce_from_tensor_model_parallel_region(x, mesh.group("tp"))

    mesh = Mesh(layout.grid, rank, DIMS + ("dp_cp", "embedding"), fresh=True)   # chapter 15
    dm = mesh.device_mesh(DIMS)                       # torch's DeviceMesh over the same groups

Every group is a slice of the course's rank grid (``grid.py``): along one dimension (``"tp"``, ``"dp"``, ...), along
several (``("dp", "cp")``, named ``"dp_cp"``: the ranks that hold the same parameters with different tokens), the
expert groups carved out of dp x cp (``"ep"``, ``"edp"``), ``"embedding"``: the first and last stage of each
pipeline, which both hold the tied embedding (Megatron's ``get_embedding_group``; made only when pp > 1), or
``"pp_up"`` and ``"pp_down"``: each pipeline's ranks again, twice, so that a pipeline's messages to a higher rank and
to a lower one travel on different groups (``pipeline/p2p.py`` says why gloo needs that).

Three rules of ``dist.new_group`` shape this class:

* it is collective over the *world*: every rank creates every group of a kind, in the same order, even those it
  is not in (``RankGrid.new_groups``);
* warm ranks outlive a run, so every group made here is destroyed by ``destroy()`` (or the ``with`` block), and
  torch's ``init_device_mesh`` is not used: it makes groups of its own that no one can hand back. ``device_mesh``
  builds torch's ``DeviceMesh`` from the groups made here instead, and empties DTensor's caches of earlier runs'
  meshes (a destroyed group otherwise outlives its run in them);
* a group waits as long as the world's collectives (``runtime.collective_timeout``) unless ``timeout_s`` says
  otherwise, never torch's 30 minutes.

A group that spans the whole world is torch's default group (``group(name)`` is None) unless ``fresh`` asks for a
group of its own (a short timeout, or a ``DeviceMesh``, need one).
"""
from __future__ import annotations

from workers.layout.grid import DIMS, RankGrid, make_groups

NAMED = {"dp_cp": ("dp", "cp"), "pp_up": "pp", "pp_down": "pp"}
LINKS = ("pp_up", "pp_down")  # a pipeline's messages up the ranks, and down: one group each (pipeline/p2p.py)


def link_names(backend: str, pp: int) -> tuple[str, ...]:
    """The groups a pipeline's messages travel on beyond the grid's: ``LINKS`` on gloo when there is a pipeline
    (``pipeline/p2p.py`` says why), none on NCCL, where the default group carries both directions."""
    return LINKS if backend == "gloo" and pp > 1 else ()


class Mesh:
    def __init__(self, grid: RankGrid, rank: int, groups=("tp",), *, fresh: bool = False,
                 timeout_s: float | None = None):
        self.grid, self.rank, self.coords = grid, rank, grid.coords(rank)
        self.fresh, self.timeout_s = fresh or timeout_s is not None, timeout_s
        self._groups, self._created, self._device_meshes = {}, [], {}
        try:
            for name in groups:
                self._make(name)
        except BaseException:
            self.destroy()
            raise

    @classmethod
    def for_world(cls, groups=("tp",), *, fresh: bool = False, timeout_s: float | None = None,
                  **sizes: int) -> "Mesh":
        """This rank's groups in the grid ``RankGrid.for_world(world, **sizes)`` of the running world."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        return cls(RankGrid.for_world(world, **sizes), rank, groups, fresh=fresh, timeout_s=timeout_s)

    # -- making and destroying -------------------------------------------------------------------------------

    def _make(self, name: str) -> None:
        if name in self._groups:
            return
        if name == "embedding":
            self._groups[name] = self._make_embedding()
            return
        dims = NAMED.get(name, name)
        # a link's groups are their own even where pp spans the world: the default group is not one of them
        mine, created = self.grid.new_groups(dims, self.rank, timeout_s=self.timeout_s,
                                             fresh=self.fresh or name in LINKS)
        self._groups[name] = mine
        self._created += created

    def _make_embedding(self):
        if self.grid.pp == 1:
            return None
        ends = [[pipeline[0], pipeline[-1]] for pipeline in self.grid.groups("pp")]
        mine, created = make_groups(ends, self.rank, timeout_s=self.timeout_s)
        self._created += created
        return mine

    def destroy(self) -> None:
        import torch.distributed as dist

        if self._device_meshes:
            forget_meshes()
            self._device_meshes = {}
        for pg in self._created:
            dist.destroy_process_group(pg)
        self._created = []

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    # -- reading ------------------------------------------------------------------------------------------------

    def group(self, name: str):
        """This rank's process group ``name`` (None: torch's default group, the whole world)."""
        if name not in self._groups:
            raise KeyError(f"no {name!r} groups were made for this run: made {', '.join(self._groups)}")
        return self._groups[name]

    def links(self) -> tuple | None:
        """``(pp_up, pp_down)``, what ``pipeline.p2p.P2P`` takes as ``links``, or None where they were not made."""
        return tuple(self._groups[name] for name in LINKS) if LINKS[0] in self._groups else None

    def ranks(self, name: str) -> list[int]:
        """The members of this rank's group ``name``, in order ([] for the embedding group of a middle stage)."""
        if name == "embedding":
            pipeline = self.grid.group("pp", self.rank)
            ends = [pipeline[0], pipeline[-1]]
            return ends if self.grid.pp > 1 and self.rank in ends else []
        return self.grid.group(NAMED.get(name, name), self.rank)

    def size(self, name: str) -> int:
        return self.grid.size(NAMED.get(name, name))

    def rank_in(self, name: str) -> int:
        """This rank's place in its group ``name``."""
        return self.ranks(name).index(self.rank)

    def index(self, name: str) -> int:
        """Which of the groups ``name`` this rank's is (groups ordered by their first rank)."""
        return self.grid.groups(NAMED.get(name, name)).index(self.ranks(name))

    def describe(self, name: str = "tp") -> dict:
        """``{"tp": 2, "tp_group": 0, "tp_group_ranks": [0, 1]}``: what a worker reports about its group ``name``."""
        return {name: self.size(name), f"{name}_group": self.index(name), f"{name}_group_ranks": self.ranks(name)}

    def device_mesh(self, dims=DIMS, device_type: str = "cpu"):
        """torch's ``DeviceMesh`` over ``dims`` of the grid, built from this mesh's groups (made ``fresh``).

        The dimensions not in ``dims`` must have size 1 (the mesh covers the world). Made once per run.
        """
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        dims = tuple(dims)
        if dims not in self._device_meshes:
            missing = [d for d in DIMS if d not in dims and getattr(self.grid, d) != 1]
            if missing or not self.fresh:
                raise ValueError(f"a DeviceMesh over {dims} needs groups of its own (fresh=True) and every other "
                                 f"dimension of size 1, not {', '.join(missing)}")
            for d in dims:
                self._make(d)
            if not self._device_meshes:
                forget_meshes()  # whatever an earlier run on these warm ranks left behind
            ranks = torch.arange(self.grid.world).view(*(getattr(self.grid, d) for d in dims))
            self._device_meshes[dims] = DeviceMesh.from_group([self._groups[d] for d in dims], device_type,
                                                              mesh=ranks, mesh_dim_names=dims)
        return self._device_meshes[dims]


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches, before a run's groups are destroyed (and before a new mesh).

    DTensor memoises the output placements of every op, keyed by its inputs' specs, which hold their
    ``DeviceMesh``; and a mesh compares and hashes by its ranks, dimension names and device type, *not* by the
    process groups behind it. So the next run's mesh over the same ranks (warm ranks: a new run, new groups) is a
    cache hit, its op outputs come back on the previous run's mesh, and the first collective names a destroyed
    group: ``RuntimeError: Could not resolve the process group registered under the name 1`` (measured here on
    torch 2.13, the second ``api="tp"`` run of chapter 15 on warm ranks). Megatron-LM clears the same cache when it
    destroys its groups (NVIDIA/Megatron-LM#7029). ``_clear_sharding_prop_cache`` is torch's own (private) way to
    clear both the Python and the C++ fast-path caches.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
