"""Chapter 17's graded exercises: where to resume after a restart (on ranks, inside the real restart path), the
gradient of a shrunken quorum and the goodput of a timeline (in the notebook process, against the course's own code).

- ``resume_position``: the rows each rank reads in the first step after a restart, checked on real ranks by
  ``workers/exercises/ch17.py`` against the real trainer's own resume (``workers/resilience/trainer.py``, DCP);
- ``quorum_grad_scale``: the averaged gradient when the quorum shrinks, held step by step to the quorum's rule (a sum
  over the present replicas divided by their count, torchft's ``Manager.allreduce``) and at the end to the one-process
  reference on the present replicas' batches (``workers/resilience/replicas.reference``);
- ``timeline_goodput``: productive time over wall time for a timeline of work, checkpoints, failures and recoveries,
  against ``course_utils.goodput.timeline_ledger``.
"""
from __future__ import annotations

import math

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

CHECKER = "workers.exercises.ch17"

# -- 2. the gradient of a shrunken quorum ---------------------------------------------------------------------------

# (replicas planned, the quorum of each step, {step: a replica whose gradient buffer is garbage from then on}).
# Run 1: replica 2 is away in steps 3 and 4 (its buffer holds its step-2 gradient: stale), back in step 5.
# Run 2: in step 2 replica 1 dies in the middle of the allreduce (a failed allreduce leaves partial sums in its buffer:
# NaN here) and replica 3 is away (stale since step 1); replica 3 heals in step 3; in step 4 a quorum of one; all
# four back in step 5. The missing replica is the last one, then one in the middle, then three of four.
QUORUM_RUNS = (
    (3, ((0, 1, 2), (0, 1, 2), (0, 1), (0, 1), (0, 1, 2), (0, 1, 2)), {}),
    (4, ((0, 1, 2, 3), (0, 2), (0, 2, 3), (3,), (0, 1, 2, 3)), {2: 1}),
)


def _bits_equal(a, b) -> bool:
    """The same float64 bits (NaN included: a garbage buffer must stay the same garbage)."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.int64),
                                                                       b.reshape(-1).view(torch.int64))


def _quorum_hint(got, sums: dict, present, replicas: int, buffers: dict, garbage: set) -> str:
    """Name the mistake from the flat averaged gradient ``got`` ([P] float64)."""
    import torch

    P, R = len(present), replicas
    absent = [r for r in sorted(buffers) if r not in present]
    if not bool(torch.isfinite(got).all()):
        if garbage & set(absent):
            dead = sorted(garbage & set(absent))[0]
            return (f"your average holds NaN: replica {dead} is not in the quorum and its buffer is garbage (it died "
                    "in the middle of an allreduce, which leaves partial sums there); a term multiplied by 0 is still "
                    "NaN (0 x NaN = NaN), so masking the absent replicas does not remove it: leave them out of the "
                    "sum")
        return "your average holds NaN or inf, from finite gradients"
    want = sums["present"] / P
    scale = want.abs().max().item()

    def close(candidate) -> bool:
        return bool(torch.isfinite(candidate).all()) and bool(
            torch.allclose(got, candidate, rtol=1e-12, atol=1e-12 * scale))

    if close(sums["present"]):
        return (f"you summed the {P} gradients without dividing: the quorum's allreduce gives the SUM over the "
                f"replicas present; divide by how many took part, len(participants) = {P} (torchft's "
                "Manager.allreduce divides by num_participants())")
    if R != P and close(sums["present"] / R):
        return (f"you divided by the {R} replicas the run is planned for, but only {P} took part: the gradient is "
                f"{P}/{R} of the reference's, as if the missing replicas had contributed zeros; divide by "
                f"len(participants) = {P}")
    if absent and any(close(sums["all"] / d) for d in (R, P, len(buffers))):
        return (f"you included the gradient of replica(s) {absent}, which are not in this step's quorum: their buffer "
                "holds the gradient of the last step they took, stale (computed on weights that have moved since); "
                "average over the participants only")
    top = max(present) + 1
    if top not in (P, R) and close(sums["present"] / top):
        return (f"you divided by {top}, the highest replica id + 1: the replicas of a quorum need not be 0 to P-1 "
                f"(here {list(present)}); divide by len(participants) = {P}")
    err = (got - want).abs().max().item()
    return (f"your average differs from the sum over the quorum divided by {P} by up to {err:.3g}: each parameter's "
            "gradient is the mean of the present replicas' gradients of that parameter")


def _check_quorum_run(answer, run: int, replicas: int, schedule, garbage: dict) -> tuple[str, str] | None:
    import torch

    from workers.resilience.replicas import (ReplicaConfig, flat_weights, forward_loss, make_data,
                                             make_inner_optimizer, make_replica_model, reference, replica_batch,
                                             set_lr)

    cfg = ReplicaConfig(replicas=replicas, steps=len(schedule))
    data, model = make_data(cfg), make_replica_model(cfg)
    optimizer = make_inner_optimizer(model, cfg)
    shapes = [tuple(p.shape) for p in model.parameters()]
    last: dict[int, list] = {}  # replica -> its gradient buffer: its last backward's gradient (or garbage)
    dead: set[int] = set()
    for step, present in enumerate(schedule, 1):
        set_lr(optimizer, cfg, step)
        for r in present:
            model.zero_grad(set_to_none=True)
            forward_loss(model, replica_batch(data, cfg, step, r), step).backward()
            last[r] = [p.grad.detach().clone() for p in model.parameters()]
            dead.discard(r)
        if step in garbage:
            last[garbage[step]] = [torch.full_like(g, float("nan")) for g in last[garbage[step]]]
            dead.add(garbage[step])
        where = f"run {run} ({replicas} replicas planned), step {step}, quorum {list(present)}"
        given = {r: [g.clone() for g in last[r]] for r in sorted(last)}
        got = answer(given, list(present), replicas)
        if any(r not in given or len(given[r]) != len(last[r]) or not all(_bits_equal(a, b) for a, b in
                                                                          zip(given[r], last[r])) for r in last):
            changed = next(r for r in last if r not in given or len(given[r]) != len(last[r])
                           or not all(_bits_equal(a, b) for a, b in zip(given[r], last[r])))
            return FAIL, (f"{where}: your function changed replica {changed}'s gradient in place (a += into the "
                          "first replica's tensors?): those buffers are the replicas' own .grad; compute the average "
                          "in new tensors")
        if isinstance(got, torch.Tensor) and got.dim() == 1 and got.numel() == sum(math.prod(s) for s in shapes):
            return FAIL, (f"{where}: you returned one flat tensor of {got.numel()} values: return one tensor per "
                          f"parameter ({len(shapes)}, shaped {shapes}), as each parameter's .grad is set from its own")
        if not isinstance(got, (list, tuple)) or len(got) != len(shapes) or not all(
                isinstance(g, torch.Tensor) for g in got):
            return FAIL, (f"{where}: return a list of {len(shapes)} tensors, one per parameter (shaped {shapes}), not "
                          f"{type(got).__name__}" + (f" of {len(got)}" if isinstance(got, (list, tuple)) else ""))
        for i, (g, shape) in enumerate(zip(got, shapes)):
            if tuple(g.shape) != shape:
                return FAIL, f"{where}: tensor {i} has shape {list(g.shape)}; parameter {i}'s gradient is {list(shape)}"
            if g.dtype != torch.float64:
                return FAIL, (f"{where}: tensor {i} is {g.dtype}, the gradients are float64 (an accumulator made with "
                              "torch.zeros(shape) has the default dtype, float32: make it with torch.zeros_like(g), "
                              "or add the gradients themselves)")
        flat = torch.cat([g.detach().reshape(-1) for g in got])  # [P]
        ordered = sorted(present)
        total = None
        for r in ordered:  # as replicas.reference adds them: in replica order, then one division
            total = last[r] if total is None else [a + b for a, b in zip(total, last[r])]
        want = torch.cat([t.reshape(-1) for t in total]) / len(present)  # [P]
        everything = torch.stack([torch.cat([t.reshape(-1) for t in last[r]]) for r in sorted(last)]).sum(0)
        scale = want.abs().max().item()
        if not (bool(torch.isfinite(flat).all()) and bool(torch.allclose(flat, want, rtol=1e-12, atol=1e-12 * scale))):
            sums = {"present": want * len(present), "all": everything}
            return FAIL, f"{where}: {_quorum_hint(flat, sums, present, replicas, last, dead)}"
        for p, g in zip(model.parameters(), got):
            p.grad = g.detach().clone()
        optimizer.step()
    ref, _ = reference(cfg, {k: list(q) for k, q in enumerate(schedule, 1)})
    mine = flat_weights(model)
    if not torch.allclose(mine, ref, rtol=1e-9, atol=1e-12):
        err = (mine - ref).abs().max().item()
        return FAIL, (f"run {run}: every step's average matched, yet "
                      f"the final weights differ from the one-process reference by {err:.3g}")
    return None


def check_quorum_grad_scale(answer) -> tuple[str, str]:
    import torch

    with torch.random.fork_rng(devices=[]):  # the replicas' dropout seeds the global RNG: the notebook's is left alone
        for run, (replicas, schedule, garbage) in enumerate(QUORUM_RUNS, 1):
            failed = _check_quorum_run(answer, run, replicas, schedule, garbage)
            if failed:
                return failed
    steps = sum(len(s) for _, s, _ in QUORUM_RUNS)
    return PASS, (f"correct: over {steps} steps in which the quorum shrank to 2 of 3, 2 of 4 and 1 of 4 (stale and "
                  "garbage buffers left out), the weights equal the one-process reference trained on only the present "
                  "replicas' batches (replicas.reference): the batch shrinks with the quorum, the gradient's scale "
                  "does not")


# -- 3. the goodput of a timeline -----------------------------------------------------------------------------------

def _laptop_run() -> list[tuple[str, float]]:
    """Chapter 17's laptop run as ``goodput.predict_run`` models it: 12 steps of 0.5 s, a checkpoint (0.25 s) after
    every 4th, a fault at the start of step 8 (1-based): steps 5 to 7 are rolled back, 6 s to recover."""
    work, ckpt = ("work", 0.5), ("checkpoint", 0.25)
    return [work] * 4 + [ckpt] + [work] * 3 + [("rollback", 1.5), ("recovery", 6.0)] + (
        [work] * 4 + [ckpt]) * 2


TIMELINES = (
    ("a restart, whose failure rolls back the 3 s of work since the checkpoint",
     [("work", 4.0), ("checkpoint", 1.0), ("work", 3.0), ("rollback", 3.0), ("recovery", 2.0), ("work", 3.0),
      ("work", 1.0), ("checkpoint", 1.0)]),
    ("two failures between the same checkpoints, the first right after one (a rollback of 0 s)",
     [("work", 6.0), ("checkpoint", 0.5), ("rollback", 0.0), ("recovery", 4.0), ("work", 2.5), ("rollback", 2.5),
      ("recovery", 4.0), ("work", 5.0), ("checkpoint", 0.5)]),
    ("a quorum run, with a replica group away (degraded) and then healing from a peer, nothing rolled back",
     [("work", 5.0), ("degraded", 1.5), ("heal", 0.5), ("work", 4.0), ("checkpoint", 1.0)]),
    ("a job whose every second of work was rolled back",
     [("work", 3.0), ("rollback", 3.0), ("recovery", 4.0)]),
    ("chapter 17's laptop run as predict_run models it (12 steps of 0.5 s, a checkpoint every 4, a fault in step 8)",
     _laptop_run()),
)


# A share computed in float32 (a torch tensor made from Python numbers) rounds at 6e-8; every mistake named below is
# off by more than 1e-2.
GOODPUT_RTOL = 1e-6


def _as_share(got):
    if hasattr(got, "item") and getattr(got, "numel", lambda: 1)() == 1:
        got = got.item()
    return got if isinstance(got, (int, float)) and not isinstance(got, bool) else None


def _previous_work_lost(segments) -> float:
    """What a rollback takes away if it is read as "the work segment just before it" (not its own seconds)."""
    taken, last = 0.0, 0.0
    for kind, seconds in segments:
        if kind == "work":
            last = seconds
        elif kind == "rollback":
            taken += last
    return taken


def _goodput_hint(got: float, segments, ledger: dict) -> str:
    total = {k: sum(s for kind, s in segments if kind == k) for k in
             ("work", "rollback", "checkpoint", "recovery", "degraded", "heal")}
    wall = sum(s for kind, s in segments if kind != "rollback")
    prod, rolled, ckpt = ledger["productive"], total["rollback"], total["checkpoint"]
    want = ledger["goodput"]
    away = total["degraded"] + total["heal"]
    taken = _previous_work_lost(segments)
    candidates = [
        (100 * want if want > 0 else math.nan,
         "you returned a percentage: return the share, productive / wall, a number between 0 and 1"),
        (wall / prod if prod > 0 else math.nan,
         f"you divided by the productive time ({prod:g} s): goodput is productive / wall time, a share between 0 "
         f"and 1; wall / productive = {wall / prod if prod > 0 else math.inf:.4g} is the wall time each productive "
         "second costs"),
        ((prod + rolled + ckpt) / wall if rolled > 0 and ckpt > 0 else math.nan,
         f"you counted the {rolled:g} s of rolled-back work and the {ckpt:g} s of checkpoints as productive: work a "
         "rollback undoes is lost, and a checkpoint trains nothing"),
        ((prod + rolled) / wall if rolled > 0 else math.nan,
         f"you counted the {rolled:g} s of rolled-back work as productive: a rollback undoes the work since the last "
         "checkpoint, which has to be done again; subtract each rollback's seconds from the productive time"),
        ((prod + ckpt) / wall if ckpt > 0 else math.nan,
         f"you counted the {ckpt:g} s of checkpoints as productive: a checkpoint trains nothing, it is wall time "
         "spent so that a failure costs less"),
        (prod / (wall + rolled) if rolled > 0 else math.nan,
         f"you added the rollbacks' {rolled:g} s to the wall time: a rollback takes no time itself, it turns work "
         "already counted in the wall time into lost work (its cost in time is the recovery next to it)"),
        (prod / total["work"] if total["work"] > 0 and total["work"] != wall else math.nan,
         f"you divided by the time spent in work segments ({total['work']:g} s); goodput divides by the wall time, "
         f"{wall:g} s, every second of the timeline: checkpoints, recovery, degraded and heal included"),
        (prod / (wall - away) if away > 0 else math.nan,
         f"you left the {away:g} s of 'degraded' and 'heal' segments out of the wall time: they are seconds of the "
         "timeline in which the job trained less (a replica group away, then copying the state back), so they count "
         "in the wall time and not in the productive time"),
        ((total["work"] - taken) / wall if abs(taken - rolled) > 1e-12 else math.nan,
         "a rollback's seconds are the work it throws away: you took away the work segment before each rollback "
         "instead, but a rollback of 0 s (the failure struck right after a checkpoint) loses nothing"),
    ]
    for value, hint in candidates:
        if math.isfinite(value) and abs(value - want) > GOODPUT_RTOL * max(abs(want), 1.0) and \
                abs(got - value) <= GOODPUT_RTOL * max(abs(value), 1.0):
            return hint
    return (f"expected productive / wall = {prod:g} / {wall:g} = {want:.6g}: productive is the work minus what "
            "rollbacks undid, the wall time is every segment's seconds except the rollbacks' (they take none)")


def check_timeline_goodput(answer) -> tuple[str, str]:
    from course_utils.goodput import timeline_ledger

    for what, segments in TIMELINES:
        given = list(segments)
        got = answer(given)
        if given != segments:
            return FAIL, (f"for {what}, your function changed the timeline it was given (a segment replaced, added or "
                          "removed): the caller still reads it (to draw it, or to ask for another share); compute "
                          "on your own variables")
        share = _as_share(got)
        if share is None:
            return FAIL, f"for {what}, return the goodput as one number (productive / wall), not {type(got).__name__}"
        if not math.isfinite(share):
            return FAIL, f"for {what}, you returned {share}, not a finite share of the wall time"
        ledger = timeline_ledger(segments)
        want = ledger["goodput"]
        if abs(share - want) <= GOODPUT_RTOL * max(abs(want), 1.0):
            continue
        return FAIL, (f"for {what}, you returned {share:.6g} where the goodput is {want:.6g}: "
                      f"{_goodput_hint(share, segments, ledger)}")
    return PASS, (f"correct on {len(TIMELINES)} timelines: productive time (work minus what rollbacks undid) over the "
                  "wall time (every segment but the rollbacks), as course_utils.goodput.timeline_ledger counts it")


NO_MEMORY = NOT_APPLICABLE + "the answer returns a few numbers; nothing is held that should be released"

register(Exercise("resume_position", "17", "resume_position",
                  "Where to resume after a restart: each rank's rows of the first step after the checkpoint",
                  worker=CHECKER, world_sizes=(2, 4), timeout_s=90.0, tries={
                      "non-finite": NOT_APPLICABLE + "rows are integers: a float row, NaN included, is refused as not "
                                    "an index (output)",
                      "order": NOT_APPLICABLE + "no gradients arrive: the answer computes one step's rows",
                      "sizes": "60 rows in global batches of 8: 7 steps an epoch, the last 4 rows of each epoch's order "
                               "never read; an epoch counted as ceil(60 / 8) = 8 steps resumes in the wrong place from "
                               "epoch 1 on",
                      "ragged": "a checkpoint that closes an epoch: the sampler saved (epoch 1, position 7), and "
                                "reading that position without its rollover hands the ranks the 4 leftover rows, some "
                                "ranks none",
                      "layouts": "world 2 and 4, checkpoints mid epoch 0, mid epoch 2 and at an epoch's end: each "
                                 "rank's rows are compared with its own, so a split other than the sampler's "
                                 "consecutive slices fails even where the ranks together read the right rows",
                      "traffic": NOT_APPLICABLE + "the answer computes rows and runs no collective (the check's "
                                 "restart runs the real DDP steps around it)",
                      "mutation": "the checkpoint dict is compared with a deep copy after the call (the restart still "
                                  "loads the weights and RNG from that checkpoint)",
                      "output": "a list of ints or a 1-D integer tensor of rows inside the dataset: a 2-D tensor "
                                "(every rank's rows), floats or rows out of range are named",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "rows are integers compared exactly; the restarted run's weights are "
                              "then compared with the uninterrupted run's (bit for bit at world 2, within 1e-12 at 4), "
                              "which follows from the rows"}))
register(Exercise("quorum_grad_scale", "17", "quorum_grad_scale",
                  "The gradient of a shrunken quorum: the mean over the replicas present, not the plan",
                  local=check_quorum_grad_scale, tries={
                      "non-finite": "a replica that died in the middle of an allreduce leaves garbage (NaN here) in its "
                                    "buffer: an answer that masks the absent replicas by multiplying by 0 returns NaN "
                                    "(0 x NaN), named",
                      "order": NOT_APPLICABLE + "the answer gets every gradient at once; a sum in another order "
                               "differs from the reference's in the last bits only, within the tolerance",
                      "sizes": NOT_APPLICABLE + "nothing is split: each replica's gradient is whole, one tensor per "
                               "parameter",
                      "ragged": NOT_APPLICABLE + "every replica's batch has the same rows (4), so the mean of their "
                                "mean gradients is the gradient of the quorum's batch; a quorum of one is among the "
                                "layouts",
                      "layouts": "plans of 3 and 4 replicas, quorums missing the last replica, one in the middle, "
                                 "and three of four: a count right only when the survivors are replicas 0 to P-1 fails",
                      "traffic": NOT_APPLICABLE + "no collective: torchft's allreduce sums over the quorum; the answer "
                                 "is the arithmetic around it",
                      "mutation": "every replica's buffer, the stale and garbage ones too, is compared bit for bit "
                                  "with a copy after the call",
                      "output": "one float64 tensor per parameter, of its shape: a float32 accumulator "
                                "(torch.zeros(shape)) and one flat bucket are named",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "compared within 1e-12 of the largest value: the sum over the quorum in "
                              "another order differs in its last bits"}))
register(Exercise("timeline_goodput", "17", "timeline_goodput",
                  "The goodput of a timeline: productive time over wall time, rollbacks and checkpoints counted right",
                  local=check_timeline_goodput, tries={
                      "non-finite": NOT_APPLICABLE + "every timeline has wall time (the one whose work was all rolled "
                                    "back has goodput 0, not an undefined one); a NaN returned still fails, named",
                      "order": NOT_APPLICABLE + "the goodput is a sum over segments; their order only decides what a "
                               "rollback may undo, and every timeline given is a possible one",
                      "sizes": NOT_APPLICABLE + "times are real numbers: nothing is divided into parts",
                      "ragged": "a failure right after a checkpoint: a rollback of 0 s, which loses nothing; an answer "
                                "that takes away the work segment before a rollback instead of its seconds fails there",
                      "layouts": "timelines of a restart, of two failures between the same checkpoints, of a quorum "
                                 "(degraded and heal segments, no rollback), of a run that lost all its work: a wall "
                                 "time counting only a restart's kinds of segment fails on the quorum's",
                      "traffic": NOT_APPLICABLE + "a sum of seconds: no tensors, no ranks",
                      "mutation": "the list of segments is compared with a copy after the call",
                      "output": NOT_APPLICABLE + "any real number (or one-element tensor) is accepted as the share; a "
                                "percentage is named as such",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "compared within 1e-6 relative: the same sums in another order, or in "
                              "float32, differ in their last bits"}))
