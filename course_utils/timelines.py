"""Reading pipeline timelines (chapters 13 and 15): how much of a step each rank spent idle.

A timeline is one rank's list of compute boxes ``{"start", "end", ...}`` in seconds, all ranks timed from one
barrier. Idle / total over the whole pipeline is what ``ledger.pipeline_bubble_fraction(denominator="total")``,
(p-1)/(v m + p-1), predicts.
"""
from __future__ import annotations


def idle_fractions(timelines: list[list[dict]]) -> list[float]:
    """Per rank: 1 - (time inside its boxes) / (first start to last end over all of ``timelines``)."""
    t_start = min(e["start"] for line in timelines for e in line)
    t_end = max(e["end"] for line in timelines for e in line)
    return [1 - sum(e["end"] - e["start"] for e in line) / (t_end - t_start) for line in timelines]
