"""The run's logbook: what each rank did and when, on disk next to the checkpoints.

A checkpoint holds where training *can* resume; the journal holds what actually happened, including the steps a
killed attempt finished after its last checkpoint (lost work) and when the fault struck. Each rank appends to its
own file (``journal/rank{R}.jsonl``: no two writers share one), one JSON line per event, flushed at once: a SIGKILL
loses nothing written before it (the kernel keeps the page), only a machine that loses power would, which is why
real jobs send the same records to a metrics service as well. Times are ``time.time()``: every attempt's processes
share the machine's clock, so intervals across a restart are differences of wall-clock times.

    events = read_events(root, run)            # every rank, this run only, in time order
    split = ledger(events)                     # {"productive_s": ..., "lost_steps": [...], ...}
"""
from __future__ import annotations

import json
import os
import time

FOLDER = "journal"
# A spread of arrivals at the gradient all_reduce above this names the last rank to arrive as a straggler. The
# ranks leave the previous step together (its loss all_reduce), so without a stall they arrive within the jitter of
# one forward pass and the scheduler: milliseconds, tens of them on a loaded machine; a stalled rank arrives its
# stall later (chapter 17's is 0.3 s).
STRAGGLER_S = 0.1


class Journal:
    def __init__(self, root: str, rank: int, attempt: int, run: str):
        self.rank, self.attempt, self.run = rank, attempt, run
        os.makedirs(os.path.join(root, FOLDER), exist_ok=True)
        self.path = os.path.join(root, FOLDER, f"rank{rank}.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, event: str, **fields) -> dict:
        record = {"event": event, "run": self.run, "attempt": self.attempt, "rank": self.rank,
                  "t": fields.pop("t", time.time()), **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # in the kernel's page cache now: a SIGKILL of this process cannot lose it
        return record

    def close(self) -> None:
        self._file.close()


def started_before(root: str, rank: int, run: str, attempt: int) -> bool:
    """Whether this rank's journal already holds a start of this run and attempt: the same ranks running again into
    the same folder (warm ranks keep their torchrun run id), which would mix two runs into one ledger."""
    path = os.path.join(root, FOLDER, f"rank{rank}.jsonl")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        return any(e.get("event") == "start" and e.get("run") == run and e.get("attempt") == attempt
                   for e in (json.loads(line) for line in f if line.strip()))


def read_events(root: str, run: str) -> list[dict]:
    """Every rank's events of run ``run`` (torchrun's run id: the same across its restarts), oldest first."""
    folder, events = os.path.join(root, FOLDER), []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    if record.get("run") == run:
                        events.append(record)
    return sorted(events, key=lambda e: e["t"])


def ledger(events: list[dict], straggler_s: float = STRAGGLER_S) -> dict:
    """Where the wall time of a run went, from its journal (rank 0's steps; faults and failures from any rank;
    every rank's arrivals at the gradient all_reduce).

    - ``productive_s``: the steps the final weights are made of, each counted once, less their waiting (below);
    - ``lost_s``: steps finished and then thrown away by a rollback, plus the step in flight when the fault struck,
      up to the fault (``lost_steps`` lists the thrown-away ones);
    - ``detect_s``: from the fault to the failure a rank raised (a hang waits for the collective timeout here; a
      SIGKILL is seen by torchrun's agent within its monitor interval, counted in ``restart_s``);
    - ``restart_s``: from the failure (or the kill) to the new attempt starting to load its checkpoint: torchrun
      stopping the survivors, new processes, ``import torch``, rendezvous, model and DDP built again;
    - ``reload_s``: reading the checkpoint back (DCP) and putting it into model, optimizer, schedule, data, RNG;
    - ``checkpoint_s``: every save, in every attempt (rank 0's wall time: the save's last barrier makes it the job's);
    - ``skipped``: per restart, the steps whose checkpoint folder was torn (no ``.metadata``) when it reloaded;
    - ``rows``: per step of the final trajectory, the sample indices every rank of its attempt read (sorted);
    - ``world_sizes``: the world of each attempt (an elastic job goes on in a smaller one after a lost node);
    - ``waiting_s``: in each step of the final trajectory, the time the first rank to reach the gradient all_reduce
      waited there for the last (the spread of every rank's ``arrive``), summed; ``wait_by_step`` per step, aligned
      with ``steps``; ``last_to_arrive``: per step, the rank that arrived last where the spread is over
      ``straggler_s``, else None; ``stalls``: the stall events (a straggler's, from any rank).

    The shares add up to the wall time without counting anything twice: the waiting happens inside rank 0's step
    (between its ``t0`` and ``t1``: it waits in the all_reduce, or it is the one the other ranks wait for), so it
    is taken out of that step's productive time: ``productive_s`` is the final trajectory's step time minus
    ``waiting_s``, and ``productive_s + waiting_s`` is what ``productive_s`` was before waiting was counted. A
    step's wait is capped at rank 0's whole step (the ranks start a step a few milliseconds apart, so a spread can
    stick out of it by as much), so no step's productive time goes below zero.
    """
    mine = [e for e in events if e["rank"] == 0]
    attempts = sorted({e["attempt"] for e in events})
    steps = {a: [e for e in mine if e["event"] == "step" and e["attempt"] == a] for a in attempts}
    final: dict[int, dict] = {}
    for a in attempts:
        for e in steps[a]:
            final[e["step"]] = e  # a later attempt's step replaces the one it redid
    # (step, attempt) -> rank -> arrival at the gradient all_reduce; each step is read from the attempt that made it
    # (a redone step's first try, and the ranks of a world that shrank since, are not its)
    arrivals: dict[tuple[int, int], dict[int, float]] = {}
    for e in events:
        if e["event"] == "step" and "arrive" in e:
            arrivals.setdefault((e["step"], e["attempt"]), {})[e["rank"]] = e["arrive"]
    waits, last = [], []
    for s in sorted(final):
        seen = arrivals.get((s, final[s]["attempt"]), {})
        spread = max(seen.values()) - min(seen.values()) if len(seen) > 1 else 0.0
        waits.append(min(spread, final[s]["t1"] - final[s]["t0"]))
        last.append(max(seen, key=seen.get) if spread > straggler_s else None)
    out = {"attempts": len(attempts),
           "productive_s": sum(e["t1"] - e["t0"] for e in final.values()) - sum(waits),
           "waiting_s": sum(waits), "wait_by_step": waits, "last_to_arrive": last,
           "stalls": [e for e in events if e["event"] == "stall"],
           "lost_s": 0.0, "detect_s": 0.0, "restart_s": 0.0, "reload_s": 0.0,
           "checkpoint_s": sum(e["t1"] - e["t0"] for e in mine if e["event"] == "checkpoint"),
           "lost_steps": [], "faults": [], "failures": [], "resumed_from": [], "skipped": []}
    for a, nxt in zip(attempts, attempts[1:]):
        faults = [e for e in events if e["event"] == "fault" and e["attempt"] == a]
        failures = [e for e in events if e["event"] == "failure" and e["attempt"] == a]
        reload = [e for e in mine if e["event"] == "reload" and e["attempt"] == nxt]
        start = [e for e in mine if e["event"] == "start" and e["attempt"] == nxt]
        resumed = reload[0]["step"] if reload else 0
        redone = [e for e in steps[a] if e["step"] > resumed]
        out["lost_steps"] += [e["step"] for e in redone]
        out["resumed_from"].append(resumed)
        out["skipped"].append(reload[0].get("skipped", []) if reload else [])  # torn saves the reload passed over
        out["faults"] += faults
        out["failures"] += failures
        fault_t = min((e["t"] for e in faults), default=None)
        seen_t = min((e["t"] for e in failures), default=fault_t)
        last_done = max([e["t1"] for e in mine if e["attempt"] == a and "t1" in e], default=None)
        if fault_t is not None and last_done is not None:
            out["lost_s"] += max(fault_t - last_done, 0.0)  # the step in flight, up to the fault
        out["lost_s"] += sum(e["t1"] - e["t0"] for e in redone)
        if fault_t is not None and seen_t is not None:
            out["detect_s"] += max(seen_t - fault_t, 0.0)
        resume_t = reload[0]["t0"] if reload else (start[0]["t"] if start else None)
        if seen_t is not None and resume_t is not None:
            out["restart_s"] += resume_t - seen_t
        out["reload_s"] += sum(e["t1"] - e["t0"] for e in reload)
    out["steps"] = sorted(final)
    # what each step of the final trajectory read: the rows of every rank of the attempt that made it (the data order
    # is global, so a restart in a smaller world reads the same global batch split over fewer ranks)
    rows: dict[tuple[int, int], list[int]] = {}
    for e in events:
        if e["event"] == "step" and "rows" in e:
            rows.setdefault((e["step"], e["attempt"]), []).extend(e["rows"])
    out["rows"] = [sorted(rows.get((s, final[s]["attempt"]), [])) for s in out["steps"]]
    out["world_sizes"] = [e.get("world_size") for e in mine if e["event"] == "start"]  # one per attempt
    out["losses"] = [final[s]["loss"] for s in out["steps"]]
    out["step_attempts"] = [final[s]["attempt"] for s in out["steps"]]
    out["step_s"] = [final[s]["t1"] - final[s]["t0"] for s in out["steps"]]
    return out
