"""Plausible wrong answers for chapter 11, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def zero_stage2_keeps_full_grads(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    local = n_params / (tp * pp)
    return {"params": 2 * local / (dp if stage >= 3 else 1), "grads": 2 * local / (dp if stage >= 3 else 1),
            "optimizer": optimizer_bytes * local / (dp if stage >= 1 else 1)}


def zero_stage1_shards_params(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    local = n_params / (tp * pp)
    return {"params": 2 * local / (dp if stage >= 1 else 1), "grads": 2 * local / (dp if stage >= 2 else 1),
            "optimizer": optimizer_bytes * local / (dp if stage >= 1 else 1)}


def zero_ignores_tp_pp(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    return {"params": 2 * n_params / (dp if stage >= 3 else 1), "grads": 2 * n_params / (dp if stage >= 2 else 1),
            "optimizer": optimizer_bytes * n_params / (dp if stage >= 1 else 1)}


def zero_in_gb(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    local = n_params / (tp * pp) / 1e9
    return {"params": 2 * local / (dp if stage >= 3 else 1), "grads": 2 * local / (dp if stage >= 2 else 1),
            "optimizer": optimizer_bytes * local / (dp if stage >= 1 else 1)}


def zero1_no_resync(params, state, make_optimizer):
    # Steps its own slice, copies it back into its own parameters, and stops there: the other ranks' slices
    # were updated on the other ranks only.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    if not state:
        shard = -(-total // n)
        flat = torch.zeros(n * shard)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        state["shard"], state["mine"] = shard, torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    shard, mine = state["shard"], state["mine"]
    grads = torch.zeros(n * shard)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(grads)
    mine.grad = grads[rank * shard:(rank + 1) * shard] / n
    state["optimizer"].step()
    flat = torch.cat([p.detach().reshape(-1) for p in params] + [torch.zeros(n * shard - total)])
    flat[rank * shard:(rank + 1) * shard] = mine.detach()
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_full_step_everywhere(params, state, make_optimizer):
    # Averages correctly and gets the right weights, but every rank keeps optimizer state for the whole
    # model: this is DDP wearing a ZeRO name.
    import torch.distributed as dist

    if not state:
        state["optimizer"] = make_optimizer(params)
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    state["optimizer"].step()


def zero1_no_average(params, state, make_optimizer):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    if not state:
        shard = -(-total // n)
        flat = torch.zeros(n * shard)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        state["shard"], state["mine"] = shard, torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    shard, mine = state["shard"], state["mine"]
    grads = torch.zeros(n * shard)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard)
    dist.reduce_scatter_tensor(my_grad, grads)
    mine.grad = my_grad  # the sum over ranks, never divided
    state["optimizer"].step()
    updated = torch.empty(n * shard)
    dist.all_gather_into_tensor(updated, mine.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_new_optimizer_every_step(params, state, make_optimizer):
    # Rebuilds the optimizer each call: the momentum buffer starts from zero every step.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    shard = -(-total // n)
    flat = torch.zeros(n * shard)
    flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
    mine = torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
    optimizer = make_optimizer([mine])
    grads = torch.zeros(n * shard)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard)
    dist.reduce_scatter_tensor(my_grad, grads)
    mine.grad = my_grad / n
    optimizer.step()
    updated = torch.empty(n * shard)
    dist.all_gather_into_tensor(updated, mine.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_no_reduction(params, state, make_optimizer):
    # Steps its slice with its own local gradient, then all-gathers: the ranks agree, on the wrong weights.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    if not state:
        shard = -(-total // n)
        flat = torch.zeros(n * shard)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        state["shard"], state["mine"] = shard, torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    shard, mine = state["shard"], state["mine"]
    grads = torch.zeros(n * shard)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    mine.grad = grads[rank * shard:(rank + 1) * shard].clone()  # this rank's gradient only: no reduction
    state["optimizer"].step()
    updated = torch.empty(n * shard)
    dist.all_gather_into_tensor(updated, mine.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_floor_shards(params, state, make_optimizer):
    # No padding: slices of total // n, so the last total % n elements belong to no rank and are never stepped.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    shard = total // n
    if not state:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        state["mine"] = torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    mine = state["mine"]
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(grads)
    mine.grad = grads[rank * shard:(rank + 1) * shard] / n
    state["optimizer"].step()
    updated = torch.empty(n * shard)
    dist.all_gather_into_tensor(updated, mine.detach())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat[:n * shard] = updated
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_unpadded_reduce_scatter(params, state, make_optimizer):
    # No padding, straight into reduce_scatter_tensor: the flat gradient is not n equal slices.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    shard = total // n
    if not state:
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        state["mine"] = torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    mine = state["mine"]
    grads = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard)
    dist.reduce_scatter_tensor(my_grad, grads)
    mine.grad = my_grad / n
    state["optimizer"].step()
    updated = torch.empty(total)
    dist.all_gather_into_tensor(updated, mine.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_divides_by_two(params, state, make_optimizer):
    # "Two ranks, so halve the sum": the mean at world size 2 only.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    if not state:
        shard = -(-total // n)
        flat = torch.zeros(n * shard)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        state["shard"], state["mine"] = shard, torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    shard, mine = state["shard"], state["mine"]
    grads = torch.zeros(n * shard)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard)
    dist.reduce_scatter_tensor(my_grad, grads)
    mine.grad = my_grad / 2
    state["optimizer"].step()
    updated = torch.empty(n * shard)
    dist.all_gather_into_tensor(updated, mine.detach())
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero1_nan_in_one_weight(params, state, make_optimizer):
    # The right step, then one weight NaN on every rank (what a 0/0 in a hand-written update leaves behind).
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    if not state:
        shard = -(-total // n)
        flat = torch.zeros(n * shard)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        state["shard"], state["mine"] = shard, torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())
        state["optimizer"] = make_optimizer([state["mine"]])
    shard, mine = state["shard"], state["mine"]
    grads = torch.zeros(n * shard)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard)
    dist.reduce_scatter_tensor(my_grad, grads)
    mine.grad = my_grad / n
    state["optimizer"].step()
    updated = torch.empty(n * shard)
    dist.all_gather_into_tensor(updated, mine.detach())
    updated[total - 1] = float("nan")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


# The ZeRO-2 and ZeRO-3 wrong answers travel to the ranks as source, one function each: every one is the right
# answer (solutions/ch11.py) with the one change its comment names.

def zero2_hooks_average_twice(params, grad_shard):
    # Pre-scales by 1/n and then divides the reduced shard by n again, as if the SUM still had to be averaged.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n
            dist.reduce_scatter_tensor(grad_shard, flat)
            grad_shard.div_(n)
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero2_hooks_keep_whole_grads(params, grad_shard):
    # Reduce-scatters correctly but leaves every .grad in place: ZeRO-1's memory, not ZeRO-2's.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n
            dist.reduce_scatter_tensor(grad_shard, flat)
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero2_hooks_count_the_tied_weight_twice(params, grad_shard):
    # Waits for one gradient more than there are Parameters (the embedding and the head counted apart): the bucket
    # never fills, so the reduce-scatter never runs.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params) + 1}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n
            dist.reduce_scatter_tensor(grad_shard, flat)
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero2_hooks_sum(params, grad_shard):
    # Forgets the average: the shard holds the SUM of the ranks' gradients.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())])
            dist.reduce_scatter_tensor(grad_shard, flat)
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero3_hooks_free_before_backward(unit, flat, shard):
    # Frees after forward and never gathers again: backward would read freed memory.
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()

    def gather(*_):
        flat.untyped_storage().resize_(nbytes)
        dist.all_gather_into_tensor(flat, shard)

    def free(_module, _args, _out):
        flat.untyped_storage().resize_(0)

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(free)


def zero3_hooks_never_free(unit, flat, shard):
    # Gathers before forward and keeps it: every unit ends up whole, which is ZeRO-2's parameter memory.
    import torch.distributed as dist

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            dist.all_gather_into_tensor(flat, shard)

    unit.register_forward_pre_hook(gather)


def zero3_hooks_gather_only_for_backward(unit, flat, shard):
    # Forgets the forward-pre hook: forward would run on a freed buffer.
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()
    params = list(unit.parameters())
    left = {"grads": len(params)}

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes)
            dist.all_gather_into_tensor(flat, shard)

    def after_forward(_module, _args, out):
        out.register_hook(lambda grad: gather())
        flat.untyped_storage().resize_(0)

    def grad_ready(_p):
        left["grads"] -= 1
        if left["grads"] == 0:
            flat.untyped_storage().resize_(0)

    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(grad_ready)


def zero3_hooks_keep_after_backward(unit, flat, shard):
    # Right around forward, and gathers again for backward, but never frees after it.
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes)
            dist.all_gather_into_tensor(flat, shard)

    def after_forward(_module, _args, out):
        out.register_hook(lambda grad: gather())
        flat.untyped_storage().resize_(0)

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)


def zero3_hooks_lambda_returns_storage(unit, flat, shard):
    # Frees in a lambda forward hook: the lambda returns resize_'s storage, which replaces the unit's output.
    import torch.distributed as dist

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            dist.all_gather_into_tensor(flat, shard)

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(lambda module, args, out: flat.untyped_storage().resize_(0))


def zero2_hooks_nan_padding(params, grad_shard):
    # Pads with NaN "so the padding is easy to spot": the last rank's shard ends in NaN.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_full((n * grad_shard.numel() - flat.numel(),), float("nan"))]) / n
            dist.reduce_scatter_tensor(grad_shard, flat)
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero2_hooks_all_reduce_then_slice(params, grad_shard):
    # The right numbers by an all-reduce of the whole gradient, then its slice: twice the bytes, a whole reduced
    # gradient held on every rank.
    import torch
    import torch.distributed as dist

    n, rank, pending = dist.get_world_size(), dist.get_rank(), {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n
            dist.all_reduce(flat)
            S = grad_shard.numel()
            grad_shard.copy_(flat[rank * S:(rank + 1) * S])
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero2_hooks_shard_plus_one(params, grad_shard):
    # Computes the shard size itself as total // n + 1: ceil(total / n) when n does not divide the total, one element
    # too many per shard when it does.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params)}
    total = sum(p.numel() for p in params)

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * (total // n + 1) - total)]) / n
            dist.reduce_scatter_tensor(grad_shard, flat)
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero2_hooks_launch_at_first_parameter(params, grad_shard):
    # One hook, on params[0], taken for the last gradient backward computes (the first layer's): true only when the
    # parameters are listed in the model's order and the first one is indeed the last to land.
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()

    def ready(_p):
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n
        dist.reduce_scatter_tensor(grad_shard, flat)
        for p in params:
            p.grad = None
    return [params[0].register_post_accumulate_grad_hook(ready)]


def zero2_hooks_never_waited(params, grad_shard):
    # Launches the reduce-scatter asynchronously and drops its handle: nothing waits for the result.
    import torch
    import torch.distributed as dist

    n, pending = dist.get_world_size(), {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if not pending["left"]:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n
            dist.reduce_scatter_tensor(grad_shard, flat, async_op=True)
            for p in params:
                p.grad = None
    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero3_hooks_copy_out_of_flat(unit, flat, shard):
    # Gathers into flat, then points every parameter at its own copy of its slice: freeing flat then frees nothing
    # the parameters use, so the unit stays whole.
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()
    params = list(unit.parameters())
    left = {"grads": len(params)}

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes)
            dist.all_gather_into_tensor(flat, shard)
            offset = 0
            for p in params:
                p.data = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()

    def free(*_):
        flat.untyped_storage().resize_(0)

    def after_forward(_module, _args, out):
        out.register_hook(lambda grad: gather())
        free()

    def grad_ready(_p):
        left["grads"] -= 1
        if left["grads"] == 0:
            free()

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(grad_ready)


def zero3_hooks_free_at_first_parameter(unit, flat, shard):
    # Frees when the first listed parameter (ln1's weight) gets its gradient, taking it for the last one backward
    # computes: true of a pre-norm block, not of a post-norm one, where ln1 comes after the attention.
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes)
            dist.all_gather_into_tensor(flat, shard)

    def free(*_):
        flat.untyped_storage().resize_(0)

    def after_forward(_module, _args, out):
        out.register_hook(lambda grad: gather())
        free()

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    next(unit.parameters()).register_post_accumulate_grad_hook(free)


def zero3_hooks_gather_never_waited(unit, flat, shard):
    # Launches the all-gathers asynchronously and drops their handles: the forward reads flat while it is filled.
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()
    params = list(unit.parameters())
    left = {"grads": len(params)}

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes)
            dist.all_gather_into_tensor(flat, shard, async_op=True)

    def free(*_):
        flat.untyped_storage().resize_(0)

    def after_forward(_module, _args, out):
        out.register_hook(lambda grad: gather())
        free()

    def grad_ready(_p):
        left["grads"] -= 1
        if left["grads"] == 0:
            free()

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(grad_ready)


def zero_state_nan_grads(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    # The right ledger with one entry NaN (what 0 / 0 gives in numpy, where Python would raise).
    local = n_params / (tp * pp)
    return {"params": 2 * local / (dp if stage >= 3 else 1), "grads": float("nan") if stage == 0 else 2 * local / (dp if stage >= 2 else 1),
            "optimizer": optimizer_bytes * local / (dp if stage >= 1 else 1)}


def zero_state_floor_division(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    # Whole bytes by floor division: right whenever the shards divide evenly, short by the remainder otherwise.
    local = n_params // (tp * pp)
    return {"params": 2 * local // (dp if stage >= 3 else 1), "grads": 2 * local // (dp if stage >= 2 else 1),
            "optimizer": optimizer_bytes * local // (dp if stage >= 1 else 1)}


def clip_per_rank_norm(grads, max_norm):
    # torch.nn.utils.clip_grad_norm_ on this rank's shards: the norm of a part of the gradient, a different one on
    # every rank, so every rank clips by its own coefficient.
    import torch

    return torch.nn.utils.clip_grad_norm_(grads, max_norm)


def clip_sum_of_norms(grads, max_norm):
    # All-reduces each rank's norm: norms do not add (the triangle inequality), the sum overstates the whole norm.
    import torch
    import torch.distributed as dist

    norm = torch.zeros(())
    for g in grads:
        norm += g.float().pow(2).sum()
    norm = norm.sqrt()
    dist.all_reduce(norm)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return norm


def clip_no_square_root(grads, max_norm):
    # The sum of squares, all-reduced right, but never square-rooted.
    import torch
    import torch.distributed as dist

    squares = torch.zeros(())
    for g in grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)
    coef = (max_norm / (squares + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return squares


def clip_averaged_squares(grads, max_norm):
    # The squares averaged over the ranks (as a gradient is) instead of summed: the norm is sqrt(n) too small.
    import torch
    import torch.distributed as dist

    squares = torch.zeros(())
    for g in grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)
    total = (squares / dist.get_world_size()).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def clip_gathers_the_gradients(grads, max_norm):
    # Right numbers, wrong traffic: every rank's whole shard sent to every rank, to compute one number (as objects:
    # the shards' lengths differ by rank, which a tensor all-gather would refuse).
    import torch
    import torch.distributed as dist

    mine = torch.cat([g.reshape(-1) for g in grads])
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    total = torch.cat(pieces).float().norm()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def clip_returns_clipped_norm(grads, max_norm):
    # Clips right, but returns the norm after clipping (max_norm whenever it clipped): a training log would never
    # show the spikes clipping hides.
    import torch
    import torch.distributed as dist

    squares = torch.zeros(())
    for g in grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return total * coef


def clip_always_rescales(grads, max_norm):
    # Rescales to max_norm whatever the norm: small gradients are blown up.
    import torch
    import torch.distributed as dist

    squares = torch.zeros(())
    for g in grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)
    total = squares.sqrt()
    for g in grads:
        g.mul_(max_norm / total)
    return total


def clip_not_in_place(grads, max_norm):
    # Computes clipped copies and rebinds the list: the caller's gradients never change.
    import torch
    import torch.distributed as dist

    squares = torch.zeros(())
    for g in grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    grads = [g * coef for g in grads]
    return total


def clip_hides_nan(grads, max_norm):
    # "Safe" squares: NaN and inf replaced by 0 before summing, so a diverged step reports a finite norm.
    import torch
    import torch.distributed as dist

    squares = torch.zeros(())
    for g in grads:
        squares += torch.nan_to_num(g.float(), nan=0.0, posinf=0.0, neginf=0.0).pow(2).sum()
    dist.all_reduce(squares)
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("memory")(zero1_full_step_everywhere)
tries("sizes")(zero1_floor_shards)
tries("layouts")(zero1_divides_by_two)
tries("non-finite")(zero1_nan_in_one_weight)
tries("memory")(zero2_hooks_keep_whole_grads)
tries("output")(zero3_hooks_lambda_returns_storage)
tries("non-finite")(zero2_hooks_nan_padding)
tries("traffic")(zero2_hooks_all_reduce_then_slice)
tries("sizes")(zero2_hooks_shard_plus_one)
tries("order")(zero2_hooks_launch_at_first_parameter)
tries("memory")(zero3_hooks_copy_out_of_flat)
tries("order")(zero3_hooks_free_at_first_parameter)
tries("layouts")(zero_ignores_tp_pp)
tries("non-finite")(zero_state_nan_grads)
tries("sizes")(zero_state_floor_division)
tries("traffic")(clip_gathers_the_gradients)
tries("output")(clip_returns_clipped_norm)
tries("non-finite")(clip_hides_nan)

WRONG = [
    ("zero_state_bytes", zero_stage2_keeps_full_grads, "stage 2 shards the grads over the 64 data-parallel ranks"),
    ("zero_state_bytes", zero_stage1_shards_params, "stage 1 does not shard the params yet"),
    ("zero_state_bytes", zero_ignores_tp_pp, "divide by tp*pp"),
    ("zero_state_bytes", zero_in_gb, "return bytes, not GB"),
    ("zero_state_bytes", zero_state_nan_grads, "is nan (NaN or infinite)"),
    ("zero_state_bytes", zero_state_floor_division, "divide with /, not //"),
    ("zero1_step", zero1_no_resync, "Re-synchronise"),
    ("zero1_step", zero1_no_reduction, "the gradients were never reduced"),
    ("zero1_step", zero1_floor_shards, "leave the last 1 behind; pad to n * ceil(total / n)"),
    ("zero1_step", zero1_unpadded_reduce_scatter, "do not split into 2 equal shards"),
    ("zero1_step", zero1_full_step_everywhere, "which is plain DDP, not ZeRO-1"),
    ("zero1_step", zero1_no_average, "divide by the world size"),
    ("zero1_step", zero1_new_optimizer_every_step, "a new optimizer forgets its momentum"),
    ("zero1_step", zero1_divides_by_two, "divided by 2, which is the mean only at world size 2"),
    ("zero1_step", zero1_nan_in_one_weight, "are NaN or infinite"),
    ("zero2_grad_hooks", zero2_hooks_average_twice, "the average was taken twice"),
    ("zero2_grad_hooks", zero2_hooks_keep_whole_grads, "still hold a whole .grad"),
    ("zero2_grad_hooks", zero2_hooks_count_the_tied_weight_twice, "the reduce-scatter never ran during backward"),
    ("zero2_grad_hooks", zero2_hooks_sum, "reduce-scatter SUMs over the ranks"),
    ("zero2_grad_hooks", zero2_hooks_nan_padding, "NaN or infinite value(s)"),
    ("zero2_grad_hooks", zero2_hooks_all_reduce_then_slice, "during backward your hook ran all_reduce"),
    ("zero2_grad_hooks", zero2_hooks_shard_plus_one, "must be padded to exactly n x S"),
    ("zero2_grad_hooks", zero2_hooks_launch_at_first_parameter, "it ran before every gradient had landed"),
    ("zero2_grad_hooks", zero2_hooks_never_waited, "nothing waited for its handle"),
    ("zero3_unit_hooks", zero3_hooks_free_before_backward, "they had been freed after forward"),
    ("zero3_unit_hooks", zero3_hooks_never_free, "still whole after its forward"),
    ("zero3_unit_hooks", zero3_hooks_gather_only_for_backward, "not gathered when its forward began"),
    ("zero3_unit_hooks", zero3_hooks_keep_after_backward, "still whole after backward"),
    ("zero3_unit_hooks", zero3_hooks_lambda_returns_storage, "a forward hook's return value replaces"),
    ("zero3_unit_hooks", zero3_hooks_copy_out_of_flat, "freeing flat freed nothing they use"),
    ("zero3_unit_hooks", zero3_hooks_free_at_first_parameter, "freed again before backward had finished with them"),
    ("zero3_unit_hooks", zero3_hooks_gather_never_waited, "nothing waited for its handle"),
    ("clip_grad_norm_sharded", clip_per_rank_norm, "only this rank's shard"),
    ("clip_grad_norm_sharded", clip_sum_of_norms, "norms do not add"),
    ("clip_grad_norm_sharded", clip_no_square_root, "take the square root after the all-reduce"),
    ("clip_grad_norm_sharded", clip_averaged_squares, "all-reduce their SUM"),
    ("clip_grad_norm_sharded", clip_gathers_the_gradients, "gathered the gradients"),
    ("clip_grad_norm_sharded", clip_returns_clipped_norm, "return the norm before clipping"),
    ("clip_grad_norm_sharded", clip_always_rescales, "clipping only scales down"),
    ("clip_grad_norm_sharded", clip_not_in_place, "scale them in place"),
    ("clip_grad_norm_sharded", clip_hides_nan, "do not filter or replace non-finite values"),
]
