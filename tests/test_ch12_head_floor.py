"""Chapter 12, the frozen-head floor (``course_utils.ch12_floor``): the lowest loss on a target token
that any residual stream can reach through a frozen final LayerNorm and LM head. Checked against a closed
form (two tokens), a brute-force grid (a 3-feature head), a real ``nn.LayerNorm`` fed random and optimised
inputs, and the tiny GPT's own head (why blocks-only LoRA stalls in the notebook)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_utils.ch12_floor import frozen_head_floor
from workers.posttrain import task
from workers.posttrain.train import TOY, make_policy

pytestmark = pytest.mark.usefixtures("one_thread")


def _affine_ln(d, seed):
    g = torch.Generator().manual_seed(seed)
    ln = nn.LayerNorm(d).double()
    with torch.no_grad():
        ln.weight.copy_(0.5 + torch.rand(d, generator=g, dtype=torch.float64))  # gains in [0.5, 1.5]
        ln.bias.copy_(0.3 * torch.randn(d, generator=g, dtype=torch.float64))
    return ln


def _loss_through(ln, W, x, targets):
    logits = ln(x) @ W.T  # [n, V]
    return torch.logsumexp(logits, -1) - logits.gather(1, targets[:, None]).squeeze(1)  # [n]


def test_two_tokens_match_the_closed_form():
    # V = 2: loss = softplus(-(a_t - a_o).z - (c_t - c_o)) with a_v = g * w_v, c_v = w_v . b. Over zero-mean z
    # of norm <= R the best z points along the zero-mean part of a_t - a_o, so the floor is
    # softplus(-(R ||P (a_t - a_o)|| + c_t - c_o)), P removing the mean.
    d = 5
    W = torch.randn(2, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ln = _affine_ln(d, seed=2)
    a = W * ln.weight.detach()
    c = W @ ln.bias.detach()
    diff = a[0] - a[1]
    want = F.softplus(-(math.sqrt(d) * (diff - diff.mean()).norm() + c[0] - c[1]))
    got = frozen_head_floor(W, [0], ln.weight, ln.bias)
    assert float(got.floor[0]) == pytest.approx(float(want), abs=1e-9)
    # without the zero-mean constraint the bound would be lower (||diff|| >= ||P diff||): LayerNorm's mean
    # removal is part of what the head cannot escape
    assert float(F.softplus(-(math.sqrt(d) * diff.norm() + c[0] - c[1]))) < float(want)


def test_floor_matches_a_brute_force_grid_on_a_tiny_head():
    # d = 3: the zero-mean vectors of norm <= sqrt(3) form a disc; a polar grid over it is an exhaustive search
    torch.manual_seed(0)
    V, d = 4, 3
    W = 2.0 * torch.randn(V, d, dtype=torch.float64)
    ln = _affine_ln(d, seed=3)
    basis = torch.linalg.qr(torch.tensor([[1.0, -1.0, 0.0], [1.0, 1.0, -2.0]], dtype=torch.float64).T)[0].T  # [2, 3]
    r = torch.linspace(0, math.sqrt(d), 401, dtype=torch.float64)
    theta = torch.linspace(0, 2 * math.pi, 2001, dtype=torch.float64)
    uv = torch.stack([torch.outer(r, theta.cos()), torch.outer(r, theta.sin())], -1).reshape(-1, 2)
    z = uv @ basis  # [n, 3], each of mean 0 and norm <= sqrt(3)
    logits = (z * ln.weight.detach() + ln.bias.detach()) @ W.T  # [n, V]
    grid_min = (torch.logsumexp(logits, -1)[:, None] - logits).min(0).values  # [V]
    floor = frozen_head_floor(W, range(V), ln.weight, ln.bias).floor
    # a lower bound: never above what some grid point achieves; and tight: the grid (spacing ~4e-3) gets close
    assert torch.all(floor <= grid_min + 1e-12), (floor, grid_min)
    assert torch.all(grid_min - floor < 1e-4), (floor, grid_min)


def test_no_input_through_a_real_layernorm_beats_the_floor_and_an_optimised_one_reaches_it():
    d, V = 8, 6
    W = torch.randn(V, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ln = _affine_ln(d, seed=5)
    targets = torch.arange(V)
    floor = frozen_head_floor(W, targets, ln.weight, ln.bias).floor
    # random residuals at every scale, tiny ones included (there LayerNorm's eps shrinks the output's norm)
    g = torch.Generator().manual_seed(6)
    scales = 10.0 ** torch.linspace(-4, 3, 50, dtype=torch.float64)
    x = torch.randn(50, 200, d, generator=g, dtype=torch.float64) * scales[:, None, None]
    x = x.reshape(-1, d)
    with torch.no_grad():
        for t in range(V):
            assert _loss_through(ln, W, x, torch.full((len(x),), t)).min() >= floor[t] - 1e-12
    # and the floor is attained by inputs the real LayerNorm accepts: Adam on x gets within 1e-3 of it
    x = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(1000):
        opt.zero_grad()
        _loss_through(ln, W, x, targets).sum().backward()
        opt.step()
    with torch.no_grad():
        reached = _loss_through(ln, W, x, targets)
    assert torch.all(reached >= floor - 1e-12) and torch.all(reached - floor < 1e-3), (reached, floor)


def test_the_solution_is_feasible_and_the_certificate_holds_even_unconverged():
    W = torch.randn(13, 48, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    best = frozen_head_floor(W, range(13))
    assert torch.all(best.gap < 1e-9)
    assert torch.all(best.z.sum(-1).abs() < 1e-9) and torch.all(best.z.norm(dim=-1) <= math.sqrt(48) + 1e-9)
    # one step: the solver's z is far from the optimum, but the certified floor is still below the true one
    rough = frozen_head_floor(W, range(13), steps=1)
    assert torch.all(rough.floor <= best.floor + 1e-12) and torch.all(rough.achieved >= best.achieved - 1e-12)
    # adding a multiple of the all-ones vector to every head row changes no logit difference on zero-mean z
    assert torch.allclose(frozen_head_floor(W + 3.0, range(13)).floor, best.floor, atol=1e-9)


def test_the_tiny_gpt_head_caps_the_answer_loss_near_1_7_nats():
    # seed 0's frozen random head (std 0.02) and the final LayerNorm at init (gain 1, bias 0): every digit's
    # floor lies in 1.6 .. 1.9 nats (1.665 .. 1.839 here, the same under AVX-512, AVX2 and plain kernels), and
    # the answer tokens of the training prompts average 1.70. Blocks-only LoRA can change the residual stream
    # only, so its answer-token loss can never go below that.
    model = make_policy(0)
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.ln_f.bias == 0)
    floor = frozen_head_floor(model.head.weight, range(10), model.ln_f.weight, model.ln_f.bias)
    assert torch.all((floor.floor > 1.6) & (floor.floor < 1.9)), floor.floor
    answers = task.sequences(task.split_pairs()[0])[:, task.PROMPT_LEN:].reshape(-1).tolist()
    assert floor.mean_over(answers) == pytest.approx(1.70, abs=0.01)
    assert TOY.hidden == floor.z.shape[1]


def test_targets_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="token ids in 0..12"):
        frozen_head_floor(torch.randn(13, 4), [13])
