"""Chapter 15's graded exercises: the mesh's groups by hand (checked here against the rank grid); the
token-normalised loss across micro-batches, data and context parallelism (trained for real on 4 ranks); and a
layout chosen for a memory budget with its traffic predicted, then run on 8 ranks and measured."""
import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, call_answer, register

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
    """Every dimension's groups, sorted; a rank that is not a finite number raises ValueError naming it."""
    from workers.layout.grid import DIMS

    out = {}
    for dim in DIMS:
        groups = [list(g) for g in answer(dp, pp, cp, tp, dim)]
        bad = next((r for g in groups for r in g if not math.isfinite(float(r))), None)
        if bad is not None:
            raise ValueError(f"along {dim} a rank is {bad}: ranks are integers from 0 to world - 1")
        out[dim] = _normal(groups)
    return out


def check_mesh_groups(answer) -> tuple[str, str]:
    """``answer(dp, pp, cp, tp, dim)``: every group along ``dim`` of the grid ``arange(world).view(dp, pp, cp, tp)``."""
    from workers.layout.grid import DIMS, RankGrid

    for dp, pp, cp, tp in SHAPES:
        grid = RankGrid(dp=dp, pp=pp, cp=cp, tp=tp)
        sizes = grid.describe()
        try:
            answers = _answers(answer, dp, pp, cp, tp)
        except ValueError as exc:
            if "ranks are integers" in str(exc):
                return FAIL, f"at dp={dp}, pp={pp}, cp={cp}, tp={tp}: {exc}"
            return FAIL, (f"at dp={dp}, pp={pp}, cp={cp}, tp={tp}: return a list of groups, each a list of ranks, like "
                          "[[0, 1], [2, 3]]")
        except TypeError:
            return FAIL, (f"at dp={dp}, pp={pp}, cp={cp}, tp={tp}: return a list of groups, each a list of ranks, like "
                          "[[0, 1], [2, 3]]")
        # a mistake in the layout shows along several dimensions at once: recognise it from all of them
        reversed_grid = {d: _grid_groups(sizes, tuple(reversed(DIMS)), d) for d in DIMS}
        cp_outside_pp = {d: _grid_groups(sizes, ("dp", "cp", "pp", "tp"), d) for d in DIMS}
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
            if answers == cp_outside_pp:
                return FAIL, (f"{where}: you ordered the grid dp, cp, pp, tp: the course's (and Megatron's) order is "
                              "dp, pp, cp, tp, outermost first, so a context-parallel group is tp ranks apart and a "
                              "pipeline cp*tp apart. The two orders agree only while pp or cp is 1")
            if n == 1 and not got:
                return FAIL, (f"{where}: {dim} has size 1, so every rank is a group of its own: return all "
                              f"{grid.world} groups of one rank; every rank creates every group, even of one")
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
    odd = [d for d in DIMENSIONS if not math.isfinite(predicted[d])]
    if odd:  # before any rank starts: no measurement equals it
        return FAIL, (f"your prediction along {odd[0]} is {predicted[odd[0]]}: predict a finite number of bytes for "
                      "every dimension (0 where nothing is sent)")
    layout = Layout(**options)
    why = layout_problem(layout, WORLD, global_batch=CONFIG["global_batch"])
    if why:
        return FAIL, f"layout {layout.name} is refused before launch: {why}"
    held = [(s, _state_bytes(layout.as_dict(), s)) for s in range(layout.pp)]
    over = [(s, b) for s, b in held if not b <= BUDGET]
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
        if abs(predicted[dim] - measured[dim]) < 0.5:  # finite by now: a NaN prediction was refused above
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
                  "The mesh's groups by hand: which ranks share a TP, CP, PP or DP group", local=check_mesh_groups,
                  tries={
                      "non-finite": "a rank that is NaN or infinite is named, not cast",
                      "order": NOT_APPLICABLE + "rank lists from a formula: no gradients",
                      "sizes": NOT_APPLICABLE + "the world is the product of the four degrees, so every degree "
                               "divides it",
                      "ragged": "degrees of 1 ((1, 1, 1, 8), (2, 2, 2, 1)): every rank is then a group of its own, "
                                "and all of them must be returned",
                      "layouts": "seven grids, among them ones where pp and cp are both above 1: a dimension order "
                                 "right only while one of them is 1 fails",
                      "traffic": NOT_APPLICABLE + "computed in one process: no group is created",
                      "mutation": NOT_APPLICABLE + "the inputs are integers and a name",
                      "output": "the number of groups: every group along the dimension, not only rank 0's",
                      "memory": NOT_APPLICABLE + "no tensors are held",
                      "bits": NOT_APPLICABLE + "integers, compared exactly",
                  }))
register(Exercise("micro_batch_loss", "15", "micro_batch_loss",
                  "The token-normalised loss across micro-batches, data and context parallelism",
                  worker=CHECKER, world_sizes=(4,), tries={
                      "non-finite": "every step's loss is tested finite before it is compared: a NaN or infinite "
                                    "loss is named, with the micro-batch that made it",
                      "order": NOT_APPLICABLE + "the trainer accumulates the micro-batches' gradients; the answer "
                               "only scales one micro-batch's loss",
                      "sizes": NOT_APPLICABLE + "the trainer refuses a batch that does not divide into dp x m "
                               "micro-batches; the answer sees only counts",
                      "ragged": "micro-batches of different token counts, and at step 1 one without any valid token: "
                                "its loss must be 0, not 0/0",
                      "layouts": "2x1x2x1 with 4 micro-batches (dp != m) and 2x1x1x2 with 2 (dp = m, cp = 2): a "
                                 "factor dp / m or cp fails on one of them",
                      "traffic": NOT_APPLICABLE + "the answer computes a number; the trainer does every collective",
                      "mutation": NOT_APPLICABLE + "summed_ce is the answer's to use: the trainer reads only what it "
                                  "returns",
                      "output": "one float64 number on summed_ce's device, connected to summed_ce's graph: a float, "
                                "a float32 loss or a tensor made afresh is named",
                      "memory": NOT_APPLICABLE + "a scalar: nothing to release",
                      "bits": NOT_APPLICABLE + "the losses are compared within float64 rounding (1e-10): another "
                              "order of the same division passes",
                  }))
# The check starts 8 ranks (a cold start takes 15-40 s on two loaded cores) and runs a step with its own timeout:
# the exercise's limit covers that; the learner's function alone gets call_answer's 30 s.
register(Exercise("layout_and_traffic", "15", "layout_and_traffic",
                  "Pick a layout that fits the memory budget, predict its traffic, and run it",
                  local=check_layout_and_traffic, timeout_s=660.0, tries={
                      "non-finite": "a prediction that is NaN or infinite is refused before any rank starts",
                      "order": NOT_APPLICABLE + "the answer returns a layout and four numbers: no gradients",
                      "sizes": "degrees and micro-batches that do not divide the world, the layers or the batch are "
                               "refused before launch, naming the degree",
                      "ragged": NOT_APPLICABLE + "the run's batch and stages are the chapter's, equal by the refusal "
                                "rules",
                      "layouts": NOT_APPLICABLE + "the learner chooses one layout; it is checked as chosen",
                      "traffic": "the layout runs one step on 8 ranks and rank 0's measured bytes along tp, cp, pp "
                                 "and dp must equal the prediction, to the byte",
                      "mutation": NOT_APPLICABLE + "the answer takes no input",
                      "output": NOT_APPLICABLE + "a layout and four numbers, read by value; a malformed return is "
                                "named as such",
                      "memory": NOT_APPLICABLE + "the budget is checked on the state the layout holds per rank, by the "
                                "implementation's own count; nothing is released",
                      "bits": NOT_APPLICABLE + "byte counts, compared to half a byte",
                  }))
