"""Rank-side check for chapter 15's ``micro_batch_loss``: the learner's loss normalisation, trained for real.

The composed trainer (``workers/composed/train.py``) calls the answer for every micro-batch of every rank
instead of its own rule, on two layouts of 4 ranks with ragged token counts: 2x1x2x1 (data and pipeline
parallel, 2 micro-batches) and 2x1x1x2 (data and context parallel). Every rank also trains the one-process
reference and compares (``workers/composed/equivalence.compare`` needs all ranks' shards, so here each rank
checks the loss of every step and its own gradients' effect through the loss of the next steps).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workers.layout import Layout
from workers.composed.model import MODEL
from workers.composed.train import ComposedTrainer, reference_run
from workers.exercises.support import Wrong, agree, run_exercise

LAYOUTS = (Layout(dp=2, pp=2, micro_batches=2), Layout(dp=2, cp=2, micro_batches=2))
STEPS, GLOBAL_BATCH, LR = 3, 8, 0.01
TOL = 1e-10  # float64, as the chapter's equivalence check (workers/composed/equivalence.TOLERANCE)


def _diagnose(answer) -> str | None:
    """What a wrong rule does, read off its values on numbers where each mistake shows differently."""
    summed, micro, total, m, dp, cp = torch.tensor(6.0, dtype=torch.float64), 3, 40, 2, 2, 2
    try:
        got = float(answer(summed, micro, total, m, dp, cp))
    except Exception as exc:  # noqa: BLE001 - the answer's own error is the message
        return f"your function raised {type(exc).__name__}: {exc}"
    if abs(got - 6.0 / (3 * m * dp)) < 1e-12:
        return ("each micro-batch is averaged over its own tokens, then over m and dp: with ragged micro-batches a "
                "token of a short one weighs more than a token of a long one. Divide the summed loss by the number "
                "of valid tokens in the whole global batch")
    if abs(got - 6.0 / 3) < 1e-12 or abs(got - 6.0 / (3 * m)) < 1e-12:
        return ("you normalise by this micro-batch's tokens: every micro-batch then counts as much as the whole "
                "batch. Each token should weigh 1 / (valid tokens of the global batch)")
    if abs(got - 6.0 / (total * dp)) < 1e-12 or abs(got - 6.0 / (total * dp * cp)) < 1e-12 \
            or abs(got - 6.0 / (total * m)) < 1e-12:
        return ("the loss is divided once more by dp, cp or m: the gradients are summed over the data- and "
                "context-parallel ranks and accumulated over micro-batches, not averaged, so dividing by the global "
                "token count is all it takes")
    return None


def check_micro_batch_loss(ctx, answer) -> None:
    if ctx.world_size != 4:
        raise Wrong(f"this check runs on 4 ranks, not {ctx.world_size}")
    # Every rank tries the answer once before any rank builds a trainer: only the last pipeline stage calls it
    # in training, so a stub (NotImplementedError) or a crash raised there alone would leave the other stages
    # waiting for a message; here every rank raises together, and the verdict is "not attempted" or the error.
    trial = answer(torch.tensor(1.0, dtype=torch.float64, requires_grad=True), 1, 8, 2, 2, 1)
    if not isinstance(trial, torch.Tensor) or not trial.requires_grad:
        raise Wrong(f"return a tensor computed from summed_ce (got {type(trial).__name__}"
                    f"{'' if not isinstance(trial, torch.Tensor) else ' without a gradient'}): the loss is backpropagated, "
                    "and a Python number (.item()) or a detached tensor carries no gradient")
    cfg = MODEL
    reference = reference_run(cfg, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR)
    for layout in LAYOUTS:
        trainer = ComposedTrainer(layout, cfg, rank=ctx.rank, device=ctx.device, comm_device=ctx.comm_device("send"),
                                  global_batch=GLOBAL_BATCH, lr=LR, normalise=answer)
        try:
            losses = []
            for step in range(STEPS):
                losses.append(trainer.step(step)["loss"])
        finally:
            trainer.close()

        def compare(losses=losses, layout=layout):
            for step, (got, want) in enumerate(zip(losses, reference["losses"])):
                if got is not None and abs(got - want) > TOL * abs(want):
                    why = _diagnose(answer) or "compare your rule with the global mean of the token losses"
                    raise Wrong(f"layout {layout.name} (DPxTPxPPxCP), step {step}: the loss is {got:.6f}, one process "
                                f"gives {want:.6f}: {why}")

        agree(compare)
    dist.barrier()


CHECKS = {"micro_batch_loss": check_micro_batch_loss}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
