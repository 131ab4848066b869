"""Reference answers for chapter 13's exercises (each self-contained: it travels to the ranks as source)."""


def one_f_one_b_schedule(p, m, stage):
    """PipeDream-Flush's action list for ``stage``: warm-up forwards, then one F and one B in turn, then cool-down."""
    warmup = min(p - stage - 1, m)  # the later stages must have something to work on before our first B
    actions = [("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        actions += [("F", warmup + j), ("B", j)]
    actions += [("B", i) for i in range(m - warmup, m)]
    return actions


def stage_step(stage, comm):
    """One micro-batch through this stage: receive, forward, send; receive the gradient, backward, send."""
    import torch

    if comm.is_first:
        x = comm.input()
    else:
        x = comm.recv_forward().requires_grad_()  # a leaf of this stage's graph: its .grad goes back
    y = stage(x)  # [micro_batch, hidden]
    if comm.is_last:
        comm.loss(y).backward()
    else:
        comm.send_forward(y)
        torch.autograd.backward(y, grad_tensors=comm.recv_backward())  # d loss / d y from the next stage
    if not comm.is_first:
        comm.send_backward(x.grad)
