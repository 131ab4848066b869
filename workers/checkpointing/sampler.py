"""A shuffling data order with a position: the part of "where training is" that lives in the data loader.

Epoch ``e`` reads the rows in the order ``torch.randperm(n_samples)`` drawn from a generator seeded with
``seed + e`` (what ``DistributedSampler(shuffle=True, seed=seed)`` with ``set_epoch(e)`` does), ``global_batch``
rows per step, and rank ``r`` keeps its ``global_batch / world_size`` consecutive rows of each global batch.

The order depends only on (seed, epoch, position), never on the global RNG, so dropout or augmentation cannot
shift it, and saving two integers (epoch, position) is enough to resume it. ``DistributedSampler`` itself keeps
no position: a job resumed mid-epoch with it re-reads the epoch from the start unless it skips batches itself.
"""
from __future__ import annotations

import torch
from workers.runtime import batch_over_world


class ShuffledSampler:
    def __init__(self, n_samples: int, global_batch: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        if why := batch_over_world(global_batch, world_size):
            raise ValueError(why)
        if n_samples < global_batch:
            raise ValueError(f"n_samples={n_samples} is smaller than one global batch of {global_batch}")
        self.n_samples, self.global_batch, self.seed = n_samples, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.position = 0  # global batches already read in this epoch
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.global_batch  # drop_last: every step reads a full global batch

    def _epoch_order(self) -> torch.Tensor:
        if self._order_epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            self._order, self._order_epoch = torch.randperm(self.n_samples, generator=g), self.epoch  # [n_samples]
        return self._order

    def next_indices(self) -> torch.Tensor:
        """This rank's rows of the next global batch, then advance (into the next epoch when this one is read)."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.global_batch
        batch = self._epoch_order()[start:start + self.global_batch]  # [B]
        per_rank = self.global_batch // self.world_size
        self.position += 1
        return batch[self.rank * per_rank:(self.rank + 1) * per_rank].clone()  # [B / world_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_samples": self.n_samples, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "n_samples", "global_batch"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the saved sampler has {key}={state[key]}, this one {getattr(self, key)}: "
                                 "a different data order cannot resume where the saved one stopped")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __repr__(self) -> str:
        return f"ShuffledSampler(epoch={self.epoch}, position={self.position}/{self.steps_per_epoch}, seed={self.seed})"
