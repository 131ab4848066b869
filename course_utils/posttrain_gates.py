"""Three evaluation gates a post-training run must pass before it ships, as functions with thresholds.

1. training health: every logged loss finite, no grad-norm spike (no step's norm before clipping far above
   the run's typical step), the typical KL to the reference below a limit: a run that broke is not
   evaluated further;
2. regression: the held-out loss of the base skill (here the SFT answers) no worse than the starting
   model's by more than a margin: post-training must not forget what it started with;
3. target and safety: reward / accuracy on the task above a floor, and the rate of forbidden outputs
   (answers with a non-digit token) below a ceiling.

Each gate returns a ``Gate`` (name, passed, reasons); ``run_gates`` applies all three to a run's result as
the workers return it: {"history": [...], "before": {...}, "after": {...}}.

The thresholds are set from the spread of healthy runs and of the lr x 30 run, over seeds and over the CPU
kernels learners' machines run (``python -m course_utils.cpu_spread ch12_grpo``; the numbers are in
``Thresholds``). Statistics of one step (the largest grad norm, the largest KL) are the noisiest numbers a
run logs: the same healthy run peaked at grad norm 9 on one CPU and 112 on an AVX-512 Xeon. A gate compares each
step with the run's own median instead, as a loss-spike detector does (chapter 09), and reads the KL's
median over steps.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Thresholds:
    """Measured over 12 healthy runs and 12 at lr x 30 (seeds 0-3 x native, AVX2 and plain kernels; ``python -m
    course_utils.cpu_spread ch12_grpo``, 2026-12-04, the course's GPT), each threshold sits well inside the gap
    (30 + 30 runs over five kernel variants and seeds 0-5 gave the same picture with the earlier model):"""
    # largest grad norm (before clipping) over the run's median: healthy <= 17.5, lr x 30 >= 480
    max_grad_norm_ratio: float = 100.0
    # median over steps of the mean per-token KL to the reference, nats: healthy <= 0.32, lr x 30 >= 1.9
    max_median_kl: float = 1.0
    # held-out loss may rise by at most this much (nats per answer token): healthy <= 0.25, lr x 30 >= 1.26
    max_regression: float = 0.5
    # greedy exact match on the 20 held-out prompts: healthy >= 0.45 (9 right), lr x 30 <= 0.20 (4 right)
    min_accuracy: float = 0.25
    max_forbidden_rate: float = 0.01


@dataclass(frozen=True)
class Gate:
    name: str
    passed: bool
    reasons: list = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.name}: {'PASS' if self.passed else 'FAIL'}" + (f" ({'; '.join(self.reasons)})" if self.reasons else "")


def training_health(history: list[dict], t: Thresholds = Thresholds()) -> Gate:
    reasons = []
    bad = [h["step"] for h in history if not math.isfinite(h["loss"])]
    if bad:
        reasons.append(f"non-finite loss at step {bad[0]}")
    norms = [h["grad_norm"] for h in history]
    bad = [h["step"] for h in history if not math.isfinite(h["grad_norm"])]
    if bad:
        reasons.append(f"non-finite grad norm at step {bad[0]}")
    elif norms:
        peak, typical = max(norms), statistics.median(norms)
        if not peak <= t.max_grad_norm_ratio * typical:  # NaN fails
            reasons.append(f"grad norm spike: {peak:.3g} at step {norms.index(peak)}, "
                           f"{peak / typical:.3g}x the median {typical:.3g} (limit {t.max_grad_norm_ratio:g}x)")
    kls = [h["kl"] for h in history if "kl" in h]
    if kls and not statistics.median(kls) <= t.max_median_kl:
        reasons.append(f"median KL to reference {statistics.median(kls):.3g} above {t.max_median_kl:g}")
    return Gate("training health", not reasons, reasons)


def regression(before: dict, after: dict, t: Thresholds = Thresholds()) -> Gate:
    rise = after["heldout_loss"] - before["heldout_loss"]
    ok = rise <= t.max_regression  # NaN fails
    return Gate("regression", ok, [] if ok else [f"held-out loss rose by {rise:.3g} (limit {t.max_regression:g})"])


def target_and_safety(after: dict, t: Thresholds = Thresholds()) -> Gate:
    reasons = []
    if not after["accuracy"] >= t.min_accuracy:
        reasons.append(f"accuracy {after['accuracy']:.2f} below {t.min_accuracy:g}")
    if not after["forbidden_rate"] <= t.max_forbidden_rate:
        reasons.append(f"forbidden-output rate {after['forbidden_rate']:.2f} above {t.max_forbidden_rate:g}")
    return Gate("target and safety", not reasons, reasons)


def run_gates(result: dict, t: Thresholds = Thresholds()) -> list[Gate]:
    return [training_health(result["history"], t), regression(result["before"], result["after"], t),
            target_and_safety(result["after"], t)]


def verdict(gates: list[Gate]) -> str:
    return "ship" if all(g.passed for g in gates) else "block: " + ", ".join(g.name for g in gates if not g.passed)
