"""``torch.autograd.gradcheck`` on real ranks, in float64, through the collectives.

    torchrun --nproc-per-node 4 workers/ch03_gradcheck.py --variant g_backward_all_reduce

gradcheck compares the backward (analytical Jacobian) with finite differences of the forward
(numerical Jacobian). On ranks it must check a function whose input and output are *replicated*: every
rank perturbs the same entry of its copy of the input at the same time, which is exactly perturbing the
one logical input, and every rank seeds the backward with the same output gradient, which is exactly
differentiating the one logical output. So each circuit starts from a replicated x, goes through a
parallel region where each rank computes something of its own (weights that depend on the rank), and
comes back to a replicated y. If any mapping's backward disagrees with its forward, the circuit's
Jacobian is wrong on every rank and gradcheck fails on every rank.

``variant`` swaps one library mapping for a plausible wrong one, to show gradcheck catching it. The circuits
and the wrong mappings live in ``workers/parallel/circuits.py``.
"""
import torch
from torch.autograd.gradcheck import GradcheckError

from workers.parallel.circuits import CIRCUITS, VARIANTS, circuits, library
from workers.parallel.groups import TensorParallelGroups
from workers.runtime import entrypoint
from workers.parallel.grid import choose_divisor


def check_params(world_size, variant, rows, hidden, tp_size, **_):
    if variant not in VARIANTS:
        return f"variant={variant!r} is not known: choose one of {', '.join(VARIANTS)}"
    tp = tp_size or world_size
    if tp < 1 or world_size % tp:
        return f"tp_size={tp_size} does not divide world_size={world_size}: {choose_divisor(world_size)}"
    if rows % tp or hidden % tp or rows < 1 or hidden < 1:
        return (f"rows={rows} and hidden={hidden} must be positive multiples of the group size {tp}: "
                f"try rows={tp} hidden={2 * tp}")
    return None


def main(ctx, variant: str = "correct", rows: int = 4, hidden: int = 4, seed: int = 0, tp_size: int = 0,
         group_timeout: float = 20.0):
    """gradcheck every circuit in float64 on this rank, inside its group of ``tp_size`` ranks (0: the world)."""
    tp = tp_size or ctx.world_size
    m = {**library(), **VARIANTS[variant]}
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, hidden), generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()  # replicated
    verdicts = {}
    for name in CIRCUITS:
        # Fresh groups per circuit with a short timeout: if a broken backward ever left the ranks out of
        # step, the next circuit could not be confused with this one, and the wait ends in an error.
        with TensorParallelGroups(tp, timeout_s=group_timeout) as groups:
            fn = circuits(m, groups.group, groups.rank, hidden, seed, ctx.device)[name]
            try:
                torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=True)
                verdicts[name] = {"passed": True, "message": ""}
            except GradcheckError as exc:
                verdicts[name] = {"passed": False, "message": str(exc).strip().splitlines()[0]}
            # How far off is the backward? One vector-Jacobian product against a central difference.
            verdicts[name]["grad_ratio"] = _vjp_ratio(fn, x)
    return {"gradcheck": verdicts, "variant": variant, "tp_size": tp, "group_ranks": groups.ranks}


def _vjp_ratio(fn, x: torch.Tensor, eps: float = 1e-6) -> float:
    """<v, J u> from the backward over the same from finite differences, for fixed u and v on all ranks.

    1.0 when the backward matches the forward; the world size when the backward adds the gradient up n
    times. u and v come from a fixed seed, so every rank uses the same ones (they are replicated too).
    """
    gen = torch.Generator().manual_seed(1234)
    u = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device)
    xx = x.detach().clone().requires_grad_()
    y = fn(xx)
    v = torch.randn(y.shape, generator=gen, dtype=x.dtype).to(x.device)
    (grad,) = torch.autograd.grad(y, xx, v)
    analytic = (grad * u).sum().item()
    with torch.no_grad():
        numeric = ((fn(x.detach() + eps * u) - fn(x.detach() - eps * u)) * v).sum().item() / (2 * eps)
    return analytic / numeric if numeric else float("nan")


if __name__ == "__main__":
    entrypoint(main)
