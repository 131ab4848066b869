"""How saves die, on purpose: a process killed after N bytes, and the naive writer it is compared with.

``KillAfterBytes`` wraps the files one save writes; once ``limit`` bytes have gone through it (counted over
all the files of the save), it flushes exactly those bytes to the kernel and SIGKILLs its own process: no
``finally``, no ``atexit``, no flush of anything else, as when the OOM killer or a preemption takes a node.
The bytes written stay in the file (the kernel has them), so the damage left behind is exactly what a real
kill at that byte leaves. ``after_file`` kills instead right after the named file is complete.

``naive_save_dir`` is what most training scripts do: ``torch.save`` straight to the final names, one file
after the other. Killed inside a file, it leaves a truncated file that fails to load; killed between two
files of a checkpoint saved over an older one in place, it leaves a directory where every file loads and
the model is from one step, the optimizer from another.

``writes_fail_beyond`` is the gentler fault the exercise checker uses inside a live rank: every write past N
bytes fails (a full disk), so a save dies midway without taking the process with it; ``watch_file_ops``
records what a save did (renames, removals, fsyncs, copies) so the checker can say which rule it broke.
"""
from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal

import torch


class KillAfterBytes:
    def __init__(self, limit: int = -1, after_file: str = "", how: str = "sigkill"):
        if how not in ("sigkill", "exit"):
            raise ValueError(f"how={how!r}: choose 'sigkill' (a kill from outside) or 'exit' (os._exit)")
        self.limit, self.after_file, self.how = limit, after_file, how
        self.written = 0

    def wrap(self, f, name: str = "") -> "_CountingFile":
        return _CountingFile(f, self)

    def done(self, name: str) -> None:
        """Called by the writers when file ``name`` is complete (closed, or renamed onto its final name)."""
        if self.after_file and name == self.after_file:
            self.die()

    def die(self) -> None:
        if self.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # 128 + 9, what a shell reports for a SIGKILL


class _CountingFile:
    """The file-like object ``torch.save`` writes into (it needs ``write`` and ``flush``)."""

    def __init__(self, f, budget: KillAfterBytes):
        self.f, self.budget = f, budget

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        room = self.budget.limit - self.budget.written
        if self.budget.limit >= 0 and room < len(data):
            self.f.write(data[:room])
            self.f.flush()  # these bytes reach the kernel, so they survive the kill
            self.budget.die()
        self.f.write(data)
        self.budget.written += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def naive_save_dir(ckpt_dir: str, files: dict, fault: KillAfterBytes | None = None) -> None:
    """``torch.save`` each ``name -> object`` straight to ``ckpt_dir/name``: the write a crash can tear."""
    os.makedirs(ckpt_dir, exist_ok=True)
    for name, obj in files.items():
        with open(os.path.join(ckpt_dir, name), "wb") as f:  # O_TRUNC: the old file is gone from this moment
            torch.save(obj, fault.wrap(f, name) if fault is not None else f)
        if fault is not None:
            fault.done(name)


@contextlib.contextmanager
def writes_fail_beyond(limit: int):
    """Within the block, no file of this process can grow past ``limit`` bytes: the write that would raises
    OSError(EFBIG), as on a full disk. (RLIMIT_FSIZE; its signal, SIGXFSZ, is ignored so the process lives.)"""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@contextlib.contextmanager
def watch_file_ops(path: str):
    """Record the renames, removals, fsyncs and copies made within the block: ``(abspath(path), events)``, each
    event ``(name, [paths])``. The calls pass through unchanged; the exercise checker reads what a save did."""
    target, events = os.path.abspath(path), []
    names = [(m, n) for m, n in [(os, "replace"), (os, "rename"), (os, "remove"), (os, "unlink"), (os, "fsync"),
                                 (os, "fdatasync"), (os, "sync"), (shutil, "copyfile")] if hasattr(m, n)]
    originals = {(m, n): getattr(m, n) for m, n in names}

    def spy(module, name):
        real = originals[(module, name)]

        def call(*args, **kwargs):
            paths = [os.path.abspath(os.fspath(a)) for a in args[:2] if isinstance(a, (str, os.PathLike))]
            events.append((name, paths))
            return real(*args, **kwargs)
        return call

    for m, n in names:
        setattr(m, n, spy(m, n))
    try:
        yield target, events
    finally:
        for (m, n), real in originals.items():
            setattr(m, n, real)
