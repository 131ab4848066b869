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


def split_linear_backward(x, weight, dy):
    """B now, W later, for y = x W^T + b: return dx, and a function that gives (dW, db) when the schedule runs W."""
    dx = dy @ weight  # [n, out] @ [out, in] -> [n, in]: what the previous stage waits for

    def weight_grad():  # W: x and dy are all it needs, and all B keeps for it
        return dy.t() @ x, dy.sum(0)  # [out, n] @ [n, in] -> [out, in]; the bias is added to every row: [out]

    return dx, weight_grad


def fix_schedule(broken):
    """Repair the hand-written ZB-H1 table: move the two actions that break a dependency, leave the rest."""
    table = [list(row) for row in broken]

    def move(row, action, after):
        row.remove(action)
        row.insert(row.index(after) + 1, action)

    move(table[2], ("W", 1), after=("B", 3))  # ZB-H1's place, step 1 + p - 1: in a gap, not right after its B
    move(table[1], ("B", 2), after=("F", 4))  # stage 2 sends B(2)'s gradient only after it has received F(3)
    return table


def predict_bubble(schedule, p, m, t_f, t_b, t_w):
    """The largest idle time of a rank inside its own span, in ideal time (t_F, t_B, t_W per action of the table)."""
    if schedule == "1f1b":
        return (p - 1) * (t_f + t_b + t_w)  # the round trip of the first micro-batch; 1F1B's B is the whole backward
    if schedule == "zb-h1":
        # stage 0 waits (p - 1) t_B for the first gradient after its warm-up (no W is ready to fill it); in the
        # cool-down each W stands in for a forward no longer there, which it covers only up to t_W
        return (p - 1) * (t_b + max(0.0, t_f - t_w))
    if schedule == "zb-v":  # t_F = t_B = t_W = t: each micro-batch short of 2p - 1 leaves rank 0 idle 2t
        return 2 * max(0, 2 * p - 1 - m) * t_f
    raise ValueError(f"schedule={schedule!r}: choose '1f1b', 'zb-h1' or 'zb-v'")
