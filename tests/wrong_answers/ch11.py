"""Plausible wrong answers for chapter 11, each with a fragment of the message the check must give."""


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


WRONG = [
    ("zero_state_bytes", zero_stage2_keeps_full_grads, "stage 2 shards the grads over the 64 data-parallel ranks"),
    ("zero_state_bytes", zero_stage1_shards_params, "stage 1 does not shard the params yet"),
    ("zero_state_bytes", zero_ignores_tp_pp, "divide by tp*pp"),
    ("zero_state_bytes", zero_in_gb, "return bytes, not GB"),
    ("zero1_step", zero1_no_resync, "Re-synchronise"),
    ("zero1_step", zero1_no_reduction, "the gradients were never reduced"),
    ("zero1_step", zero1_floor_shards, "leave the last 1 behind; pad to n * ceil(total / n)"),
    ("zero1_step", zero1_unpadded_reduce_scatter, "do not split into 2 equal shards"),
    ("zero1_step", zero1_full_step_everywhere, "which is plain DDP, not ZeRO-1"),
    ("zero1_step", zero1_no_average, "divide by the world size"),
    ("zero1_step", zero1_new_optimizer_every_step, "a new optimizer forgets its momentum"),
]
