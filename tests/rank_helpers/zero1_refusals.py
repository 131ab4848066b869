"""Parameter groups ``Zero1Optimizer`` must refuse, on real ranks, and what the refusal left of the weights.

Each rank starts from weights of its own (rank r holds r + 1, 10 + r, 20 + r): the construction's broadcast
from rank 0 would make rank 1's equal to rank 0's, and flattening re-points every ``p.data`` into a flat
buffer, so either trace shows a construction that touched the model before it refused.
"""
import torch

from workers.zero.zero1 import Zero1Optimizer


def main(ctx, case: str = "in_two_groups"):
    a = torch.nn.Parameter(torch.full((6,), ctx.rank + 1.0, device=ctx.device))
    b = torch.nn.Parameter(torch.full((3, 2), 10.0 + ctx.rank, device=ctx.device))
    c = torch.nn.Parameter(torch.full((4,), 20.0 + ctx.rank, dtype=torch.float64, device=ctx.device))
    params = {"a": a, "b": b, "c": c}
    groups = {
        # b is in group 0 and again in group 1 (group 0 alone would be flattened and broadcast first)
        "in_two_groups": [{"params": [a, b]}, {"params": [b]}],
        # a twice in group 0 is a tied weight and is fine; a again in group 1 is not
        "twice_in_a_group_then_in_another": [{"params": [a, b, a]}, {"params": [c, a]}],
        # group 0 is valid; group 1 mixes float32 and float64
        "later_group_mixes_dtypes": [{"params": [a]}, {"params": [b, c]}],
        # valid groups, but an option the wrapped optimizer refuses when it is built (after the broadcast, unfixed)
        "optimizer_refuses_an_option": [{"params": [a, b]}, {"params": [c]}],
    }[case]
    lr = -1.0 if case == "optimizer_refuses_an_option" else 0.1
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in params.items()}
    try:
        Zero1Optimizer(groups, torch.optim.SGD, lr=lr)
        error = ""
    except ValueError as exc:
        error = str(exc)
    return {"error": error,
            "values_kept": [name for name, p in params.items() if torch.equal(p.detach(), before[name][1])],
            "memory_kept": [name for name, p in params.items() if p.data_ptr() == before[name][0]]}
