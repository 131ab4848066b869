"""Activation memory counted from the tensors themselves (chapter 11): ``SavedActivations`` watches what autograd
saves for backward and says how many distinct bytes of it are still alive. ``workers/ch11_memory.py`` reads it
at the four moments of a step; the tests check its counting on hand-made views.
"""
from __future__ import annotations

import weakref

import torch


def _footprint(t: torch.Tensor) -> tuple:
    """What ``t`` occupies: ("span", start, stop) in bytes when its elements fill [data_ptr, data_ptr + numel *
    element_size) exactly (contiguous, or a permutation of contiguous: such tensors that start at the same address
    with the same size are the same memory, whatever their shapes); otherwise ("own", ptr, shape, stride, bytes),
    a strided view counted for its own elements (q, k and v interleaved in the fused QKV output; the batch's
    token ids without the last column)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return ("own", t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.numel() * t.element_size())
        expected *= sz
    return ("span", t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


class SavedActivations:
    """The tensors autograd saves for backward while ``hooks()`` is active, parameters excluded, tracked by weak
    reference: ``alive_bytes()`` counts those still alive *now*, so it falls to zero only when backward (or the
    end of the graph) has really released them."""

    def __init__(self, exclude_ptrs: set[int]):
        self.exclude = exclude_ptrs  # storages of the flat parameter buffers (weights are not activations)
        self.saved: list[tuple[weakref.ref, tuple]] = []

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() not in self.exclude:
            self.saved.append((weakref.ref(t), _footprint(t)))
        return t  # the graph keeps the tensor itself: we only watch it

    def alive(self) -> list[tuple]:
        return [footprint for ref, footprint in self.saved if ref() is not None]

    def alive_bytes(self) -> int:
        """Distinct bytes of the saved tensors alive now: overlapping spans merged, strided views counted once each."""
        spans = sorted((a, b) for kind, a, b, *_ in self.alive() if kind == "span")
        total, end = 0, None
        for a, b in spans:
            if end is None or a >= end:
                total += b - a
                end = b
            elif b > end:
                total += b - end
                end = b
        total += sum(f[4] for f in set(f for f in self.alive() if f[0] == "own"))
        return total

    def alive_count(self) -> int:
        return len(self.alive())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
