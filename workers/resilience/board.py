"""Which collective each rank is in, written where every rank can read it: the job's TCP store.

gloo's own timeout names neither the collective nor the missing rank ("Timed out waiting 3000ms for recv operation
to complete"), and after it the group is broken ("Application timeout caused pair closure"), so it cannot be asked.
Before each collective a rank posts ``[step, collective]`` under its rank in the store torchrun's agent keeps
(``MASTER_ADDR:MASTER_PORT``, outside the broken group); when a collective fails, the rank reads every rank's post:
a rank whose post is another collective never called this one. It is NCCL's flight recorder in miniature (which
records every collective per rank and is read after a timeout). The posts are keyed by torchrun's run id and the
attempt, so a restarted attempt never reads an older attempt's posts.

    board = Board(rank, world, run, attempt)
    board.enter(step, "gradient all_reduce")
    with board.naming():                       # a failure inside is raised again as CollectiveFailed, naming who
        loss.backward()
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import time

import torch.distributed as dist


class CollectiveFailed(RuntimeError):
    """A collective failed (timed out, or a peer vanished); the message names it and the ranks that never called it."""

    def __init__(self, message: str, step: int, collective: str, missing: list[int]):
        super().__init__(message)
        self.step, self.collective, self.missing = step, collective, missing


class Board:
    def __init__(self, rank: int, world_size: int, run: str, attempt: int, timeout_s: float = 10.0):
        self.rank, self.world_size = rank, world_size
        self.prefix = f"course/board/{run}/{attempt}/"
        # A client of the store the job already has (torchrun's agent hosts it; a world of one started by
        # `python worker.py` hosts it in rank 0): no port of our own.
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.here = (0, "")

    def enter(self, step: int, collective: str) -> None:
        self.here = (step, collective)
        self.store.set(f"{self.prefix}{self.rank}", json.dumps([step, collective]))

    def posts(self) -> dict[int, tuple[int, str] | None]:
        """Every rank's last post (None: it never posted in this attempt)."""
        out = {}
        for r in range(self.world_size):
            key = f"{self.prefix}{r}"
            out[r] = tuple(json.loads(self.store.get(key))) if self.store.check([key]) else None
        return out

    def explain(self, exc: BaseException, waited_s: float) -> CollectiveFailed:
        step, collective = self.here
        posts = self.posts()
        missing = [r for r, p in posts.items() if r != self.rank and p != (step, collective)]
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = "; ".join(f"rank {r} never called it (its last collective: "
                          + (f"{posts[r][1]} of step {posts[r][0]})" if posts[r] else "none: it never started)")
                          for r in missing)
        who = where or "every rank had called it, so no rank is missing (a peer that died inside it, or an error of its own)"
        # the diagnosis first, gloo's own words last: a summary that cuts the message keeps what matters
        return CollectiveFailed(f"step {step}: the {collective} failed on rank {self.rank} after {waited_s:.1f} s: "
                                f"{who}; gloo said: {cause}", step, collective, missing)

    @contextlib.contextmanager
    def naming(self):
        t0 = time.monotonic()
        try:
            yield
        except RuntimeError as exc:  # gloo raises RuntimeError (DistBackendError is one) for timeouts and lost peers
            raise self.explain(exc, time.monotonic() - t0) from exc
