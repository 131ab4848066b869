"""Plausible wrong answers for chapter 13, each with a fragment of the message the check must give."""


def schedule_gpipe_order(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]  # all forwards first: GPipe


def schedule_warmup_one_too_many(p, m, stage):
    warmup = min(p - stage, m)  # p - stage: one more micro-batch stashed than 1F1B needs
    actions = [("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def schedule_warmup_too_short(p, m, stage):
    warmup = max(min(p - stage - 2, m), 0)  # too few warm-up forwards: stages downstream starve
    actions = [("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def stage_step_no_requires_grad(stage, comm):
    import torch

    x = comm.input() if comm.is_first else comm.recv_forward()  # plain data: autograd stops here
    y = stage(x)
    if comm.is_last:
        comm.loss(y).backward()
    else:
        comm.send_forward(y)
        torch.autograd.backward(y, grad_tensors=comm.recv_backward())
    if not comm.is_first:
        comm.send_backward(x.grad)


def stage_step_no_send_backward(stage, comm):
    import torch

    x = comm.input() if comm.is_first else comm.recv_forward().requires_grad_()
    y = stage(x)
    if comm.is_last:
        comm.loss(y).backward()
    else:
        comm.send_forward(y)
        torch.autograd.backward(y, grad_tensors=comm.recv_backward())
    # the input's gradient never goes back


def stage_step_own_loss(stage, comm):
    x = comm.input() if comm.is_first else comm.recv_forward().requires_grad_()
    y = stage(x)
    if comm.is_last:
        comm.loss(y).backward()
    else:
        comm.send_forward(y)
        comm.recv_backward()
        y.sum().backward()  # a made-up loss instead of the gradient from the next stage
    if not comm.is_first:
        comm.send_backward(x.grad)


def stage_step_zero_grad_each_micro_batch(stage, comm):
    # Right for one micro-batch, but the gradients are zeroed at every micro-batch: only the last one's survive.
    import torch

    stage.zero_grad()
    x = comm.input() if comm.is_first else comm.recv_forward().requires_grad_()
    y = stage(x)
    if comm.is_last:
        comm.loss(y).backward()
    else:
        comm.send_forward(y)
        torch.autograd.backward(y, grad_tensors=comm.recv_backward())
    if not comm.is_first:
        comm.send_backward(x.grad)


WRONG = [
    ("one_f_one_b_schedule", schedule_gpipe_order, "GPipe's order"),
    ("one_f_one_b_schedule", schedule_warmup_one_too_many, "a warm-up of p - stage - 1"),
    ("one_f_one_b_schedule", schedule_warmup_too_short, "a warm-up shorter than p - stage - 1"),
    ("stage_step", stage_step_no_requires_grad, "requires_grad_()"),
    ("stage_step", stage_step_no_send_backward, "never sent the gradient of its input back"),
    ("stage_step", stage_step_own_loss, "that of a loss of its own"),
    ("stage_step", stage_step_zero_grad_each_micro_batch, "the last micro-batch's alone"),
]
