"""Plausible wrong answers for chapter 02, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def ddp_without_averaging(model):
    import torch.distributed as dist

    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)

    def sum_grad(param):
        dist.all_reduce(param.grad)  # summed, never divided by the world size

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sum_grad)


def ddp_hook_gets_parameter(model):
    # The Picotron fault: the hook's argument is the parameter, not the gradient. Averaging identical
    # parameters changes nothing, and the gradients are never synchronised; nothing crashes.
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)

    def average(grad):
        dist.all_reduce(grad)
        grad.div_(world_size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)


def ddp_without_broadcast(model):
    import torch.distributed as dist

    world_size = dist.get_world_size()

    def average_grad(param):
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average_grad)


def ddp_without_buffers(model):
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for p in model.parameters():  # parameters only: the buffer in_scale stays different per rank
        dist.broadcast(p.data, src=0)

    def average_grad(param):
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average_grad)


def ddp_hooks_on_weights_only(model):
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)

    def average_grad(param):
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)

    for p in model.parameters():
        if p.dim() == 2:  # the weight matrices only: the biases keep each rank's own gradient
            p.register_post_accumulate_grad_hook(average_grad)


def ddp_leaves_a_nan(model):
    # The right hooks, but one averaged value comes back NaN (a division by a zero count, say).
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0)

    def average_grad(param):
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)
        if param.dim() == 1:
            param.grad[0] = float("nan")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average_grad)


def buckets_assume_four_bytes(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    buckets, current, filled = [], [], 0
    for g in grads:
        current.append(g)
        filled += g.numel() * 4  # as if every gradient were fp32
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def buckets_strict_capacity(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    buckets, current, filled = [], [], 0
    for g in grads:
        current.append(g)
        filled += g.numel() * g.element_size()
        if filled > bucket_bytes:  # a bucket exactly at the limit stays open
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def buckets_drop_last(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    buckets, current, filled = [], [], 0
    for g in grads:
        current.append(g)
        filled += g.numel() * g.element_size()
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    # the bucket still being filled when the loop ends is forgotten
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def buckets_one_per_tensor(grads, bucket_bytes):
    import torch.distributed as dist

    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())


def buckets_without_copy_back(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    buckets, current, filled = [], [], 0
    for g in grads:
        current.append(g)
        filled += g.numel() * g.element_size()
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())  # averaged, but only in the copy


def buckets_without_averaging(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def buckets_close_before_exceeding(grads, bucket_bytes):
    import torch
    import torch.distributed as dist

    buckets, current, filled = [], [], 0
    for g in grads:
        size = g.numel() * g.element_size()
        if current and filled + size > bucket_bytes:  # never exceed the limit: not DDP's rule
            buckets.append(current)
            current, filled = [], 0
        current.append(g)
        filled += size
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def buckets_leave_a_nan(grads, bucket_bytes):
    # The right buckets, but one averaged value comes back NaN.
    import torch
    import torch.distributed as dist

    buckets, current, filled = [], [], 0
    for g in grads:
        current.append(g)
        filled += g.numel() * g.element_size()
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        flat[-1] = float("nan")
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def shard_ignores_epoch(dataset_size, rank, world_size, epoch, seed):
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed)  # the epoch never enters: set_epoch forgotten
    indices = torch.randperm(dataset_size, generator=g).tolist()
    total = math.ceil(dataset_size / world_size) * world_size
    indices += indices[:total - len(indices)]
    return indices[rank:total:world_size]


def shard_seeded_by_rank(dataset_size, rank, world_size, epoch, seed):
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch + rank)  # each rank its own permutation: overlaps and holes
    indices = torch.randperm(dataset_size, generator=g).tolist()
    total = math.ceil(dataset_size / world_size) * world_size
    indices += indices[:total - len(indices)]
    return indices[rank:total:world_size]


def shard_reseeds_global_rng(dataset_size, rank, world_size, epoch, seed):
    import math

    import torch

    torch.manual_seed(seed + epoch)  # the same shuffle on every rank, but every later random draw is reseeded
    indices = torch.randperm(dataset_size).tolist()
    total = math.ceil(dataset_size / world_size) * world_size
    while len(indices) < total:
        indices += indices[:total - len(indices)]
    return indices[rank:total:world_size]


def shard_pads_once(dataset_size, rank, world_size, epoch, seed):
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    indices = torch.randperm(dataset_size, generator=g).tolist()
    total = math.ceil(dataset_size / world_size) * world_size
    indices += indices[:total - len(indices)]  # one repeat: short when the dataset is smaller than half the ranks
    return indices[rank:total:world_size]


def shard_without_padding(dataset_size, rank, world_size, epoch, seed):
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(dataset_size, generator=g).tolist()[rank::world_size]  # uneven shards


def shard_returns_a_tensor(dataset_size, rank, world_size, epoch, seed):
    # The right indices, left in the tensor torch.randperm returns.
    import math

    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    indices = torch.randperm(dataset_size, generator=g)
    total = math.ceil(dataset_size / world_size) * world_size
    while len(indices) < total:
        indices = torch.cat([indices, indices[:total - len(indices)]])
    return indices[rank:total:world_size]


# Overlap: each is the right answer (solutions/ch02.py: overlapped_hooks) with the one change its comment names.

def overlap_waits_in_the_hook(params, buckets):
    # Waits for each bucket right after launching it, inside the hook: correct numbers, no overlap.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]
    done = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]]) / n
            dist.all_reduce(flat, async_op=True).wait()
            done.append((k, flat))

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))

    def finish():
        for k, flat in done:
            offset = 0
            for j in buckets[k]:
                g = params[j].grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
    return finish


def overlap_bucket_never_fires(params, buckets):
    # Starts every bucket's count at the number of parameters in the whole model: no bucket ever fills.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(params) for _ in buckets]
    in_flight = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]]) / n
            in_flight.append((k, flat, dist.all_reduce(flat, async_op=True)))

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))

    def finish():
        for k, flat, work in in_flight:
            work.wait()
    return finish


def overlap_synchronous_all_reduce(params, buckets):
    # Launches each bucket from the hook, but without async_op: backward waits for every all-reduce.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]]) / n
            dist.all_reduce(flat)
            offset = 0
            for j in buckets[k]:
                g = params[j].grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))
    return lambda: None


def overlap_never_copies_back(params, buckets):
    # Waits for every handle in finish(), but the averages stay in the flattened copies.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]
    in_flight = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]]) / n
            in_flight.append(dist.all_reduce(flat, async_op=True))

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))

    def finish():
        for work in in_flight:
            work.wait()
    return finish


def overlap_without_averaging(params, buckets):
    # Forgets the division by the world size.
    import torch
    import torch.distributed as dist

    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]
    in_flight = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]])
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
    return finish


def overlap_launches_at_the_end(params, buckets):
    # One countdown over the whole model: every bucket is launched, asynchronously, when backward's last gradient
    # lands, so the first buckets wait for the whole backward and nothing overlaps.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    remaining = [len(params)]
    in_flight = []

    def ready(_i):
        remaining[0] -= 1
        if remaining[0] == 0:
            for k, bucket in enumerate(buckets):
                flat = torch.cat([params[j].grad.reshape(-1) for j in bucket]) / n
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
    return finish


def overlap_launches_on_last_listed(params, buckets):
    # Launches a bucket when the hook of its last listed parameter runs, as if gradients arrived in listed order:
    # LayerNorm's weight gradient lands before its bias's, so that bucket leaves with the bias's old .grad.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    last_of = {bucket[-1]: k for k, bucket in enumerate(buckets)}
    in_flight = []

    def ready(i):
        if i in last_of:
            k = last_of[i]
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
    return finish


def overlap_averages_the_incoming_gradient(params, buckets):
    # Tensor hooks (p.register_hook) receive this backward's gradient before it is added into .grad: with .grad
    # already holding a first micro-batch's gradient, finish() overwrites that sum with this backward's mean.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]
    incoming, in_flight = {}, []

    def ready(i, grad):
        incoming[i] = grad
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([incoming[j].reshape(-1) for j in buckets[k]]) / n
            in_flight.append((k, flat, dist.all_reduce(flat, async_op=True)))

    for i, p in enumerate(params):
        p.register_hook(lambda grad, i=i: ready(i, grad))

    def finish():
        for k, flat, work in in_flight:
            work.wait()
            offset = 0
            for j in buckets[k]:
                g = params[j].grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
    return finish


def overlap_counts_as_the_first_bucket(params, buckets):
    # Every bucket's count starts at the first bucket's length, as if all buckets held as many parameters.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(buckets[0])] * len(buckets)
    in_flight = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
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
    return finish


def overlap_launches_per_gradient(params, buckets):
    # Launches every gradient's own all-reduce from its hook: overlapped and right, but the buckets are ignored.
    import torch.distributed as dist

    n = dist.get_world_size()
    in_flight = []

    def ready(p):
        flat = p.grad.reshape(-1) / n
        in_flight.append((p, flat, dist.all_reduce(flat, async_op=True)))

    for p in params:
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        for p, flat, work in in_flight:
            work.wait()
            p.grad.copy_(flat.view_as(p.grad))
    return finish


def overlap_leaves_a_nan(params, buckets):
    # The right answer, but one averaged value comes back NaN (a division by a zero count, say).
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    bucket_of = {i: k for k, bucket in enumerate(buckets) for i in bucket}
    pending = [len(bucket) for bucket in buckets]
    in_flight = []

    def ready(i):
        k = bucket_of[i]
        pending[k] -= 1
        if pending[k] == 0:
            flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]]) / n
            in_flight.append((k, flat, dist.all_reduce(flat, async_op=True)))

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: ready(i))

    def finish():
        for k, flat, work in in_flight:
            work.wait()
            flat[0] = float("nan")
            offset = 0
            for j in buckets[k]:
                g = params[j].grad
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
    return finish


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("non-finite")(ddp_leaves_a_nan)
tries("layouts")(buckets_assume_four_bytes)
tries("sizes")(buckets_strict_capacity)
tries("ragged")(buckets_drop_last)
tries("traffic")(buckets_one_per_tensor)
tries("non-finite")(buckets_leave_a_nan)
tries("mutation")(shard_reseeds_global_rng)
tries("ragged")(shard_pads_once)
tries("sizes")(shard_without_padding)
tries("output")(shard_returns_a_tensor)
tries("order")(overlap_launches_on_last_listed)
tries("order")(overlap_averages_the_incoming_gradient)
tries("ragged")(overlap_counts_as_the_first_bucket)
tries("traffic")(overlap_launches_per_gradient)
tries("non-finite")(overlap_leaves_a_nan)


WRONG = [
    ("ddp_by_hand", ddp_without_averaging, "times too large"),
    ("ddp_by_hand", ddp_hook_gets_parameter, "receives the parameter, not the gradient"),
    ("ddp_by_hand", ddp_without_broadcast, "still has its own initial weights"),
    ("ddp_by_hand", ddp_without_buffers, "broadcast the buffers too"),
    ("ddp_by_hand", ddp_hooks_on_weights_only, "not only on the weight matrices"),
    ("ddp_by_hand", ddp_leaves_a_nan, "holds NaN or inf"),
    ("bucketed_average", buckets_assume_four_bytes, "as if every element took 4 bytes"),
    ("bucketed_average", buckets_strict_capacity, "close it when filled >= bucket_bytes"),
    ("bucketed_average", buckets_drop_last, "the bucket still being filled needs its all_reduce too"),
    ("bucketed_average", buckets_one_per_tensor, "one per gradient"),
    ("bucketed_average", buckets_without_copy_back, "torch.cat makes a copy"),
    ("bucketed_average", buckets_without_averaging, "divide the summed bucket by the world size"),
    ("bucketed_average", buckets_close_before_exceeding, "closes it as soon as it holds at least bucket_bytes"),
    ("bucketed_average", buckets_leave_a_nan, "holds NaN or inf after averaging"),
    ("shard_indices", shard_ignores_epoch, "set_epoch"),
    ("shard_indices", shard_seeded_by_rank, "never + rank"),
    ("shard_indices", shard_reseeds_global_rng, "changed torch's global random state"),
    ("shard_indices", shard_pads_once, "repeated more than once"),
    ("shard_indices", shard_without_padding, "pad by repeating"),
    ("shard_indices", shard_returns_a_tensor, "return a list of ints from range(dataset_size)"),
    ("overlapped_hooks", overlap_waits_in_the_hook, "inside backward (work.wait() in the hook)"),
    ("overlapped_hooks", overlap_bucket_never_fires, "a bucket whose count never reaches zero never fires"),
    ("overlapped_hooks", overlap_synchronous_all_reduce, "launched with async_op=False inside backward"),
    ("overlapped_hooks", overlap_never_copies_back, "the averaged buckets never reached .grad"),
    ("overlapped_hooks", overlap_without_averaging, "times the mean gradient"),
    ("overlapped_hooks", overlap_launches_at_the_end, "nothing overlapped with backward"),
    ("overlapped_hooks", overlap_launches_on_last_listed, "Gradients do not always arrive in the order a bucket lists"),
    ("overlapped_hooks", overlap_averages_the_incoming_gradient, "holds the mean of this backward's gradients only"),
    ("overlapped_hooks", overlap_counts_as_the_first_bucket, "bucket sizes here: [4, 2]"),
    ("overlapped_hooks", overlap_launches_per_gradient, "launch one per bucket, once"),
    ("overlapped_hooks", overlap_leaves_a_nan, "holds NaN or inf"),
]
