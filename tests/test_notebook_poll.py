"""The executor's kernel channels wait in slices (course_utils.notebooks.poll_in_slices): a reply that one long poll
would miss until its timeout (jupyter/nbclient#312) is found within a slice, and a real timeout still raises Empty."""
import asyncio
import time
from queue import Empty

import pytest

from course_utils.notebooks import poll_in_slices


class Channel:
    """A channel whose poll misses a pending message: a call waits its whole timeout, then finds nothing, until the
    message is taken by a new call made after ``ready_at``."""

    def __init__(self, ready_at: float | None):
        self.ready_at, self.calls = ready_at, []

    async def get_msg(self, timeout=None):
        self.calls.append(timeout)
        if self.ready_at is not None and time.monotonic() >= self.ready_at:
            return {"msg": "reply"}
        await asyncio.sleep(timeout)
        raise Empty


def sliced(ready_in: float | None):
    cls = type("Sliced", (Channel,), {"get_msg": Channel.get_msg})
    poll_in_slices(cls, slice_s=0.05)
    return cls(None if ready_in is None else time.monotonic() + ready_in)


def test_a_reply_missed_by_one_poll_is_found_within_a_slice_not_at_the_timeout():
    channel = sliced(ready_in=0.12)
    t0 = time.monotonic()
    assert asyncio.run(channel.get_msg(timeout=30)) == {"msg": "reply"}
    assert time.monotonic() - t0 < 5  # one long poll would have waited 30 s
    assert len(channel.calls) >= 3 and max(channel.calls) <= 0.05


def test_a_real_timeout_still_raises_and_no_timeout_waits_on():
    channel = sliced(ready_in=None)
    with pytest.raises(Empty):
        asyncio.run(channel.get_msg(timeout=0.2))
    assert asyncio.run(sliced(ready_in=0.1).get_msg(timeout=None)) == {"msg": "reply"}


def test_patching_twice_keeps_one_layer():
    cls = type("Twice", (Channel,), {"get_msg": Channel.get_msg})
    poll_in_slices(cls, slice_s=0.05)
    once = cls.get_msg
    poll_in_slices(cls, slice_s=0.05)
    assert cls.get_msg is once
