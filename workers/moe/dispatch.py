"""Expert parallelism's two all-to-alls: send each token to the rank that holds its expert, bring the results back.

Megatron-LM's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/token_dispatcher.py``) in four steps,
the names kept:

1. **permute** (``dispatch_preprocess``): list this rank's kept (token, choice) pairs, sort them by expert
   (stably: token order within an expert) and gather their rows: ``[A, h]``, A = kept choices. Experts are
   numbered so that EP rank r holds experts ``[r E/ep, (r+1) E/ep)``: sorted by expert is sorted by destination.
2. **the split sizes**: each rank counts its rows per expert ``[E]``; one all-to-all of those counts tells every
   rank how many rows it will receive from each source for each of its local experts ``[ep, E/ep]``. Without
   it, ``all_to_all_single`` cannot size its output.
3. **token_dispatch**: ``all_to_all_single`` of the rows with those splits. What arrives is source-major
   (rank 0's rows for my experts, then rank 1's, ...), expert-sorted within each source; ``dispatch_postprocess``
   sorts it once more by local expert, so each expert reads one contiguous block.
4. **combine**: the same steps backwards: undo the local sort, ``all_to_all_single`` with the splits swapped,
   and **unpermute**: scatter-add each row, times its routing weight, into its token's place. Forgetting that the
   rows come back sorted by expert (adding them in the order the choices were listed) mixes tokens up.

The all-to-all is differentiable: its backward is the all-to-all with input and output splits swapped
(``all_to_all`` below; Megatron's ``tensor_parallel.all_to_all``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.runtime import host_staged


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input_, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return input_.clone()  # one rank (or one process): nothing leaves
        output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        return host_staged("all_to_all", dist.all_to_all_single, output, input_.contiguous(), group=group,
                           output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        return None, all_to_all(ctx.group, grad, ctx.input_split_sizes, ctx.output_split_sizes), None, None


def all_to_all(group, input_: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]):
    """Rows ``input_split_sizes[j]`` of ``input_`` go to rank j of ``group``; ``output_split_sizes[j]`` rows come from it."""
    return _AllToAll.apply(group, input_, output_split_sizes, input_split_sizes)


@dataclass
class Dispatched:
    """What the combine needs to undo the dispatch, and what the run reports."""

    token_index: torch.Tensor  # [A] the token of each kept choice, sorted by expert
    weight: torch.Tensor  # [A] its routing weight, same order
    order: torch.Tensor  # [A] the sort: position in the (token, choice) listing of each sorted row
    send_splits: list[int]  # rows to each EP rank
    recv_splits: list[int]  # rows from each EP rank
    local_order: torch.Tensor  # [R] the sort of the received rows by local expert
    tokens_per_local_expert: list[int]  # rows each of my experts computes


class MoEAlltoAllTokenDispatcher:
    """Dispatch and combine over ``group`` (the EP group, ``ep`` ranks, this one at ``ep_rank``)."""

    def __init__(self, experts: int, group, ep: int, ep_rank: int):
        self.experts, self.group, self.ep, self.ep_rank = experts, group, ep, ep_rank
        self.local_experts = experts // ep
        self.combine_s = 0.0

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor):
        """``x`` ``[T, h]``, ``experts``/``weights``/``keep`` ``[T, k]`` -> (rows for my experts ``[R, h]``, state)."""
        tokens, k = experts.shape
        token_index = torch.arange(tokens, device=x.device)[:, None].expand(tokens, k)[keep]  # [A]
        expert_index = experts[keep]  # [A]
        order = torch.argsort(expert_index, stable=True)  # [A]: by expert, token order within
        permuted = x[token_index[order]]  # [A, h]
        counts = torch.bincount(expert_index, minlength=self.experts)  # [E] rows to send per expert
        send_splits = counts.view(self.ep, self.local_experts).sum(dim=1).tolist()  # [ep]
        recv_counts = self._exchange_counts(counts)  # [ep, E/ep]: from each source, per local expert
        recv_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all(self.group, permuted, recv_splits, send_splits)  # [R, h], source-major
        local_expert = torch.repeat_interleave(
            torch.arange(self.local_experts, device=x.device).repeat(self.ep), recv_counts.reshape(-1).to(x.device))
        local_order = torch.argsort(local_expert, stable=True)  # [R]: by local expert, source order within
        state = Dispatched(token_index[order], weights[keep][order], order, send_splits, recv_splits, local_order,
                           recv_counts.sum(dim=0).tolist())
        return received[local_order], state  # [R, h]

    def combine(self, expert_output: torch.Tensor, state: Dispatched, tokens: int) -> torch.Tensor:
        """``[R, h]`` in local-expert order -> ``[T, h]``: each token's weighted sum over its kept experts."""
        inverse = torch.argsort(state.local_order)
        t0 = time.perf_counter()
        back = all_to_all(self.group, expert_output[inverse], state.send_splits, state.recv_splits)  # [A, h]
        self.combine_s = time.perf_counter() - t0  # includes waiting for the slowest rank's experts
        out = expert_output.new_zeros((tokens, expert_output.shape[-1]))  # [T, h]
        return self.add_rows(out, back, state)

    def add_rows(self, out: torch.Tensor, back: torch.Tensor, state: Dispatched) -> torch.Tensor:
        """Each returned row, times its routing weight, added into its token's place (the rows come back in the
        dispatch's sorted order, the order ``state.token_index`` and ``state.weight`` were sorted into)."""
        return out.index_add(0, state.token_index, back * state.weight[:, None])

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return counts.view(1, self.experts)
        recv = torch.empty_like(counts)  # [ep * E/ep]: source j's counts for my experts at [j E/ep, (j+1) E/ep)
        host_staged("all_to_all", dist.all_to_all_single, recv, counts, group=self.group)
        return recv.view(self.ep, self.local_experts)
