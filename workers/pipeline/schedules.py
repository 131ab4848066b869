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

from array import array

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


class Plan:
    """A table compiled for ``simulate``: each rank's list as units (the actions that start together: one call), in
    an order the ranks can run them. Whether a unit can run depends on the table alone (once the units it waits on
    have), never on the times, so one plan prices its table for any times in a single pass; a caller that prices one
    table many times (the planner, at every GEMM share it tries) builds the plan once and keeps it.

    Per unit, in that order, flat arrays (a published run's step is hundreds of thousands of actions): its rank, its
    action's key (kind and virtual stage: which seconds it takes; -1 for a call of several actions, kept in
    ``calls``), micro-batch and chunk, and the unit it waits on (2 u + 1 when that dependency crossed ranks, so it
    waits for the message too; -1 for none). ``deadlock``: None, or the sentence ``simulate`` returns (the units
    that can never run are left out)."""

    def __init__(self, schedules: list[list[Action]], placement: str = "loop", calls=None):
        p, chunks = len(schedules), num_chunks(schedules)
        self.p, self.chunks = p, chunks
        self.split = any(a[0] == "W" for row in schedules for a in row)
        self.last = virtual_count(p, chunks, placement) - 1
        owner = [rank_of(vs, p, placement)[0] for vs in range(self.last + 1)]  # the rank that holds virtual stage vs
        self.stages = stages = self.last + 1
        kinds = {"F": 0, "B": stages, "W": 2 * stages}  # an action's key: its kind's block of stages, plus its stage
        micros = 1 + max((a[1] for row in schedules for a in row), default=0)
        per_rank = []  # per rank: (actions as (kind, micro, chunk, key), ids waited on and if crossed, first index)
        for r, row in enumerate(schedules):
            ranges = dict(calls[r]) if calls else {}
            held = [placed_stage(r, c, p, placement) for c in range(chunks)]
            rank_units, n = [], 0
            while n < len(row):
                end = ranges.get(n, n)
                acts, deps = [], []
                for a in row[n:end + 1]:
                    kind, i, c = split_action(a)
                    if kind not in kinds:
                        raise ValueError(f"stage {r}: {a!r} is not an F, B or W action")
                    vs = held[c]
                    acts.append((kind, i, c, kinds[kind] + vs))
                    if kind == "F":
                        dep = None if vs == 0 else vs - 1
                    elif kind == "B":
                        dep = vs if vs == self.last else stages + vs + 1
                    else:
                        dep = stages + vs
                    if dep is not None:  # an action's id: key * micros + micro
                        deps.append((dep * micros + i, owner[dep % stages] != r))
                if len(acts) > 1:  # a call: what its own actions provide is no dependency
                    inside = {key * micros + i for _, i, _, key in acts}
                    deps = [(d, crossed) for d, crossed in deps if d not in inside]
                rank_units.append((acts, deps, n))
                n = end + 1
            per_rank.append(rank_units)
        unit_of = [-1] * (3 * stages * micros)  # an action's id -> the unit that computes it (-1: none yet)
        self.rank, self.key, self.micro, self.chunk, self.dep = (array("l") for _ in range(5))
        self.calls = {}  # a call's unit -> (its actions, the units it waits on (2 u + crossed), overlapped)
        pos = [0] * p
        waiting = {}  # an action not computed yet -> the rank whose next unit waits on it
        ready = list(range(p - 1, -1, -1))  # ranks that may go on: each runs its units in order while it can
        while ready:
            r = ready.pop()
            rank_units, k = per_rank[r], pos[r]
            while k < len(rank_units):
                acts, deps, _ = rank_units[k]
                waits_on = []
                for d, crossed in deps:
                    u = unit_of[d]
                    if u < 0:
                        waiting[d] = r
                        break
                    waits_on.append(2 * u + crossed)
                else:
                    u = len(self.rank)
                    self.rank.append(r)
                    if len(acts) == 1:
                        _, i, c, key = acts[0]
                        self.key.append(key)
                        self.dep.append(waits_on[0] if waits_on else -1)
                    else:
                        i = c = -1
                        self.key.append(-1)
                        self.dep.append(-1)
                        self.calls[u] = (acts, waits_on, {"F", "B"} <= {a[0] for a in acts})
                    self.micro.append(i)
                    self.chunk.append(c)
                    for _, i, _, key in acts:
                        done = key * micros + i
                        unit_of[done] = u
                        if done in waiting:
                            ready.append(waiting.pop(done))
                    k += 1
                    continue
                break
            pos[r] = k
        stuck = [r for r in range(p) if pos[r] < len(per_rank[r])]
        self.deadlock = None
        if stuck:
            waits = ", ".join(f"stage {r} waits at {schedules[r][per_rank[r][pos[r]][2]]}" for r in stuck)
            self.deadlock = f"the stages wait on each other forever: {waits}"

    def seconds(self, forward_time, backward_time, weight_time) -> list[float]:
        """One action's seconds, indexed by its key: F, B, W, each by virtual stage."""
        split, chunks = self.split, self.chunks

        def at(t, vs):
            return t[vs] if isinstance(t, (list, tuple)) else t / chunks
        stages = range(self.stages)
        return ([at(forward_time, vs) for vs in stages]
                + [at(backward_time, vs) + (0.0 if split else at(weight_time, vs)) for vs in stages]
                + [at(weight_time, vs) for vs in stages])

    def run(self, forward_time: float | list[float] = 1.0, backward_time: float | list[float] = 2.0,
            message_time: float = 0.0, *, weight_time: float | list[float] = 0.0, overlap_time: float | None = None,
            boxes: bool = True) -> dict:
        """``simulate``'s result for these times."""
        seconds = self.seconds(forward_time, backward_time, weight_time)
        ranks, keys, deps, calls = self.rank, self.key, self.dep, self.calls
        ends = [0.0] * len(ranks)
        clock = [0.0] * self.p
        timeline = [[] for _ in range(self.p)]
        for u in range(len(ranks)):
            r, key = ranks[u], keys[u]
            ready = clock[r]
            if key >= 0:  # one action
                d = deps[u]
                if d >= 0:
                    end = ends[d >> 1] + message_time if d & 1 else ends[d >> 1]
                    if end > ready:
                        ready = end
                start = ready + seconds[key]
                if boxes:
                    timeline[r].append({"kind": "FBW"[key // self.stages], "micro": self.micro[u],
                                        "chunk": self.chunk[u], "start": ready, "end": start})
            else:  # a call: it starts once every action in it may; its boxes side by side, scaled to its time
                acts, waits_on, overlapped = calls[u]
                for d in waits_on:
                    end = ends[d >> 1] + message_time if d & 1 else ends[d >> 1]
                    if end > ready:
                        ready = end
                scale = 1.0
                if overlapped and overlap_time is not None:
                    scale = overlap_time / self.chunks / sum(seconds[a[3]] for a in acts)
                start = ready
                for kind, i, c, key in acts:
                    took_s = seconds[key] * scale
                    if boxes:
                        timeline[r].append({"kind": kind, "micro": i, "chunk": c, "start": start,
                                            "end": start + took_s})
                    start += took_s
            ends[u] = clock[r] = start  # a call's results leave together, when all of it is done (then it sends)
        makespan = max(clock) if clock else 0.0
        if not boxes:
            return {"timeline": None, "makespan": makespan, "span_idle": None, "deadlock": self.deadlock}
        span_idle = [row[-1]["end"] - row[0]["start"] - sum(e["end"] - e["start"] for e in row) if row else 0.0
                     for row in timeline]
        return {"timeline": timeline, "makespan": makespan, "span_idle": span_idle, "deadlock": self.deadlock}


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
    a caller that needs only the makespan (a published run's step is hundreds of thousands of actions). The
    table is compiled first (``Plan``); a caller pricing one table many times keeps the plan and calls its ``run``.
    """
    return Plan(schedules, placement, calls).run(forward_time, backward_time, message_time, weight_time=weight_time,
                                                 overlap_time=overlap_time, boxes=boxes)


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
