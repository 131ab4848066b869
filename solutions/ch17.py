"""Reference answers for chapter 17's exercises (each self-contained: ``resume_position`` travels to the ranks as
source)."""


def resume_position(checkpoint, failed_step, rank, world_size):
    """This rank's rows in the first step after a restart. The data order rolls back with the weights: to the
    checkpoint's step (``failed_step`` only says how much work was lost). After ``step`` steps, ``step`` global batches
    are read; an epoch is ``n_samples // global_batch`` of them (the incomplete last batch is dropped), each epoch
    shuffled with ``seed + epoch``, and rank r reads its consecutive slice of each global batch."""
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], n // batch)  # the next global batch: number `position` of `epoch`
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))  # [n]: the epoch's order
    per_rank = batch // world_size
    start = position * batch + rank * per_rank
    return order[start:start + per_rank].tolist()  # [global_batch / world_size]


def quorum_grad_scale(grads, participants, replicas):
    """The gradient every replica of the quorum steps with: the sum over the replicas present divided by how many
    they are (torchft's ``Manager.allreduce``: SUM, then / ``num_participants()``). The replicas outside the quorum,
    and the plan's count, play no part."""
    total = None
    for r in sorted(participants):
        total = [g.clone() for g in grads[r]] if total is None else [t + g for t, g in zip(total, grads[r])]
    return [t / len(participants) for t in total]


def timeline_goodput(segments):
    """Productive time over wall time: work minus what rollbacks undid, over every segment's seconds except the
    rollbacks' (a rollback takes no time: it turns earlier work into lost work)."""
    productive = sum(s for kind, s in segments if kind == "work") - sum(s for kind, s in segments if kind == "rollback")
    wall = sum(s for kind, s in segments if kind != "rollback")
    return productive / wall
