"""What a run gives back to the notebook, and the ways a run can fail."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class CourseError(Exception):
    """Base class: everything the launcher raises on purpose."""


class InvalidParameter(CourseError, ValueError):
    """Rejected before anything was launched; the message says what to change."""


class WorkerFailed(CourseError, RuntimeError):
    """A rank raised or died. ``rank``, ``error_type`` and ``rank_traceback`` say where and why; ``startup`` is True
    when the ranks never got ready (torchrun, ``import torch`` or the rendezvous), before any task ran."""

    def __init__(self, summary: str, *, rank: int | None = None, error_type: str = "", rank_traceback: str = "",
                 errors: dict[int, dict] | None = None, logs: list[str] | None = None, startup: bool = False):
        self.summary = summary
        self.startup = startup  # the ranks never became ready: nothing of the task (or a learner's answer) ran
        self.rank = rank
        self.error_type = error_type
        self.rank_traceback = rank_traceback
        self.errors = errors or {}
        self.logs = logs or []
        text = summary
        if rank_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{rank_traceback.rstrip()}"
        super().__init__(text)

    @property
    def lost_connection_making_groups(self) -> bool:
        """Every rank that raised lost a TCP connection (gloo's or the store's) while torch was making a process
        group, and none died: the machine's sockets failed, not the worker's code. Gloo does this rarely on a loaded
        machine (pytorch/pytorch#11364: "Broken pipe" from ``new_group``); ``run`` retries such a run once."""
        if self.startup or not self.errors or isinstance(self, JobTimeout) or "died without" in self.summary:
            return False
        return all(err.get("type") == "DistNetworkError" and "_new_process_group_helper" in err.get("traceback", "")
                   for err in self.errors.values())


class JobTimeout(WorkerFailed, TimeoutError):
    """The job ran past its timeout; ``stuck`` maps rank -> where that rank was waiting."""

    def __init__(self, summary: str, *, stuck: dict[int, str] | None = None, **kw):
        self.stuck = stuck or {}
        super().__init__(summary, **kw)


class JobCancelled(CourseError):
    """Cancelled by the learner (cancel button, ``job.cancel()`` or a kernel interrupt)."""


def merge_result(into: dict, values: dict) -> None:
    """Later ``ctx.result`` calls add keys; timings accumulate as lists (one entry per measurement)."""
    for key, value in values.items():
        if key == "timings":
            timings = into.setdefault("timings", {})
            for name, seconds in value.items():
                timings.setdefault(name, []).append(seconds)
        else:
            into[key] = value


@dataclass
class RunResult:
    """All ranks' results of one run. ``result[r]`` is rank r's dict; ``result.gather(key)`` lists a key by rank."""

    worker: str
    world_size: int
    backend: str
    devices: list[str]
    placement: str
    ranks: list[dict]
    metrics: list[list[dict]]
    logs: list[str]
    seconds: float  # from sending the task to the last rank finishing: the measurement of this run
    launch: str  # "cold" (new ranks were started for it) or "warm" (ranks reused; the run itself is new)
    startup_seconds: float = 0.0  # only for cold runs: torchrun start, imports, rendezvous
    rank_seconds: list[float] = field(default_factory=list)
    retried: str = ""  # why the run was repeated once on fresh ranks (WorkerFailed.lost_connection_making_groups)

    def __getitem__(self, rank: int) -> dict:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def gather(self, key: str) -> list[Any]:
        missing = [r for r, d in enumerate(self.ranks) if key not in d]
        if missing:
            raise KeyError(f"rank(s) {missing} sent no result named {key!r}; they sent {sorted(self.ranks[missing[0]])}")
        return [d[key] for d in self.ranks]

    def timings(self, name: str) -> list[list[float]]:
        return [d.get("timings", {}).get(name, []) for d in self.ranks]

    def describe(self) -> str:
        how = (f"cold start ({self.startup_seconds:.1f} s to start ranks)" if self.launch == "cold"
               else "warm ranks (reused processes; the run itself is new)")
        return (f"{self.worker}: world {self.world_size}, {self.backend} on {', '.join(sorted(set(self.devices)))}; "
                f"ran in {self.seconds * 1e3:.0f} ms; {how}"
                + (f"; repeated once on fresh ranks after {self.retried}" if self.retried else ""))

    def __repr__(self) -> str:
        return f"<RunResult {self.describe()}>"
