"""Plausible wrong answers for chapter 13, each with a fragment of the message the check must give.

Answers are marked with ``tries(...)(answer)`` after their definition, never with a decorator: an answer travels as
its source (to the ranks, and into a notebook cell in the browser test), and a decorator line would travel with it."""
from tests.wrong_answers import tries


def schedule_gpipe_order(p, m, stage):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]  # all forwards first: GPipe


def schedule_warmup_one_too_many(p, m, stage):
    warmup = min(p - stage, m)  # p - stage: one more micro-batch stashed than 1F1B needs
    actions = [("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def schedule_warmup_not_capped(p, m, stage):
    warmup = p - stage - 1  # not capped at m: with fewer micro-batches than stages it runs ones that do not exist
    actions = [("F", i) for i in range(warmup)]
    for j in range(max(m - warmup, 0)):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", i) for i in range(max(m - warmup, 0), m)]


def schedule_warmup_half_the_micro_batches(p, m, stage):
    warmup = min(p - stage - 1, m // 2)  # right while m >= 2 (p - 1), as at p=4, m=8
    actions = [("F", i) for i in range(warmup)]
    for j in range(m - warmup):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", i) for i in range(m - warmup, m)]


def schedule_nan_index(p, m, stage):
    from solutions.ch13 import one_f_one_b_schedule

    actions = one_f_one_b_schedule(p, m, stage)
    return actions[:-1] + [("B", float("nan"))]  # one index NaN


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


tries("traffic")(stage_step_no_send_backward)


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


tries("order")(stage_step_zero_grad_each_micro_batch)


def stage_step_every_later_stage_is_last(stage, comm):
    # Right on 2 stages: a stage that is not the first is taken for the last, so a middle stage never sends on.
    x = comm.input() if comm.is_first else comm.recv_forward().requires_grad_()
    y = stage(x)
    if comm.is_first:
        comm.send_forward(y)
        y.backward(comm.recv_backward())
    else:
        comm.loss(y).backward()
        comm.send_backward(x.grad)


tries("layouts")(stage_step_every_later_stage_is_last)


def stage_step_sends_flattened(stage, comm):
    import torch

    x = comm.input() if comm.is_first else comm.recv_forward().requires_grad_()
    y = stage(x)
    if comm.is_last:
        comm.loss(y).backward()
    else:
        comm.send_forward(y.flatten())  # the activation as one long vector: the next stage expects [b, hidden]
        torch.autograd.backward(y, grad_tensors=comm.recv_backward())
    if not comm.is_first:
        comm.send_backward(x.grad)


tries("output")(stage_step_sends_flattened)


def stage_step_nan_gradient(stage, comm):
    from solutions.ch13 import stage_step

    stage_step(stage, comm)
    next(stage.parameters()).grad.view(-1)[0] = float("nan")  # one entry of one gradient


tries("non-finite")(stage_step_nan_gradient)
tries("sizes")(schedule_warmup_not_capped)
tries("layouts")(schedule_warmup_half_the_micro_batches)
tries("non-finite")(schedule_nan_index)


WRONG = [
    ("one_f_one_b_schedule", schedule_gpipe_order, "GPipe's order"),
    ("one_f_one_b_schedule", schedule_warmup_one_too_many, "a warm-up of p - stage - 1"),
    ("one_f_one_b_schedule", schedule_warmup_too_short, "a warm-up shorter than p - stage - 1"),
    ("one_f_one_b_schedule", schedule_warmup_not_capped, "the warm-up is capped at m"),
    ("one_f_one_b_schedule", schedule_warmup_half_the_micro_batches, "a warm-up shorter than p - stage - 1"),
    ("one_f_one_b_schedule", schedule_nan_index, "micro-batch index nan is not a number of a micro-batch"),
    ("stage_step", stage_step_no_requires_grad, "requires_grad_()"),
    ("stage_step", stage_step_no_send_backward, "never sent the gradient of its input back"),
    ("stage_step", stage_step_own_loss, "that of a loss of its own"),
    ("stage_step", stage_step_zero_grad_each_micro_batch, "the last micro-batch's alone"),
    ("stage_step", stage_step_every_later_stage_is_last, "never sent its output to stage"),
    ("stage_step", stage_step_sends_flattened, "send a tensor of shape [3, 8]"),
    ("stage_step", stage_step_nan_gradient, "holds NaN or infinity"),
]
