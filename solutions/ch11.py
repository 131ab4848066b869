"""Reference answers for chapter 11's exercises (each self-contained: it travels to the ranks as source)."""


def zero_state_bytes(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    """Bytes per GPU of parameters, gradients and optimizer states under ZeRO (Rajbhandari et al. 2020, sec 5.1)."""
    local = n_params / (tp * pp)  # TP and PP split the model first; ZeRO shards what each GPU holds over dp
    return {
        "params": 2 * local / (dp if stage >= 3 else 1),
        "grads": 2 * local / (dp if stage >= 2 else 1),
        "optimizer": optimizer_bytes * local / (dp if stage >= 1 else 1),
    }


def zero1_step(params, state, make_optimizer):
    """One ZeRO-1 step: average the gradients, step this rank's slice only, all-gather the updated slices."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    total = sum(p.numel() for p in params)
    if not state:  # first call: parameters end to end, padded so that every rank's slice has the same length
        shard = -(-total // n)
        flat = torch.zeros(n * shard, dtype=params[0].dtype, device=params[0].device)
        flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
        state["shard"] = shard
        state["mine"] = torch.nn.Parameter(flat[rank * shard:(rank + 1) * shard].clone())  # [S]
        state["optimizer"] = make_optimizer([state["mine"]])  # state for S elements, not all of them
    shard, mine = state["shard"], state["mine"]

    grads = torch.zeros(n * shard, dtype=mine.dtype, device=mine.device)  # [n*S]
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    my_grad = torch.empty(shard, dtype=mine.dtype, device=mine.device)  # [S]
    dist.reduce_scatter_tensor(my_grad, grads)  # the SUM over ranks of my slice ...
    mine.grad = my_grad / n  # ... then the mean
    state["optimizer"].step()

    updated = torch.empty(n * shard, dtype=mine.dtype, device=mine.device)  # [n*S]
    dist.all_gather_into_tensor(updated, mine.detach())  # every rank's updated slice, everywhere
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(updated[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero2_grad_hooks(params, grad_shard):
    """ZeRO-2's gradient hook: when the last parameter's gradient lands in backward, flatten all of them (padded to
    n equal shards), reduce-scatter the mean into grad_shard and drop every whole .grad."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    pending = {"left": len(params)}

    def ready(_p):
        pending["left"] -= 1
        if pending["left"]:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        flat = torch.cat([flat, flat.new_zeros(n * grad_shard.numel() - flat.numel())]) / n  # [n S], pre-scaled
        dist.reduce_scatter_tensor(grad_shard, flat)  # the SUM of pre-scaled gradients: the mean
        for p in params:
            p.grad = None  # only the shard is kept

    return [p.register_post_accumulate_grad_hook(ready) for p in params]


def zero3_unit_hooks(unit, flat, shard):
    """ZeRO-3 around one unit: all-gather before forward, free after; gather again before backward (a hook on the
    output's gradient), free when every parameter has its gradient."""
    import torch.distributed as dist

    nbytes = flat.numel() * flat.element_size()
    params = list(unit.parameters())
    left = {"grads": len(params)}

    def gather(*_):
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(nbytes)
            dist.all_gather_into_tensor(flat, shard)

    def free(*_):
        flat.untyped_storage().resize_(0)

    def after_forward(_module, _args, out):
        out.register_hook(lambda grad: gather())  # the output's gradient arrives just before the unit's backward
        free()

    def grad_ready(_p):
        left["grads"] -= 1
        if left["grads"] == 0:
            free()

    unit.register_forward_pre_hook(gather)
    unit.register_forward_hook(after_forward)
    for p in params:
        p.register_post_accumulate_grad_hook(grad_ready)


def clip_grad_norm_sharded(grads, max_norm):
    """Clip ZeRO-3's sharded gradients by the norm of the whole gradient: every rank sums the squares of its own
    elements, one all-reduce adds them over the ranks, the square root is the norm; each shard is scaled in place by
    the same min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping."""
    import torch
    import torch.distributed as dist

    squares = torch.zeros((), dtype=torch.float32)
    for g in grads:
        squares += g.float().pow(2).sum()
    dist.all_reduce(squares)  # SUM over the ranks: norms do not add, squares do
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # scale down only
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
