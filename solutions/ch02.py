"""Reference answers for chapter 02's exercises (each self-contained: it travels to the ranks as source)."""


def ddp_by_hand(model):
    """Make ``model`` train like DDP: same start on every rank, and every gradient averaged over the ranks."""
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)  # rank 0's values everywhere

    def average_grad(param):  # called with the parameter, once its .grad holds this backward's gradient
        dist.all_reduce(param.grad)  # SUM over ranks
        param.grad.div_(world_size)  # ... then the mean

    return [p.register_post_accumulate_grad_hook(average_grad) for p in model.parameters() if p.requires_grad]


def bucketed_average(grads, bucket_bytes):
    """Average ``grads`` over the ranks in place, with one all_reduce per bucket (DDP's packing rule)."""
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size()
    buckets, current, filled = [], [], 0
    for g in grads:  # fill in order; close a bucket once it holds at least bucket_bytes
        current.append(g)
        filled += g.numel() * g.element_size()
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])  # a copy: one contiguous buffer per bucket
        dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for g in bucket:  # copy the averaged slices back into the gradients
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def shard_indices(dataset_size, rank, world_size, epoch, seed):
    """The indices rank ``rank`` reads in ``epoch``: DistributedSampler(shuffle=True, drop_last=False)'s rule."""
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)  # the same permutation on every rank, a new one every epoch
    indices = torch.randperm(dataset_size, generator=g).tolist()
    total = math.ceil(dataset_size / world_size) * world_size
    while len(indices) < total:  # pad by repeating from the start so every rank gets as many
        indices += indices[:total - len(indices)]
    return indices[rank:total:world_size]


def overlapped_hooks(params, buckets):
    """DDP's overlap: a post-accumulate-grad hook per parameter; when a bucket's last gradient lands, flatten it,
    divide by the world size and launch its all-reduce asynchronously. finish() waits and copies back."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]
    in_flight = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:  # the bucket is full: send it while backward goes on
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]]) / n
            in_flight.append((k, flat, dist.all_reduce(flat, async_op=True)))

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))

    def finish():
        for k, flat, work in in_flight:
            work.wait()
            offset = 0
            for j in buckets[k]:
                g = params[j].grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        in_flight.clear()

    return finish
