"""Chapter 11's graded exercises: the ZeRO stage formulas (in the notebook), the sharded optimizer step, ZeRO-2's
gradient hook and ZeRO-3's gather-then-free around a unit (on ranks)."""
from __future__ import annotations

from course_utils.exercises import FAIL, PASS, Exercise, register

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
    return ""


def check_zero_state_bytes(answer) -> tuple[str, str]:
    for n_params, dp, stage, tp, pp, k in CASES:
        got = answer(n_params, dp, stage, tp=tp, pp=pp, optimizer_bytes=k)
        if not isinstance(got, dict) or not set(STATES) <= set(got):
            return FAIL, f"return a dict with the keys 'params', 'grads' and 'optimizer' (bytes per GPU), got {got!r}"
        want = _expected(n_params, dp, stage, tp, pp, k)
        for state in STATES:
            g, w = float(got[state]), want[state]
            if abs(g - w) > 1e-9 * max(w, 1.0):
                hint = _hint(state, g, w, dp, stage, tp, pp)
                case = f"n_params={n_params:g}, dp={dp}, stage={stage}, tp={tp}, pp={pp}, optimizer_bytes={k}"
                return FAIL, (f"{state} for {case}: expected {w:.6g} bytes, got {g:.6g}" + (f"; {hint}" if hint else ""))
    return PASS, "correct: the ZeRO paper's 120 / 31.4 / 16.6 / 1.9 GB and the TP/PP compositions all match"


register(Exercise("zero_state_bytes", "11", "zero_state_bytes",
                  "The ZeRO ledger: bytes of parameters, gradients and optimizer states per GPU, with TP and PP",
                  local=check_zero_state_bytes))
register(Exercise("zero1_step", "11", "zero1_step",
                  "ZeRO-1 by hand: average the gradients, step only your shard, re-synchronise the parameters",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0))
register(Exercise("zero2_grad_hooks", "11", "zero2_grad_hooks",
                  "ZeRO-2's hook: reduce-scatter the gradient from inside backward and keep only your shard",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0))
register(Exercise("zero3_unit_hooks", "11", "zero3_unit_hooks",
                  "ZeRO-3 around a unit: gather before forward and backward, free after each",
                  worker="workers.exercises.ch11", world_sizes=(2, 4), timeout_s=60.0))
