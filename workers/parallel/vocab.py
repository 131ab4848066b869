"""The two ends of the model split by vocabulary: the embedding, and the loss computed from logits never gathered.

Megatron-LM cuts the vocabulary ``V`` over the ``t`` ranks of a tensor-parallel group, each rank a contiguous block
``[r V/t, (r+1) V/t)`` (``megatron/core/tensor_parallel/layers.py: VocabParallelEmbedding``,
``cross_entropy.py: vocab_parallel_cross_entropy``; PyTorch's ``torch.distributed.tensor.parallel.loss_parallel``
runs the same three reductions on a DTensor sharded over the classes):

* ``VocabParallelEmbedding``: rank r holds rows ``[r V/t, (r+1) V/t)`` of the table. A token another rank holds
  looks up nothing here (its row is zeroed), so summing the ranks' outputs gives every token its row:
  ``g`` (``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward).
* the LM head, a column-parallel linear over the vocabulary (``ColumnParallelLinear``, or ``parallel_lm_logits``
  with the embedding's shard when the head is tied), leaves rank r with the logits of its own words,
  ``[s, b, V/t]``.
* ``vocab_parallel_cross_entropy(logits_shard, target, group)``: the loss ``log sum_j exp z_j - z_target`` from
  those shards, with three all-reduces of ``[s, b]``: the max (MAX, so that no exponential overflows), the
  target's logit (taken on the rank that holds it, zero elsewhere; SUM) and the sum of exponentials (SUM). The
  backward, ``softmax - onehot(target)``, needs no communication: each rank writes its own columns.

Bytes, per rank, b sequences of s tokens, e elements' bytes:

    logits held          b s V/t e            against b s V e gathered (GPT-2's V = 50257, b = 8, s = 1024,
                                              float32: 1.65 GB each rank; 0.41 GB at t = 4)
    softmax saved        b s V/t e            for the backward, the same again
    what crosses         3 all-reduces of b s elements (forward only), against an all-gather of b s V elements

So the logits of a large vocabulary never exist whole on any rank, and the loss's messages are V/3 times smaller
than a gather's (V/6 on a ring's wire: an all-reduce sends twice its message, an all-gather once). The
embedding's all-reduce of ``[b, s, h]`` is the price of its split table, as for a row-parallel layer.

Each step the drills break (``workers/parallel/faults.py``: ``VOCAB_FAULTS``) is a function of its own here, so a
fault replaces one of them for a run and nothing below branches on a fault's name.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.parallel import mappings
from workers.parallel.comm_stats import region
from workers.parallel.layers import contiguous_index, group_size_rank, shard_parameter

CROSS_ENTROPY = "vocab_parallel_cross_entropy"  # how its collectives are named in the communication ledger


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, end)``: the words rank ``rank`` of ``tp`` holds (Megatron's ``VocabUtility``)."""
    index = contiguous_index(vocab, tp, rank, "vocab")
    return int(index[0]), int(index[-1]) + 1


def in_shard(ids: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local, elsewhere)``: each word's row (or column) in this rank's shard, and where another rank holds it.

    ``local`` is 0 where the word lives elsewhere, so that indexing with it stays inside the shard; what it picks
    there must then be thrown away, where ``elsewhere`` is True.
    """
    elsewhere = (ids < start) | (ids >= end)
    return (ids - start).masked_fill(elsewhere, 0), elsewhere


def mask_target(target: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss's targets in this shard (``in_shard``): the drill ``target_not_masked`` replaces this one."""
    return in_shard(target, start, end)


# -- the embedding ---------------------------------------------------------------------------------------

class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, end)`` of the table; ``tokens [b, s]`` in, every token's row ``[b, s, h]`` out.

    Megatron-LM: ``megatron/core/tensor_parallel/layers.py: VocabParallelEmbedding``; its option to reduce-scatter
    the output for sequence parallelism is ``partial_rows`` and the caller's reduce-scatter
    (``workers/parallel/gpt.py: ParallelGPT``).
    """

    comm_scope = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, *, device=None, dtype=None,
                 _dense: nn.Embedding | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        tp, rank = group_size_rank(group)
        if _dense is None:  # the same table on every rank (same seed), then keep our rows
            _dense = nn.Embedding(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, tp, rank)
        rows = torch.arange(self.vocab_start_index, self.vocab_end_index)
        self.weight = shard_parameter(_dense.weight, 0, rows)  # [V/t, h]

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group=None) -> "VocabParallelEmbedding":
        """This rank's block of rows of ``embedding``."""
        return cls(embedding.num_embeddings, embedding.embedding_dim, group, _dense=embedding)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return region(self.comm_scope, mappings.reduce_from_tensor_model_parallel_region, self.partial_rows(tokens),
                      group=self.group)  # [b, s, h], the same on every rank

    def partial_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum, before any communication: ``tokens [b, s]`` -> ``[b, s, h]``, each token's
        row where this rank holds its word, zeros elsewhere. ``forward`` all-reduces it; under sequence parallelism
        a caller may reduce-scatter it instead (Megatron's ``reduce_scatter_embeddings``)."""
        local, elsewhere = in_shard(tokens, self.vocab_start_index, self.vocab_end_index)
        rows = F.embedding(local, self.weight)  # [b, s, h]; row 0 stands in for the tokens other ranks hold
        # zeroed, so they add nothing to the sum (and their stand-in row gets no gradient from them)
        return rows.masked_fill(elsewhere.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start_index}.."
                f"{self.vocab_end_index - 1} on this rank)")


def parallel_lm_logits(x: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """The tied LM head: ``x [s, b, h]`` times this rank's rows of the embedding, ``[s, b, V/t]``.

    ``x`` enters through ``f`` (identity forward, all-reduce backward): every rank's words read all of x, so its
    gradient is the sum of the ranks' parts. Megatron-LM: the GPT model's ``output_layer`` (a column-parallel
    linear) called with the embedding's weight when ``share_embeddings_and_output_weights`` is set.
    """
    x = region("head", mappings.copy_to_tensor_model_parallel_region, x, group=group)
    return F.linear(x, weight)  # [s, b, V/t]


# -- the loss --------------------------------------------------------------------------------------------

def _all_reduce(t: torch.Tensor, op, group, what: str) -> torch.Tensor:
    """``t`` reduced over the group, in place (it is the loss's own tensor), seen by the communication ledger."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # noted as the mappings note theirs, so that a CommLedger around the loss counts these three too
        mappings._note(f"{CROSS_ENTROPY}.{what}", "all_reduce", "forward", t, group)
        dist.all_reduce(t, op=op, group=group)
    return t


def partition_logits_max(logits: torch.Tensor) -> torch.Tensor:
    """The largest logit of each token among this rank's words, ``[s, b]``."""
    return logits.max(dim=-1).values


def all_reduce_logits_max(logits_max: torch.Tensor, group) -> torch.Tensor:
    """MAX over the group: every rank subtracts the same number, so the shards' sums are in one unit."""
    return _all_reduce(logits_max, dist.ReduceOp.MAX, group, "logits_max")


def all_reduce_predicted_logits(predicted: torch.Tensor, group) -> torch.Tensor:
    """SUM over the group of the target's logit, which exactly one rank holds (the others contribute 0)."""
    return _all_reduce(predicted, dist.ReduceOp.SUM, group, "predicted_logits")


def all_reduce_sum_exp_logits(sum_exp: torch.Tensor, group) -> torch.Tensor:
    """SUM over the group: the softmax's denominator runs over the whole vocabulary."""
    return _all_reduce(sum_exp, dist.ReduceOp.SUM, group, "sum_exp_logits")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy ``[s, b]`` from ``logits [s, b, V/t]`` split by vocabulary; ``target [s, b]``.

    Unlike Megatron's, the caller's logits are never written to (Megatron subtracts the max in place, to save
    the memory of one more shard).
    """

    @staticmethod
    def forward(ctx, logits, target, group):
        tp, rank = group_size_rank(group)
        part = logits.shape[-1]
        start, end = rank * part, (rank + 1) * part
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half precision: the loss in float32
        logits_max = all_reduce_logits_max(partition_logits_max(z), group)  # [s, b]
        z = z - logits_max.unsqueeze(-1)  # [s, b, V/t], at most 0: exp() cannot overflow
        local, elsewhere = mask_target(target, start, end)
        predicted = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)  # [s, b]
        predicted = all_reduce_predicted_logits(predicted.masked_fill(elsewhere, 0.0), group)
        exp = z.exp()  # [s, b, V/t]
        sum_exp = all_reduce_sum_exp_logits(exp.sum(dim=-1), group)  # [s, b]
        loss = sum_exp.log() - predicted  # [s, b]
        softmax = exp / sum_exp.unsqueeze(-1)  # [s, b, V/t]: this rank's columns of the whole softmax
        ctx.save_for_backward(softmax, local, elsewhere)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, elsewhere = ctx.saved_tensors
        # d loss / d z = softmax - onehot(target): the one-hot's 1 sits on the rank that holds the target. A copy,
        # not the saved softmax itself, so that a second backward (retain_graph) starts from the softmax again.
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~elsewhere).to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))  # [s, b, V/t]
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token loss ``[s, b]`` (float32 at least) from this rank's ``logits [s, b, V/t]`` and ``target [s, b]``.

    The same on every rank of the group; average or sum it as the dense loss would be (the gradient that comes
    back is then already complete on every rank, as after ``g``).
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target has shape {tuple(target.shape)} but the logits {tuple(logits.shape)}: the target "
                         f"is [s, b], the logits [s, b, vocab/tp] (transpose a batch-first target with .t())")
    return _VocabParallelCrossEntropy.apply(logits, target, group)
