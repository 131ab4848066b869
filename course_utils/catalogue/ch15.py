"""Chapter 15's graded exercises: the mesh's groups by hand (checked here against the rank grid); the
token-normalised loss across micro-batches, data and context parallelism (trained for real on 4 ranks); and a
layout chosen for a memory budget with its traffic predicted, then run on 8 ranks and measured."""
from course_utils.exercises import FAIL, PASS, Exercise, call_answer, register

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
    from workers.layout.grid import DIMS

    return {dim: _normal(answer(dp, pp, cp, tp, dim)) for dim in DIMS}


def check_mesh_groups(answer) -> tuple[str, str]:
    """``answer(dp, pp, cp, tp, dim)``: every group along ``dim`` of the grid ``arange(world).view(dp, pp, cp, tp)``."""
    from workers.layout.grid import DIMS, RankGrid

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


WORLD, BUDGET = 8, 600_000  # ranks; bytes of parameters + gradients + AdamW state per rank (float64)
CONFIG = {"vocab": 32, "seq": 16, "hidden": 32, "heads": 8, "layers": 4, "dropout": 0.0, "global_batch": 8,
          "dtype": "float64"}
DIMENSIONS = ("tp", "cp", "pp", "dp")


def _state_bytes(layout: dict, stage: int) -> int:
    """Parameters, gradients and AdamW's two moments on a rank of ``stage``, in bytes (``ch15_truth.state_bytes``)."""
    from course_utils.ch15_truth import state_bytes

    return sum(state_bytes(layout, CONFIG, stage).values())


def check_layout_and_traffic(answer) -> tuple[str, str]:
    """``answer()`` = (layout, predicted): a layout of the chapter's model on 8 ranks whose every rank holds at most
    600 kB of parameters, gradients and AdamW state (float64), and the bytes rank 0 sends in one step along tp, cp,
    pp and dp. The layout is then run for one step and rank 0's measured bytes must equal the prediction."""
    import course_utils as cu
    from course_utils import ch15_truth as truth
    from course_utils.ch15 import layout_problem
    from workers.layout import Layout

    try:
        layout_in, predicted = call_answer(answer)
        options = {k: layout_in[k] for k in ("dp", "tp", "pp", "cp")}
        options.update(zero=int(layout_in.get("zero", 0)), micro_batches=int(layout_in.get("micro_batches", 1)),
                       sequence_parallel=bool(layout_in.get("sequence_parallel", False)))
        predicted = {d: float(predicted.get(d, 0.0)) for d in DIMENSIONS}
    except (TypeError, ValueError, KeyError, AttributeError):
        return FAIL, ("return (layout, predicted): layout a dict with dp, tp, pp, cp (and zero, micro_batches, "
                      "sequence_parallel), predicted a dict of bytes per dimension, like {'tp': 0, 'cp': 0, 'pp': 0, "
                      "'dp': 0}")
    layout = Layout(**options)
    why = layout_problem(layout, WORLD, global_batch=CONFIG["global_batch"])
    if why:
        return FAIL, f"layout {layout.name} is refused before launch: {why}"
    held = [(s, _state_bytes(layout.as_dict(), s)) for s in range(layout.pp)]
    over = [(s, b) for s, b in held if b > BUDGET]
    if over:
        stage, held = over[0]
        return FAIL, (f"layout {layout.name} (zero={layout.zero}) does not fit: a rank of stage {stage} holds {held:,} "
                      f"bytes of parameters, gradients and AdamW state, over the {BUDGET:,} budget; shard the model "
                      "(tp, pp)" + (" or the optimizer state (zero=1)" if layout.zero == 0 else ""))
    res = cu.run("workers.ch15_composed", world_size=WORLD, timeout=300, steps=1, report=False, **options)
    rank = truth.first_rank(res.ranks)
    measured = {d: rank["comm"][0][d]["wire_bytes"] for d in DIMENSIONS}
    planner = {row["dimension"]: row["planner"] for row in truth.comm_rows(res.ranks)}
    for dim in DIMENSIONS:
        if abs(predicted[dim] - measured[dim]) < 0.5:
            continue
        where = f"layout {layout.name}, rank 0, along {dim}: you predicted {predicted[dim]:,.0f} bytes, it sent {measured[dim]:,.0f}"
        if measured[dim] and abs(predicted[dim] - planner[dim]) < 0.5:
            return FAIL, f"{where}. That is the planner's figure; the run differs because {truth.WHY[dim]}"
        if dim == "pp" and measured[dim] and abs(predicted[dim] - 2 * measured[dim]) < 0.5:
            return FAIL, (f"{where}: rank 0 is the first stage: it sends each micro-batch's activation forward and "
                          "receives the gradient, but sends nothing backward")
        if dim == "dp" and measured[dim] and abs(predicted[dim] - 2 * measured[dim] * layout.dp * layout.cp
                                                 / (2 * (layout.dp * layout.cp - 1))) < 0.5:
            return FAIL, (f"{where}: a ring all-reduce over n ranks sends 2(n-1)/n of the message per rank, not the "
                          "whole message twice")
        return FAIL, f"{where}"
    return PASS, (f"layout {layout.name} fits in {BUDGET:,} bytes per rank and rank 0 sent exactly the predicted bytes "
                  f"along tp, cp, pp and dp ({', '.join(f'{d} {measured[d]:,.0f}' for d in DIMENSIONS)})")


register(Exercise("mesh_groups", "15", "mesh_groups",
                  "The mesh's groups by hand: which ranks share a TP, CP, PP or DP group", local=check_mesh_groups))
register(Exercise("micro_batch_loss", "15", "micro_batch_loss",
                  "The token-normalised loss across micro-batches, data and context parallelism",
                  worker=CHECKER, world_sizes=(4,)))
# The check starts 8 ranks (a cold start takes 15-40 s on two loaded cores) and runs a step with its own timeout:
# the exercise's limit covers that; the learner's function alone gets call_answer's 30 s.
register(Exercise("layout_and_traffic", "15", "layout_and_traffic",
                  "Pick a layout that fits the memory budget, predict its traffic, and run it",
                  local=check_layout_and_traffic, timeout_s=660.0))
