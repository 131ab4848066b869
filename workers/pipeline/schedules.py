"""Pipeline schedules as data: for each rank, the ordered list of actions it runs in one optimizer step.

An action is ``("F", i)`` (forward of micro-batch i on this stage) or ``("B", i)`` (its backward); with
model chunks (the interleaved schedule) it is ``("F", i, c)``: micro-batch i through this rank's chunk c.
The messages follow from the position of the (virtual) stage: an F receives its input from the previous
stage first (``recv_forward``) and sends its output on (``send_forward``); a B receives the output's
gradient from the next stage (``recv_backward``) and sends the input's gradient back (``send_backward``).
``with_p2p`` spells those out, and the executor runs exactly that list.

A third kind, ``("W", i)``, is the weight gradient alone (``zero_bubble.py``: ZB-H1, ZB-H2, ZB-V, DualPipeV): in a
table that has W actions, B is the input gradient only; in the tables here B stays the whole backward.

* GPipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds m micro-batches'
  activations at the turn.
* 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters", section 2.2.1, Figure 4): stage s runs p - s - 1 warm-up forwards, then alternates one forward
  and one backward, then drains the remaining backwards. The same bubble as GPipe, but at most p - s
  micro-batches in flight (Megatron: ``forward_backward_pipelining_without_interleaving``).
* Interleaved 1F1B (the same paper, section 2.2.2, Figure 4 bottom): each rank holds v model chunks, so the
  model is cut into p * v virtual stages and chunk c of rank s is virtual stage c * p + s. Micro-batches go
  round the ranks v times; each action is 1/v of a stage's work, so the warm-up and cool-down triangles,
  and the bubble, shrink by v, for v times as many messages (Megatron:
  ``forward_backward_pipelining_with_interleaving``).
"""
from __future__ import annotations

from workers.pipeline.zero_bubble import placed_stage, rank_of, virtual_count

Action = tuple  # ("F", micro) | ("B", micro) | ("W", micro) | ("F", micro, chunk) ..., or a p2p action from with_p2p

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def split_action(action: Action) -> tuple[str, int, int]:
    """``(kind, micro, chunk)``; a pair is chunk 0 (one chunk per rank)."""
    kind, micro, *rest = action
    return kind, micro, rest[0] if rest else 0


def num_chunks(schedules: list[list[Action]]) -> int:
    """v: model chunks per rank, read off the actions (1 for GPipe and 1F1B)."""
    return 1 + max((split_action(a)[2] for actions in schedules for a in actions), default=0)


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


def interleaved_order(num_stages: int, micro_batches: int, chunks: int, forward: bool) -> list[tuple[int, int]]:
    """The (micro, chunk) order a rank runs its m * v forwards (or backwards) in: micro-batches in groups of p,
    each group through chunk 0, then chunk 1, ... (backwards: the last chunk first). Megatron's
    ``get_model_chunk_id``; it is why m must be a multiple of p."""
    p, v = num_stages, chunks
    order = []
    for k in range(micro_batches * v):
        group, pos = divmod(k, p * v)  # the k-th action: which group of p micro-batches, where in its p * v
        chunk = pos // p
        order.append((group * p + pos % p, chunk if forward else v - 1 - chunk))
    return order


def num_warmup_interleaved(num_stages: int, micro_batches: int, stage: int, chunks: int) -> int:
    """Megatron's warm-up for the interleaved schedule: (p - s - 1) * 2 + (v - 1) * p forwards (at most m v),
    or every forward when m == p (Megatron's ``all_warmup_microbatches``: one group, nothing to interleave).

    The (v - 1) * p lets the first group of micro-batches reach the last chunk; the 2 (p - s - 1), twice the
    plain 1F1B warm-up, because a chunk's forward and backward are each half of a round trip to the last rank."""
    if micro_batches == num_stages:
        return micro_batches * chunks
    return min((num_stages - stage - 1) * 2 + (chunks - 1) * num_stages, micro_batches * chunks)


def interleaved_schedule(num_stages: int, micro_batches: int, stage: int, chunks: int = 2) -> list[Action]:
    """Interleaved 1F1B with ``chunks`` (v) model chunks per rank: the 1F1B pattern over the m * v chunk-actions."""
    if micro_batches % num_stages:
        raise ValueError(f"micro_batches={micro_batches} is not a multiple of the {num_stages} stages: the "
                         f"interleaved schedule sends micro-batches round in groups of p; choose a multiple of {num_stages}")
    forwards = [("F", i, c) for i, c in interleaved_order(num_stages, micro_batches, chunks, forward=True)]
    backwards = [("B", i, c) for i, c in interleaved_order(num_stages, micro_batches, chunks, forward=False)]
    warmup = num_warmup_interleaved(num_stages, micro_batches, stage, chunks)
    steady = len(forwards) - warmup
    actions = forwards[:warmup]
    for j in range(steady):
        actions += [forwards[warmup + j], backwards[j]]
    return actions + backwards[steady:]


def schedule(name: str, num_stages: int, micro_batches: int, stage: int, chunks: int = 1) -> list[Action]:
    if name == "gpipe":
        return gpipe_schedule(num_stages, micro_batches, stage)
    if name == "1f1b":
        return one_f_one_b_schedule(num_stages, micro_batches, stage)
    if name == "interleaved":
        return interleaved_schedule(num_stages, micro_batches, stage, chunks)
    raise ValueError(f"schedule={name!r} is not known: choose one of {', '.join(SCHEDULES)}")


def all_stages(name: str, num_stages: int, micro_batches: int, chunks: int = 1) -> list[list[Action]]:
    return [schedule(name, num_stages, micro_batches, s, chunks) for s in range(num_stages)]


def virtual_stage(stage: int, chunk: int, num_stages: int) -> int:
    """Chunk c of rank s is virtual stage c * p + s: the model goes round the ranks once per chunk."""
    return chunk * num_stages + stage


def with_p2p(actions: list[Action], num_stages: int, stage: int, chunks: int = 1) -> list[Action]:
    """The action list with its messages spelled out: recv before the compute that needs it, send after.
    A p2p action carries the compute action's micro-batch (and chunk): ``("recv_forward", i[, c])``."""
    last_virtual = num_stages * chunks - 1
    out = []
    for action in actions:
        kind, _, c = split_action(action)
        where = action[1:]
        vs = virtual_stage(stage, c, num_stages)
        first, last = vs == 0, vs == last_virtual
        if kind == "F":
            out += ([] if first else [("recv_forward", *where)]) + [action] + ([] if last else [("send_forward", *where)])
        else:
            out += ([] if last else [("recv_backward", *where)]) + [action] + ([] if first else [("send_backward", *where)])
    return out


def peak_stash(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) forwards whose backward has not run: activations kept for backward."""
    live = peak = 0
    for action in actions:
        live += 1 if action[0] == "F" else -1 if action[0] == "B" else 0
        peak = max(peak, live)
    return peak


def _name(kind: str, i: int, c: int, chunks: int) -> str:
    return f"{kind}({i})" if chunks == 1 else f"{kind}({i}, chunk {c})"


def check_stage(actions, micro_batches: int, stage: int, chunks: int = 1) -> str | None:
    """One sentence if one stage's list is malformed: not F/B actions, a micro-batch (or chunk) missing or
    repeated, B before F."""
    try:
        triples = [split_action((str(a[0]), *(int(x) for x in a[1:]))) for a in actions]
        if any(len(a) not in (2, 3) for a in actions):
            raise ValueError
    except (TypeError, ValueError, IndexError):
        return f"stage {stage}: every action must be a pair like ('F', 0) or ('B', 0), got {actions!r:.80}"
    seen_f, seen_b = [], []
    for kind, i, c in triples:
        if kind not in ("F", "B") or not 0 <= i < micro_batches or not 0 <= c < chunks:
            return (f"stage {stage}: {(kind, i) if chunks == 1 else (kind, i, c)} is not an action: use ('F', i) or "
                    f"('B', i) with 0 <= i < {micro_batches}" + ("" if chunks == 1 else f" and a chunk below {chunks}"))
        if kind == "B" and (i, c) not in seen_f:
            return (f"stage {stage}: {_name('B', i, c, chunks)} comes before {_name('F', i, c, chunks)}: a backward "
                    "needs the activations its forward stored")
        (seen_f if kind == "F" else seen_b).append((i, c))
    want = sorted((i, c) for i in range(micro_batches) for c in range(chunks))
    for name, seen in (("F", seen_f), ("B", seen_b)):
        if sorted(seen) != want:
            if chunks == 1:
                return (f"stage {stage}: the {name} actions cover micro-batches {sorted(i for i, _ in seen)}; each "
                        f"of the {micro_batches} micro-batches needs exactly one {name}")
            return (f"stage {stage}: the {name} actions cover (micro-batch, chunk) {sorted(seen)}; each of the "
                    f"{micro_batches} micro-batches needs exactly one {name} per chunk")
    return None


def simulate(schedules: list[list[Action]], forward_time: float | list[float] = 1.0,
             backward_time: float | list[float] = 2.0, message_time: float = 0.0, *,
             weight_time: float | list[float] = 0.0, placement: str = "loop", calls=None,
             overlap_time: float | None = None, boxes: bool = True) -> dict:
    """Run the ranks' lists in ideal time respecting the dependencies across (virtual) stages: F(i) on stage k
    after F(i) on k - 1, B(i) on k after B(i) on k + 1 (the last stage's B after its own F), W(i) after B(i). Each
    rank runs its list in order; an action starts when the rank is free and its dependency is done, plus
    ``message_time`` (a message's latency) when that dependency crossed ranks: interleaving sends v times as many.
    ``forward_time`` / ``backward_time`` / ``weight_time`` are one micro-batch through a rank's whole share of the
    model; with v chunks per rank an action is one chunk, 1/v of that. Stages of unequal work (the planner's: the
    first carries the embedding, the last the head) pass one time per virtual stage instead, ``forward_time[k]``
    for virtual stage k, not divided by v. A B in a table without W actions is the whole backward,
    ``backward_time + weight_time``.

    ``placement``: where the chunks sit ("loop": chunk c of rank s is virtual stage c p + s; "v": the V of the
    zero-bubble tables, ``zero_bubble.placed_stage``). ``calls[r]``: index ranges ``(first, last)`` of rank r's list
    that run as one call (DualPipe's overlapped forward and full backward: ``zero_bubble.dualpipev_calls``). A call
    starts once every action in it may, and what it computes is ready only when all of it is done (the call sends
    after it returns). A call with both an F and a B takes ``overlap_time`` (a rank's whole share, divided by v like
    the others; None: the sum of its actions, no gain from overlapping).

    Returns ``{"timeline": [[{"kind", "micro", "chunk", "start", "end"}, ...] per rank], "makespan", "span_idle",
    "deadlock"}`` (the executor's timeline format): ``span_idle[r]`` is rank r's idle time between its own first
    start and its own last end, the bubble the zero-bubble paper counts; ``deadlock`` is None or one sentence
    naming the ranks that wait on each other. ``boxes=False``: no timeline (None) and no ``span_idle`` (None), for
    a caller that needs only the makespan (a published run's step is hundreds of thousands of actions).
    """
    p, chunks = len(schedules), num_chunks(schedules)
    split = any(a[0] == "W" for row in schedules for a in row)
    last = virtual_count(p, chunks, placement) - 1

    def took(kind: str, vs: int) -> float:
        def at(t):
            return t[vs] if isinstance(t, (list, tuple)) else t / chunks
        if kind == "F":
            return at(forward_time)
        return at(weight_time) if kind == "W" else at(backward_time) + (0.0 if split else at(weight_time))

    # Each rank's list as units (the actions that start together: one call), each read once up front: its actions
    # (kind, micro, chunk, virtual stage, seconds), the dependencies it waits on outside itself (each with the message
    # latency it adds when it crossed ranks) and its time scale (an overlapped call's). A unit that is not ready yet is tried again on the next pass: only its
    # dependencies are looked up again (a published run's step is hundreds of thousands of actions).
    owner = [rank_of(vs, p, placement)[0] for vs in range(last + 1)]  # the rank that holds virtual stage vs
    seconds = {kind: [took(kind, vs) for vs in range(last + 1)] for kind in "FBW"}
    units = []
    for r, row in enumerate(schedules):
        ranges = dict(calls[r]) if calls else {}
        held = [placed_stage(r, c, p, placement) for c in range(chunks)]
        rank_units, n = [], 0
        while n < len(row):
            end = ranges.get(n, n)
            acts = []
            for a in row[n:end + 1]:
                kind, i, c = split_action(a)
                acts.append((kind, i, c, held[c], seconds[kind][held[c]]))
            deps = []
            for kind, i, _, vs, _ in acts:
                if kind == "F":
                    dep = None if vs == 0 else ("F", vs - 1, i)
                elif kind == "B":
                    dep = ("F", vs, i) if vs == last else ("B", vs + 1, i)
                else:
                    dep = ("B", vs, i)
                if dep is not None:  # a dependency on another rank's stage waits for the message too
                    deps.append((dep, message_time if owner[dep[1]] != r else 0.0))
            scale = 1.0
            if len(acts) > 1:  # a call: what its own actions provide is no dependency, and it may overlap F and B
                inside = {(kind, vs, i) for kind, i, _, vs, _ in acts}
                deps = [(dep, lag) for dep, lag in deps if dep not in inside]
                own = sum(t for *_, t in acts)
                if overlap_time is not None and {"F", "B"} <= {kind for kind, *_ in acts}:
                    scale = overlap_time / chunks / own
            rank_units.append((acts, deps, scale, n))
            n = end + 1
        units.append(rank_units)
    done: dict[tuple, float] = {}  # (kind, virtual stage, micro) -> end time
    pos, clock = [0] * p, [0.0] * p
    timeline = [[] for _ in range(p)]
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            rank_units, line, k = units[r], timeline[r], pos[r]
            while k < len(rank_units):
                acts, deps, scale, _ = rank_units[k]
                ready = clock[r]
                for dep, lag in deps:
                    end = done.get(dep)
                    if end is None:
                        ready = None
                        break
                    if end + lag > ready:
                        ready = end + lag
                if ready is None:
                    break
                start = ready
                for kind, i, c, _, t in acts:  # an overlapped call's boxes side by side, scaled to its time
                    took_s = t * scale
                    if boxes:
                        line.append({"kind": kind, "micro": i, "chunk": c, "start": start, "end": start + took_s})
                    start += took_s
                for kind, i, _, vs, _ in acts:  # its results leave together, when the whole call is done (then sends)
                    done[(kind, vs, i)] = start
                clock[r] = start
                k += 1
                progressed = True
            pos[r] = k
    stuck = [r for r in range(p) if pos[r] < len(units[r])]
    deadlock = None
    if stuck:
        waits = ", ".join(f"stage {r} waits at {schedules[r][units[r][pos[r]][3]]}" for r in stuck)
        deadlock = f"the stages wait on each other forever: {waits}"
    if not boxes:
        return {"timeline": None, "makespan": max(clock) if clock else 0.0, "span_idle": None, "deadlock": deadlock}
    span_idle = [row[-1]["end"] - row[0]["start"] - sum(e["end"] - e["start"] for e in row) if row else 0.0
                 for row in timeline]
    return {"timeline": timeline, "makespan": max(clock) if clock else 0.0, "span_idle": span_idle,
            "deadlock": deadlock}


def validate(schedules: list[list[Action]], micro_batches: int) -> str | None:
    """None if every stage's list is well formed and the whole pipeline can run to the end; else one sentence."""
    try:  # v from the actions themselves: a stage that leaves out a chunk is then missing actions
        chunks = num_chunks(schedules)
    except (TypeError, ValueError):
        chunks = 1  # malformed actions: check_stage names them
    for s, actions in enumerate(schedules):
        problem = check_stage(actions, micro_batches, s, chunks)
        if problem:
            return problem
    return simulate([[(str(a[0]), *(int(x) for x in a[1:])) for a in actions] for actions in schedules])["deadlock"]


def step_bubble(sim: dict) -> float:
    """Idle share of the whole step on rank 0 of a ``simulate`` result: 1 - busy / makespan."""
    busy = sum(e["end"] - e["start"] for e in sim["timeline"][0])
    return 1 - busy / sim["makespan"]


def ideal_bubble(schedules: list[list[Action]], forward_time: float = 1.0, backward_time: float = 2.0,
                 message_time: float = 0.0) -> float:
    """Idle share of the step (idle / total) per rank in ideal time: (p-1)/(m+p-1) for GPipe and 1F1B,
    (p-1)/(v m + p-1) for the interleaved schedule (free messages; ``message_time`` > 0 adds their latency)."""
    if not schedules:
        return 0.0
    return step_bubble(simulate(schedules, forward_time, backward_time, message_time))
