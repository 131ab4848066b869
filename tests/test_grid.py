"""The rank grid (workers/layout/grid.py): one layout of the world from which every chapter slices its groups.

Start here when a chapter needs a new kind of group: add nothing but a dimension size to ``RankGrid.for_world``.
The layout is plain data, so most of it is checked without ranks; one test compares it with torch's own
``DeviceMesh`` on real ranks, and the chapters' workers are checked to take their groups from it.
"""
import itertools
import re

import pytest

import course_utils as cu
from course_utils.paths import ROOT
from workers.layout.grid import DIMS, RankGrid


def test_the_docstring_example_world_of_eight():
    grid = RankGrid.for_world(8, pp=2, tp=2)
    assert grid.shape == (2, 2, 1, 2) and grid.world == 8
    assert grid.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.groups("cp") == [[r] for r in range(8)]
    assert grid.coords(6) == {"dp": 1, "pp": 1, "cp": 0, "tp": 0}


@pytest.mark.parametrize("shape", [s for s in itertools.product([1, 2, 3], repeat=4) if 1 < s[0] * s[1] * s[2] * s[3] <= 24])
def test_coordinates_and_groups_partition_the_world(shape):
    grid = RankGrid(*shape)
    ranks = list(range(grid.world))
    assert [grid.rank_at(**grid.coords(r)) for r in ranks] == ranks  # coords and rank_at are inverse
    for dim in DIMS:
        groups = grid.groups(dim)
        assert sorted(r for g in groups for r in g) == ranks  # every rank in exactly one group per dimension
        assert all(len(g) == getattr(grid, dim) for g in groups)
        for g in groups:  # a group varies its own coordinate only, in order
            assert [grid.coords(r)[dim] for r in g] == list(range(len(g)))
            assert all({d: c for d, c in grid.coords(r).items() if d != dim} ==
                       {d: c for d, c in grid.coords(g[0]).items() if d != dim} for r in g)
    # tp is innermost: a tensor-parallel group is a run of consecutive ranks
    assert all(g == list(range(g[0], g[0] + grid.tp)) for g in grid.groups("tp"))


def test_the_order_of_dimensions_is_dp_pp_cp_tp():
    # Picotron's order (tp innermost, dp outermost). Changing it changes which ranks share a group in every
    # chapter; this test says that on purpose.
    assert DIMS == ("dp", "pp", "cp", "tp")
    assert RankGrid.for_world(8, cp=2, tp=2).group("cp", 0) == [0, 2]


def test_data_parallel_takes_what_the_other_degrees_leave():
    assert RankGrid.for_world(8, tp=2).dp == 4
    assert RankGrid.for_world(6, pp=3).describe() == {"dp": 2, "pp": 3, "cp": 1, "tp": 1}
    assert RankGrid.for_world(4).dp == 4


@pytest.mark.parametrize("world, sizes, message", [
    (8, {"tp": 3}, "tp=3 (3 ranks per data-parallel replica) does not divide the world size 8"),
    (8, {"dp": 2, "tp": 2}, "dp=2 x tp=2 makes 4 ranks, not the world's 8: choose degrees whose product is 8"),
    (4, {"xp": 2}, "unknown parallel dimension(s) xp: the grid has dp, pp, cp, tp (and ep)"),
    (6, {"ep": 4}, "ep=4 does not divide dp x cp = 6: expert parallelism is carved out of them"),
    (4, {"tp": 0}, "tp=0 must be whole numbers >= 1"),
])
def test_a_layout_that_does_not_fit_is_refused_naming_every_degree(world, sizes, message):
    assert RankGrid.problem(world, **sizes) == message
    with pytest.raises(ValueError, match=re.escape(message)):
        RankGrid.for_world(world, **sizes)


def test_unknown_dimensions_and_ranks_are_refused():
    grid = RankGrid.for_world(4, tp=2)
    with pytest.raises(ValueError, match="unknown parallel dimension 'xp'"):
        grid.groups("xp")
    with pytest.raises(ValueError, match="rank 4 is outside a grid of 4 ranks"):
        grid.coords(4)


@pytest.mark.parametrize("shape", ["2,2,1,2", "1,2,2,2"])
def test_the_grid_matches_torch_device_mesh(shape):
    """torch's DeviceMesh, real process groups on 8 cold ranks: the same members along every dimension."""
    res = cu.run("tests.rank_helpers.mesh_groups", world_size=8, shape=shape, warm=False, timeout=240)
    grid = RankGrid(*(int(s) for s in shape.split(",")))
    for rank, out in enumerate(res.ranks):
        expected = {d: grid.group(d, rank) for d in DIMS if getattr(grid, d) > 1}
        assert out["groups"] == expected, f"rank {rank}"


def test_the_chapters_take_their_groups_from_the_grid():
    """Pipelines (chapter 13) and rings (14) are ``pp`` and ``cp`` slices of the grid: a world of 4 holds two
    of each side by side, and both compute the same thing. No worker does group arithmetic of its own."""
    pipes = cu.run("workers.ch13_pipeline", world_size=4, pp=2, micro_batches=2, schedule="gpipe")
    assert pipes[1]["losses"] == pipes[3]["losses"] and pipes[1]["losses"]  # the two pipelines' last stages
    ring = cu.run("workers.ch14_ring_attention", world_size=4, cp=2, seq=16, split="contiguous", backward=False)
    for a, b in ((0, 2), (1, 3)):  # the same place in each ring: the same rows, the same output
        assert list(ring[a]["positions"]) == list(ring[b]["positions"]) and ring[a]["out"].equal(ring[b]["out"])
    assert list(ring[0]["positions"]) != list(ring[1]["positions"])
    arithmetic = [str(p.relative_to(ROOT)) for p in (ROOT / "workers").rglob("*.py")
                  if re.search(r"rank\s*-\s*\S*rank\s*%|rank\s*//\s*\w+_size", p.read_text())]
    assert arithmetic == [], f"group arithmetic outside the grid in {arithmetic}"


def test_a_refusal_names_the_sizes_that_divide_the_world():
    from workers.runtime import choose_divisor

    assert choose_divisor(4) == "choose 1, 2 or 4"
    assert choose_divisor(6) == "choose 1, 2, 3 or 6"
    assert choose_divisor(1) == "choose 1"


def test_expert_groups_are_carved_out_of_data_and_context_parallelism():
    # ep ranks exchange tokens: a run of ep consecutive members of the dp x cp group; edp ranks hold the same experts
    grid = RankGrid.for_world(4, ep=2)
    assert [grid.group("ep", r) for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert grid.groups("edp") == [[0, 2], [1, 3]] and grid.edp == 2
    grid = RankGrid.for_world(8, tp=2, ep=2)  # tp innermost: the ep groups skip over the tp partner
    assert grid.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.size("ep") == 2 and grid.size("edp") == 2
