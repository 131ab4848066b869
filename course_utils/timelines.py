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


def least_idle_fractions(timelines: list[list[dict]]) -> list[float]:
    """Per rank, the idle its own boxes allow: ``timelines`` (one pipeline's stages in order, one model chunk per
    rank, boxes ``"F"`` and ``"B"`` with ``"micro"``) replayed as soon as possible, each box at its measured length
    in its rank's order, a forward waiting only for the same micro-batch's forward on the stage before and a backward
    for its backward on the stage after, every message free. A run's boxes can only have started later than that
    (its messages take time, a rank waits for a core), and its boxes keep their lengths, so its ``idle_fractions``
    are never below these but by rounding: a lower bound that holds however unequally a loaded machine stretched
    the boxes, where a replay at the boxes' mean lengths does not."""
    p = len(timelines)
    lines = [[(e["kind"], e["micro"], e["end"] - e["start"]) for e in line if e["kind"] in ("F", "B")]
             for line in timelines]
    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro) -> end in the replay
    free, done = [0.0] * p, [0] * p
    while any(done[s] < len(lines[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while done[s] < len(lines[s]):
                kind, micro, length = lines[s][done[s]]
                before = s - 1 if kind == "F" else s + 1  # the stage whose box this one needs
                need = (kind, before, micro) if 0 <= before < p else None
                if need is not None and need not in ends:
                    break  # that box has not been replayed yet: go on with the other stages
                start = max(free[s], ends[need] if need is not None else 0.0)
                free[s] = ends[(kind, s, micro)] = start + length
                done[s] += 1
                moved = True
        if not moved:
            raise ValueError("these timelines wait on each other in a cycle: not one pipeline's stages in order")
    span = max(free)
    return [1 - sum(length for *_, length in line) / span for line in lines]
