"""The circuits chapter 03 gradchecks on real ranks, and the plausible wrong mappings it must catch.

Each circuit starts from a replicated x, goes through a parallel region where each rank computes something of
its own (weights that depend on the rank), and comes back to a replicated y: the one logical function that
``torch.autograd.gradcheck`` can check on every rank at once (``workers/ch03_gradcheck.py`` runs it).
``VARIANTS`` swaps one library mapping for a plausible wrong one; ``library()`` is the right set.
"""
import torch
import torch.distributed as dist

from workers.parallel import mappings as M
from workers.parallel.faults import all_reduce_both_ways

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
