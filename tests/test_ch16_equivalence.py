"""``workers/moe/equivalence.compare`` on synthetic ranks, in one process: equal entries give no sentence, and a NaN
or an infinity in the output, a gradient, the aux loss or the input's gradient is a difference, named as not finite
(a NaN compares False against any tolerance, and the max of a tensor holding one is NaN: a check written
``diff > tol`` would let it through)."""
import math

import pytest
import torch

from workers.moe.equivalence import compare

WORLD, TOKENS, HIDDEN = 2, 3, 4  # tokens per rank


def _synthetic():
    """The one-process reference and two ranks that returned exactly it (rank r holds expert r)."""
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    experts = torch.tensor([[0, 1]] * TOKENS)
    keep = torch.ones(TOKENS, 2, dtype=torch.bool)
    grads = {"router.weight": draw(2, HIDDEN), "experts.0.fc1": draw(HIDDEN, HIDDEN), "experts.1.fc1": draw(HIDDEN, HIDDEN)}
    ref = {"y": draw(WORLD * TOKENS, HIDDEN), "input_grad": draw(WORLD * TOKENS, HIDDEN), "grads": grads,
           "records": [(experts, keep)] * WORLD, "aux": 1.25}
    mine = slice(0, TOKENS), slice(TOKENS, 2 * TOKENS)
    cases = [{"experts": experts.clone(), "keep": keep.clone(), "dropped": 0, "aux": ref["aux"],
              "y": ref["y"][mine[r]].clone(), "input_grad": ref["input_grad"][mine[r]].clone(),
              "grads": {n: g.clone() for n, g in grads.items() if not n.startswith("experts.") or n == f"experts.{r}.fc1"}}
             for r in range(WORLD)]
    return cases, ref


def test_equal_ranks_give_no_difference():
    cases, ref = _synthetic()
    assert compare(cases, ref, WORLD, ep=WORLD) == []


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where, fragment", [
    ("y", "the output differs at 1 of 6 tokens (rank 1 token 2), 1 of its 24 entries are NaN or infinite"),
    ("input_grad", "the input's gradient differs, 1 of its 24 entries are NaN or infinite"),
    ("router.weight", "router.weight's gradient differs on rank 0: 1 of its 8 entries are NaN"),
    ("experts.1.fc1", "experts.1.fc1's gradient differs on rank 1 (held by rank 1): 1 of its 16 entries are NaN"),
], ids=["output", "input-gradient", "router-gradient", "expert-gradient"])
def test_a_non_finite_tensor_is_a_difference_named_as_such(value, where, fragment):
    cases, ref = _synthetic()
    if where in ("y", "input_grad"):
        cases[1][where][-1, -1] = value
    else:
        holder = 1 if where.startswith("experts.") else 0
        cases[holder]["grads"][where][0, 0] = value
    found = compare(cases, ref, WORLD, ep=WORLD)
    assert len(found) == 1 and fragment in found[0], found


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_aux_loss_is_a_difference_named_as_such(value):
    cases, ref = _synthetic()
    cases[0]["aux"] = value
    found = compare(cases, ref, WORLD, ep=WORLD)
    assert len(found) == 1 and f"the load-balancing loss is {value / 2} (the ranks' mean), not finite" in found[0], found


def test_the_notebook_error_columns_keep_a_nan():
    from course_utils.ch16 import max_errors

    cases, ref = _synthetic()
    cases[1]["grads"]["experts.1.fc1"][0, 0] = math.nan
    out, grad = max_errors(cases, ref)
    assert out == 0.0 and math.isnan(grad)
