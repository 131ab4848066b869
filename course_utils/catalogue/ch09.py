"""Chapter 09's graded exercises: the cross-rank checksum (on ranks), the first divergence of two traces and
the z-loss term (in the notebook process)."""
from __future__ import annotations

import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

# (trace_a, trace_b, rtol, expected); what a wrong answer is told instead is worked out by _why
DIVERGENCE_CASES = [
    ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 0.0, None),
    ([3.2, 2.9, 2.7, 2.6, 2.5], [3.2, 2.9, 2.7 * (1 + 1e-9), 2.6, 2.9], 1e-6, 4),  # rounding at 2, divergence at 4
    ([4.0, 3.0, 2.0, 1.5], [4.0, 3.1, 2.0, 9.0], 0.0, 1),  # the first difference, not the largest
    ([1.0, 2.0, 3.0], [1.0, 2.0], 0.0, 2),  # a replay that stopped early diverges where it stops
    ([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, float("nan"), 4.0], 1e-3, 2),  # NaN is never close to anything
    ([1e4, 2e4, 3e4], [1e4 + 1e-3, 2e4 + 1e-3, 3e4 * 1.01], 1e-6, 2),  # rtol is relative: 1e-3 on 1e4 is rounding
    # relative to the LARGER value: 0.6 apart is within 0.25 * 2.6 = 0.65, but not within 0.25 * 2.0 = 0.5
    ([1.0, 2.0, 3.0], [1.0, 2.6, 6.0], 0.25, 2),  # trace_b holds the larger value at step 1
    ([1.0, 2.6, 6.0], [1.0, 2.0, 3.0], 0.25, 2),  # trace_a holds it
    ([0.0, 1.0, 0.0, 2.0], [0.0, 1.0, 0.0, 2.5], 0.1, 3),  # steps where both traces are exactly 0 agree
    ([1.0, 2.0], [1.0, 2.0, 3.0], 0.0, 2),  # trace_a is the one that stopped early
    ([5.0, 1.0, 1.0], [6.0, 1.0, 1.0], 0.1, 0),  # divergence at the very first step: index 0, not None
    ([1.0, float("nan"), 3.0], [1.0, 2.0, 3.0], 1e-3, 1),  # a NaN in trace_a
    ([1.0, float("nan"), 3.0], [1.0, float("nan"), 3.0], 1e-3, 1),  # NaN in both at the same step: still no match
    ([1.0, 2.0, 3.0], [1.0, float("inf"), 3.0], 1e-3, 1),  # an overflow: |inf - 2| <= 1e-3 * inf holds, yet it diverged
    ([2.0, float("-inf")], [2.0, float("-inf")], 0.1, 1),  # the same infinity in both: a blow-up, as two NaNs
    ([], [], 0.0, None),  # two empty traces agree
    ([], [2.0], 0.0, 0),  # an empty trace ends before the other's first step
]


def _why(case, got) -> str:
    a, b, rtol, want = case
    if want is None and got == 0 and a == b:
        return ("the traces are identical: |a - b| = 0 is within any tolerance, rtol = 0 included; test "
                "|a - b| <= rtol * max(|a|, |b|), with <=, not <")
    if want == 4 and got == 2:
        return ("step 2 differs by 1e-9 relative, within rtol=1e-6: that is rounding, not divergence; compare "
                "|a - b| <= rtol * max(|a|, |b|)")
    if want == 1 and got == 3:
        return "you returned the step with the largest difference: return the first step that differs"
    if len(a) != len(b) and want == min(len(a), len(b)) and got is None:
        short = "trace_a" if len(a) < len(b) else "trace_b"
        return (f"{short} stops after {want} steps: a trace that ends early diverges where it ends, whichever of "
                "the two is shorter (zip stops silently)")
    if want is not None and got is None and want < min(len(a), len(b)) \
            and (a[want] != a[want] or b[want] != b[want]):
        both = a[want] != a[want] and b[want] != b[want]
        return (f"a NaN at step {want} went unnoticed" + (" although both traces hold NaN there: NaN == NaN is False, "
                "so two NaNs never match (a blow-up in both runs is no agreement)" if both else
                ": NaN > tol is False") + "; write the test as not (|a - b| <= tol) so that NaN counts as a divergence")
    if want is not None and got is None and want < min(len(a), len(b)) \
            and (math.isinf(a[want]) or math.isinf(b[want])):
        return (f"an infinity at step {want} went unnoticed: |a - b| is inf and so is rtol * max(|a|, |b|), and "
                "inf <= inf holds; a step where either value is not finite (math.isfinite) is a divergence")
    if want == 0 and got is None:
        return ("the traces differ at step 0, and 0 is a valid index: a test such as `if first:` or `return i or None` "
                "takes 0 for no divergence; compare with None instead")
    if want is None and got is not None and not isinstance(got, bool) and isinstance(got, int) \
            and got in (-1, len(a)):
        return "when the traces never differ, return None, not -1 or the length: None is what the caller tests for"
    if want == 2 and got == 0 and a[0] == 1e4:
        return "you compared |a - b| with rtol itself: rtol is relative, so scale it by max(|a|, |b|)"
    if want == 2 and got == 1 and rtol == 0.25:
        x, y = a[1], b[1]
        side = "trace_a's" if abs(x) < abs(y) else "trace_b's"
        return (f"step 1 differs by {abs(x - y):.2g}, within rtol * max(|a|, |b|) = {rtol * max(abs(x), abs(y)):.2g}: "
                f"the relative tolerance is taken against the wrong operand ({side} value, or the smaller of the two, "
                f"gives {rtol * min(abs(x), abs(y)):.2g}); scale rtol by the larger, max(|a|, |b|), so that swapping "
                "the traces changes nothing")
    if want == 3 and got in (0, 2):
        return (f"at step {got} both traces are exactly 0, which is no divergence: compare |a - b| <= rtol * max(|a|, "
                "|b|) (0 <= 0 holds) rather than dividing by a value that can be 0")
    return ""


def check_first_divergence(answer) -> tuple[str, str]:
    for case in DIVERGENCE_CASES:
        a, b, rtol, want = case
        copy_a, copy_b = list(a), list(b)
        try:
            got = answer(copy_a, copy_b, rtol)
        except ZeroDivisionError:
            return FAIL, (f"first_divergence({a}, {b}, rtol={rtol:g}) divided by zero: where both values are 0 a "
                          "ratio such as |a - b| / max(|a|, |b|) is 0 / 0. Compare without dividing: |a - b| <= rtol * max(|a|, |b|)")
        except IndexError:
            return FAIL, (f"first_divergence({a}, {b}, rtol={rtol:g}) raised IndexError: the traces have different "
                          "lengths, so one index runs past the shorter one; walk min(len(a), len(b)) steps, then a "
                          "trace that ended early diverges where it ends")
        if repr(copy_a) != repr(a) or repr(copy_b) != repr(b):
            return FAIL, (f"first_divergence({a}, {b}, rtol={rtol:g}) changed the traces it was given (now {copy_a}, "
                          f"{copy_b}): only read them, the caller keeps using them")
        if got != want or (want is not None and isinstance(got, bool)):
            hint = _why(case, got)
            return FAIL, (f"first_divergence({a}, {b}, rtol={rtol:g}) returned {got!r}, expected {want!r}"
                          + (f": {hint}" if hint else ""))
    return PASS, "correct: first index beyond a relative tolerance, NaN, infinity and early ends included"


def _z_loss_reference(logits, coeff):
    import torch

    return coeff * (torch.logsumexp(logits.float(), dim=-1) ** 2).mean()


Z_CASES = (  # (shape, coeff, shift added to N(0, 2^2) logits, dtype of the logits)
    ((2, 5, 11), 1e-4, 0.0, "float32"),
    ((3, 7), 0.5, 4.0, "float32"),
    ((1, 4, 6), 1e-2, -3.0, "float32"),
    ((4, 9), 1e-3, 100.0, "float32"),  # exp(100) overflows fp32 (max about e^88.7)
    ((4, 9), 1e-3, -120.0, "float32"),  # exp(-120) underflows fp32 to 0 (smallest about e^-103)
    ((2, 3, 10), 1e-2, 30.0, "bfloat16"),  # what a mixed-precision model's head hands over
)


def check_z_loss(answer) -> tuple[str, str]:
    import torch

    g = torch.Generator().manual_seed(0)
    for shape, coeff, shift, dtype in Z_CASES:
        logits = (torch.randn(*shape, generator=g) * 2 + shift).to(getattr(torch, dtype)).requires_grad_()
        before = logits.detach().clone()
        got = answer(logits, coeff)
        want = _z_loss_reference(logits.detach(), coeff)
        where = f"shape {tuple(shape)}, coeff {coeff:g}, {dtype} logits around {shift:g}"
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            return FAIL, f"return a scalar tensor (a loss term to add before backward), got {got!r}"
        if not torch.equal(logits.detach(), before):
            return FAIL, f"{where}: you changed the logits in place: the cross-entropy still needs them; compute into new tensors"
        if not got.requires_grad:
            return FAIL, "the z-loss has no gradient: compute it from the logits with torch ops, not .item()"
        if got.dtype != torch.float32:
            return FAIL, (f"{where}: the z-loss came back in {got.dtype}: return it in float32, as the loss it is "
                          "added to (a cast back to the logits' dtype rounds it to 8 bits in bfloat16)")
        if not math.isfinite(got.item()) and abs(shift) >= 100:
            return FAIL, (f"{where}: got {got.item()}: an unstable log(sum(exp)): exp of logits around {shift:g} "
                          f"{'overflows to inf' if shift > 0 else 'underflows to 0'} in fp32. Use torch.logsumexp, which "
                          "subtracts the largest logit before exponentiating")
        if not math.isfinite(got.item()):
            return FAIL, (f"{where}: got {got.item()}, not a finite number, for logits of moderate size: a log of 0 "
                          "or a division by 0? coeff * mean(logsumexp(logits.float(), dim=-1) ** 2) is finite here")
        if math.isclose(got.item(), want.item(), rel_tol=1e-5, abs_tol=1e-8):
            (grad,) = torch.autograd.grad(got, logits)
            want_logits = logits.detach().float().requires_grad_()
            (want_grad,) = torch.autograd.grad(_z_loss_reference(want_logits, coeff), want_logits)
            grad_tol = 1e-3 if dtype == "float32" else 2e-2  # a bf16 gradient is rounded to 8 bits
            if not torch.allclose(grad.float(), want_grad, rtol=grad_tol, atol=1e-8 * coeff):
                return FAIL, (f"{where}: the value is right but its gradient with respect to the logits is not "
                              "(a detached factor, or a value computed outside autograd?): every op from the logits "
                              "to the loss must stay in the graph")
            continue
        if dtype != "float32" and math.isclose(got.item(), (coeff * (torch.logsumexp(logits.detach(), -1).float() ** 2)
                                                            .mean()).item(), rel_tol=1e-5):
            return FAIL, (f"{where}: you computed log Z in {dtype}, which keeps 8 bits of mantissa: cast the logits "
                          "to float32 first (logits.float()), as the loss is")
        lse = torch.logsumexp(logits.detach().float(), dim=-1)
        if math.isclose(got.item(), (coeff * lse.mean()).item(), rel_tol=1e-5):
            return FAIL, f"{where}: you did not square log Z: the z-loss is coeff * mean(log Z ** 2)"
        if math.isclose(got.item(), (coeff * lse.mean() ** 2).item(), rel_tol=1e-5):
            return FAIL, f"{where}: you squared the mean of log Z; square each position's log Z, then average"
        if math.isclose(got.item(), (coeff * (logits.detach().float().amax(-1) ** 2).mean()).item(), rel_tol=1e-5):
            return FAIL, f"{where}: log Z is the logsumexp over the vocabulary, not the largest logit"
        if math.isclose(got.item(), (coeff * (lse ** 2).sum()).item(), rel_tol=1e-5):
            return FAIL, f"{where}: you summed over positions: average, so the term does not grow with the batch"
        if logits.dim() > 2 and math.isclose(
                got.item(), (coeff * (torch.logsumexp(logits.detach().float(), dim=1) ** 2).mean()).item(), rel_tol=1e-5):
            return FAIL, (f"{where}: you took logsumexp over dim=1, which is the vocabulary only for 2-D logits: the "
                          "vocabulary is the last dimension, whatever comes before it (dim=-1)")
        return FAIL, f"{where}: got {got.item():.6g}, expected {want.item():.6g}"
    return PASS, ("correct: coeff * mean over positions of logsumexp(logits)^2, with its gradient, stable for huge "
                  "and very negative logits")


_NO_GRADIENTS = NOT_APPLICABLE + "no gradients arrive: the answer only reads what it is given"
register(Exercise("cross_rank_checksum", "09", "cross_rank_checksum",
                  "Cross-rank checksum: every rank's bitwise checksum of its parameters, gathered on every rank",
                  worker="workers.exercises.ch09", world_sizes=(2, 4), timeout_s=60.0,
                  tries={"non-finite": "a float checksum that is nan or inf fails, named with its rank: such a "
                                       "checksum absorbs or never equals anything",
                         "order": _NO_GRADIENTS,
                         "sizes": NOT_APPLICABLE + "each rank checksums all its own parameters: nothing is split "
                                                   "across ranks",
                         "ragged": NOT_APPLICABLE + "every rank holds the same parameter shapes: nothing is "
                                                    "partitioned",
                         "layouts": NOT_APPLICABLE + "world 2 and 4 ask the same of every rank; no rule depends on "
                                                     "the world size",
                         "traffic": NOT_APPLICABLE + "any collective that gathers the checksums is right: the "
                                                     "gathered list is what is checked",
                         "mutation": "the parameters are compared with a copy after every call",
                         "output": "a list with one checksum per rank, in rank order, the same list on every rank",
                         "memory": NOT_APPLICABLE + "a checksum holds nothing after it returns",
                         "bits": "one rank differs by one bit: the lowest mantissa bit of a weight and of a weight "
                                 "of 1.5e-12 (below a float64 sum's rounding), and -0.0 against 0.0"}))
register(Exercise("first_divergence", "09", "first_divergence",
                  "Replay: the first step where two traces differ beyond a relative tolerance",
                  local=check_first_divergence,
                  tries={"non-finite": "NaN in trace_b, in trace_a, and in both at the same step, an infinity in "
                                       "one trace and the same infinity in both: each is a divergence (NaN is close "
                                       "to nothing, itself included; inf passes a relative test, inf <= rtol * inf)",
                         "order": _NO_GRADIENTS,
                         "sizes": NOT_APPLICABLE + "traces are walked step by step: no size is split",
                         "ragged": "either trace ending early (trace_a or trace_b shorter, one of them empty), equal "
                                   "lengths with no divergence, a divergence at step 0",
                         "layouts": NOT_APPLICABLE + "two lists of numbers: one layout",
                         "traffic": NOT_APPLICABLE + "one process, no collective: checked in the notebook",
                         "mutation": "both traces are compared with copies after every call",
                         "output": "the index as an int, or None when the traces agree (not -1, a bool or the "
                                   "length)",
                         "memory": NOT_APPLICABLE + "returns an index: nothing to release",
                         "bits": NOT_APPLICABLE + "values are compared within a relative tolerance: -0.0 and 0.0 "
                                                  "agree here"}))
register(Exercise("z_loss", "09", "z_loss", "The PaLM z-loss: coeff * mean(log Z^2) of the output logits",
                  local=check_z_loss,
                  tries={"non-finite": "logits around +100 and -120, where exp overflows or underflows fp32: a nan "
                                       "or inf loss fails, named",
                         "order": NOT_APPLICABLE + "one loss term: its gradient is compared, no gradients arrive",
                         "sizes": NOT_APPLICABLE + "a mean over every position: no size is split",
                         "ragged": NOT_APPLICABLE + "every position has the whole vocabulary: nothing is "
                                                    "partitioned",
                         "layouts": "logits of shapes [B, T, V] and [N, V]: log Z over the last dimension, whatever "
                                    "the leading ones",
                         "traffic": NOT_APPLICABLE + "one process, no collective: checked in the notebook",
                         "mutation": NOT_APPLICABLE + "the logits are a leaf that requires grad: torch itself "
                                                      "refuses to change them in place (the check compares them "
                                                      "anyway)",
                         "output": "a 0-dim float32 tensor that carries a gradient, bfloat16 logits included",
                         "memory": NOT_APPLICABLE + "returns one scalar: nothing to release",
                         "bits": NOT_APPLICABLE + "compared within 1e-5 relative: any order of summation is "
                                                  "right"}))
