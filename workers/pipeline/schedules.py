"""Pipeline schedules as data: for each rank, the ordered list of actions it runs in one optimizer step.

An action is ``("F", i)`` (forward of micro-batch i on this stage) or ``("B", i)`` (its backward). The
messages follow from the position of the stage: an F receives its input from the previous stage first
(``recv_forward``) and sends its output on (``send_forward``); a B receives the output's gradient from the
next stage (``recv_backward``) and sends the input's gradient back (``send_backward``). ``with_p2p`` spells
those out, and the executor runs exactly that list.

* GPipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds m micro-batches'
  activations at the turn.
* 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters", section 2.2.1, Figure 4): stage s runs p - s - 1 warm-up forwards, then alternates one forward
  and one backward, then drains the remaining backwards. The same bubble as GPipe, but at most p - s
  micro-batches in flight (Megatron: ``forward_backward_pipelining_without_interleaving``).
"""
from __future__ import annotations

Action = tuple  # ("F", micro) | ("B", micro), or a p2p action from with_p2p

SCHEDULES = ("gpipe", "1f1b")


def gpipe_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """All forwards, then all backwards (in micro-batch order)."""
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def num_warmup_microbatches(num_stages: int, micro_batches: int, stage: int) -> int:
    """Megatron's ``num_warmup_microbatches``: p - stage - 1 forwards before the first backward (at most m)."""
    return min(num_stages - stage - 1, micro_batches)


def one_f_one_b_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    warmup = num_warmup_microbatches(num_stages, micro_batches, stage)
    steady = micro_batches - warmup
    actions = [("F", i) for i in range(warmup)]
    for j in range(steady):  # the forward of micro-batch warmup + j, then the backward of the oldest one
        actions += [("F", warmup + j), ("B", j)]
    actions += [("B", i) for i in range(steady, micro_batches)]  # cool-down
    return actions


def schedule(name: str, num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    if name == "gpipe":
        return gpipe_schedule(num_stages, micro_batches, stage)
    if name == "1f1b":
        return one_f_one_b_schedule(num_stages, micro_batches, stage)
    raise ValueError(f"schedule={name!r} is not known: choose one of {', '.join(SCHEDULES)}")


def all_stages(name: str, num_stages: int, micro_batches: int) -> list[list[Action]]:
    return [schedule(name, num_stages, micro_batches, s) for s in range(num_stages)]


def with_p2p(actions: list[Action], num_stages: int, stage: int) -> list[Action]:
    """The action list with its messages spelled out: recv before the compute that needs it, send after."""
    first, last = stage == 0, stage == num_stages - 1
    out = []
    for kind, i in actions:
        if kind == "F":
            out += ([] if first else [("recv_forward", i)]) + [("F", i)] + ([] if last else [("send_forward", i)])
        else:
            out += ([] if last else [("recv_backward", i)]) + [("B", i)] + ([] if first else [("send_backward", i)])
    return out


def peak_stash(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not: activations kept for backward."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1 if kind == "B" else 0
        peak = max(peak, live)
    return peak


def check_stage(actions, micro_batches: int, stage: int) -> str | None:
    """One sentence if one stage's list is malformed: not F/B pairs, a micro-batch missing or repeated, B before F."""
    try:
        pairs = [(str(k), int(i)) for k, i in actions]
    except (TypeError, ValueError):
        return f"stage {stage}: every action must be a pair like ('F', 0) or ('B', 0), got {actions!r:.80}"
    seen_f, seen_b = [], []
    for kind, i in pairs:
        if kind not in ("F", "B") or not 0 <= i < micro_batches:
            return f"stage {stage}: {(kind, i)} is not an action: use ('F', i) or ('B', i) with 0 <= i < {micro_batches}"
        if kind == "B" and i not in seen_f:
            return f"stage {stage}: B({i}) comes before F({i}): a backward needs the activations its forward stored"
        (seen_f if kind == "F" else seen_b).append(i)
    for name, seen in (("F", seen_f), ("B", seen_b)):
        if sorted(seen) != list(range(micro_batches)):
            return (f"stage {stage}: the {name} actions cover micro-batches {sorted(seen)}; each of the "
                    f"{micro_batches} micro-batches needs exactly one {name}")
    return None


def simulate(schedules: list[list[Action]], forward_time: float = 1.0, backward_time: float = 2.0) -> dict:
    """Run the ranks' lists in ideal time (no communication cost) respecting the dependencies across stages:
    F(i) on stage s after F(i) on s - 1, B(i) on s after B(i) on s + 1. Each rank runs its list in order.

    Returns ``{"timeline": [[(kind, i, start, end), ...] per rank], "makespan", "deadlock"}``; ``deadlock`` is
    None or one sentence naming the ranks that wait on each other.
    """
    p = len(schedules)
    done: dict[tuple, float] = {}  # (stage, kind, i) -> end time
    pos, clock = [0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(p):
            while pos[s] < len(schedules[s]):
                kind, i = schedules[s][pos[s]]
                dep = (s - 1, "F", i) if kind == "F" else (s + 1, "B", i)
                if kind == "F" and s == 0 or kind == "B" and s == p - 1:
                    ready = 0.0 if kind == "F" else done.get((s, "F", i), 0.0)
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                start = max(clock[s], ready)
                end = start + (forward_time if kind == "F" else backward_time)
                timeline[s].append((kind, i, start, end))
                done[(s, kind, i)] = clock[s] = end
                pos[s] += 1
                progressed = True
    stuck = [s for s in range(p) if pos[s] < len(schedules[s])]
    deadlock = None
    if stuck:
        waits = ", ".join(f"stage {s} waits at {schedules[s][pos[s]]}" for s in stuck)
        deadlock = f"the stages wait on each other forever: {waits}"
    return {"timeline": timeline, "makespan": max(clock) if clock else 0.0, "deadlock": deadlock}


def validate(schedules: list[list[Action]], micro_batches: int) -> str | None:
    """None if every stage's list is well formed and the whole pipeline can run to the end; else one sentence."""
    for s, actions in enumerate(schedules):
        problem = check_stage(actions, micro_batches, s)
        if problem:
            return problem
    return simulate([[(str(k), int(i)) for k, i in a] for a in schedules])["deadlock"]


def ideal_bubble(schedules: list[list[Action]], forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """Idle share of the step (idle / total) per rank in ideal time: (p-1)/(m+p-1) for GPipe and 1F1B."""
    p = len(schedules)
    sim = simulate(schedules, forward_time, backward_time)
    busy = sum(e - s for _, _, s, e in sim["timeline"][0])
    return 1 - busy / sim["makespan"] if p else 0.0
