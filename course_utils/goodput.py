"""Goodput: where a training job's wall time goes when parts of it fail, as a ledger of named shares.

The same categories as a measured run's journal (``workers/resilience/journal.py: ledger``), so a laptop run and a
cluster can be read side by side:

- ``productive``: steps the final weights are made of;
- ``checkpoint``: writing checkpoints (the part of the write the steps wait for);
- ``lost``: work done and thrown away by a rollback to the last checkpoint (and a step in flight when a fault hit);
- ``recovery``: detecting the failure, restarting processes and reloading the checkpoint (or, for a quorum, the
  surviving replicas reconfiguring);
- ``degraded``: capacity missing while a replica group is away (a quorum goes on with fewer batches per step);
- ``heal``: a returning replica copying the weights and optimizer state from a live peer;
- ``waiting``: ranks waiting in a step's collective for a slower rank (a straggler). Measured by the journal and
  priced by ``predict_run`` for the laptop run; the cluster models (``restart_ledger``, ``quorum_ledger``) leave it
  out, and ``SHARES`` lists their shares.

Two recoveries are modelled, each from costs that a run measures or a paper prints:

- **restart** (torchrun's elastic agent, chapter 08's checkpoints): Daly's complete model (2006, the one chapter 08
  uses for the optimum interval), split into its parts: the work and checkpoint of each segment, the work a failure
  threw away, and the recoveries (a failure during a recovery restarts it). The parts add up to Daly's wall time
  exactly.
- **quorum** (torchft: replica groups, a lighthouse, healing from a peer): no rollback. A failure costs every group
  the step in flight and a reconfiguration of the quorum; the failed group is away while it is detected, restarted
  and healed, and the job runs on ``groups - 1`` of ``groups`` for that long. Checkpoints remain (the whole job can
  still fail), written every ``interval_s``.

Failures are a Poisson process: a job on ``n_gpus`` whose GPUs fail independently with mean time ``gpu_mtbf_s``
fails every ``gpu_mtbf_s / n_gpus`` (``checkpoint_interval.job_mtbf``). Llama 3 405B's 419 unexpected
interruptions in 54 days on 16,384 H100s (Llama Team 2024, section 3.3.4) give one every 3.1 hours; the same paper
reports over 90% effective training time, which the restart model reaches with checkpoint and restart costs of
minutes (assumed: the paper prints neither).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from course_utils.checkpoint_interval import DAY, LLAMA3_GPUS, LLAMA3_SNAPSHOT_DAYS, LLAMA3_UNEXPECTED_INTERRUPTIONS

SHARES = ("productive", "checkpoint", "lost", "recovery", "degraded", "heal")

# The per-GPU mean time between the interruptions Llama 3 counted: 54 days x 16,384 GPUs / 419 (section 3.3.4).
LLAMA3_GPU_MTBF_S = LLAMA3_SNAPSHOT_DAYS * DAY * LLAMA3_GPUS / LLAMA3_UNEXPECTED_INTERRUPTIONS


@dataclass(frozen=True)
class Costs:
    """What one failure and one checkpoint cost, in seconds (measured on a run, or assumed for a cluster).

    ``detect_s``: fault to the failure being seen (a dead process: the agent's monitor interval; a hang: the
    collective's timeout). ``restart_s``: new processes up to loading. ``reload_s``: reading the checkpoint back.
    ``checkpoint_s``: the part of a save the steps wait for. ``step_s``: one training step. ``heal_s``: a returning
    replica copying the state from a peer. ``reconfigure_s``: the survivors agreeing on a new quorum."""
    step_s: float
    checkpoint_s: float
    detect_s: float = 0.0
    restart_s: float = 0.0
    reload_s: float = 0.0
    heal_s: float = 0.0
    reconfigure_s: float = 0.0

    def __post_init__(self):
        for name in ("step_s", "checkpoint_s", "detect_s", "restart_s", "reload_s", "heal_s", "reconfigure_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value}: give a time in seconds, 0 or more")
        if self.step_s <= 0:
            raise ValueError(f"step_s={self.step_s}: a step takes some time; give seconds > 0")

    @property
    def recovery_s(self) -> float:
        """A restart's whole recovery: detection, new processes, reload."""
        return self.detect_s + self.restart_s + self.reload_s


def restart_ledger(costs: Costs, interval_s: float, mtbf_s: float) -> dict[str, float]:
    """Shares of wall time under restart-and-roll-back, Daly's complete model split exactly (they add up to 1).

    One segment is ``tau = interval_s`` of work and its checkpoint write, ``L = tau + delta``; it survives a try with
    probability ``p = exp(-L / M)``, so it fails ``1/p - 1 = exp(L/M) - 1`` times on average. Each failure throws
    away the part of the segment done before it (together ``M (exp(L/M) - 1) - L`` per segment) and costs a
    recovery of ``R``, itself restarted by a failure during it (``M (exp(R/M) - 1)`` on average). The four parts add
    up to Daly's ``M exp(R/M) (exp(L/M) - 1)`` per segment."""
    _check_interval(interval_s, mtbf_s)
    m, length, r = mtbf_s, interval_s + costs.checkpoint_s, costs.recovery_s
    failures = math.expm1(length / m)  # per segment
    parts = {"productive": interval_s, "checkpoint": costs.checkpoint_s,
             "lost": m * failures - length, "recovery": failures * m * math.expm1(r / m)}
    total = m * math.exp(r / m) * failures  # Daly's wall time per segment
    out = dict.fromkeys(SHARES, 0.0)
    out.update({k: v / total for k, v in parts.items()})
    return out


def quorum_ledger(costs: Costs, interval_s: float, mtbf_s: float, groups: int) -> dict[str, float]:
    """Shares of wall time when replica groups drop out and heal (torchft), first order in ``1 / mtbf_s``.

    Per failure: every group loses the step in flight and waits for the new quorum (``lost`` and ``recovery``); the
    failed group's share of the capacity, ``1 / groups``, is missing while it is detected, restarted and loaded
    (``degraded``) and while it heals (``heal``). Checkpoints are still written every ``interval_s`` of work."""
    _check_interval(interval_s, mtbf_s)
    if groups < 2:
        raise ValueError(f"groups={groups}: a quorum needs at least 2 replica groups to go on without one")
    rate = 1.0 / mtbf_s  # failures per second of wall time
    lost = rate * costs.step_s
    recovery = rate * costs.reconfigure_s
    degraded = rate * (costs.detect_s + costs.restart_s + costs.reload_s) / groups
    heal = rate * costs.heal_s / groups
    away = lost + recovery + degraded + heal
    if away >= 1.0:
        raise ValueError(f"failures every {mtbf_s:g} s leave no time to train: each one costs more than that")
    running = 1.0 - away
    checkpoint = running * costs.checkpoint_s / (interval_s + costs.checkpoint_s)
    out = dict.fromkeys(SHARES, 0.0)
    out.update(productive=running - checkpoint, checkpoint=checkpoint, lost=lost, recovery=recovery,
               degraded=degraded, heal=heal)
    return out


def timeline_ledger(segments: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds per share of a timeline given as ``[(share, seconds), ...]`` in order, plus ``goodput``.

    A ``"work"`` segment is productive unless a later ``"rollback"`` segment takes it back: a rollback of ``k``
    seconds moves the last ``k`` seconds of work since the previous checkpoint to ``lost`` (it is zero-length in
    time itself: the time it costs is the recovery around it). A ``"waiting"`` segment is time the ranks spent
    waiting for a straggler (the result has a ``waiting`` share besides ``SHARES``)."""
    out = dict.fromkeys(SHARES + ("waiting",), 0.0)
    since_checkpoint = 0.0
    for share, seconds in segments:
        if seconds < 0:
            raise ValueError(f"({share!r}, {seconds}): a segment lasts 0 seconds or more")
        if share == "work":
            out["productive"] += seconds
            since_checkpoint += seconds
        elif share == "rollback":
            if seconds > since_checkpoint + 1e-12:
                raise ValueError(f"a rollback of {seconds:g} s undoes more than the {since_checkpoint:g} s of work "
                                 "since the last checkpoint")
            out["productive"] -= seconds
            out["lost"] += seconds
            since_checkpoint -= seconds
        elif share in SHARES or share == "waiting":
            out[share] += seconds
            if share == "checkpoint":
                since_checkpoint = 0.0
        else:
            raise ValueError(f"{share!r} is not a share: use 'work', 'rollback' or one of {', '.join(SHARES)}")
    wall = sum(out[s] for s in SHARES) + out["waiting"]
    out["goodput"] = out["productive"] / wall if wall > 0 else 0.0
    return out


def predict_run(costs: Costs, steps: int, every: int, fail_at: list[int],
                stalls: dict[int, float] | None = None) -> dict[str, float]:
    """Seconds per share of a short run with failures at given steps, under restart-and-roll-back: the model of the
    laptop run, to hold against its measured journal.

    ``steps`` steps, a checkpoint after every ``every``-th, and a fault during each step in ``fail_at`` (0-based, at
    the step's start, as the course's fault injection strikes): the job rolls back to the last checkpoint before it,
    recovers, and redoes the steps since.

    ``stalls``: a straggler, ``{step (0-based): seconds}``: in each of those steps one rank sleeps that long after
    its forward and every other rank waits for it in the gradient all_reduce, so the step costs ``step_s`` of work
    and that much ``waiting`` (``slow_s x slow_steps`` in all, again in a step done twice). The model's assumption:
    the stall dominates, so the wait is the whole sleep, less nothing (the ranks' forwards take the same time, so
    the ones that arrive first waited exactly the stall)."""
    stalls = stalls or {}
    if every < 1:
        raise ValueError(f"every={every}: checkpoint after at least every 1 step")
    segments: list[tuple[str, float]] = []
    pending = sorted(set(fail_at))
    step = 0
    while step < steps:
        if pending and pending[0] == step:
            pending.pop(0)
            last = (step // every) * every  # the first step after the last checkpoint
            segments += [("rollback", (step - last) * costs.step_s), ("recovery", costs.recovery_s)]
            step = last
            continue
        segments.append(("work", costs.step_s))
        if stalls.get(step, 0.0) > 0:
            segments.append(("waiting", stalls[step]))
        step += 1
        if step % every == 0:
            segments.append(("checkpoint", costs.checkpoint_s))
    return timeline_ledger(segments)


def _check_interval(interval_s: float, mtbf_s: float) -> None:
    if not interval_s > 0:
        raise ValueError(f"interval_s={interval_s}: checkpoint after some work; give seconds > 0")
    if not mtbf_s > 0:
        raise ValueError(f"mtbf_s={mtbf_s}: the mean time between failures must be positive seconds")


__all__ = ["Costs", "LLAMA3_GPU_MTBF_S", "SHARES", "predict_run",
           "quorum_ledger", "restart_ledger", "timeline_ledger"]
