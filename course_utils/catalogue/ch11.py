"""Chapter 11's graded exercises: the ZeRO stage formulas (in the notebook), the sharded optimizer step, ZeRO-2's
gradient hook, ZeRO-3's gather-then-free around a unit and gradient-norm clipping over ZeRO-3's shards (on
ranks)."""
from __future__ import annotations

import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

# (n_params, dp, stage, tp, pp, optimizer_bytes): the ZeRO paper's Figure 1 example first, then TP/PP
# compositions, an SGD-momentum K and a fractional split.
CASES = [
    (7.5e9, 64, 0, 1, 1, 12), (7.5e9, 64, 1, 1, 1, 12), (7.5e9, 64, 2, 1, 1, 12), (7.5e9, 64, 3, 1, 1, 12),
    (70e9, 8, 1, 8, 4, 12), (70e9, 8, 2, 8, 4, 12), (70e9, 8, 3, 8, 4, 12), (405e9, 64, 1, 8, 16, 12),
    (1e9, 4, 1, 1, 1, 4), (1e9, 4, 2, 2, 1, 8), (1e6, 3, 3, 1, 1, 12), (7e9, 1, 3, 1, 1, 12),
]
STATES = ("params", "grads", "optimizer")


def _expected(n_params, dp, stage, tp, pp, k) -> dict:
    from course_utils.ledger import model_state_bytes

    return model_state_bytes(n_params, dp=dp, tp=tp, pp=pp, zero_stage=stage, optimizer_bytes_per_param=k).as_dict()


def _hint(state: str, got: float, want: float, dp: int, stage: int, tp: int, pp: int) -> str:
    if want and abs(got * 1e9 / want - 1) < 1e-6 or want and abs(got * 2**30 / want - 1) < 1e-6:
        return "return bytes, not GB or GiB"
    if want and abs(got / (want * dp) - 1) < 1e-9:
        return f"stage {stage} shards the {state} over the {dp} data-parallel ranks: divide by dp"
    if want and abs(got * dp / want - 1) < 1e-9:
        return f"stage {stage} does not shard the {state} yet (stage 1: optimizer, 2: + gradients, 3: + parameters)"
    if want and tp * pp > 1 and abs(got / (want * tp * pp) - 1) < 1e-9:
        return f"tensor and pipeline parallelism first split the parameters tp*pp = {tp * pp} ways: divide by tp*pp"
    if want != math.floor(want) and got == math.floor(want):
        return (f"dp={dp} does not divide the bytes evenly and the exact share is fractional: divide with /, not // "
                "(floor division drops the remainder)")
    return ""


def check_zero_state_bytes(answer) -> tuple[str, str]:
    for n_params, dp, stage, tp, pp, k in CASES:
        got = answer(n_params, dp, stage, tp=tp, pp=pp, optimizer_bytes=k)
        if not isinstance(got, dict) or not set(STATES) <= set(got):
            return FAIL, f"return a dict with the keys 'params', 'grads' and 'optimizer' (bytes per GPU), got {got!r}"
        want = _expected(n_params, dp, stage, tp, pp, k)
        case = f"n_params={n_params:g}, dp={dp}, stage={stage}, tp={tp}, pp={pp}, optimizer_bytes={k}"
        for state in STATES:
            try:
                g, w = float(got[state]), want[state]
            except (TypeError, ValueError):
                return FAIL, f"{state} for {case} should be a number of bytes, got {got[state]!r}"
            if not math.isfinite(g):
                return FAIL, (f"{state} for {case} is {g} (NaN or infinite), where {w:.12g} bytes was expected: "
                              "bytes per GPU are finite; look for a division by zero")
            if not abs(g - w) <= 1e-9 * max(w, 1.0):
                hint = _hint(state, g, w, dp, stage, tp, pp)
                return FAIL, (f"{state} for {case}: expected {w:.12g} bytes, got {g:.12g}" + (f"; {hint}" if hint else ""))
    return PASS, "correct: the ZeRO paper's 120 / 31.4 / 16.6 / 1.9 GB and the TP/PP compositions all match"


NO_GRADIENTS = NOT_APPLICABLE + "a formula of three byte counts: no gradients, no hooks"

register(Exercise("zero_state_bytes", "11", "zero_state_bytes",
                  "The ZeRO ledger: bytes of parameters, gradients and optimizer states per GPU, with TP and PP",
                  local=check_zero_state_bytes, tries={
                      "non-finite": "each of the three byte counts must be a finite number: NaN or infinity is refused "
                                    "by name",
                      "order": NO_GRADIENTS,
                      "sizes": "dp = 3 and 1e6 parameters, and 405B over tp*pp = 128 and dp = 64: shares that are not "
                               "whole bytes must be exact, not floored",
                      "ragged": NOT_APPLICABLE + "every rank of a stage holds the same share: the formula has no "
                                                 "partitions of unequal size",
                      "layouts": "twelve cases: ZeRO stages 0-3, with and without tp and pp, and optimizer states of "
                                 "12, 8 and 4 bytes: a rule true of tp = pp = 1 alone fails",
                      "traffic": NOT_APPLICABLE + "a ledger on paper: no collective runs",
                      "mutation": NOT_APPLICABLE + "the inputs are Python numbers, which a function cannot change",
                      "output": NOT_APPLICABLE + "a dict of three Python numbers; int and float alike are accepted",
                      "memory": NOT_APPLICABLE + "the answer predicts bytes; nothing is allocated or freed",
                      "bits": NOT_APPLICABLE + "byte counts are compared to a relative 1e-9, not bit for bit",
                  }))
register(Exercise("zero1_step", "11", "zero1_step",
                  "ZeRO-1 by hand: average the gradients, step only your shard, re-synchronise the parameters",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0, tries={
                      "non-finite": "the weights after every step must all be finite on every rank: a NaN is named "
                                    "before any comparison",
                      "order": NOT_APPLICABLE + "the step runs after backward on whole .grad tensors: no hook sees "
                                                "gradients arrive",
                      "sizes": "29403 parameters, which split into neither 2 nor 4 equal shards: every element must be "
                               "stepped by exactly one rank",
                      "ragged": NOT_APPLICABLE + "one flat buffer cut into n equal padded shards: the remainder is the "
                                                 "sizes class, and no rank's shard is empty at 2 or 4 ranks",
                      "layouts": "world sizes 2 and 4: an average that is right at one world size only (dividing the "
                                 "sum by 2) fails at the other",
                      "traffic": NOT_APPLICABLE + "judged by the weights, the optimizer state and agreement across "
                                                  "ranks, not by which collective moved them",
                      "mutation": NOT_APPLICABLE + "the answer's job is to update the parameters in place",
                      "output": NOT_APPLICABLE + "the answer returns nothing: its effect is on the parameters",
                      "memory": "the momentum buffers each rank's optimizer holds: about 1/n of the elements, not the "
                                "whole model's",
                      "bits": NOT_APPLICABLE + "sums reordered over the ranks differ in the last bits: weights are "
                                               "compared within 1e-5",
                  }))
register(Exercise("zero2_grad_hooks", "11", "zero2_grad_hooks",
                  "ZeRO-2's hook: reduce-scatter the gradient from inside backward and keep only your shard",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0, tries={
                      "non-finite": "grad_shard must be finite after backward: a NaN (in the padding too) is named",
                      "order": "the parameters handed over in reverse: the last gradient to land is not the last "
                               "listed, so only a hook that counts them launches after all have landed",
                      "sizes": "29403 parameters (padding needed at 2 and 4 ranks) and 15168 (no padding): the flat "
                               "gradient must be padded to exactly n x S",
                      "ragged": NOT_APPLICABLE + "one bucket, the whole model, cut into n equal shards: the remainder "
                                                 "is the sizes class",
                      "layouts": NOT_APPLICABLE + "one rule for every model and world size: which slice, and its "
                                                  "padding, are the sizes and order classes",
                      "traffic": "every collective called during backward is logged: one reduce-scatter of the "
                                 "padded gradient's bytes, no all-reduce, and a handle waited on",
                      "mutation": NOT_APPLICABLE + "the answer's job is to fill grad_shard and clear the .grads",
                      "output": NOT_APPLICABLE + "the result is written into the grad_shard given, whose dtype and "
                                                 "length the check chose",
                      "memory": "no parameter may keep a whole .grad after backward: only the shard remains",
                      "bits": NOT_APPLICABLE + "sums reordered over the ranks differ in the last bits: compared "
                                               "within 1e-5",
                  }))
register(Exercise("zero3_unit_hooks", "11", "zero3_unit_hooks",
                  "ZeRO-3 around a unit: gather before forward and backward, free after each",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0, tries={
                      "non-finite": NOT_APPLICABLE + "the answer computes no numbers: it moves the shards the check "
                                                     "made, and the output and gradients are compared with allclose, "
                                                     "which fails on NaN",
                      "order": "a pre-norm and a post-norm block: in the post-norm one, ln1 (listed first) gets its "
                               "gradient before the attention's, so freeing at one chosen gradient frees mid-backward",
                      "sizes": NOT_APPLICABLE + "flat and shard come already padded to n equal shards",
                      "ragged": NOT_APPLICABLE + "one unit, whose shards all have S elements",
                      "layouts": NOT_APPLICABLE + "one block shape at world sizes 2 and 4; the post-norm block is "
                                                  "there for the order its gradients land in (see order)",
                      "traffic": NOT_APPLICABLE + "the gathered values are judged, not the collective that moved "
                                                  "them; only that every asynchronous gather is waited on",
                      "mutation": NOT_APPLICABLE + "the answer's job is to fill and free the buffer it is given",
                      "output": "the unit's output must stay the block's tensor: a forward hook that returns a value "
                                "replaces it",
                      "memory": "after forward and after backward both flat's storage and the parameters' own storage "
                                "must be freed, so a parameter rebound to a copy is caught",
                      "bits": NOT_APPLICABLE + "values are moved, not computed: compared within 1e-5",
                  }))
register(Exercise("clip_grad_norm_sharded", "11", "clip_grad_norm_sharded",
                  "Gradient-norm clipping over ZeRO-3's shards: the whole gradient's norm, from every rank's squares",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0, tries={
                      "non-finite": "a NaN in one rank's shard: the norm returned must be NaN (or infinite) on every "
                                    "rank, not the finite norm of what is left; every comparison fails on NaN",
                      "order": NOT_APPLICABLE + "it runs after backward on reduced shards: no gradient arrives while "
                                                "it runs",
                      "sizes": NOT_APPLICABLE + "a norm is a sum over elements, whatever the cut: the shards are "
                                                "ZeRO-3's padded ones, with parameters split across ranks and empty "
                                                "views, in every case",
                      "ragged": NOT_APPLICABLE + "every rank holds S elements of one padded buffer; the empty "
                                                 "per-parameter views are in every case, not a class of their own",
                      "layouts": NOT_APPLICABLE + "one rule at world sizes 2 and 4; the wrong reductions (per rank, "
                                                  "sum of norms, no square root, mean) fail at both",
                      "traffic": "every collective is logged: one all-reduce of a number per rank, never the shards "
                                 "gathered; no collective at all is named as a norm of one rank's shard",
                      "mutation": NOT_APPLICABLE + "the answer's job is to scale the gradients in place (checked: a "
                                                   "clipped copy leaves them unchanged and is named)",
                      "output": "the returned norm must be the norm before clipping, as torch.nn.utils."
                                "clip_grad_norm_ returns, the same on every rank; a number or a 0-d tensor",
                      "memory": NOT_APPLICABLE + "the answer allocates a scalar; nothing is freed",
                      "bits": NOT_APPLICABLE + "sums reordered over the ranks differ in the last bits: compared "
                                               "within 1e-5 of the norm",
                  }))
