"""Reference answers for chapter 03's exercises (each self-contained: it travels to the ranks as source)."""


def f_and_g():
    """Megatron's f and g (Shoeybi et al. 2019, sec. 3) as autograd Functions: returns (copy_to, reduce_from)."""
    import torch
    import torch.distributed as dist

    def all_reduce(t, group):
        t = t.clone()  # never overwrite a tensor autograd or the caller may still need
        dist.all_reduce(t, group=group)
        return t

    class CopyToRegion(torch.autograd.Function):  # f
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)  # identity: every rank goes on with its copy of the replicated input

        @staticmethod
        def backward(ctx, grad_output):
            return all_reduce(grad_output, ctx.group), None  # the copies' gradients add up

    class ReduceFromRegion(torch.autograd.Function):  # g
        @staticmethod
        def forward(ctx, x, group):
            return all_reduce(x, group)  # sum the partial results

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None  # the output is replicated: its gradient is already complete

    return (lambda x, group=None: CopyToRegion.apply(x, group),
            lambda x, group=None: ReduceFromRegion.apply(x, group))


def split_and_gather():
    """Split / gather along the last dimension, each the other's backward: returns (scatter_to, gather_from)."""
    import torch
    import torch.distributed as dist

    def split(t, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return t.chunk(n, dim=-1)[r].contiguous()  # [..., h/n]

    def gather(t, group):
        n = dist.get_world_size(group)
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=-1)  # [..., h], slices in rank order

    class ScatterToRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return split(x, group)

        @staticmethod
        def backward(ctx, grad_output):
            return gather(grad_output, ctx.group), None

    class GatherFromRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return gather(x, group)

        @staticmethod
        def backward(ctx, grad_output):
            return split(grad_output, ctx.group), None

    return (lambda x, group=None: ScatterToRegion.apply(x, group),
            lambda x, group=None: GatherFromRegion.apply(x, group))
