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

from workers.layout.mesh import Mesh
from workers.parallel.circuits import CIRCUITS, VARIANTS, circuits, library
from workers.runtime import divides_world, entrypoint, one_of, refusal


def check_params(world_size, variant, rows, hidden, tp, **_):
    group = tp or world_size
    return refusal(one_of("variant", variant, list(VARIANTS)), divides_world("tp", group, world_size)) or \
        refusal(*(_multiple(name, value, group) for name, value in (("rows", rows), ("hidden", hidden))))


def _multiple(name: str, value: int, group: int) -> str | None:
    """rows and hidden are split over the group's ranks: the group size must divide them."""
    if isinstance(value, int) and value >= 1 and value % group == 0:
        return None
    return (f"{name}={value} must be a positive multiple of tp={group} (each rank holds {name}/tp of it): "
            f"try {2 * group}")


def main(ctx, variant: str = "correct", rows: int = 4, hidden: int = 4, seed: int = 0, tp: int = 0,
         group_timeout: float = 20.0):
    """gradcheck every circuit in float64 on this rank, inside its tensor-parallel group of ``tp`` ranks.

    ``tp`` 0 means the whole world (one group).
    """
    tp = tp or ctx.world_size
    m = {**library(), **VARIANTS[variant]}
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, hidden), generator=gen, dtype=torch.float64).to(ctx.device).requires_grad_()  # replicated
    verdicts = {}
    for name in CIRCUITS:
        # Fresh groups per circuit with a short timeout: if a broken backward ever left the ranks out of
        # step, the next circuit could not be confused with this one, and the wait ends in an error.
        with Mesh.for_world(("tp",), tp=tp, timeout_s=group_timeout) as mesh:
            fn = circuits(m, mesh.group("tp"), mesh.rank_in("tp"), hidden, seed, ctx.device)[name]
            try:
                torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=True)
                verdicts[name] = {"passed": True, "message": ""}
            except GradcheckError as exc:
                verdicts[name] = {"passed": False, "message": str(exc).strip().splitlines()[0]}
            # How far off is the backward? One vector-Jacobian product against a central difference.
            verdicts[name]["grad_ratio"] = _vjp_ratio(fn, x)
    return {"gradcheck": verdicts, "variant": variant, "tp": tp, "group_ranks": mesh.ranks("tp")}


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
