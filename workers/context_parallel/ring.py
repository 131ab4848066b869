"""The ring's links: every rank sends to rank + 1 and receives from rank - 1, all at once.

One exchange is an ``isend`` to the next rank and an ``irecv`` from the previous one, posted together and
waited on later, so the caller computes on the chunk it holds while the next one is on the wire (the
overlap that hides ring attention's communication when a block's compute takes longer than its transfer).
Both calls are non-blocking, so no ordering of sends and receives around the ring can deadlock.

Gloo has no CUDA send/recv: on a one-GPU machine the bytes go through host memory (``comm_device``, as in
``workers/pipeline/p2p.py``). ``members`` are the ring's global ranks in ring order (a ``cp`` slice of the rank
grid, ``workers/layout/grid.py``), so a world of 4 can hold two rings of 2 (or four of 1) side by side.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

KV_TAG, GRAD_TAG = 0, 1  # two streams on one link in backward: K/V (posted early) and dK/dV (after compute)


class Exchange:
    """One posted send + receive; ``wait()`` returns what arrived from the previous rank, on ``device``."""

    def __init__(self, works, send_buf: torch.Tensor, recv_buf: torch.Tensor, device: torch.device, ring=None):
        self._works, self._send_buf, self._recv_buf, self._device, self._ring = works, send_buf, recv_buf, device, ring

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for work in self._works:
            work.wait()
        if self._ring is not None:  # what the transfer cost beyond the compute it overlapped
            self._ring.wait_s += time.perf_counter() - start
        self._send_buf = None  # the send buffer had to live until its send completed
        return self._recv_buf.to(self._device)


class Ring:
    """Links of position ``index`` in the ring of global ranks ``members``."""

    def __init__(self, index: int, members: list[int], device: torch.device, comm_device: torch.device):
        self.index, self.cp = index, len(members)
        self.next_rank = members[(index + 1) % self.cp]  # K/V (and dK/dV) go forward around the ring ...
        self.prev_rank = members[(index - 1) % self.cp]  # ... and arrive from behind
        self.device, self.comm_device = device, comm_device
        self.sent_bytes = {"forward": 0, "backward": 0}
        self.messages = {"forward": 0, "backward": 0}
        self.score_entries = 0  # (query, key) scores computed in forward (``attention.RingAttention`` counts them)
        self.wait_s = 0.0  # seconds spent waiting for transfers to finish

    def exchange(self, tensor: torch.Tensor, phase: str, tag: int = KV_TAG) -> Exchange:
        """Post: send ``tensor`` to the next rank, receive one of the same shape from the previous rank."""
        send_buf = tensor.detach().to(self.comm_device).contiguous()  # data only: autograd never crosses a rank
        recv_buf = torch.empty_like(send_buf)
        works = [dist.isend(send_buf, dst=self.next_rank, tag=tag), dist.irecv(recv_buf, src=self.prev_rank, tag=tag)]
        self.sent_bytes[phase] += send_buf.numel() * send_buf.element_size()
        self.messages[phase] += 1
        return Exchange(works, send_buf, recv_buf, self.device, self)
