"""Reference answers for chapter 01's exercises (each self-contained: it travels to the ranks as source)."""


def ring_all_reduce(x):
    """Sum ``x`` over all ranks with a ring: reduce-scatter (n-1 steps), then all-gather (n-1 steps)."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return x
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(x.chunk(n))  # views into x: updating a chunk updates x
    incoming = torch.empty_like(chunks[0])
    # Reduce-scatter: at step s, pass chunk (rank - s) on and add the neighbour's chunk (rank - s - 1).
    # After n-1 steps this rank holds the full sum of chunk (rank + 1) % n.
    for step in range(n - 1):
        send = dist.isend(chunks[(rank - step) % n], right)  # isend: both neighbours can send at once
        dist.recv(incoming, left)
        send.wait()
        chunks[(rank - step - 1) % n] += incoming
    # All-gather: pass the finished chunks around the ring; each arrival replaces a partial sum.
    for step in range(n - 1):
        send = dist.isend(chunks[(rank + 1 - step) % n], right)
        dist.recv(incoming, left)
        send.wait()
        chunks[(rank - step) % n].copy_(incoming)
    return x


def all_gather_from_broadcast(x):
    """Row k of the result is rank k's ``x``: one broadcast from each rank, each into its own buffer."""
    import torch
    import torch.distributed as dist

    rows = []
    for src in range(dist.get_world_size()):
        buf = x.clone() if src == dist.get_rank() else torch.empty_like(x)
        dist.broadcast(buf, src=src)
        rows.append(buf)
    return torch.stack(rows)  # [n, *x.shape]


def bus_bandwidth(collective, nbytes, seconds, world_size):
    """nccl-tests' bus bandwidth in bytes/s: algbw = S / t, times the collective's factor."""
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}[collective]
    return nbytes / seconds * factor
