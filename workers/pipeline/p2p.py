"""Point-to-point messages between consecutive stages (Megatron's ``p2p_communication.py`` names).

What crosses a stage boundary is one activation per micro-batch forward, ``[micro_batch, hidden]``, and its
gradient, the same shape, backward: nothing else (the weights never move, unlike data or tensor parallelism).

Sends are ``isend``: the sender goes on computing and waits for its sends only at the end of the step
(``P2P.finish``), so the only blocking calls are receives, and a schedule that runs in ``schedules.simulate``
cannot deadlock here. (Gloo may hold a send until the receiver posts its receive, so waiting on each send at
once would serialise the stages.) Receives land in a tensor on ``comm_device``: gloo has no CUDA send/recv,
so on a one-GPU machine the bytes travel through host memory (``runtime.comm_device``).

Receives are posted before the step (``post_receives``), waited for where the schedule needs them. A message sent
before its receive is posted cannot land until it is (gloo's receiver announces its buffer, then the data crosses),
and meanwhile the ranks' transport threads (``gloo_tcp_loop``) were measured polling without sleeping: 3.5 million
``epoll_wait`` calls in 2 s on one rank, a core's worth. When ranks outnumber cores that is worse than a lost core:
the rank that must post the receive waits for a scheduler time slice. Measured on 2 cores, two pairs of ranks
exchanging [4, 16] floats: a round trip took 0.15 ms or 4 ms, run to run, with the receive posted after the send;
0.15-0.2 ms, and a tenth of the CPU time, with it posted first. (Megatron, too, posts the next receive before it
computes, so that the message lands during the compute.)

A link's two directions travel on two process groups (``links``: the mesh's ``pp_up`` and ``pp_down``, made by the
worker on gloo). Gloo keeps one lock per pair of ranks in a group, and its transport thread only *tries* that lock
when a message arrives: while the rank's own thread holds it, sending on the same pair, the transport thread gives
up, and ``epoll_wait`` hands it the same message at once, again and again, until the lock is free. A rank whose
core was taken from it in the middle of a send holds the lock for a scheduler slice, and its transport thread spends
that slice polling. GPipe's messages cross a link one way at a time; 1F1B's and an interleaved schedule's cross it
both ways at once. Measured on 2 cores, two pipelines of two stages, m = 8 (chapter 13's MLP, unpadded), all four
ranks together: on one group, ``epoll_wait`` ran 3,400 times a step under GPipe, 19,900 under 1F1B and 32,500
interleaved, and the transport threads' CPU per message end was 73, 275 and 172 us; with a group per direction,
3,100, 3,800 and 4,400 calls and 45, 30 and 9 us. This is gloo's transport: on NCCL the workers keep the one group.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

FORWARD_TAG, BACKWARD_TAG = 0, 1  # two directions on one link: activations go up, gradients come down
DIRECTIONS = ("forward", "backward")  # what a message carries: an activation, or its gradient
GROUPS = ("up", "down", "default")  # what it travels on: the group of messages to a higher rank, to a lower, or one


def route(links, src: int, dst: int) -> str:
    """Which group a message from rank ``src`` to rank ``dst`` travels on: with ``links`` = (up, down), "up" to a
    higher rank and "down" to a lower one, so that a rank never receives on a pair it sends on; "default" without."""
    return "default" if links is None else "up" if src < dst else "down"


def link_group(links, src: int, dst: int):
    """The process group of ``route(links, src, dst)`` (None: torch's default group)."""
    name = route(links, src, dst)
    return None if name == "default" else links[GROUPS.index(name)]


def tag(direction_tag: int, key: int) -> int:
    """One tag per (direction, message): with model chunks a link carries several micro-batches' messages
    in flight (rank p-1 also sends to rank 0, round the ring), and the tag says which is which."""
    return 2 * key + direction_tag


class P2P:
    """This rank's links: ``prev_rank`` (None on the first stage) and ``next_rank`` (None on the last); with
    model chunks they wrap round (rank 0's previous is rank p-1). ``key`` names the message on its link (the
    executor passes the boundary's lower virtual stage * m + micro, the same number on both sides; 0 is fine
    where messages on a link arrive in the order they are sent)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, shape: tuple, device: torch.device,
                 comm_device: torch.device, dtype=torch.float32, links: tuple | None = None):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.links = links  # (group of messages to a higher rank, group of those to a lower), or the default group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.shape, self.device, self.comm_device, self.dtype = tuple(shape), device, comm_device, dtype
        self.pending: list = []  # (work, tensor): a send's buffer must live until the send completes
        self.sent_bytes = dict.fromkeys(DIRECTIONS, 0)
        self.messages = dict.fromkeys(DIRECTIONS, 0)
        self.received = dict.fromkeys(DIRECTIONS, 0)
        self.posted_ahead = dict.fromkeys(DIRECTIONS, 0)  # of those received, how many were posted before the step
        self.sent_on = dict.fromkeys(GROUPS, 0)  # messages sent on each group
        self.wait_s = 0.0  # seconds blocked in receives
        self.posted: dict[tuple[int, int], tuple] = {}  # (src, tag) -> (work, buffer): receives posted ahead

    def _where(self, kind: str, key: int) -> tuple[int, int]:
        """(source rank, tag) of a receive: ``recv_forward`` from the previous stage, ``recv_backward`` the next."""
        if kind == "recv_forward":
            return self.prev_rank, tag(FORWARD_TAG, key)
        if kind == "recv_backward":
            return self.next_rank, tag(BACKWARD_TAG, key)
        raise ValueError(f"{kind!r} is not a receive (recv_forward or recv_backward)")

    def post_receives(self, receives) -> None:
        """Post ``receives``, ``[(kind, key)]``, now, before their messages can arrive (see the module's text):
        the executor posts a step's receives before the barrier every rank leaves together, so no message of the
        step finds its receive missing. ``recv_forward`` / ``recv_backward`` with the same key then wait for it."""
        for kind, key in receives:
            src, t = self._where(kind, key)
            if (src, t) in self.posted:
                raise ValueError(f"{kind} key {key} posted twice: each message on a link needs its own key")
            buf = torch.empty(self.shape, device=self.comm_device, dtype=self.dtype)  # [micro_batch, hidden]
            self.posted[(src, t)] = (dist.irecv(buf, src=src, tag=t, group=link_group(self.links, src, self.rank)), buf)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, direction: str) -> None:
        buf = tensor.detach().to(self.comm_device, self.dtype).contiguous()  # data only: autograd stops here
        self.pending.append((dist.isend(buf, dst=dst, tag=tag, group=link_group(self.links, self.rank, dst)), buf))
        self.sent_bytes[direction] += buf.numel() * buf.element_size()
        self.sent_on[route(self.links, self.rank, dst)] += 1
        self.messages[direction] += 1

    def _recv(self, src: int, tag: int, direction: str) -> torch.Tensor:
        work, buf = self.posted.pop((src, tag), (None, None))
        self.received[direction] += 1
        if work is None:  # not posted ahead: post it now
            buf = torch.empty(self.shape, device=self.comm_device, dtype=self.dtype)  # [micro_batch, hidden]
            work = dist.irecv(buf, src=src, tag=tag, group=link_group(self.links, src, self.rank))
        else:
            self.posted_ahead[direction] += 1
        start = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - start  # blocked: the message's latency, or the bubble
        return buf.to(self.device)

    def send_forward(self, output: torch.Tensor, key: int = 0) -> None:
        self._send(output, self.next_rank, tag(FORWARD_TAG, key), "forward")  # [micro_batch, hidden] to stage + 1

    def recv_forward(self, key: int = 0) -> torch.Tensor:
        """The previous stage's output, as a leaf that requires grad: its .grad is what we send back."""
        return self._recv(*self._where("recv_forward", key), "forward").requires_grad_()  # [micro_batch, hidden]

    def send_backward(self, input_grad: torch.Tensor, key: int = 0) -> None:
        self._send(input_grad, self.prev_rank, tag(BACKWARD_TAG, key), "backward")  # [micro_batch, hidden] to stage - 1

    def recv_backward(self, key: int = 0) -> torch.Tensor:
        return self._recv(*self._where("recv_backward", key), "backward")  # d loss / d output, [micro_batch, hidden]

    def finish(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []
        if self.posted:  # a receive posted for a message the schedule never waited for: the two disagree
            raise RuntimeError(f"receives posted but never waited for (source rank, tag): {sorted(self.posted)}")

    def stats(self) -> dict:
        return {"sent_bytes": dict(self.sent_bytes), "messages": dict(self.messages), "received": dict(self.received),
                "posted_ahead": dict(self.posted_ahead), "sent_on": dict(self.sent_on)}
