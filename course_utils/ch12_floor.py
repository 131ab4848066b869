"""The lowest loss a model can reach on a token when its final LayerNorm and LM head are frozen.

The tiny GPT ends with ``logits = W_head (g * z + b)``, where ``z = (x - mean(x)) / sqrt(var(x) + eps)`` is
the LayerNorm's normalised input and ``g``, ``b`` its affine weight and bias. Whatever the blocks compute,
``z`` has mean 0 over its d features and norm ``sqrt(d var / (var + eps)) < sqrt(d)``: it lies in the
zero-mean ball of radius sqrt(d), and every point inside it (norm below sqrt(d)) is some x's. With ``W_head``, ``g``,
``b`` frozen (LoRA on the blocks only), the loss on target token t is therefore at least

    floor(t) = min over {z : sum(z) = 0, ||z|| <= sqrt(d)} of  -log softmax(A z + c)[t],   A = W diag(g), c = W b.

``-log softmax(A z + c)[t] = logsumexp(A z + c) - (A z + c)[t]`` is convex in z (a logsumexp of affine
functions minus an affine one), and the set is convex, so projected gradient descent finds the global
minimum; no local optimum can mislead it. The projection is exact: remove the mean (the zero-mean plane),
then shrink onto the ball (its centre, 0, lies in the plane). The returned floor is *certified*: by
convexity, f(z) >= f(z*) + grad.(z - z*) for every feasible z, so f(z*) - max_z grad.(z* - z) =
f(z*) - (grad.z* + R ||P grad||) is a true lower bound, whatever the solver's convergence; at the optimum
the two coincide (the returned ``gap`` is their difference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadFloor:
    targets: tuple  # the target token ids, one row each below
    floor: torch.Tensor  # [T] float64: certified lower bound on -log p(target), nats
    achieved: torch.Tensor  # [T]: the loss at the solver's feasible z (>= floor; equal at the optimum)
    z: torch.Tensor  # [T, d]: that z (mean 0, norm <= radius)
    gap: torch.Tensor  # [T]: achieved - floor, the certificate's slack

    def mean_over(self, tokens) -> float:
        """Mean floor over a list of target tokens (repeats count): a floor of their mean loss."""
        row = {t: i for i, t in enumerate(self.targets)}
        return float(torch.stack([self.floor[row[int(t)]] for t in tokens]).mean())


def _project(z: torch.Tensor, radius: float) -> torch.Tensor:
    z = z - z.mean(dim=-1, keepdim=True)  # onto the zero-mean plane
    norm = z.norm(dim=-1, keepdim=True)
    return z * torch.clamp(radius / norm.clamp_min(1e-300), max=1.0)  # then onto the ball inside it


def _loss_and_grad(z, A, c, targets):
    logits = z @ A.T + c  # [T, V]
    p = torch.softmax(logits, dim=-1)
    loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None]).squeeze(1)  # [T]
    onehot = torch.nn.functional.one_hot(targets, A.shape[0]).to(A.dtype)
    return loss, (p - onehot) @ A  # [T], [T, d]


def _certified(z, A, c, targets, radius):
    """(loss at z, certified lower bound on the minimum): f(z) - max over the feasible set of grad . (z - z')."""
    loss, grad = _loss_and_grad(z, A, c, targets)
    plane_grad = grad - grad.mean(dim=-1, keepdim=True)  # the gradient's part inside the zero-mean plane
    slack = (grad * z).sum(-1) + radius * plane_grad.norm(dim=-1)  # >= 0 by Cauchy-Schwarz
    return loss, loss - slack.clamp_min(0.0)


@torch.no_grad()
def frozen_head_floor(head_weight: torch.Tensor, targets, ln_weight: torch.Tensor | None = None,
                      ln_bias: torch.Tensor | None = None, radius: float | None = None,
                      steps: int = 5000, tol: float = 1e-10) -> HeadFloor:
    """Certified minimum of -log softmax(head(LayerNorm output))[t] for each t in ``targets``.

    ``head_weight`` [V, d] (a bias-free head, as the tiny GPT's); ``ln_weight``, ``ln_bias`` [d]: the final
    LayerNorm's affine parameters (None: no affine, i.e. gain 1 and bias 0); ``radius``: the bound on the
    normalised vector's norm, sqrt(d) by default (LayerNorm's eps only makes it smaller). Solved in float64
    by projected gradient descent with step 1 / L, L = ||A||^2 / 2 the gradient's Lipschitz constant (the
    Hessian of logsumexp is at most 1/2 in every direction), with Nesterov momentum, until the certificate's
    gap is below ``tol`` nats or ``steps`` run out (the floor is a true lower bound either way)."""
    W = head_weight.detach().double()
    V, d = W.shape
    g = torch.ones(d, dtype=torch.float64) if ln_weight is None else ln_weight.detach().double()
    b = torch.zeros(d, dtype=torch.float64) if ln_bias is None else ln_bias.detach().double()
    R = float(d) ** 0.5 if radius is None else float(radius)
    A, c = W * g, W @ b  # logits = A z + c: [V, d], [V]
    t = torch.as_tensor(list(targets), dtype=torch.long)
    if t.numel() == 0 or t.min() < 0 or t.max() >= V:
        raise ValueError(f"targets must be token ids in 0..{V - 1}, got {t.tolist()}")
    step = 2.0 / max(float(torch.linalg.matrix_norm(A, ord=2)) ** 2, 1e-30)
    # start from the direction that raises the target logit most (the V = 2 solution, a good first guess)
    z = _project(R * 1e3 * (A[t] - A.mean(0)), R)
    y, z_prev = z.clone(), z.clone()
    for k in range(steps):
        _, grad = _loss_and_grad(y, A, c, t)
        z = _project(y - step * grad, R)
        y = z + (k / (k + 3)) * (z - z_prev)
        z_prev = z
        if k % 50 == 49:
            loss, floor = _certified(z, A, c, t, R)
            if float((loss - floor).max()) < tol:
                break
    loss, floor = _certified(z, A, c, t, R)
    return HeadFloor(targets=tuple(t.tolist()), floor=floor, achieved=loss, z=z, gap=loss - floor)

