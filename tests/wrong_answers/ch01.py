"""Plausible wrong answers for chapter 01, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries


def ring_without_all_gather(x):
    # Stops after the reduce-scatter phase: each rank owns one finished chunk and never shares it.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(x.chunk(n))
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send = dist.isend(chunks[(rank - step) % n], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        send.wait()
        chunks[(rank - step - 1) % n] += incoming
    return x


def ring_adds_in_all_gather(x):
    # The all-gather phase adds the finished chunk to the local partial sum instead of replacing it.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(x.chunk(n))
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send = dist.isend(chunks[(rank - step) % n], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        send.wait()
        chunks[(rank - step - 1) % n] += incoming
    for step in range(n - 1):
        send = dist.isend(chunks[(rank + 1 - step) % n], (rank + 1) % n)
        dist.recv(incoming, (rank - 1) % n)
        send.wait()
        chunks[(rank - step) % n] += incoming
    return x


def ring_via_rank_zero(x):
    # Right sum, wrong algorithm: everyone sends everything to rank 0, which sends the total back.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        incoming = torch.empty_like(x)
        for src in range(1, n):
            dist.recv(incoming, src)
            x += incoming
        for dst in range(1, n):
            dist.send(x, dst)
    else:
        dist.send(x, 0)
        dist.recv(x, 0)
    return x


def ring_with_library_all_reduce(x):
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def gather_into_x(x):
    # Broadcasts into x itself: from the first step on, x holds rank 0's data, so that is all anyone sends.
    import torch
    import torch.distributed as dist

    rows = []
    for src in range(dist.get_world_size()):
        dist.broadcast(x, src=src)
        rows.append(x.clone())
    return torch.stack(rows)


def gather_one_shared_buffer(x):
    # One buffer for every broadcast, appended n times: every row ends up as the last rank's tensor.
    import torch
    import torch.distributed as dist

    buf = torch.empty_like(x)
    rows = []
    for src in range(dist.get_world_size()):
        if src == dist.get_rank():
            buf.copy_(x)
        dist.broadcast(buf, src=src)
        rows.append(buf)
    return torch.stack(rows)


def gather_into_float32_buffer(x):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(n, *x.shape)  # float32 on the CPU, whatever x is
    for src in range(n):
        if src == rank:
            out[src].copy_(x)
        dist.broadcast(out[src], src=src)
    return out


def busbw_is_algbw(collective, nbytes, seconds, world_size):
    return nbytes / seconds  # algbw: forgot the collective's factor


def busbw_all_reduce_factor_everywhere(collective, nbytes, seconds, world_size):
    n = world_size
    return nbytes / seconds * 2 * (n - 1) / n  # right for all_reduce only


def ring_leaves_a_nan(x):
    # The right ring, but one value of the result is NaN.
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = list(x.chunk(n))
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send = dist.isend(chunks[(rank - step) % n], right)
        dist.recv(incoming, left)
        send.wait()
        chunks[(rank - step - 1) % n] += incoming
    for step in range(n - 1):
        send = dist.isend(chunks[(rank + 1 - step) % n], right)
        dist.recv(incoming, left)
        send.wait()
        chunks[(rank - step) % n].copy_(incoming)
    x[-1] = float("nan")
    return x


def gather_leaves_a_nan(x):
    # One broadcast per rank into its own buffer, but one gathered value is NaN.
    import torch
    import torch.distributed as dist

    rows = []
    for src in range(dist.get_world_size()):
        buf = x.clone() if src == dist.get_rank() else torch.empty_like(x)
        dist.broadcast(buf, src=src)
        rows.append(buf)
    out = torch.stack(rows)
    if out.is_floating_point():
        out[-1, 0, 0] = float("nan")
    return out


def gather_with_library_all_gather(x):
    import torch
    import torch.distributed as dist

    rows = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, x)
    return torch.stack(rows)


def busbw_nan_for_rooted(collective, nbytes, seconds, world_size):
    # Broadcast and reduce have no factor in the table: 0/0 where there should be 1.
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n}.get(collective, float("nan"))
    return nbytes / seconds * factor


def busbw_as_text(collective, nbytes, seconds, world_size):
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(collective, (n - 1) / n)
    return f"{nbytes / seconds * factor / 1e9:.2f} GB/s"  # a label, not a number

# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("traffic")(ring_via_rank_zero)
tries("mutation")(gather_into_x)
tries("output")(gather_into_float32_buffer)
tries("non-finite")(ring_leaves_a_nan)
tries("non-finite")(gather_leaves_a_nan)
tries("traffic")(gather_with_library_all_gather)
tries("layouts")(busbw_all_reduce_factor_everywhere)
tries("non-finite")(busbw_nan_for_rooted)
tries("output")(busbw_as_text)


WRONG = [
    ("ring_all_reduce", ring_without_all_gather, "forget the all-gather phase"),
    ("ring_all_reduce", ring_adds_in_all_gather, "counted twice"),
    ("ring_all_reduce", ring_via_rank_zero, "where a ring sends"),
    ("ring_all_reduce", ring_with_library_all_reduce, "called dist.all_reduce"),
    ("ring_all_reduce", ring_leaves_a_nan, "holds NaN or inf"),
    ("all_gather_from_broadcast", gather_into_x, "broadcast into x itself"),
    ("all_gather_from_broadcast", gather_one_shared_buffer, "share one buffer"),
    ("all_gather_from_broadcast", gather_into_float32_buffer, "the receive buffers must have x's dtype"),
    ("all_gather_from_broadcast", gather_leaves_a_nan, "holds NaN or inf"),
    ("all_gather_from_broadcast", gather_with_library_all_gather, "called dist.all_gather"),
    ("bus_bandwidth", busbw_is_algbw, "that is the algorithm bandwidth (bytes / seconds) itself, with no factor"),
    ("bus_bandwidth", busbw_all_reduce_factor_everywhere, "or all_reduce's factor (1), but all_gather's factor at n=2 is 0.5"),
    ("bus_bandwidth", busbw_nan_for_rooted, "returned nan for broadcast at n=2"),
    ("bus_bandwidth", busbw_as_text, "should return a number of bytes/s, not str"),
]
