"""Rank-side check for chapter 06: the Megatron block's forward with its two all-reduces, on real ranks.

The learner gets the block's pieces with *no* communication inside (``BlockParts``): the two LayerNorms,
each sub-layer's partial output (this rank's heads / FFN columns, before the sum, without the bias) and
the two replicated biases. They write the forward with ``f`` and ``g`` in the right places. Every rank
runs forward, and the ranks agree on the forward's verdict (``agree``) before the backward, whose ``f``
all-reduces need every rank: a rank whose output is already wrong (or detached) never leaves the others
waiting there. Then it compares the input gradient and the gradient of every parameter shard with the
dense block, and counts the collectives the regions ran.
"""
from __future__ import annotations

import torch

from workers.exercises.subgroups import DEFAULT_GROUP, in_sub_group, layouts, sub_group
from workers.exercises.support import Wrong, agree, expect_close, run_exercise, scaled_by
from workers.parallel import mappings
from workers.parallel.block import ParallelBlock
from workers.model.dense import BlockConfig, build, reference, inputs

TOL = dict(atol=1e-5, rtol=1e-5)
SEQ, BATCH = 6, 2


class BlockParts:
    """This rank's pieces of a Megatron block, without communication.

    ``ln1(x)``, ``ln2(x)``: the LayerNorms (replicated). ``attention_partial(y)``: this rank's heads applied to
    ``y`` and projected by its rows of the output projection: one addend of the attention output, bias not
    added. ``mlp_partial(y)``: the same for the MLP (fc1 columns, GeLU, fc2 rows). ``attention_bias``,
    ``mlp_bias``: the output projections' biases, whole on every rank.
    """

    def __init__(self, block: ParallelBlock):
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.attention_partial = block.attention.partial
        self.mlp_partial = block.mlp.partial
        self.attention_bias = block.attention.proj.bias
        self.mlp_bias = block.mlp.fc2.bias


def _dense_with_biases_times(cfg: BlockConfig, factor: int, x: torch.Tensor, seed: int) -> torch.Tensor:
    """The dense block's output if both output-projection biases counted ``factor`` times (bias inside g)."""
    dense = build("block", cfg, seed=seed).double()
    with torch.no_grad():
        dense.attention.proj.bias.mul_(factor)
        dense.mlp.fc2.bias.mul_(factor)
        return dense(x.double())


def check_block_forward(ctx, answer) -> None:
    # The whole world as the group first, then, at world 4, two groups of 2 side by side (non-contiguous
    # [0, 2] [1, 3], then consecutive [0, 1] [2, 3]), each group with its own block and data.
    _block_case(ctx, answer, None, ctx.world_size, ctx.rank, seed=30)
    for dim in layouts(ctx.world_size):
        with sub_group(ctx, dim) as sg:
            _block_case(ctx, answer, sg.group, sg.size, sg.rank, seed=300 + sg.index, sg=sg)


def _stage(sg, stage):
    return stage if sg is None else (lambda: in_sub_group(sg, stage))


def _off_group(log, pass_: str, t: int, world: int) -> str | None:
    """A collective of the mappings that ran over more ranks than the group's ``t`` (None passed as group)."""
    sizes = sorted({e["group_size"] for e in log if e["pass"] == pass_ and e["group_size"] != t})
    if not sizes:
        return None
    names = sorted({e["mapping"] for e in log if e["pass"] == pass_ and e["group_size"] != t})
    return (f"in the {pass_} pass, {', '.join(names)} ran over {sizes[-1]} ranks (the world has {world}), where "
            f"the group has {t}: it " + DEFAULT_GROUP)


def _block_case(ctx, answer, group, t, r, *, seed, sg=None) -> None:
    cfg = BlockConfig(hidden=16, heads=4)
    block = ParallelBlock.from_dense(build("block", cfg, seed=seed), group).to(ctx.device)
    parts = BlockParts(block)
    x_full, g_full = inputs("block", cfg, SEQ, BATCH, seed=seed)
    x = x_full.clone().to(ctx.device).requires_grad_()
    ref = reference("block", cfg, SEQ, BATCH, seed=seed)
    with mappings.record_communication() as log:
        y = answer(x, parts, group)
        forward_ar = sum(1 for e in log if e["collective"] == "all_reduce" and e["pass"] == "forward")

        def forward_verdict():
            if not isinstance(y, torch.Tensor):
                raise Wrong(f"block_forward should return a tensor, not {type(y).__name__}")
            off = _off_group(log, "forward", t, ctx.world_size) if sg is not None else None
            if off:
                raise Wrong(off)
            if y.shape != x.shape:
                raise Wrong(f"rank {r}'s output has shape {tuple(y.shape)}: it should have the input's shape "
                            f"{tuple(x.shape)}")
            if not y.requires_grad:
                raise Wrong(f"rank {r}'s output is not requiring grad: every rank's output must stay in the graph, "
                            "because each rank's backward runs the f all-reduces that the other ranks wait for "
                            "(no .detach(), no torch.no_grad(), on any rank)")
            if t > 1 and forward_ar > 2:
                raise Wrong(f"your forward ran {forward_ar} all-reduces: a Megatron block needs exactly two, one g "
                            "after each sub-layer's partial output")
            got = y.detach().cpu().double()
            want = ref["output"]
            bad = int((~torch.isfinite(got)).sum())
            if bad:
                raise Wrong(f"rank {r}'s block output holds {bad} NaN or infinite value(s): the dense block's is "
                            "finite everywhere; look for a division by zero or a value read before it was written")
            if t > 1 and torch.allclose(got, _dense_with_biases_times(cfg, t, x_full, seed), atol=1e-4):
                raise Wrong(f"the output holds each bias {t} times: you added it inside g (before the all-reduce); "
                            "add it after the sum")
            if not torch.allclose(got, want, **TOL):
                raise Wrong(f"rank {r}'s block output is off by {(got - want).abs().max().item():.3g}: each "
                            "sub-layer's partial output must be summed over ranks with g before it joins the "
                            "residual stream (the next LayerNorm needs the whole sum), exactly once, and its bias "
                            "added after the sum")

        # The backward runs the learner's f all-reduces: every rank runs it, or none does.
        agree(_stage(sg, forward_verdict))
        y.backward(g_full.to(ctx.device))
    backward_ar = sum(1 for e in log if e["collective"] == "all_reduce" and e["pass"] == "backward")

    def backward_verdict():
        off = _off_group(log, "backward", t, ctx.world_size) if sg is not None else None
        if off:
            raise Wrong(off)
        wrong = []
        for name, p in block.named_parameters():
            dense_grad = ref["grads"][name]
            if hasattr(p, "partition_dim"):
                dense_grad = dense_grad.index_select(p.partition_dim, p.partition_index)
            if p.grad is None or not torch.allclose(p.grad.cpu().double(), dense_grad, **TOL):
                wrong.append(name)
        biases = {"attention.proj.bias", "mlp.fc2.bias"}
        if wrong and set(wrong) <= biases:
            missing = [n for n in wrong if dict(block.named_parameters())[n].grad is None]
            raise Wrong(f"the output is right but rank {r}'s gradients of {', '.join(wrong)} are not"
                        + (" (they got none)" if missing else "") + ": the output-projection biases are replicated, "
                        "whole on every rank, and each copy must get the full gradient. Add each bias on every rank, "
                        "once, after g (adding it inside g on one rank only gives the right output, but the other "
                        "ranks' copies get no gradient and drift apart at the first optimizer step)")
        if wrong or not torch.allclose(x.grad.cpu().double(), ref["grad_input"], **TOL):
            lns = [n for n in wrong if n.startswith("ln")]
            raise Wrong("the output is right but the gradients are not (" + ", ".join(wrong or ["the input's"]) +
                        "): each sub-layer's input feeds this rank's own heads or FFN columns, so its gradient is "
                        "only this rank's part. Pass the LayerNorm outputs through f (copy_to, all-reduce in "
                        "backward) before the partial sub-layers" + (f" ({', '.join(lns)} are partial)" if lns else ""))
        expect_close(x.grad.cpu(), ref["grad_input"], "the input gradient", **TOL,
                     hints=[(scaled_by(t), f"it is {t} times too large: a gradient was all-reduced twice")])
        if t > 1 and backward_ar != 2:
            if backward_ar == 0:  # right numbers, nothing through the course's regions: an f/g of the learner's own
                raise Wrong("outputs and gradients are right, but no all-reduce went through the course's regions: "
                            "the check counts communication through copy_to_tensor_model_parallel_region (f) and "
                            "reduce_from_tensor_model_parallel_region (g), as the exercise asks; a hand-written f/g "
                            "is not counted, so use those two")
            raise Wrong(f"outputs and gradients are right, but the backward ran {backward_ar} all-reduces through the "
                        "regions, where the block needs exactly two (one f per sub-layer)")

    agree(_stage(sg, backward_verdict))


CHECKS = {"block_forward": check_block_forward}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)


if __name__ == "__main__":
    from workers.runtime import entrypoint

    entrypoint(main)
