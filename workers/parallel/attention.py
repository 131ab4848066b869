"""Self-attention split by heads (Shoeybi et al. 2019, sec. 3 and Figure 3b), with grouped-query attention.

Heads are independent until the output projection, so attention parallelises with no communication
inside: the QKV projection is column-parallel *by heads* (rank r computes the queries, keys and values of
its own heads/t heads), each rank runs softmax attention on its heads, and the output projection is
row-parallel (its input rows are exactly those heads' outputs), finished by one all-reduce.

GQA (Ainslie et al. 2023): ``kv_heads`` key/value heads, each shared by ``heads / kv_heads`` consecutive query
heads. Two cases:
* ``kv_heads % t == 0``: every rank holds kv_heads/t KV heads, exactly those its query heads read;
* ``t % kv_heads == 0`` (t > kv_heads): a KV head cannot be split, so it is *replicated* on the
  t/kv_heads ranks whose query heads read it (rank r holds KV head ``r // (t / kv_heads)``). Each copy
  then gets only its own query heads' share of the gradient; the true gradient is their sum. So the
  replicated K/V weights enter through ``f`` over the group of their copies: identity forward, all-reduce
  of the gradient backward, and the copies stay identical after every optimizer step.
Anything else (heads not divisible by t, or t and kv_heads not dividing one another) is refused: the course's one
rule (``workers/layout/rules.py: heads_problem``), which the planner and every layout check use too.

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

from workers.layout.grid import make_groups
from workers.layout.rules import heads_problem
from workers.parallel import mappings
from workers.parallel.comm_stats import PARAMETER, region
from workers.model.dense import DenseAttention, attention_core, merge_heads, split_heads
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear, group_size_rank


def head_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """One sentence saying why ``heads``/``kv_heads`` cannot be split over ``tp`` ranks, or None."""
    kv_heads = kv_heads or heads
    if tp < 1:
        return f"tp={tp} must be at least 1"
    if kv_heads < 1 or heads % kv_heads:
        return (f"heads={heads} is not a multiple of kv_heads={kv_heads}: every KV head must serve the same number of "
                "query heads")
    return heads_problem(heads, kv_heads, tp)


def kv_replicated(kv_heads: int, tp: int) -> bool:
    return tp > kv_heads


def kv_heads_for_rank(heads: int, kv_heads: int, tp: int, rank: int) -> list[int]:
    """KV heads rank r holds: the ones its query heads ``[r heads/t, (r+1) heads/t)`` read."""
    problem = head_problem(heads, kv_heads, tp)
    if problem:
        raise ValueError(problem)
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // kv_heads)]  # t / kv_heads copies of each KV head, on consecutive ranks


def qkv_rows(heads: int, kv_heads: int, head_dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rows of the fused [Q; K; V] weight for rank r: its query heads' rows, then its KV heads' K rows, V rows."""
    kv_heads = kv_heads or heads
    q_per = heads // tp
    d = head_dim

    def rows(offset: int, which) -> list[torch.Tensor]:
        return [torch.arange(offset + j * d, offset + (j + 1) * d) for j in which]

    kv = kv_heads_for_rank(heads, kv_heads, tp, rank)
    parts = (rows(0, range(rank * q_per, (rank + 1) * q_per)) + rows(heads * d, kv)
             + rows((heads + kv_heads) * d, kv))
    return torch.cat(parts)


def naive_qkv_rows(heads: int, kv_heads: int, head_dim: int, rank: int, tp: int) -> torch.Tensor:
    """The trap: rank r's contiguous 1/t of the fused weight's rows, ignoring where Q ends and K begins."""
    total = (heads + 2 * (kv_heads or heads)) * head_dim
    if total % tp:
        raise ValueError(f"the fused QKV weight has {total} rows, which do not split into {tp} equal chunks")
    n = total // tp
    return torch.arange(rank * n, (rank + 1) * n)


def kv_replica_group(kv_heads: int, group=None):
    """The process group of this rank's KV-head copies (None when KV heads are split, not replicated).

    ``dist.new_group`` is collective over the *world*: every rank must create every group, in the same
    order. So the ranks first share their tensor-parallel groups, then all create the replica groups of all
    of them. Returns ``(group or None, [groups this rank created and must destroy])``. The groups wait as long
    as the world's collectives (``runtime.collective_timeout``), never torch's 30-minute default.
    """
    tp, _ = group_size_rank(group)
    if not kv_replicated(kv_heads, tp):
        return None, []
    copies = tp // kv_heads
    me = dist.get_rank()
    mine = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if group is None or tp == dist.get_world_size():
        tp_groups = [mine]
    else:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        tp_groups = sorted({tuple(g) for g in everyone})
    copy_groups = [list(ranks[kv * copies:(kv + 1) * copies]) for ranks in tp_groups for kv in range(kv_heads)]
    return make_groups(copy_groups, me)


def destroy_owned_groups(module: nn.Module) -> None:
    """Destroy the process groups a model created (warm ranks live on between runs: groups must not pile up)."""
    for m in module.modules():
        for pg in getattr(m, "_owned_groups", []):
            dist.destroy_process_group(pg)
        if hasattr(m, "_owned_groups"):
            m._owned_groups = []


class ParallelAttention(nn.Module):
    """Attention on this rank's ``heads/t`` query heads and their KV heads. ``[s, b, h]`` -> ``[s, b, h]``.

    With sequence parallelism, ``[s/t, b, h]`` in and out (the QKV projection all-gathers the sequence,
    the output projection reduce-scatters it). ``heads``/``kv_heads`` are the whole layer's; ``local_heads`` and
    ``local_kv_heads`` this rank's, ``kv_head_ids`` which KV heads it holds.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int = 0, bias: bool = True, causal: bool = True,
                 group=None, *, sequence_parallel: bool = False, device=None, dtype=None,
                 _dense: DenseAttention | None = None, _qkv_rows: torch.Tensor | None = None):
        super().__init__()
        kv_heads = kv_heads or heads
        tp, rank = group_size_rank(group)
        problem = head_problem(heads, kv_heads, tp)
        if problem:
            raise ValueError(problem)
        if _dense is None:
            _dense = DenseAttention(hidden, heads, kv_heads, bias, causal, device, dtype)
        if _dense.q_norm is not None or _dense.logit_probe:
            raise ValueError("qk_layernorm and logit_probe are single-process features of the model here: build the "
                             "attention without them to split it over tensor-parallel ranks")
        self.hidden, self.heads, self.kv_heads = hidden, heads, kv_heads
        self.head_dim, self.causal, self.group = _dense.head_dim, causal, group
        self.local_heads = heads // tp
        self.kv_head_ids = kv_heads_for_rank(heads, kv_heads, tp, rank)
        self.local_kv_heads = len(self.kv_head_ids)
        if _qkv_rows is None:
            _qkv_rows = qkv_rows(heads, kv_heads, self.head_dim, rank, tp)
        self.qkv = ColumnParallelLinear.from_dense(_dense.qkv, group, sequence_parallel=sequence_parallel,
                                                   rows=_qkv_rows)  # [(hq/t + 2 hkv_local) d, h]
        self.proj = RowParallelLinear.from_dense(_dense.proj, group, sequence_parallel=sequence_parallel)
        self.kv_group, self._owned_groups = (kv_replica_group(kv_heads, group) if dist.is_initialized()
                                             else (None, []))

    @classmethod
    def from_dense(cls, attention: DenseAttention, group=None, *, sequence_parallel: bool = False,
                   qkv_rows: torch.Tensor | None = None) -> "ParallelAttention":
        """This rank's heads of ``attention``. ``qkv_rows`` overrides the fused-QKV split (for the trap demo)."""
        return cls(attention.hidden, attention.heads, attention.kv_heads, attention.qkv.bias is not None,
                   attention.causal, group, sequence_parallel=sequence_parallel, _dense=attention,
                   _qkv_rows=qkv_rows)

    def qkv_weights(self):
        """The QKV weight and bias as used: with replicated KV heads, their rows pass through ``f`` over the copies."""
        weight, bias = self.qkv.weight, self.qkv.bias
        if self.kv_group is None:
            return weight, bias
        q = self.local_heads * self.head_dim
        scope = self.qkv.comm_scope + ".kv_copies"
        weight = torch.cat([weight[:q], region(scope, mappings.copy_to_tensor_model_parallel_region, weight[q:],
                                               group=self.kv_group, kind=PARAMETER)])
        if bias is not None:
            bias = torch.cat([bias[:q], region(scope, mappings.copy_to_tensor_model_parallel_region, bias[q:],
                                               group=self.kv_group, kind=PARAMETER)])
        return weight, bias

    # Context parallelism (chapters 14-15): set ``ring`` (a ``workers.context_parallel.ring.Ring``) and ``split`` after
    # construction, and the local heads attend over the whole sequence with ring attention (every block in float64,
    # returned in the input's dtype). None: plain local attention over the rows this rank holds.
    ring = None
    split = "zigzag"

    def core(self, x: torch.Tensor) -> torch.Tensor:
        """Local heads only, no communication but the ring's: replicated ``[s, b, h]`` -> ``[s, b, (heads/t) d]``."""
        weight, bias = self.qkv_weights()
        qkv = self.qkv.local(x, weight, bias)  # [s, b, (hq/t + 2 hkv_local) d]
        q, k, v = split_heads(qkv, self.local_heads, self.local_kv_heads, self.head_dim)  # [b, heads/t, s, d]
        if self.ring is None or self.ring.cp == 1:
            out = attention_core(q, k, v, self.causal)
        else:
            from workers.context_parallel.attention import ring_attention

            out = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.ring, self.split, self.causal)
        return merge_heads(out)  # [s, b, hq/t * d]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output before the all-reduce, no bias (``x`` already replicated)."""
        return self.proj.local(self.core(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.qkv.input_region(x)  # f (or the sequence all-gather): [s, b, h]
        return self.proj(self.core(x))  # g (or reduce-scatter), then + bias once

    def extra_repr(self) -> str:
        return (f"heads {self.local_heads} of {self.heads} on this rank, KV heads {self.kv_head_ids} of "
                f"{self.kv_heads}" + (" (replicated)" if self.kv_group is not None else ""))
