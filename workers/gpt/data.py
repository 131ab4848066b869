"""A synthetic corpus with structure a tiny GPT can learn in a hundred steps: a seeded Markov chain.

Token t+1 depends on token t through a fixed table in which every token has a few likely successors, so
the loss falls from log V (uniform guessing) towards the chain's entropy rate within a hundred steps on
one CPU core. Everything is generated in code from a seed; nothing is downloaded.

Samples are addressed by id: ``dataset.tokens[i]`` is sample i, the same on every rank and in every run.
A loader hands out the ids of each global batch in order and can be told to skip ids: that is what the
rewind-and-skip recovery needs (the bad ids never come back, everything else keeps its order).
"""
from __future__ import annotations

import torch

SUCCESSORS = 3  # likely next tokens per context
BLOCK = 1024  # samples generated per generator


def transition_table(vocab: int, seed: int) -> torch.Tensor:
    """P(next | current) as a [V, V] tensor: mass 0.9 on SUCCESSORS tokens per row, 0.1 spread evenly."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 0.1 / vocab)
    favourites = torch.rand(vocab, vocab, generator=g).argsort(dim=-1)[:, :SUCCESSORS]  # [V, k]
    weights = torch.softmax(torch.randn(vocab, SUCCESSORS, generator=g), dim=-1) * 0.9  # [V, k]
    probs.scatter_add_(-1, favourites, weights)
    return probs  # every row sums to 1


def entropy_rate(table: torch.Tensor) -> float:
    """The loss floor: the chain's next-token entropy, rows weighted by the chain's stationary distribution."""
    pi = torch.full((table.shape[0],), 1.0 / table.shape[0], dtype=torch.float64)
    for _ in range(200):  # power iteration: the chain mixes in a few steps (every row has 0.1 spread evenly)
        pi = pi @ table.double()
    return float(-(pi[:, None] * table * table.log()).sum())


class MarkovDataset:
    """``n_samples`` sequences of ``seq + 1`` tokens (inputs and shifted targets), generated at once, vectorised."""

    def __init__(self, vocab: int, seq: int, n_samples: int, seed: int = 1234):
        self.vocab, self.seq, self.seed = vocab, seq, seed
        self.table = transition_table(vocab, seed)
        blocks = [self._block(b) for b in range((n_samples + BLOCK - 1) // BLOCK)]
        self.tokens = torch.cat(blocks)[:n_samples]  # [n_samples, seq + 1]
        self.garbage: set[int] = set()

    def _block(self, b: int) -> torch.Tensor:
        """Samples [b*BLOCK, (b+1)*BLOCK), from their own generator: sample i is the same whatever n_samples is."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + b + 1)
        cdf = self.table.cumsum(-1)  # [V, V]
        tokens = torch.empty(BLOCK, self.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (BLOCK,), generator=g)
        uniform = torch.rand(BLOCK, self.seq + 1, generator=g)
        for t in range(1, self.seq + 1):  # inverse-CDF sampling, one position at a time for the whole block
            rows = cdf[tokens[:, t - 1]]  # [BLOCK, V]
            tokens[:, t] = torch.searchsorted(rows, uniform[:, t:t + 1].contiguous()).squeeze(1).clamp_max(self.vocab - 1)
        return tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def corrupt(self, ids) -> None:
        """Turn samples ``ids`` into garbage: uniform random tokens, what a shard of binary junk or a broken
        tokenizer run looks like. A trained model finds every token surprising (a loss spike near or above
        log V), and the large, aimless gradient knocks the weights off course for a few steps."""
        g = torch.Generator().manual_seed(self.seed + 2)
        for i in ids:
            self.tokens[i] = torch.randint(0, self.vocab, (self.seq + 1,), generator=g)
            self.garbage.add(int(i))

    def batch(self, ids: list[int]) -> torch.Tensor:
        return self.tokens[torch.as_tensor(ids, dtype=torch.long)]  # [len(ids), seq + 1]


class Loader:
    """Hands out the sample ids of each global batch in order, skipping any id in ``skip``.

    ``cursor`` (the next id to consider) is all the state there is, so a snapshot of it plus the model and
    optimizer is enough to rewind.
    """

    def __init__(self, n_samples: int, global_batch: int, skip=()):
        self.n_samples, self.global_batch = n_samples, global_batch
        self.skip = set(skip)
        self.cursor = 0

    def next_ids(self) -> list[int]:
        ids = []
        while len(ids) < self.global_batch:
            if self.cursor >= self.n_samples:
                raise RuntimeError(f"the dataset's {self.n_samples} samples are used up: make it larger")
            if self.cursor not in self.skip:
                ids.append(self.cursor)
            self.cursor += 1
        return ids


def rank_rows(ids: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous B/n of a global batch's sample ids."""
    per_rank = len(ids) // world_size
    return ids[rank * per_rank:(rank + 1) * per_rank]
