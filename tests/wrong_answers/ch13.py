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



# --- split_linear_backward ---------------------------------------------------------------------------------------

def slb_dx_times_w_transposed(x, weight, dy):
    dx = dy @ weight.t()  # the forward's product again: [n, out] @ [in, out] multiplies only when in = out

    def weight_grad():
        return dy.t() @ x, dy.sum(0)

    return dx, weight_grad


def slb_dw_transposed(x, weight, dy):
    def weight_grad():
        return x.t() @ dy, dy.sum(0)  # [in, n] @ [n, out]: dW transposed

    return dy @ weight, weight_grad


def slb_db_not_summed(x, weight, dy):
    def weight_grad():
        return dy.t() @ x, dy  # one bias gradient per sample, never summed over the batch

    return dy @ weight, weight_grad


def slb_db_mean(x, weight, dy):
    def weight_grad():
        return dy.t() @ x, dy.mean(0)  # averaged over the batch: right only at n = 1

    return dy @ weight, weight_grad


def slb_db_keepdim(x, weight, dy):
    def weight_grad():
        return dy.t() @ x, dy.sum(0, keepdim=True)  # [1, out], not the bias's [out]

    return dy @ weight, weight_grad


def slb_w_computed_in_b(x, weight, dy):
    dw, db = dy.t() @ x, dy.sum(0)  # computed in B, on the path the previous stage waits on
    return dy @ weight, lambda: (dw, db)


def slb_newest_stash(x, weight, dy, stash=[]):  # one list, shared by every call
    stash.append((x, dy))

    def weight_grad():
        x_, dy_ = stash.pop()  # the newest B's stash: right only when each W follows its own B at once
        return dy_.t() @ x_, dy_.sum(0)

    return dy @ weight, weight_grad


def slb_frees_callers_input(x, weight, dy):
    def weight_grad():
        grads = dy.t() @ x, dy.sum(0)
        x.untyped_storage().resize_(0)  # "free the stash": the caller's own x, gone
        return grads

    return dy @ weight, weight_grad


def slb_nan_entry(x, weight, dy):
    from solutions.ch13 import split_linear_backward

    dx, weight_grad = split_linear_backward(x, weight, dy)
    dx = dx.clone()
    dx.view(-1)[0] = float("nan")  # one entry
    return dx, weight_grad


tries("layouts")(slb_db_mean)
tries("output")(slb_db_keepdim)
tries("order")(slb_newest_stash)
tries("mutation")(slb_frees_callers_input)
tries("non-finite")(slb_nan_entry)


# --- fix_schedule --------------------------------------------------------------------------------------------------

def _move(row, action, after):
    row.remove(action)
    row.insert(row.index(after) + 1, action)


def fix_only_the_first_mistake(broken):
    table = [list(row) for row in broken]
    table[2].remove(("W", 1))
    table[2].insert(table[2].index(("B", 3)) + 1, ("W", 1))  # the first one named; the deadlock stays
    return table


def fix_by_dropping_the_w(broken):
    table = [list(row) for row in broken]
    table[2].remove(("W", 1))  # out of the way, and out of the table
    table[1].remove(("B", 2))
    table[1].insert(table[1].index(("F", 4)) + 1, ("B", 2))
    return table


def fix_w_right_after_its_b(broken):
    table = [list(row) for row in broken]
    table[2].remove(("W", 1))
    table[2].insert(table[2].index(("B", 1)) + 1, ("W", 1))  # valid, but where it delays what others wait for
    table[1].remove(("B", 2))
    table[1].insert(table[1].index(("F", 4)) + 1, ("B", 2))
    return table


def fix_b_right_after_the_forward(broken):
    table = [list(row) for row in broken]
    table[2].remove(("W", 1))
    table[2].insert(table[2].index(("B", 3)) + 1, ("W", 1))
    table[1].remove(("B", 2))
    table[1].insert(table[1].index(("F", 3)) + 1, ("B", 2))  # no deadlock, but now ahead of B(1)
    return table


def fix_on_the_wrong_rank(broken):
    table = [list(row) for row in broken]
    table[1].remove(("W", 1))  # "rank 2" read as the second row: rank 1's W(1), which was in its place
    table[1].insert(table[1].index(("B", 3)) + 1, ("W", 1))
    table[1].remove(("B", 2))
    table[1].insert(table[1].index(("F", 4)) + 1, ("B", 2))
    return table


def fix_by_starting_over(broken):
    from workers.pipeline.zero_bubble import split_stages

    return split_stages("zb-h1", len(broken), 6)  # a new table, not the repaired one


def fix_by_sorting_each_rank(broken):
    order = {"F": 0, "B": 1, "W": 2}
    return [sorted(row, key=lambda a: (order[a[0]], a[1])) for row in broken]  # every F, then every B, then every W


tries("traffic")(fix_only_the_first_mistake)


# --- predict_bubble ------------------------------------------------------------------------------------------------

def bubble_1f1b_everywhere(schedule, p, m, t_f, t_b, t_w):
    return (p - 1) * (t_f + t_b + t_w)


def bubble_1f1b_without_w(schedule, p, m, t_f, t_b, t_w):
    if schedule == "1f1b":
        return (p - 1) * (t_f + t_b)  # as if 1F1B's backward were B alone
    from solutions.ch13 import predict_bubble

    return predict_bubble(schedule, p, m, t_f, t_b, t_w)


def bubble_papers_zb_h1_at_any_times(schedule, p, m, t_f, t_b, t_w):
    if schedule == "zb-h1":
        return (p - 1) * (t_f + t_b - t_w)  # the paper's, for t_W <= t_F
    from solutions.ch13 import predict_bubble

    return predict_bubble(schedule, p, m, t_f, t_b, t_w)


def bubble_v_always_full(schedule, p, m, t_f, t_b, t_w):
    if schedule == "zb-v":
        return 0.0  # zero bubble, as if the V were always full
    from solutions.ch13 import predict_bubble

    return predict_bubble(schedule, p, m, t_f, t_b, t_w)


def bubble_v_not_clamped(schedule, p, m, t_f, t_b, t_w):
    if schedule == "zb-v":
        return 2 * (2 * p - 1 - m) * t_f  # negative once m > 2p - 1
    from solutions.ch13 import predict_bubble

    return predict_bubble(schedule, p, m, t_f, t_b, t_w)


def bubble_v_start_only(schedule, p, m, t_f, t_b, t_w):
    if schedule == "zb-v":
        return max(0, 2 * p - 1 - m) * t_f  # the wait at the start, not the one at the end
    from solutions.ch13 import predict_bubble

    return predict_bubble(schedule, p, m, t_f, t_b, t_w)


def bubble_as_a_share(schedule, p, m, t_f, t_b, t_w):
    from solutions.ch13 import predict_bubble

    idle = predict_bubble(schedule, p, m, t_f, t_b, t_w)
    return idle / (idle + m * (t_f + t_b + t_w))  # the idle share of the step, not the idle time


def bubble_replayed(schedule, p, m, t_f, t_b, t_w):
    from workers.pipeline.schedules import all_stages
    from workers.pipeline.validity import simulate_split
    from workers.pipeline.zero_bubble import placement_of, split_stages

    if schedule == "1f1b":  # the table replayed, not predicted
        return max(simulate_split(all_stages("1f1b", p, m), t_f, t_b, t_w)["span_idle"])
    v = 2 if schedule == "zb-v" else 1
    return max(simulate_split(split_stages(schedule, p, m), t_f * v, t_b * v, t_w * v,
                              placement=placement_of(schedule))["span_idle"])


def bubble_nan_where_the_v_is_full(schedule, p, m, t_f, t_b, t_w):
    if schedule == "zb-v" and m >= 2 * p - 1:
        return float("nan")  # 0/0, where no rank idles
    from solutions.ch13 import predict_bubble

    return predict_bubble(schedule, p, m, t_f, t_b, t_w)


tries("layouts")(bubble_papers_zb_h1_at_any_times)
tries("sizes")(bubble_v_always_full)
tries("non-finite")(bubble_nan_where_the_v_is_full)


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
    ("split_linear_backward", slb_dx_times_w_transposed, "B raised RuntimeError"),
    ("split_linear_backward", slb_dw_transposed, "dW has shape [5, 4], the weight's transposed"),
    ("split_linear_backward", slb_db_not_summed, "db has shape [3, 4], one row per sample"),
    ("split_linear_backward", slb_db_mean, "db is 1/3 of autograd's: you averaged dy over the batch"),
    ("split_linear_backward", slb_db_keepdim, "db has shape [1, 4], the bias's is [4]"),
    ("split_linear_backward", slb_w_computed_in_b, "B computed a tensor of dW's shape [4, 5] and one of db's shape"),
    ("split_linear_backward", slb_newest_stash, "the first micro-batch's W returned the second's dW"),
    ("split_linear_backward", slb_frees_callers_input, "the caller's x, weight or dy changed after W ran"),
    ("split_linear_backward", slb_nan_entry, "dx holds NaN or infinity at [0, 0]"),
    ("fix_schedule", fix_only_the_first_mistake, "the blocking receives deadlock. A B starts only once"),
    ("fix_schedule", fix_by_dropping_the_w, "never runs W of micro-batch 1 on stage 2"),
    ("fix_schedule", fix_w_right_after_its_b, "W(1) on rank 2 now runs right after its B"),
    ("fix_schedule", fix_b_right_after_the_forward, "the table now runs B(2) before B(1) on rank 1"),
    ("fix_schedule", fix_on_the_wrong_rank, "That is the first of the table's two mistakes"),
    ("fix_schedule", fix_by_starting_over, "do not write another"),
    ("fix_schedule", fix_by_sorting_each_rank, "where ZB-H1's is 3"),
    ("predict_bubble", bubble_1f1b_everywhere, "that is 1F1B's bubble"),
    ("predict_bubble", bubble_1f1b_without_w, "its B is the whole backward, t_B + t_W"),
    ("predict_bubble", bubble_papers_zb_h1_at_any_times, "is the paper's count for t_W <= t_F"),
    ("predict_bubble", bubble_v_always_full, "only with m >= 2p - 1 = 7 micro-batches"),
    ("predict_bubble", bubble_v_not_clamped, "never below zero"),
    ("predict_bubble", bubble_v_start_only, "half of it"),
    ("predict_bubble", bubble_as_a_share, "not a share of the step"),
    ("predict_bubble", bubble_replayed, "predict_bubble replayed the table"),
    ("predict_bubble", bubble_nan_where_the_v_is_full, "a bubble is a finite time"),
]
