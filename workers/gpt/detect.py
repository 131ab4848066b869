"""Detectors: a loss-spike trigger, the verdict on the cross-rank checksums, and the first divergence of two traces.

(The checksums themselves are ``telemetry.params_checksum``, gathered every step by the training loop.)
"""
from __future__ import annotations

import math

import statistics
from collections import Counter


class SpikeDetector:
    """A loss is a spike when it exceeds ``factor`` times the median of the last ``window`` accepted losses.

    The median, not the mean: one earlier spike must not raise the bar for the next one. No verdict until
    ``window`` losses are in: early training falls fast and is noisy.
    """

    def __init__(self, window: int = 10, factor: float = 1.5):
        self.window, self.factor = window, factor
        self.losses: list[float] = []

    def is_spike(self, loss: float) -> bool:
        recent = self.losses[-self.window:]
        return len(recent) == self.window and not loss <= self.factor * statistics.median(recent)  # NaN is a spike

    def accept(self, loss: float) -> None:
        self.losses.append(loss)

    def truncate(self, n: int) -> None:
        """Forget every loss after the first ``n`` (after a rewind)."""
        del self.losses[n:]


def odd_ones_out(checksums: list[int]) -> list[int]:
    """Ranks that disagree with the most common checksum ([] when all agree). With two ranks there is no
    majority: both are listed, and something else (the reduction check, a replay) must say which is wrong."""
    if len(set(checksums)) <= 1:
        return []
    counts = Counter(checksums).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return list(range(len(checksums)))
    return [r for r, c in enumerate(checksums) if c != counts[0][0]]


def first_divergence(trace_a, trace_b, rtol: float = 0.0):
    """The first index where two per-step traces differ by more than ``rtol`` (relative), else None.

    A trace that stops early (a replay that crashed) diverges where it stops. A step where either value is NaN or
    infinite diverges: NaN never equals anything, and an infinity would pass the relative test (inf <= rtol * inf).
    """
    for i, (a, b) in enumerate(zip(trace_a, trace_b)):
        if not (math.isfinite(a) and math.isfinite(b)) or not abs(a - b) <= rtol * max(abs(a), abs(b)):
            return i
    if len(trace_a) != len(trace_b):
        return min(len(trace_a), len(trace_b))
    return None


def checksum_alarm(trajectory: list[dict]) -> dict | None:
    """The first step at which the ranks' parameter checksums disagree, and who is to blame if anyone can say.

    ``culprits``: ranks that the reduction check caught applying a gradient that is not the mean of the
    ranks' gradients, else the ranks outside the checksum majority; empty when neither can tell (two ranks
    whose parameters differ although the reduction was right: ask a replay).
    """
    for rec in trajectory:
        disagreeing = rec.get("disagreeing_ranks", [])
        if disagreeing:
            majority_known = len(disagreeing) < len(rec["checksums"])
            culprits = rec["reduction_culprits"] or (disagreeing if majority_known else [])
            return {"step": rec["step"], "checksums": rec["checksums"], "disagreeing_ranks": disagreeing,
                    "culprits": culprits, "by": "reduction check" if rec["reduction_culprits"]
                    else ("checksum majority" if culprits else "nobody: replay to find out")}
    return None
