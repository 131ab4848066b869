"""Rank-side check for chapter 15's ``micro_batch_loss``: the learner's loss normalisation, trained for real.

The composed trainer (``workers/composed/train.py``) calls the answer for every micro-batch of every rank
instead of its own rule, on two layouts of 4 ranks with ragged token counts: 2x1x2x1 (data and pipeline
parallel, 4 micro-batches of one sample: dp differs from m) and 2x1x1x2 (data and context parallel, 2 micro-batches:
dp equals m), so that a rule true only where dp = m fails. At step 1 samples 0 and 1 hold no valid token: a
micro-batch without any token to average, where a rule dividing by micro_tokens gives 0/0. Every rank also trains
the one-process reference and compares (``workers/composed/equivalence.compare`` needs all ranks' shards, so here
each rank checks the loss of every step and its own gradients' effect through the loss of the next steps).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workers.layout import Layout
from workers.composed.model import MODEL
from workers.composed.train import ComposedTrainer, reference_run
from workers.exercises.support import Wrong, agree, run_exercise
from workers.model.batch import make_batch

LAYOUTS = (Layout(dp=2, pp=2, micro_batches=4), Layout(dp=2, cp=2, micro_batches=2))
STEPS, GLOBAL_BATCH, LR = 3, 8, 0.01
TOL = 1e-10  # float64, as the chapter's equivalence check (workers/composed/equivalence.TOLERANCE)
EMPTY_STEP, EMPTY_SAMPLES = 1, 2  # at step 1, samples 0 and 1 hold no valid token: dp rank 0's first micro-batch


def ragged_batch(cfg, global_batch: int, step: int, seed: int = 1):
    """``make_batch``, with an empty micro-batch at ``EMPTY_STEP`` (on both layouts: one of one sample, or of two)."""
    tokens, valid = make_batch(cfg, global_batch, step, seed)
    if step == EMPTY_STEP:
        valid[:EMPTY_SAMPLES] = False
    return tokens, valid


def _empty_gives(answer, m: int, dp: int, cp: int) -> float:
    """The answer's loss for a micro-batch without a valid token (the reference's is 0)."""
    return float(answer(torch.zeros((), dtype=torch.float64), 0, 40, m, dp, cp))


def _diagnose(answer) -> str | None:
    """What a wrong rule does, read off its values on numbers where each mistake shows differently."""
    summed, micro, total, m, dp, cp = torch.tensor(6.0, dtype=torch.float64), 3, 40, 3, 2, 4
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
    if abs(got - 6.0 / total * dp / m) < 1e-12 or abs(got - 6.0 / total * m / dp) < 1e-12:
        return ("your rule scales the loss by dp / micro_batches (or its inverse), which is 1 only on a layout where "
                "dp equals the number of micro-batches: neither enters the global mean, since the gradients are "
                "summed over dp x cp and accumulated over micro-batches; divide by the global token count alone")
    return None


def _trial(answer) -> None:
    """Every rank tries the answer before any rank builds a trainer: only the last pipeline stage calls it in
    training, so a stub (NotImplementedError) or a crash raised there alone would leave the other stages waiting for
    a message; here every rank raises together, and the verdict is "not attempted" or the error."""
    leaf = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    summed = leaf * 1.0  # as in training, the output of an operation (so an in-place division is allowed)
    got = answer(summed, 2, 8, 2, 2, 1)
    if not isinstance(got, torch.Tensor) or not got.requires_grad:
        raise Wrong(f"return a tensor computed from summed_ce (got {type(got).__name__}"
                    f"{'' if not isinstance(got, torch.Tensor) else ' without a gradient'}): the loss is "
                    "backpropagated, and a Python number (.item()) or a detached tensor carries no gradient")
    if got.numel() != 1 or got.dtype != summed.dtype or got.device != summed.device:
        raise Wrong(f"return one number of summed_ce's dtype and device ({summed.dtype}, {summed.device}), not a "
                    f"{got.dtype} tensor of shape {list(got.shape)} on {got.device}: the trainer runs in float64, and "
                    "a float32 loss rounds away what the check compares")
    (grad,) = torch.autograd.grad(got.sum(), leaf, allow_unused=True)
    if grad is None:
        raise Wrong("your loss is not connected to the model's graph: it requires a gradient but was made afresh "
                    "(torch.tensor(...) of a number), so backward reaches no parameter; compute it from summed_ce "
                    "with tensor operations")
    try:
        _empty_gives(answer, 2, 2, 1)
    except Exception as exc:  # noqa: BLE001 - in training it would be raised on the last stage alone
        raise Wrong(f"a micro-batch without a valid token (micro_tokens = 0) makes your function raise "
                    f"{type(exc).__name__}: {exc}; it contributes nothing to the global mean") from None


def check_micro_batch_loss(ctx, answer) -> None:
    if ctx.world_size != 4:
        raise Wrong(f"this check runs on 4 ranks, not {ctx.world_size}")
    _trial(answer)
    cfg = MODEL
    reference = reference_run(cfg, steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, batch=ragged_batch)
    for layout in LAYOUTS:
        trainer = ComposedTrainer(layout, cfg, rank=ctx.rank, device=ctx.device, comm_device=ctx.comm_device("send"),
                                  global_batch=GLOBAL_BATCH, lr=LR, normalise=answer, batch=ragged_batch)
        try:
            losses = []
            for step in range(STEPS):
                losses.append(trainer.step(step)["loss"])
        finally:
            trainer.close()

        def compare(losses=losses, layout=layout):
            for step, (got, want) in enumerate(zip(losses, reference["losses"])):
                if got is None:  # not the last stage
                    continue
                where = f"layout {layout.name} (DPxTPxPPxCP, {layout.micro_batches} micro-batches), step {step}"
                if not math.isfinite(got):
                    empty = _empty_gives(answer, layout.micro_batches, layout.dp, layout.cp)
                    why = (f"a micro-batch without a valid token (micro_tokens = 0; at step {EMPTY_STEP} dp rank 0's "
                           f"first) gives {empty} in your rule where it should give 0: do not divide by "
                           "micro_tokens; divide by the global batch's valid tokens only"
                           if not math.isfinite(empty) else "look for a division by a count that can be 0")
                    raise Wrong(f"{where}: the loss is {got} (NaN or infinite), one process gives {want:.6f}: {why}")
                if not abs(got - want) <= TOL * abs(want):
                    why = _diagnose(answer) or "compare your rule with the global mean of the token losses"
                    raise Wrong(f"{where}: the loss is {got:.6f}, one process gives {want:.6f}: {why}")

        agree(compare)
    dist.barrier()


CHECKS = {"micro_batch_loss": check_micro_batch_loss}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
