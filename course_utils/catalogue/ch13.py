"""Chapter 13's graded exercises: the 1F1B action list (checked here, by simulation), and one stage's
forward/backward step over real send/recv (on real ranks)."""
import math

from course_utils.ch13 import FIX_MICRO_BATCHES, FIX_STAGES, broken_schedule  # the notebook shows the table
from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, call_answer, register

CHECKER = "workers.exercises.ch13"
SHAPES = ((4, 8), (4, 2), (2, 5), (1, 3), (8, 8), (3, 1))  # (p, m): m < p too, where warm-up is capped at m


def check_one_f_one_b_schedule(answer) -> tuple[str, str]:
    """``answer(p, m, stage)`` for every stage: valid, deadlock-free, at most p - stage stashed, no extra bubble."""
    from workers.pipeline.schedules import (gpipe_schedule, ideal_bubble, num_warmup_microbatches, peak_stash,
                                            simulate, validate)

    for p, m in SHAPES:
        where = f"at p={p}, m={m}"
        try:
            raw = [list(answer(p, m, s)) for s in range(p)]
            odd = next((i for actions in raw for _, i in actions if isinstance(i, float) and not math.isfinite(i)), None)
            if odd is not None:
                return FAIL, f"{where}: micro-batch index {odd} is not a number of a micro-batch: use integers 0..m-1"
            got = [[(str(k), int(i)) for k, i in actions] for actions in raw]
        except (TypeError, ValueError):
            return FAIL, f"{where}: return a list of pairs like ('F', 0), ('B', 0) for each stage"
        problem = validate(got, m)
        if problem and m < p and any(k == "F" and i >= m for actions in got for k, i in actions):
            return FAIL, (f"{where}: {problem}: with fewer micro-batches than stages the warm-up is capped at m, "
                          "min(p - stage - 1, m) forwards")
        if problem:
            return FAIL, f"{where}: {problem}"
        for s, actions in enumerate(got):
            peak, bound = peak_stash(actions), min(p - s, m)
            if actions == gpipe_schedule(p, m, s) and not peak <= bound:
                return FAIL, (f"{where}, stage {s}: that is GPipe's order (all forwards, then all backwards), which "
                              f"stashes {peak} micro-batches; 1F1B starts backwards after p - stage - 1 warm-up forwards")
            if not peak <= bound:
                first_b = next(j for j, (k, _) in enumerate(actions) if k == "B")
                return FAIL, (f"{where}, stage {s}: {peak} micro-batches are stashed at once, 1F1B allows {bound}: "
                              f"you run {first_b} forwards before the first backward where 1F1B runs {bound}: "
                              f"a warm-up of p - stage - 1 = {num_warmup_microbatches(p, m, s)}, then one F and one B in turn")
        want = simulate(got)["makespan"]
        best = (m + p - 1) * 3.0
        if not want <= best + 1e-9:
            return FAIL, (f"{where}: the step takes {want:g} time units where 1F1B takes {best:g} (t_F = 1, t_B = 2): "
                          f"a warm-up shorter than p - stage - 1 forwards leaves the later stages waiting, a bigger bubble")
        if not abs(ideal_bubble(got) - (p - 1) / (m + p - 1)) <= 1e-9:
            return FAIL, f"{where}: the idle share is {ideal_bubble(got):.3g}, not (p-1)/(m+p-1)"
    return PASS, "valid at every (p, m) tried, at most p - stage micro-batches stashed, and the bubble of GPipe"


register(Exercise("one_f_one_b_schedule", "13", "one_f_one_b_schedule",
                  "The 1F1B schedule as data: warm-up, steady one-forward-one-backward, cool-down",
                  local=check_one_f_one_b_schedule, tries={
                      "non-finite": "a micro-batch index that is NaN or infinite is named, not cast",
                      "order": NOT_APPLICABLE + "an action list of labels: no gradient and no .grad to accumulate",
                      "sizes": "m < p and m not a multiple of p ((4, 2), (2, 5), (3, 1)): the warm-up must be capped "
                               "at m, and every micro-batch run once forward and once backward",
                      "ragged": NOT_APPLICABLE + "micro-batches are labels of equal cost (t_F = 1, t_B = 2); none is "
                                "smaller than another",
                      "layouts": "six (p, m) shapes from p = 1 to 8: the stash bound p - stage and the makespan "
                                 "(m + p - 1) x 3 at each, so a warm-up right for one shape fails another",
                      "traffic": NOT_APPLICABLE + "simulated in one process: no message is sent",
                      "mutation": NOT_APPLICABLE + "the inputs are three integers",
                      "output": NOT_APPLICABLE + "labels and indices read by value; a malformed pair is named as such",
                      "memory": NOT_APPLICABLE + "no tensors: the stash it bounds is counted on the action list",
                      "bits": NOT_APPLICABLE + "integers and labels, compared exactly",
                  }))
register(Exercise("stage_step", "13", "stage_step",
                  "One stage's forward and backward of a micro-batch over real send/recv",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "every stage's gradients are tested finite first: a NaN or infinity is named",
                      "order": "three micro-batches in a row: each backward must add to the .grad the earlier ones "
                               "left, not replace it",
                      "sizes": NOT_APPLICABLE + "the check sets the stage's module and the message shape; 2p layers "
                               "on p stages divide evenly by construction",
                      "ragged": NOT_APPLICABLE + "every micro-batch has the same shape and every stage two layers",
                      "layouts": "2 and 4 stages: with 4 there are middle stages that both receive and send, so a "
                                 "rule that treats every later stage as the last fails",
                      "traffic": "every point-to-point call of every stage is recorded: a missing, repeated or "
                                 "surplus send or receive is named",
                      "mutation": NOT_APPLICABLE + "the answer's job is to write .grad and send; the tensors it "
                                  "receives are its own",
                      "output": "what it sends: a tensor of the message's shape; None or another shape is named",
                      "memory": NOT_APPLICABLE + "one micro-batch at a time: nothing is stashed or released",
                      "bits": NOT_APPLICABLE + "gradients are sums in another order than the unsplit model's: compared "
                              "within float32 rounding",
                  }))


# --- split_linear_backward: B and W of one Linear layer by hand ------------------------------------------------------

# (n, in, out, seed): n = 1 (where a mean over the batch equals the sum), in != out (where a transposed product has
# the wrong shape) and in = out (where it has the right one). The first case has n, in and out all different, so
# that a tensor's shape says which gradient it is.
LINEAR_CASES = ((3, 5, 4, 11), (1, 3, 2, 12), (4, 6, 6, 13), (2, 2, 7, 14), (6, 8, 3, 15))
# float64 against autograd: the same products in another order (an einsum, a transpose first) differ by ~1e-15;
# every mistake the check names is off by O(1)
LINEAR_TOL = {"rtol": 1e-10, "atol": 1e-12}
DX_RULE = "dx = dy W ([n, out] @ [out, in] -> [n, in])"
PRODUCTS = f"{DX_RULE}, dW = dy^T x ([out, n] @ [n, in] -> [out, in]), db = dy summed over the n rows ([out])"


def _linear_inputs(n: int, d_in: int, d_out: int, seed: int):
    """x, weight, dy of one micro-batch and x, dy of the next (the same weight), drawn in float64 from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return draw(n, d_in), draw(d_out, d_in), draw(n, d_out), draw(n, d_in), draw(n, d_out)


def _autograd_linear(x, weight, dy):
    """(dx, dW, db) of y = x W^T + b by autograd, for the output gradient ``dy``."""
    import torch

    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    bias = torch.zeros(weight.shape[0], dtype=weight.dtype, requires_grad=True)
    torch.nn.functional.linear(x, weight, bias).backward(dy)
    return x.grad, weight.grad, bias.grad


def _made_shapes(answer, *args):
    """``answer(*args)`` and the shapes of the tensors it computed (views of tensors it had are not computed)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view:
                self.shapes |= {tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
            return out

    made = Made()
    with made:
        got = answer(*args)
    return got, made.shapes


def _unchanged(before, after) -> bool:
    """``after`` (the caller's tensors) equal to ``before`` (clones taken first), storage size included: a storage
    resized to nothing is never read (reading it would crash the process, not raise)."""
    import torch

    return all(a.untyped_storage().nbytes() == b.untyped_storage().nbytes() and a.shape == b.shape
               and a.stride() == b.stride() and torch.equal(b, a) for b, a in zip(before, after))


def _grad_problem(got, want, name: str, shape_names: str, where: str) -> str | None:
    """Why ``got`` is not the float64 tensor ``want`` (finite, its shape, its dtype), before comparing values."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"{where}: {name} is a {type(got).__name__}, not a tensor"
    if not torch.isfinite(got).all():
        return (f"{where}: {name} holds NaN or infinity at {(~torch.isfinite(got)).nonzero()[0].tolist()}: finite "
                "inputs give a finite gradient")
    if tuple(got.shape) != tuple(want.shape):
        return None  # the caller names the shape: it knows which mistake gives which
    if got.dtype != want.dtype:
        return (f"{where}: {name} is {got.dtype}, the inputs are {want.dtype}: keep their dtype (no .float() or "
                f"dtype= on the way), {name} has shape {shape_names}")
    return None


def check_split_linear_backward(answer) -> tuple[str, str]:
    """``answer(x, weight, dy) -> (dx, w)``, ``w() -> (dW, db)``: against autograd in float64, B computing no dW or
    db, each W from its own micro-batch after the next one's B, the caller's tensors untouched."""
    import torch

    for n, d_in, d_out, seed in LINEAR_CASES:
        x, weight, dy, x2, dy2 = inputs = _linear_inputs(n, d_in, d_out, seed)
        kept = [t.clone() for t in inputs]
        where = f"x [{n}, {d_in}], weight [{d_out}, {d_in}], dy [{n}, {d_out}] (seed {seed})"
        want_dx, want_dw, want_db = _autograd_linear(x, weight, dy)
        _, want_dw_2, want_db_2 = _autograd_linear(x2, weight, dy2)  # before the answer can touch x2 or dy2
        try:
            got, made = _made_shapes(answer, x, weight, dy)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - a product of the wrong shapes is the usual cause: name them
            return FAIL, f"at {where}, B raised {type(exc).__name__}: {exc}. The products: {PRODUCTS}"
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return FAIL, (f"at {where}: return a pair (dx, w): dx now, and w, a function of no arguments that returns "
                          f"(dW, db) when the schedule runs W; got {type(got).__name__}")
        dx, weight_grad = got
        if not callable(weight_grad):
            return FAIL, (f"at {where}: the second item is a {type(weight_grad).__name__}, not a function: that is dW "
                          "computed in B. Return a function that computes (dW, db) when it is called, later")
        if not _unchanged(kept[:3], [x, weight, dy]):
            return FAIL, (f"at {where}: B changed the caller's x, weight or dy in place: the forward's stash and the "
                          "next stage's gradient are not yours to overwrite; compute into new tensors")
        problem = _grad_problem(dx, want_dx, "dx", "[n, in]", f"at {where}")
        if problem:
            return FAIL, problem
        if tuple(dx.shape) != (n, d_in):
            return FAIL, (f"at {where}: dx has shape {list(dx.shape)}, the input's is [{n}, {d_in}]: "
                          f"{DX_RULE}")
        if not torch.allclose(dx, want_dx, **LINEAR_TOL):
            if d_in == d_out and torch.allclose(dx, dy @ weight.t(), **LINEAR_TOL):
                return FAIL, (f"at {where}: dx is dy W^T: the forward multiplies by W^T, so the backward multiplies "
                              "by W: dx = dy W")
            return FAIL, (f"at {where}: dx differs from autograd's by up to {(dx - want_dx).abs().max().item():.3g}: "
                          f"{DX_RULE}")
        early = [what for shape, what in (((d_out, d_in), f"dW's shape [{d_out}, {d_in}]"), ((d_out,), f"db's shape "
                 f"[{d_out}]")) if shape in made and shape != (n, d_in)]
        if early:
            return FAIL, (f"at {where}: B computed a tensor of {' and one of '.join(early)} before returning: B is the "
                          "input gradient alone, on the path the previous stage waits on. Leave dW and db to the "
                          "function you return (W), which the schedule runs later, in a bubble: let it keep x and dy, "
                          "and compute from them when it is called")
        try:  # the next micro-batch's B before this one's W, as ZB-H1 runs them; then the W's, oldest first
            _, weight_grad_2 = answer(x2, weight, dy2)
            grads = weight_grad()
            weight_grad_2()
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            return FAIL, f"at {where}, W raised {type(exc).__name__}: {exc}. The products: {PRODUCTS}"
        if not (isinstance(grads, (tuple, list)) and len(grads) == 2):
            return FAIL, f"at {where}: W must return the pair (dW, db); got {type(grads).__name__}"
        dw, db = grads
        for name, got_g, want_g, shape in (("dW", dw, want_dw, f"[{d_out}, {d_in}]"), ("db", db, want_db, f"[{d_out}]")):
            problem = _grad_problem(got_g, want_g, name, shape, f"at {where}")
            if problem:
                return FAIL, problem
        if tuple(dw.shape) != (d_out, d_in):
            if tuple(dw.shape) == (d_in, d_out):
                return FAIL, (f"at {where}: dW has shape [{d_in}, {d_out}], the weight's transposed: x^T dy is dW^T. "
                              f"dW = dy^T x has the weight's shape [{d_out}, {d_in}]")
            return FAIL, f"at {where}: dW has shape {list(dw.shape)}, the weight's is [{d_out}, {d_in}]: {PRODUCTS}"
        if tuple(db.shape) != (d_out,):
            if tuple(db.shape) == (n, d_out) and n > 1:
                return FAIL, (f"at {where}: db has shape [{n}, {d_out}], one row per sample: the bias is added to "
                              "every row, so its gradient is the sum of the rows' gradients, dy.sum(0)")
            return FAIL, (f"at {where}: db has shape {list(db.shape)}, the bias's is [{d_out}]: sum dy over the batch "
                          "dimension without keepdim (dy.sum(0))")
        for name, got_g, want_g, other in (("dW", dw, want_dw, want_dw_2), ("db", db, want_db, want_db_2)):
            if torch.allclose(got_g, want_g, **LINEAR_TOL):
                continue
            if torch.allclose(got_g, other, **LINEAR_TOL):
                return FAIL, (f"at {where}: the first micro-batch's W returned the second's {name}: the second's B "
                              "ran before the first's W (as ZB-H1 runs them), and W read what that B left. Each W must "
                              "use the x and dy of its own B: keep them in the function B returns (a closure), not in "
                              "one place every call shares")
            if name == "dW" and d_in == d_out and torch.allclose(got_g, want_g.t(), **LINEAR_TOL):
                return FAIL, f"at {where}: dW is transposed: x^T dy is dW^T; dW = dy^T x, [out, n] @ [n, in]"
            if name == "db" and torch.allclose(got_g * n, want_g, **LINEAR_TOL):
                return FAIL, (f"at {where}: db is 1/{n} of autograd's: you averaged dy over the batch; the bias is "
                              "added to every row, so every row's gradient adds up: db = dy.sum(0)")
            return FAIL, (f"at {where}: {name} differs from autograd's by up to "
                          f"{(got_g - want_g).abs().max().item():.3g}: {PRODUCTS}")
        if not _unchanged(kept, inputs):
            return FAIL, (f"at {where}: the caller's x, weight or dy changed after W ran (values or storage): B and W "
                          "hold references to the caller's tensors, and the schedule frees them by dropping those "
                          "references; never resize or overwrite them")
    return PASS, (f"dx, dW and db equal autograd's in float64 at {len(LINEAR_CASES)} shapes (n = 1, in != out, in = "
                  "out); B computes dx alone, and each W, run after the next micro-batch's B, uses its own")


register(Exercise("split_linear_backward", "13", "split_linear_backward",
                  "B now, W later: one Linear layer's backward split into input and weight gradients by hand",
                  local=check_split_linear_backward, tries={
                      "non-finite": "every gradient is tested finite before it is compared: a NaN or infinity is "
                                    "named with its position",
                      "order": "the next micro-batch's B runs before this one's W, as in ZB-H1: a W that reads the "
                               "newest stash instead of its own B's is named",
                      "sizes": NOT_APPLICABLE + "whole matrices in one process: nothing is divided among ranks",
                      "ragged": NOT_APPLICABLE + "one micro-batch per call, no partition into pieces",
                      "layouts": "five shapes: n = 1 (where a mean over the batch equals the sum), in != out (where a "
                                 "transposed product has the wrong shape) and in = out (where only its values are "
                                 "wrong)",
                      "traffic": NOT_APPLICABLE + "no messages: the check counts what B computes instead (no tensor "
                                 "of dW's or db's shape)",
                      "mutation": "x, weight and dy (both micro-batches') are compared bit for bit after B and after "
                                  "W: a stash freed by resizing the caller's tensor is named",
                      "output": "the pair (dx, w), w a function, and (dW, db): shapes [n, in], [out, in], [out] and "
                                "the inputs' float64; db of shape [1, out] (keepdim) is named",
                      "memory": NOT_APPLICABLE + "what B keeps for W is references to x and dy, not new tensors; "
                                "the check counts what B computes, not bytes",
                      "bits": NOT_APPLICABLE + "float64 against autograd within 1e-10 relative: the same products in "
                              "another order differ by ~1e-15",
                  }))


# --- fix_schedule: find and repair the broken dependencies of a zero-bubble table -----------------------------------

FIX_TIMES = (1.0, 1.0, 1.0)  # t_F, t_B, t_W: where ZB-H1's bubble is a third of 1F1B's, (p - 1) t_F
MISPLACED = 2  # actions out of place in the table the learner is given


def _moved(row: list, original: list) -> list:
    """The actions of ``row`` that moved against ``original``: those outside a longest common subsequence."""
    n, k = len(original), len(row)
    common = [[0] * (k + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(k - 1, -1, -1):
            common[i][j] = (common[i + 1][j + 1] + 1 if original[i] == row[j]
                            else max(common[i + 1][j], common[i][j + 1]))
    kept, i, j = set(), 0, 0
    while i < n and j < k:
        if original[i] == row[j]:
            kept.add(j)
            i, j = i + 1, j + 1
        elif common[i + 1][j] >= common[i][j + 1]:
            i += 1
        else:
            j += 1
    return [a for j, a in enumerate(row) if j not in kept]


def _label(action) -> str:
    return f"{action[0]}({action[1]})"


def check_fix_schedule(answer) -> tuple[str, str]:
    """``answer(broken) -> table``: every action once, no deadlock, ZB-H1's bubble, at most the misplaced actions moved."""
    from workers.pipeline.validity import simulate_split, table_problem
    from workers.pipeline.zero_bubble import split_stages

    p, m = FIX_STAGES, FIX_MICRO_BATCHES
    broken = broken_schedule()
    got = answer([list(row) for row in broken])
    if not isinstance(got, (list, tuple)) or len(got) != p:
        return FAIL, (f"return the repaired table: a list of {p} action lists, one per rank, as you were given it; got "
                      f"{type(got).__name__}" + (f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""))
    try:
        table = [[tuple(a) for a in row] for row in got]
    except TypeError:
        return FAIL, "each rank's row must be a list of actions like ('F', 0), ('B', 0), ('W', 0)"
    problem = table_problem(table, m)
    if problem:
        first_given = table_problem(broken, m)
        if problem == first_given:
            hint = "that is the first of the table's two mistakes, where you were given it"
        elif "never runs" in problem:
            hint = "an action taken out is not a repair: move it, so that every action runs exactly once"
        elif "twice" in problem:
            hint = "move the action, do not copy it: every action runs exactly once"
        elif "before its B" in problem:
            hint = "W needs the output gradient and the input its B keeps: move the W after its B"
        elif "deadlock" in problem:
            hint = ("a B starts only once the next stage has sent its gradient, and the next stage sends it only after "
                    "the forwards it runs first: run the B after the forward the next stage is waiting for")
        else:
            hint = "check_schedule(table, 6) names one broken dependency at a time"
        return FAIL, f"the table still breaks a dependency: {problem}. {hint[0].upper()}{hint[1:]}"
    span_idle = simulate_split(table, *FIX_TIMES)["span_idle"]
    target = max(simulate_split(split_stages("zb-h1", p, m), *FIX_TIMES)["span_idle"])
    worst = max(range(p), key=lambda r: span_idle[r])
    moved = {r: _moved(table[r], broken[r]) for r in range(p)}
    count = sum(len(acts) for acts in moved.values())
    described = ("; ".join(f"rank {r}: {', '.join(map(_label, acts))}" for r, acts in moved.items() if acts)
                 if count <= 8 else f"{count} actions on {sum(1 for acts in moved.values() if acts)} ranks")
    if not span_idle[worst] <= target + 1e-9:
        right_after = [f"{_label(a)} on rank {r}" for r, acts in moved.items() for a in acts
                       if a[0] == "W" and table[r].index(a) > 0 and table[r][table[r].index(a) - 1] == ("B", a[1])]
        overtaking = [f"B({a[1]}) before B({b[1]}) on rank {r}" for r, acts in moved.items() for a in acts
                      if a[0] == "B" for b in table[r][table[r].index(a) + 1:] if b[0] == "B" and b[1] < a[1]][:1]
        if right_after:
            why = (f"{' and '.join(right_after)} now runs right after its B, where it delays the F and B that other "
                   "stages wait for; a W belongs where its rank would otherwise wait")
        elif overtaking:
            why = (f"the table now runs {overtaking[0]}: the gradients come back in micro-batch order, so that B "
                   "waits, and holds up the B behind it")
        else:
            why = "an action moved earlier or later than it need be leaves a rank waiting"
        return FAIL, (f"the table runs, but its bubble is {span_idle[worst]:g} time units on rank {worst} (idle inside "
                      f"its own span at t_F = t_B = t_W = 1) where ZB-H1's is {target:g}: {why} (you moved: "
                      f"{described or 'nothing'}). Compare with split_stages('zb-h1', {p}, {m})")
    if count > MISPLACED:
        return FAIL, (f"the table runs with ZB-H1's bubble, but you moved {count} actions ({described}) where "
                      f"{MISPLACED} are out of place: repair the table you were given, do not write another (the "
                      "W's after a rank's last B may stay in any order)")
    return PASS, (f"every action runs once, no rank waits on another for ever, and the bubble is ZB-H1's, {target:g} "
                  f"time units at t_F = t_B = t_W = 1, after moving {described}")


register(Exercise("fix_schedule", "13", "fix_schedule",
                  "Find and repair the two broken dependencies of a hand-written ZB-H1 table",
                  local=check_fix_schedule, tries={
                      "non-finite": NOT_APPLICABLE + "a table of labels and integer indices: an index that is not an "
                                    "integer (NaN included) is named as not an action",
                      "order": NOT_APPLICABLE + "the answer is a table; no gradient is accumulated",
                      "sizes": NOT_APPLICABLE + "one table, p = 4 and m = 6, the one the learner repairs",
                      "ragged": NOT_APPLICABLE + "every rank runs the same m micro-batches",
                      "layouts": NOT_APPLICABLE + "the repair of one given table is checked, not a rule over shapes",
                      "traffic": "each rank's list is spelt out with its sends and receives and replayed with "
                                 "blocking receives: a table whose wire order deadlocks is named, with the two ranks "
                                 "waiting on each other",
                      "mutation": NOT_APPLICABLE + "the table passed in is the check's own copy: repairing it in "
                                  "place is allowed",
                      "output": NOT_APPLICABLE + "the table is read by value (lists or tuples); a malformed row or "
                                "action is named as such",
                      "memory": NOT_APPLICABLE + "no tensors: a table's stash is the same wherever the two actions go",
                      "bits": NOT_APPLICABLE + "labels and integers; the bubble is a sum of whole time units, "
                              "compared within 1e-9",
                  }))


# --- predict_bubble: a schedule's bubble from its table, before running it ------------------------------------------

# (schedule, p, m, t_F, t_B, t_W), times per action of the table (in ZB-V, one chunk). Ordered so that a formula right
# only in the common case passes those first, then fails with the case that shows why: ZB-H1 at t_W > t_F, ZB-V with
# fewer micro-batches than the 2p - 1 that fill its V, and more than that.
BUBBLE_CASES = (
    ("1f1b", 4, 8, 1.0, 1.0, 1.0), ("1f1b", 4, 2, 1.0, 2.0, 1.0), ("1f1b", 2, 5, 2.0, 1.0, 1.5),
    ("1f1b", 8, 8, 1.0, 2.0, 1.0),
    ("zb-h1", 4, 8, 1.0, 1.0, 1.0), ("zb-h1", 4, 6, 1.0, 2.0, 0.5), ("zb-h1", 3, 9, 2.0, 1.0, 1.0),
    ("zb-h1", 8, 16, 1.5, 1.0, 1.0), ("zb-h1", 4, 4, 1.0, 1.0, 1.0),
    ("zb-h1", 4, 8, 1.0, 2.0, 3.0), ("zb-h1", 3, 6, 1.0, 1.0, 2.0), ("zb-h1", 8, 8, 1.0, 1.5, 2.0),
    ("zb-v", 4, 7, 1.0, 1.0, 1.0), ("zb-v", 3, 9, 2.0, 2.0, 2.0),
    ("zb-v", 4, 4, 1.0, 1.0, 1.0), ("zb-v", 2, 1, 0.5, 0.5, 0.5), ("zb-v", 8, 10, 1.0, 1.0, 1.0),
    ("zb-v", 4, 12, 1.0, 1.0, 1.0),
)


def replayed_bubble(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The bubble the zero-bubble paper counts, from the table replayed in ideal time (``validity.simulate_split``):
    the largest idle time of a rank between the start of its own first action and the end of its own last."""
    from workers.pipeline.schedules import all_stages
    from workers.pipeline.validity import simulate_split
    from workers.pipeline.zero_bubble import placement_of, split_stages

    if schedule == "1f1b":  # no W actions: its B is the whole backward, t_B + t_W
        return max(simulate_split(all_stages("1f1b", p, m), t_f, t_b, t_w)["span_idle"])
    v = 2 if placement_of(schedule) == "v" else 1  # simulate_split's times are a rank's whole share: v chunks
    sim = simulate_split(split_stages(schedule, p, m), t_f * v, t_b * v, t_w * v, placement=placement_of(schedule))
    return max(sim["span_idle"])


def _bubble_hint(schedule, p, m, t_f, t_b, t_w, got, want) -> str:
    def near(value):
        return abs(got - value) <= 1e-9 * max(1.0, abs(value))

    if got < 0:
        return "a bubble is idle time, never below zero: where nothing is left idle, it is 0"
    if schedule != "1f1b" and near((p - 1) * (t_f + t_b + t_w)):
        return (f"that is 1F1B's bubble, (p-1)(t_F + t_B + t_W): in {schedule.upper()} the backward is split, and the "
                "W's, which nobody waits for, fill idle time that 1F1B leaves; work out which idle time they can fill")
    if schedule == "1f1b" and near((p - 1) * (t_f + t_b)):
        return "1F1B's table has no W: its B is the whole backward, t_B + t_W"
    if schedule == "zb-h1" and t_w > t_f and near((p - 1) * (t_f + t_b - t_w)):
        return ("(p-1)(t_F + t_B - t_W) is the paper's count for t_W <= t_F. A W fills only idle time that is there: "
                "draw stage 0's timeline at t_W > t_F and see which of its waits a W cannot shorten")
    if schedule == "zb-v" and m < 2 * p - 1 and near(0.0):
        return (f"the V runs without a gap only with m >= 2p - 1 = {2 * p - 1} micro-batches: with fewer, rank 0's "
                "warm-up runs out of chunk-0 forwards before the first micro-batch comes back up the V, and the "
                "cool-down waits as long at the end")
    if schedule == "zb-v" and m < 2 * p - 1 and near((2 * p - 1 - m) * t_f):
        return "half of it: rank 0 waits at the start, before the first micro-batch comes back up the V, and at the end"
    work = m * (t_f + t_b + t_w)  # a rank's busy time in the step
    if near(want / (want + work)) or near(want / work):
        return "return a time, in the units of t_F, t_B and t_W, not a share of the step or of its ideal time"
    return "replay the table by hand on a timeline (stage 0, then the last) and count the idle time between its ends"


PREDICT_LIMIT_S = 10.0  # one case's answer: a formula returns at once


def check_predict_bubble(answer) -> tuple[str, str]:
    """``answer(schedule, p, m, t_f, t_b, t_w)`` against ``replayed_bubble`` on every case of ``BUBBLE_CASES``."""
    import math
    from unittest import mock

    from workers.pipeline import schedules, validity

    def replay_refused(*args, **kwargs):
        raise RuntimeError("predict_bubble replayed the table: predict it, from how the table is built")

    for schedule, p, m, t_f, t_b, t_w in BUBBLE_CASES:
        want = replayed_bubble(schedule, p, m, t_f, t_b, t_w)
        where = f"{schedule} at p={p}, m={m}, t_F={t_f:g}, t_B={t_b:g}, t_W={t_w:g}"
        # the replays refused while the answer runs, and only then: an answer that never returns is left behind after
        # its limit with the module functions restored, so the learner's notebook keeps its simulate_split
        with mock.patch.object(validity, "simulate_split", replay_refused), \
                mock.patch.object(schedules, "simulate", replay_refused):
            got = call_answer(answer, schedule, p, m, t_f, t_b, t_w, limit_s=PREDICT_LIMIT_S)
        try:
            got = float(got)
        except (TypeError, ValueError):
            return FAIL, f"{where}: return one number, the bubble in time units; got {type(got).__name__}"
        if not math.isfinite(got):
            return FAIL, f"{where}: you predict {got}: a bubble is a finite time, 0 where no rank idles"
        if not abs(got - want) <= 1e-9 * max(1.0, abs(want)):
            return FAIL, (f"{where}: you predict {got:g}, the table replayed in ideal time gives {want:g}: "
                          f"{_bubble_hint(schedule, p, m, t_f, t_b, t_w, got, want)}")
    return PASS, (f"right on {len(BUBBLE_CASES)} cases: 1F1B, ZB-H1 at t_W below and above t_F, and ZB-V with fewer "
                  "micro-batches than fill its V and more")


register(Exercise("predict_bubble", "13", "predict_bubble",
                  "The bubble of 1F1B, ZB-H1 and ZB-V from how their tables are built, before running them",
                  local=check_predict_bubble, timeout_s=60.0, tries={
                      "non-finite": "a prediction of NaN or infinity is named before any comparison",
                      "order": NOT_APPLICABLE + "the answer is one number per case; no gradient",
                      "sizes": "m below p (1F1B), at p (ZB-H1) and below, at and above 2p - 1 (ZB-V): a V formula "
                               "true only once the V is full fails where it is not",
                      "ragged": NOT_APPLICABLE + "micro-batches of equal cost; no partition",
                      "layouts": "18 (schedule, p, m, times) cases from p = 2 to 8, t_W below, at and above t_F: the "
                                 "paper's ZB-H1 formula, true while t_W <= t_F, fails above it",
                      "traffic": NOT_APPLICABLE + "ideal time, no messages",
                      "mutation": NOT_APPLICABLE + "the inputs are a name and five numbers",
                      "output": NOT_APPLICABLE + "one number, read with float(): a tuple or a string is named",
                      "memory": NOT_APPLICABLE + "no tensors: the answer is one number per case",
                      "bits": NOT_APPLICABLE + "sums of the given times, compared within 1e-9 relative",
                  }))
