"""Any action table, checked and replayed: messages (with local hand-offs), validity, ideal time, memory.

``schedules.py``'s ``with_p2p`` and ``validate`` know GPipe, 1F1B and interleaved 1F1B: chunks round the ranks, a B
that is the whole backward (its ``simulate`` replays any table; ``simulate_split`` checks one first). The
zero-bubble tables (``zero_bubble.py``) add W actions and the V placement, where virtual stages p-1 and p sit on one rank (rank p-1 hands its chunk 0's output to its chunk 1
without a message) and the last virtual stage, the loss, is on rank 0. Everything here takes ``placement``
("loop" or "v", ``zero_bubble.placed_stage``) and a table in which B is the input gradient if the table has W
actions, the whole backward if not. On a loop table without W, ``with_messages`` is ``with_p2p``.

``check_schedule`` raises ``ValueError`` with one sentence naming the first dependency a table breaks:
every action exactly once per rank; F(k, i) -> F(k+1, i); B(k+1, i) -> B(k, i); F(k, i) -> B(k, i) -> W(k, i) (k a
virtual stage, i a micro-batch); and no deadlock on the wire. The wire is the executor's: ``with_messages``
spells each rank's list out, a receive blocks until its message has been sent, a send never blocks (``isend``,
waited for at the end of the step: ``p2p.py``). So a table deadlocks exactly when some ranks each wait in a
receive for a message that another of them sends only later in its own list.
"""
from __future__ import annotations

from workers.pipeline.schedules import Plan, split_action
from workers.pipeline.zero_bubble import placed_stage, rank_of, virtual_count

KINDS = ("F", "B", "W")


def with_messages(actions, num_stages: int, stage: int, chunks: int = 1, placement: str = "loop") -> list:
    """The action list with its messages spelled out, as ``with_p2p``: a receive before the compute that needs it,
    a send after. A neighbouring virtual stage on this same rank gets no message: its output (or input gradient)
    is handed over in memory. W has no message at all: nobody waits for a weight gradient."""
    last = virtual_count(num_stages, chunks, placement) - 1
    out = []
    for action in actions:
        kind, _, c = split_action(action)
        where = tuple(action[1:])
        vs = placed_stage(stage, c, num_stages, placement)

        def remote(other: int) -> bool:
            return rank_of(other, num_stages, placement)[0] != stage

        if kind == "F":
            out += ([("recv_forward", *where)] if vs > 0 and remote(vs - 1) else []) + [action] \
                + ([("send_forward", *where)] if vs < last and remote(vs + 1) else [])
        elif kind == "B":
            out += ([("recv_backward", *where)] if vs < last and remote(vs + 1) else []) + [action] \
                + ([("send_backward", *where)] if vs > 0 and remote(vs - 1) else [])
        else:
            out.append(action)
    return out


def _what(kind: str, micro: int, vs: int) -> str:
    return f"{kind} of micro-batch {micro} on stage {vs}"


def table_problem(schedules, micro_batches: int, placement: str = "loop") -> str | None:
    """One sentence naming the first dependency ``schedules`` (one action list per rank) breaks, or None."""
    p = len(schedules)
    if p < 1:
        return "the table has no ranks: give one action list per pipeline rank"
    triples = []
    for r, actions in enumerate(schedules):
        row = []
        for a in actions:
            try:
                kind, micro, chunk = split_action(a)
                ok = kind in KINDS and len(a) in (2, 3) and all(isinstance(x, int) for x in a[1:])
            except (TypeError, ValueError):
                ok = False
            if not ok:
                return f"rank {r}'s action {a!r} is not an action: use ('F', i), ('B', i), ('W', i) or with a chunk ('F', i, c)"
            row.append((kind, micro, chunk))
        triples.append(row)
    chunks = 1 + max((c for row in triples for _, _, c in row), default=0)
    if placement == "v" and chunks != 2:
        return f"a V-shaped table holds two chunks per rank (0 going down, 1 coming back up), not {chunks}"
    split = any(kind == "W" for row in triples for kind, _, _ in row)
    kinds = KINDS if split else ("F", "B")
    last = virtual_count(p, chunks, placement) - 1

    for r, row in enumerate(triples):
        position = {}
        for n, (kind, micro, c) in enumerate(row):
            vs = placed_stage(r, c, p, placement)
            if not 0 <= micro < micro_batches or c < 0:
                return f"rank {r} runs {_what(kind, micro, vs)}, but the micro-batches are 0 to {micro_batches - 1}"
            if (kind, micro, c) in position:
                return f"rank {r} runs {_what(kind, micro, vs)} twice: every action runs exactly once"
            position[(kind, micro, c)] = n
        for c in range(chunks):
            vs = placed_stage(r, c, p, placement)
            for micro in range(micro_batches):
                for kind in kinds:
                    if (kind, micro, c) not in position:
                        return (f"rank {r} never runs {_what(kind, micro, vs)}: every micro-batch needs one "
                                f"{', one '.join(kinds[:-1])} and one {kinds[-1]} on every stage")
                at = {kind: position[(kind, micro, c)] for kind in kinds}
                if at["B"] < at["F"]:
                    return (f"rank {r} runs {_what('B', micro, vs)} before its F: a backward needs the activations "
                            "its forward stashed")
                if split and at["W"] < at["B"]:
                    return (f"rank {r} runs {_what('W', micro, vs)} before its B: W needs the output gradient "
                            "and the inputs that B stashes for it")
                # the neighbours on this same rank (the V's turn): no message orders them, the list must
                for other, kind, earlier, later, what in ((vs - 1, "F", vs - 1, vs, "input"),
                                                          (vs + 1, "B", vs + 1, vs, "gradient")):
                    if not 0 <= other <= last or rank_of(other, p, placement)[0] != r:
                        continue
                    here, there = position[(kind, micro, c)], position[(kind, micro, rank_of(other, p, placement)[1])]
                    if there > here:
                        return (f"rank {r} runs {_what(kind, micro, later)} before {kind} on stage {earlier} hands "
                                f"it its {what} (both stages are on rank {r})")
    return _wire_deadlock(schedules, p, chunks, placement)


def _wire_deadlock(schedules, p: int, chunks: int, placement: str) -> str | None:
    """Run every rank's ``with_messages`` list with blocking receives and non-blocking sends; None if all finish."""
    lists = [with_messages(actions, p, r, chunks, placement) for r, actions in enumerate(schedules)]
    sent, pos = set(), [0] * p

    def needs(r: int, op) -> tuple | None:  # the message (direction, boundary's lower virtual stage, micro) it waits for
        kind, micro, c = split_action(op)
        vs = placed_stage(r, c, p, placement)
        return {"recv_forward": ("f", vs - 1, micro), "recv_backward": ("b", vs, micro)}.get(kind)

    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                op = lists[r][pos[r]]
                want = needs(r, op)
                if want is not None and want not in sent:
                    break
                kind, micro, c = split_action(op)
                vs = placed_stage(r, c, p, placement)
                if kind == "send_forward":
                    sent.add(("f", vs, micro))
                elif kind == "send_backward":
                    sent.add(("b", vs - 1, micro))
                pos[r] += 1
                progressed = True
    stuck = [r for r in range(p) if pos[r] < len(lists[r])]
    if not stuck:
        return None

    def blocked(r: int) -> tuple[int, str]:  # (the rank it waits on, what it wants to run and from which stage)
        kind, micro, c = split_action(lists[r][pos[r]])
        vs = placed_stage(r, c, p, placement)
        src = vs - 1 if kind == "recv_forward" else vs + 1
        step = "F" if kind == "recv_forward" else "B"
        return rank_of(src, p, placement)[0], (step, micro, vs, src, "activation" if step == "F" else "gradient")

    seen, r = [], stuck[0]
    while r not in seen:  # every stuck rank waits on another stuck one: follow the chain into its cycle
        seen.append(r)
        r = blocked(r)[0]
    q, (step, micro, vs, src, what) = blocked(r)
    _, (q_step, q_micro, q_vs, q_src, q_what) = blocked(q)
    return (f"rank {r} runs {_what(step, micro, vs)} before stage {src} sends its {what}, and rank {q} waits for "
            f"rank {blocked(q)[0]} first ({_what(q_step, q_micro, q_vs)} needs stage {q_src}'s {q_what}): "
            "the blocking receives deadlock")


def check_schedule(schedules, micro_batches: int, placement: str = "loop") -> None:
    """Raise ``ValueError`` naming the broken dependency, in one sentence; return None for a runnable table."""
    problem = table_problem(schedules, micro_batches, placement)
    if problem:
        raise ValueError(problem)


def simulate_split(schedules, forward_time: float = 1.0, backward_time: float = 1.0, weight_time: float = 1.0,
                   message_time: float = 0.0, placement: str = "loop", calls=None,
                   overlap_time: float | None = None) -> dict:
    """A valid table (``check_schedule``: raises on one that is not) replayed in ideal time by ``schedules.simulate``,
    with a W as its own action; the times default to the zero-bubble paper's F = B = W. ``span_idle[r]``, rank r's
    idle time between its own first start and its own last end, is the bubble that paper counts (with no all-reduce
    before the optimizer step, a rank starts the next step's forwards as soon as it is free)."""
    return split_plan(schedules, placement, calls).run(forward_time, backward_time, message_time,
                                                      weight_time=weight_time, overlap_time=overlap_time)


def split_plan(schedules, placement: str = "loop", calls=None) -> Plan:
    """A valid table (``check_schedule``: raises on one that is not) compiled for ``simulate`` (``schedules.Plan``),
    for a caller that prices it many times (the planner)."""
    check_schedule(schedules, 1 + max(a[1] for row in schedules for a in row), placement)
    return Plan(schedules, placement, calls)


def peak_stashes(actions) -> dict:
    """What one rank's list keeps, at most, in micro-batch-chunks: ``activations`` (F done, B not: the forward's
    stash), ``weight`` (B done, W not: what B keeps for W) and ``held`` (F done, W not: either). In a table without
    W actions B frees everything, so ``weight`` is 0 and ``held`` is ``activations``."""
    split = any(a[0] == "W" for a in actions)
    live = {"activations": 0, "weight": 0, "held": 0}
    peak = dict(live)
    for a in actions:
        kind = a[0]
        if kind == "F":
            live["activations"] += 1
            live["held"] += 1
        elif kind == "B":
            live["activations"] -= 1
            live["weight" if split else "held"] += 1 if split else -1
        elif kind == "W":
            live["weight"] -= 1
            live["held"] -= 1
        peak = {k: max(peak[k], live[k]) for k in live}
    return peak
