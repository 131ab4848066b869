"""``torch.autograd.gradcheck`` on real ranks, in float64, through the collectives.

    torchrun --nproc-per-node 4 workers/ch03_gradcheck.py --variant g_backward_all_reduce

gradcheck compares the backward (analytical Jacobian) with finite differences of the forward
(numerical Jacobian). On ranks it must check a function whose input and output are *replicated*: every
rank perturbs the same entry of its copy of the input at the same time, which is exactly perturbing the
one logical input, and every rank seeds the backward with the same output gradient, which is exactly
differentiating the one logical output. So each circuit below starts from a replicated x, goes through a
parallel region where each rank computes something of its own (weights that depend on the rank), and
comes back to a replicated y. If any mapping's backward disagrees with its forward, the circuit's
Jacobian is wrong on every rank and gradcheck fails on every rank.

``variant`` swaps one library mapping for a plausible wrong one, to show gradcheck catching it.
"""
import torch
import torch.distributed as dist
from torch.autograd.gradcheck import GradcheckError

from workers.parallel import mappings as M
from workers.parallel.faults import all_reduce_both_ways
from workers.parallel.groups import TensorParallelGroups
from workers.runtime import entrypoint

# -- plausible wrong mappings -------------------------------------------------------------------------


class _CopyWithIdentityBackward(torch.autograd.Function):
    """``f`` that forgot its all-reduce: each rank keeps only its own part of the input gradient."""

    @staticmethod
    def forward(ctx, x, group):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherWithSummingBackward(torch.autograd.Function):
    """Gather along the last dim whose backward sums the (already replicated) gradient before splitting."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return M.gather_from_tensor_model_parallel_region(x.detach(), group=group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[r].contiguous(), None


class _ScatterWrongChunk(torch.autograd.Function):
    """Split along the last dim that keeps the next rank's slice, with the usual all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n, dim=-1)[(r + 1) % n].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return M.gather_from_tensor_model_parallel_region(grad, group=ctx.group), None


VARIANTS = {
    "correct": {},
    "f_backward_identity": {"f": lambda x, group=None: _CopyWithIdentityBackward.apply(x, group)},
    "g_backward_all_reduce": {"g": all_reduce_both_ways},
    "gather_backward_sums": {"gather": lambda x, group=None: _GatherWithSummingBackward.apply(x, group)},
    "scatter_wrong_chunk": {"scatter": lambda x, group=None: _ScatterWrongChunk.apply(x, group)},
}


def library() -> dict:
    return {
        "f": M.copy_to_tensor_model_parallel_region,
        "g": M.reduce_from_tensor_model_parallel_region,
        "scatter": M.scatter_to_tensor_model_parallel_region,
        "gather": M.gather_from_tensor_model_parallel_region,
        "scatter_seq": M.scatter_to_sequence_parallel_region,
        "gather_seq": M.gather_from_sequence_parallel_region,
        "reduce_scatter_seq": M.reduce_scatter_to_sequence_parallel_region,
        "all_to_all": M.all_to_all,
    }


# -- circuits: replicated x -> parallel region with rank-specific weights -> replicated y ---------------

def _weights(shape, rank: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + rank)  # different on every rank: a real parallel region
    return (torch.randn(shape, generator=gen, dtype=torch.float64) / shape[0] ** 0.5).to(device)


def circuits(m: dict, group, rank: int, hidden: int, seed: int, device) -> dict:
    n = dist.get_world_size(group)
    w_square = _weights((hidden, hidden), rank, seed, device)  # [h, h]
    w_shard = _weights((hidden // n,), rank, seed + 1, device)  # [h/n]
    w_up = _weights((hidden, 2 * hidden), rank, seed + 2, device)  # [h, 2h]
    w_down = _weights((2 * hidden, hidden), rank, seed + 3, device)  # [2h, h]
    return {
        # Megatron's f ... g sandwich: y = sum_r tanh(x W_r)
        "f -> tanh(x W_r) -> g": lambda x: m["g"](torch.tanh(m["f"](x, group=group) @ w_square), group=group),
        # last-dim split and gather: y = cat_r tanh(x_r * w_r)
        "scatter -> tanh(x_r w_r) -> gather":
            lambda x: m["gather"](torch.tanh(m["scatter"](x, group=group) * w_shard), group=group),
        # sequence split and gather of a replicated tensor
        "scatter_seq -> tanh(x_r W_r) -> gather_seq(replicated)":
            lambda x: m["gather_seq"](torch.tanh(m["scatter_seq"](x, group=group) @ w_square),
                                      tensor_parallel_output_grad=False, group=group),
        # Korthikanti et al.'s sequence-parallel MLP: all-gather -> column/row parallel -> reduce-scatter
        "scatter_seq -> gather_seq -> MLP_r -> reduce_scatter_seq -> gather_seq(replicated)":
            lambda x: m["gather_seq"](
                m["reduce_scatter_seq"](
                    torch.tanh(m["gather_seq"](m["scatter_seq"](x, group=group), group=group) @ w_up) @ w_down,
                    group=group),
                tensor_parallel_output_grad=False, group=group),
        # all-to-all there and back around rank-specific work; f and g make the ends replicated
        "f -> all_to_all -> tanh(x W_r) -> all_to_all -> g":
            lambda x: m["g"](
                m["all_to_all"](torch.tanh(m["all_to_all"](m["f"](x, group=group), group=group) @ w_square),
                                group=group),
                group=group),
    }


CIRCUITS = (
    "f -> tanh(x W_r) -> g",
    "scatter -> tanh(x_r w_r) -> gather",
    "scatter_seq -> tanh(x_r W_r) -> gather_seq(replicated)",
    "scatter_seq -> gather_seq -> MLP_r -> reduce_scatter_seq -> gather_seq(replicated)",
    "f -> all_to_all -> tanh(x W_r) -> all_to_all -> g",
)


def check_params(world_size, variant, rows, hidden, tp_size, **_):
    if variant not in VARIANTS:
        return f"variant={variant!r} is not known: choose one of {', '.join(VARIANTS)}"
    tp = tp_size or world_size
    if tp < 1 or world_size % tp:
        return f"tp_size={tp_size} does not divide world_size={world_size}: choose a divisor of {world_size}"
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
