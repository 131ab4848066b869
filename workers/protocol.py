"""The one results protocol between ranks and the notebook.

Every rank keeps one TCP connection to the notebook's collector (address in ``COURSE_RESULTS_ADDR``).
Both directions carry *frames*: an 8-byte big-endian length, then a ``torch.save``'d dict

    {"kind": str, "rank": int, "task": int | None, "time": float, "data": ...}

Kinds, rank -> notebook:
    hello      data = {rank, local_rank, world_size, local_world_size, backend, device, pid, host, why}
    metric     data = {"step": int, **scalars}          a stream, drawn live as progress
    log        data = {"text": str}
    result     data = {name: tensor | number | str | list | dict}   merged into the rank's results
    error      data = {"type", "message", "traceback"}   the rank's own traceback, shown in the notebook
    loaded     data = {"seconds": float}                 the worker is imported; the run's timeout starts
    task_done  data = {"seconds": float}                 one per task and rank
    ready      data = {backend, device, why, local_world_size, node_rank, torch}   joined the process group
    stacks     data = {"stack": [[file, line, function, code], ...]}   answer to dump_stacks
Kinds, notebook -> rank:
    task         data = {"id", "worker", "params", "seed"}
    dump_stacks  data = {}      where is your main thread? (used on a timeout to name the stuck collective)
    shutdown     data = {}

Payloads are loaded with ``weights_only=True``: only tensors and plain Python values cross the wire,
so nothing a rank sends can run code in the notebook. Tensors are moved to the CPU before sending.
"""
from __future__ import annotations

import io
import socket
import struct
import time
from typing import Any

import torch

HEADER = struct.Struct(">Q")
MAX_FRAME_BYTES = 1 << 31  # 2 GiB: a bigger frame means a bug (or a tensor that should stay on the rank)

RANK_KINDS = ("hello", "ready", "loaded", "metric", "log", "result", "error", "task_done", "stacks")
NOTEBOOK_KINDS = ("task", "dump_stacks", "shutdown")


class ConnectionClosed(ConnectionError):
    """The other end closed the connection (cleanly or because its process died)."""


def to_wire(value: Any) -> Any:
    """Detach tensors onto the CPU, recursively, so a frame never references GPU memory or autograd."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {str(k): to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if value is None or type(value) in (int, float, str, bool):
        return value
    for plain in (bool, int, float, str):  # subclasses (TorchVersion, IntEnum...) become plain values
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise TypeError(
        f"cannot send a {type(value).__name__} to the notebook; send tensors, numbers, strings, lists or dicts"
    )


def encode(kind: str, data: Any, *, rank: int | None = None, task: int | None = None) -> bytes:
    """One frame: a header with the payload's length, then ``{kind, rank, task, time, data}``. ``kind`` is one of
    ``RANK_KINDS`` (rank to notebook) or ``NOTEBOOK_KINDS`` (notebook to rank): a misspelt kind fails here, at
    the sender, instead of being dropped by a receiver that does not know it."""
    if kind not in RANK_KINDS + NOTEBOOK_KINDS:
        raise ValueError(f"unknown frame kind {kind!r}: the protocol has {', '.join(RANK_KINDS + NOTEBOOK_KINDS)}")
    buf = io.BytesIO()
    torch.save({"kind": kind, "rank": rank, "task": task, "time": time.time(), "data": to_wire(data)}, buf)
    payload = buf.getvalue()
    return HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> dict:
    return torch.load(io.BytesIO(payload), weights_only=True)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionClosed("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict:
    (length,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes is larger than the protocol allows")
    return decode(_recv_exactly(sock, length))


def send_frame(sock: socket.socket, kind: str, data: Any, *, rank: int | None = None, task: int | None = None) -> None:
    sock.sendall(encode(kind, data, rank=rank, task=task))


def parse_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "127.0.0.1", int(port)
