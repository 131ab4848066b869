"""Self-attention split by heads (Shoeybi et al. 2019, sec. 3 and Figure 3b), with grouped-query attention.

Heads are independent until the output projection, so attention parallelises with no communication
inside: the QKV projection is column-parallel *by heads* (rank r computes the queries, keys and values of
its own n_heads/t heads), each rank runs softmax attention on its heads, and the output projection is
row-parallel (its input rows are exactly those heads' outputs), finished by one all-reduce.

GQA (Ainslie et al. 2023): ``n_kv_heads`` key/value heads, each shared by ``n_heads / n_kv_heads``
consecutive query heads. Two cases:
* ``n_kv_heads % t == 0``: every rank holds n_kv_heads/t KV heads, exactly those its query heads read;
* ``t % n_kv_heads == 0`` (t > n_kv_heads): a KV head cannot be split, so it is *replicated* on the
  t/n_kv_heads ranks whose query heads read it (rank r holds KV head ``r // (t / n_kv_heads)``). Each copy
  then gets only its own query heads' share of the gradient; the true gradient is their sum. So the
  replicated K/V weights enter through ``f`` over the group of their copies: identity forward, all-reduce
  of the gradient backward, and the copies stay identical after every optimizer step.
Anything else (n_heads not divisible by t, or t and n_kv_heads not dividing one another) is refused.

The fused-QKV trap. ``DenseAttention.qkv.weight`` is laid out [Q; K; V]: all query heads, then all key
heads, then all value heads. Rank r needs *its heads' rows from each of the three parts*
(``qkv_rows``). Cutting the fused weight into t contiguous chunks (``naive_qkv_rows``) gives rank 0 the
first heads' queries... and then more queries where its keys should be: the shapes still fit, nothing
crashes, and the output is wrong. Megatron-LM avoids the trap by storing QKV interleaved per query group
([q_g, k_g, v_g] for each group g), a layout in which a contiguous chunk *is* a whole set of heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from workers.parallel import mappings
from workers.parallel.comm_stats import PARAMETER, region
from workers.parallel.dense import DenseAttention, attention_core, merge_heads, split_heads
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear, group_size_rank
from workers.runtime import collective_timeout


def head_problem(n_heads: int, n_kv_heads: int, tp: int) -> str | None:
    """One sentence saying why ``n_heads``/``n_kv_heads`` cannot be split over ``tp`` ranks, or None."""
    n_kv_heads = n_kv_heads or n_heads
    if tp < 1:
        return f"the tensor-parallel size must be at least 1, not {tp}"
    if n_heads % n_kv_heads:
        return (f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}: every KV head must serve the same "
                "number of query heads")
    if n_heads % tp:
        return (f"n_heads={n_heads} is not divisible by the tensor-parallel size {tp}: each rank must hold a whole "
                f"number of heads; choose a TP size that divides {n_heads}")
    if n_kv_heads % tp and tp % n_kv_heads:
        return (f"n_kv_heads={n_kv_heads} and TP={tp} do not divide one another: the KV heads can be neither split "
                f"evenly nor replicated evenly; choose a TP size that divides {n_kv_heads} or is a multiple of it")
    return None


def kv_replicated(n_kv_heads: int, tp: int) -> bool:
    return tp > n_kv_heads


def kv_heads_for_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    """KV heads rank r holds: the ones its query heads ``[r n_heads/t, (r+1) n_heads/t)`` read."""
    problem = head_problem(n_heads, n_kv_heads, tp)
    if problem:
        raise ValueError(problem)
    if n_kv_heads % tp == 0:
        per = n_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // n_kv_heads)]  # t / n_kv copies of each KV head, on consecutive ranks


def qkv_rows(n_heads: int, n_kv_heads: int, head_dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rows of the fused [Q; K; V] weight for rank r: its query heads' rows, then its KV heads' K rows, V rows."""
    n_kv_heads = n_kv_heads or n_heads
    q_per = n_heads // tp
    d = head_dim

    def rows(offset: int, heads) -> list[torch.Tensor]:
        return [torch.arange(offset + j * d, offset + (j + 1) * d) for j in heads]

    kv = kv_heads_for_rank(n_heads, n_kv_heads, tp, rank)
    parts = (rows(0, range(rank * q_per, (rank + 1) * q_per)) + rows(n_heads * d, kv)
             + rows((n_heads + n_kv_heads) * d, kv))
    return torch.cat(parts)


def naive_qkv_rows(n_heads: int, n_kv_heads: int, head_dim: int, rank: int, tp: int) -> torch.Tensor:
    """The trap: rank r's contiguous 1/t of the fused weight's rows, ignoring where Q ends and K begins."""
    total = (n_heads + 2 * (n_kv_heads or n_heads)) * head_dim
    if total % tp:
        raise ValueError(f"the fused QKV weight has {total} rows, which do not split into {tp} equal chunks")
    n = total // tp
    return torch.arange(rank * n, (rank + 1) * n)


def kv_replica_group(n_kv_heads: int, group=None):
    """The process group of this rank's KV-head copies (None when KV heads are split, not replicated).

    ``dist.new_group`` is collective over the *world*: every rank must create every group, in the same
    order. So the ranks first share their tensor-parallel groups, then all create the replica groups of all
    of them. Returns ``(group or None, [groups this rank created and must destroy])``. The groups wait as long
    as the world's collectives (``runtime.collective_timeout``), never torch's 30-minute default.
    """
    tp, _ = group_size_rank(group)
    if not kv_replicated(n_kv_heads, tp):
        return None, []
    copies = tp // n_kv_heads
    me = dist.get_rank()
    mine = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if group is None or tp == dist.get_world_size():
        tp_groups = [mine]
    else:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        tp_groups = sorted({tuple(g) for g in everyone})
    result, created = None, []
    for ranks in tp_groups:
        for kv in range(n_kv_heads):
            members = list(ranks[kv * copies:(kv + 1) * copies])
            pg = dist.new_group(members, timeout=collective_timeout())
            if me in members:
                created.append(pg)
                result = pg
    return result, created


def destroy_owned_groups(module: nn.Module) -> None:
    """Destroy the process groups a model created (warm ranks live on between runs: groups must not pile up)."""
    for m in module.modules():
        for pg in getattr(m, "_owned_groups", []):
            dist.destroy_process_group(pg)
        if hasattr(m, "_owned_groups"):
            m._owned_groups = []


class ParallelAttention(nn.Module):
    """Attention on this rank's ``n_heads/t`` query heads and their KV heads. ``[s, b, h]`` -> ``[s, b, h]``.

    With sequence parallelism, ``[s/t, b, h]`` in and out (the QKV projection all-gathers the sequence,
    the output projection reduce-scatters it).
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int = 0, bias: bool = True, causal: bool = True,
                 group=None, *, sequence_parallel: bool = False, device=None, dtype=None,
                 _dense: DenseAttention | None = None, _qkv_rows: torch.Tensor | None = None):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        tp, rank = group_size_rank(group)
        problem = head_problem(n_heads, n_kv_heads, tp)
        if problem:
            raise ValueError(problem)
        if _dense is None:
            _dense = DenseAttention(hidden, n_heads, n_kv_heads, bias, causal, device, dtype)
        self.hidden, self.n_heads, self.n_kv_heads = hidden, n_heads, n_kv_heads
        self.head_dim, self.causal, self.group = _dense.head_dim, causal, group
        self.n_local_heads = n_heads // tp
        self.kv_heads = kv_heads_for_rank(n_heads, n_kv_heads, tp, rank)
        self.n_local_kv_heads = len(self.kv_heads)
        if _qkv_rows is None:
            _qkv_rows = qkv_rows(n_heads, n_kv_heads, self.head_dim, rank, tp)
        self.qkv = ColumnParallelLinear.from_dense(_dense.qkv, group, sequence_parallel=sequence_parallel,
                                                   rows=_qkv_rows)  # [(hq/t + 2 hkv_local) d, h]
        self.proj = RowParallelLinear.from_dense(_dense.proj, group, sequence_parallel=sequence_parallel)
        self.kv_group, self._owned_groups = (kv_replica_group(n_kv_heads, group) if dist.is_initialized()
                                             else (None, []))

    @classmethod
    def from_dense(cls, attention: DenseAttention, group=None, *, sequence_parallel: bool = False,
                   qkv_rows: torch.Tensor | None = None) -> "ParallelAttention":
        """This rank's heads of ``attention``. ``qkv_rows`` overrides the fused-QKV split (for the trap demo)."""
        return cls(attention.hidden, attention.n_heads, attention.n_kv_heads, attention.qkv.bias is not None,
                   attention.causal, group, sequence_parallel=sequence_parallel, _dense=attention,
                   _qkv_rows=qkv_rows)

    def qkv_weights(self):
        """The QKV weight and bias as used: with replicated KV heads, their rows pass through ``f`` over the copies."""
        weight, bias = self.qkv.weight, self.qkv.bias
        if self.kv_group is None:
            return weight, bias
        q = self.n_local_heads * self.head_dim
        scope = self.qkv.comm_scope + ".kv_copies"
        weight = torch.cat([weight[:q], region(scope, mappings.copy_to_tensor_model_parallel_region, weight[q:],
                                               group=self.kv_group, kind=PARAMETER)])
        if bias is not None:
            bias = torch.cat([bias[:q], region(scope, mappings.copy_to_tensor_model_parallel_region, bias[q:],
                                               group=self.kv_group, kind=PARAMETER)])
        return weight, bias

    def core(self, x: torch.Tensor) -> torch.Tensor:
        """Local heads only, no communication: replicated ``[s, b, h]`` -> ``[s, b, (n_heads/t) d]``."""
        weight, bias = self.qkv_weights()
        qkv = self.qkv.local(x, weight, bias)  # [s, b, (hq/t + 2 hkv_local) d]
        q, k, v = split_heads(qkv, self.n_local_heads, self.n_local_kv_heads, self.head_dim)
        return merge_heads(attention_core(q, k, v, self.causal))  # [s, b, hq/t * d]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output before the all-reduce, no bias (``x`` already replicated)."""
        return self.proj.local(self.core(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.qkv.input_region(x)  # f (or the sequence all-gather): [s, b, h]
        return self.proj(self.core(x))  # g (or reduce-scatter), then + bias once

    def extra_repr(self) -> str:
        return (f"heads {self.n_local_heads} of {self.n_heads} on this rank, KV heads {self.kv_heads} of "
                f"{self.n_kv_heads}" + (" (replicated)" if self.kv_group is not None else ""))
