"""Chapter 15's graded exercises: the mesh's groups by hand (checked here against the rank grid), and the
token-normalised loss across micro-batches, data and context parallelism (trained for real on 4 ranks)."""
from course_utils.exercises import FAIL, PASS, Exercise, register

CHECKER = "workers.exercises.ch15"
SHAPES = ((2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 2), (4, 1, 1, 2), (1, 4, 1, 2), (2, 2, 2, 1), (1, 1, 1, 8))


def _normal(groups) -> list[tuple[int, ...]]:
    return sorted(tuple(sorted(int(r) for r in g)) for g in groups)


def _grid_groups(sizes: dict, order: tuple, dim: str) -> list[tuple[int, ...]]:
    """Groups along ``dim`` of ``arange(world).view(*sizes in order)`` (the last dimension innermost)."""
    import math

    shape = [sizes[d] for d in order]
    groups = {}
    for rank in range(math.prod(shape)):
        coords, r = {}, rank
        for d, size in reversed(list(zip(order, shape))):
            r, coords[d] = divmod(r, size)
        groups.setdefault(tuple(coords[d] for d in order if d != dim), []).append(rank)
    return _normal(groups.values())


def _consecutive(world: int, n: int) -> list[tuple[int, ...]]:
    return _normal([list(range(s, s + n)) for s in range(0, world, n)])


def _answers(answer, dp, pp, cp, tp) -> dict:
    from workers.parallel.grid import DIMS

    return {dim: _normal(answer(dp, pp, cp, tp, dim)) for dim in DIMS}


def check_mesh_groups(answer) -> tuple[str, str]:
    """``answer(dp, pp, cp, tp, dim)``: every group along ``dim`` of the grid ``arange(world).view(dp, pp, cp, tp)``."""
    from workers.parallel.grid import DIMS, RankGrid

    for dp, pp, cp, tp in SHAPES:
        grid = RankGrid(dp=dp, pp=pp, cp=cp, tp=tp)
        sizes = grid.describe()
        try:
            answers = _answers(answer, dp, pp, cp, tp)
        except (TypeError, ValueError):
            return FAIL, (f"at dp={dp}, pp={pp}, cp={cp}, tp={tp}: return a list of groups, each a list of ranks, like "
                          "[[0, 1], [2, 3]]")
        # a mistake in the layout shows along several dimensions at once: recognise it from all of them
        reversed_grid = {d: _grid_groups(sizes, tuple(reversed(DIMS)), d) for d in DIMS}
        consecutive = {d: _consecutive(grid.world, sizes[d]) for d in DIMS}
        for dim in DIMS:
            where = f"at dp={dp}, pp={pp}, cp={cp}, tp={tp}, along {dim}"
            got, want = answers[dim], _normal(grid.groups(dim))
            if got == want:
                continue
            if answers == reversed_grid:
                return FAIL, (f"{where}: you laid the grid out with tp outermost: in the course's grid (and "
                              "Megatron's, torchtitan's) tp is innermost, so a tensor-parallel group is consecutive "
                              "ranks, the ones that share the fastest links")
            n = sizes[dim]
            if answers == consecutive or got == consecutive[dim]:
                return FAIL, (f"{where}: consecutive runs of {n} ranks are the groups of the innermost dimension only; "
                              f"along {dim} the members are a stride apart: the product of the sizes inside it")
            if len(got) > 1 and all(len(g) == n and all(b - a == n for a, b in zip(g, g[1:])) for g in got):
                return FAIL, (f"{where}: the members are {n} apart (the size of {dim}); the stride along a dimension is "
                              "the product of the sizes of the dimensions inside it (tp for cp, cp*tp for pp, "
                              "pp*cp*tp for dp)")
            if len(got) == 1 and len(want) > 1:
                return FAIL, (f"{where}: you returned one group; return every group along {dim} ({len(want)} of them): "
                              "every rank must create every group, in the same order")
            return FAIL, f"{where}: got {got}, expected {want}"
    return PASS, f"every group along dp, pp, cp and tp for {len(SHAPES)} grids"


register(Exercise("mesh_groups", "15", "mesh_groups",
                  "The mesh's groups by hand: which ranks share a TP, CP, PP or DP group", local=check_mesh_groups))
register(Exercise("micro_batch_loss", "15", "micro_batch_loss",
                  "The token-normalised loss across micro-batches, data and context parallelism",
                  worker=CHECKER, world_sizes=(4,)))
