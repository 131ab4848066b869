"""Plausible wrong answers to chapter 03's exercises, each with a fragment of the message that must catch it."""
from tests.wrong_answers import tries


def g_backward_all_reduces():
    """The 'symmetric' g: all-reduce forward and backward (what torch.distributed.nn.functional.all_reduce does)."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)  # wrong: the gradient is already complete
            return grad, None

    return lambda x, group=None: Copy.apply(x, group), lambda x, group=None: Reduce.apply(x, group)


def f_backward_identity():
    """f that forgets to sum: each rank keeps its own gradient of the replicated input."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad, None  # wrong: the replicated input's gradient is the sum over ranks

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return lambda x, group=None: Copy.apply(x, group), lambda x, group=None: Reduce.apply(x, group)


def g_in_place():
    """Megatron-style in-place all-reduce of g's input: breaks a backward that saved that tensor."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            dist.all_reduce(x, group=group)  # wrong: overwrites the caller's tensor
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return lambda x, group=None: Copy.apply(x, group), lambda x, group=None: Reduce.apply(x, group)


def f_and_g_ignore_group():
    """Right on the whole world, but every collective ignores group= (always the world)."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)  # wrong: the world, not the group
            return grad, None

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return lambda x, group=None: Copy.apply(x, group), lambda x, group=None: Reduce.apply(x, group)


def split_takes_next_rank_slice():
    """Split that keeps the next rank's slice (an off-by-one in the rank)."""
    import torch
    import torch.distributed as dist

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            n, r = dist.get_world_size(group), dist.get_rank(group)
            return x.chunk(n, dim=-1)[(r + 1) % n].contiguous()  # wrong slice

        @staticmethod
        def backward(ctx, grad):
            return gather(grad, ctx.group), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad):
            n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
            return grad.chunk(n, dim=-1)[r].contiguous(), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)


def gather_backward_all_reduces():
    """Gather whose backward sums the (already replicated) gradient before keeping its slice."""
    import torch
    import torch.distributed as dist

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    def split(t, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return t.chunk(n, dim=-1)[r].contiguous()

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return split(x, group)

        @staticmethod
        def backward(ctx, grad):
            return gather(grad, ctx.group), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)  # wrong: the gradient is already complete
            return split(grad, ctx.group), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)


def scatter_backward_own_slice_only():
    """Split whose backward pads this rank's slice gradient with zeros instead of gathering every slice."""
    import torch
    import torch.distributed as dist

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            n, r = dist.get_world_size(group), dist.get_rank(group)
            return x.chunk(n, dim=-1)[r].contiguous()

        @staticmethod
        def backward(ctx, grad):
            n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
            parts = [torch.zeros_like(grad) for _ in range(n)]
            parts[r] = grad  # wrong: the other slices' gradients live on the other ranks
            return torch.cat(parts, dim=-1), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad):
            n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
            return grad.chunk(n, dim=-1)[r].contiguous(), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)


def g_reduces_on_world():
    """f is right; g's all_reduce forgets group= (sums over the world): right only when the group is the world."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x)  # wrong: group= forgotten
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return lambda x, group=None: Copy.apply(x, group), lambda x, group=None: Reduce.apply(x, group)


def gather_on_world_group():
    """The split honours the group; the gather all-gathers over the world (its size and its collective)."""
    import torch
    import torch.distributed as dist

    def split(t, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return t.chunk(n, dim=-1)[r].contiguous()

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]  # wrong: the world
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return split(x, group)

        @staticmethod
        def backward(ctx, grad):
            return gather(grad, ctx.group), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad):
            return split(grad, ctx.group), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)


def split_with_world_rank():
    """The group's size but the world's rank (dist.get_rank() without group=): right only when they coincide."""
    import torch
    import torch.distributed as dist

    def split(t, group):
        n, r = dist.get_world_size(group), dist.get_rank()  # wrong: the rank in the world
        return t.chunk(n, dim=-1)[r].contiguous()

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return split(x, group)

        @staticmethod
        def backward(ctx, grad):
            return gather(grad, ctx.group), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad):
            return split(grad, ctx.group), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)


def f_backward_leaves_a_nan():
    """The right f and g, but f's backward leaves one NaN in the summed gradient."""
    import torch
    import torch.distributed as dist

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            grad.view(-1)[-1] = float("nan")
            return grad, None

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    return lambda x, group=None: Copy.apply(x, group), lambda x, group=None: Reduce.apply(x, group)


def gather_leaves_a_nan():
    """The right split and gather, but gather's forward leaves one NaN in the concatenation."""
    import torch
    import torch.distributed as dist

    def split(t, group):
        return t.chunk(dist.get_world_size(group), dim=-1)[dist.get_rank(group)].contiguous()

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return split(x, group)

        @staticmethod
        def backward(ctx, grad):
            return gather(grad, ctx.group), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            out = gather(x, group)
            out.view(-1)[0] = float("nan")
            return out

        @staticmethod
        def backward(ctx, grad):
            return split(grad, ctx.group), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)


def split_along_first_dim():
    """Split and gather along dim 0, the default of chunk and cat: the wrong dimension for Megatron's last-dim split."""
    import torch
    import torch.distributed as dist

    def split(t, group):
        return t.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return split(x, group)

        @staticmethod
        def backward(ctx, grad):
            return gather(grad, ctx.group), None

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad):
            return split(grad, ctx.group), None

    return lambda x, group=None: Scatter.apply(x, group), lambda x, group=None: Gather.apply(x, group)

# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("mutation")(g_in_place)
tries("layouts")(g_reduces_on_world)
tries("layouts")(split_with_world_rank)
tries("non-finite")(f_backward_leaves_a_nan)
tries("non-finite")(gather_leaves_a_nan)
tries("output")(split_along_first_dim)


WRONG = [
    ("f_and_g", g_backward_all_reduces, "world-size scaling trap"),
    ("f_and_g", f_backward_identity, "sum of all ranks' gradients"),
    ("f_and_g", g_in_place, "changed its input in place"),
    ("f_and_g", f_and_g_ignore_group, "used the default (world) group instead of the group it was given"),
    ("f_and_g", g_reduces_on_world, "sum over all 4 ranks of the world"),
    ("f_and_g", f_backward_leaves_a_nan, "the gradient of x holds NaN or inf"),
    ("split_and_gather", gather_on_world_group, "used the default (world) group instead of the group it was given"),
    ("split_and_gather", split_with_world_rank, "its rank in the world"),
    ("split_and_gather", split_takes_next_rank_slice, "kept slice"),
    ("split_and_gather", gather_backward_all_reduces, "do not sum it"),
    ("split_and_gather", scatter_backward_own_slice_only, "all_gather the slices' gradients"),
    ("split_and_gather", gather_leaves_a_nan, "forward output holds NaN or inf"),
    ("split_and_gather", split_along_first_dim, "split the last dimension (dim=-1)"),
]
