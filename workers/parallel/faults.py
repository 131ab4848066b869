"""Deliberately broken tensor parallelism: one collective dropped, doubled or misplaced.

``with inject("drop_backward_all_reduce"): ...`` runs the library with that one mistake, so a test (or a
notebook cell) can show that the equivalence check against the dense model catches it. Each fault is a
mistake people make when writing these layers by hand:

    drop_forward_all_reduce    g is the identity: the row-parallel partial sums are never added up
    drop_backward_all_reduce   f is the identity: the input gradient is only this rank's contribution
    double_all_reduce          g all-reduces twice: the output is t times too large
    misplaced_all_reduce       the backward all-reduce sits after the row layer instead of before the
                               column layer (g all-reduces in both passes, f in neither): the same counts,
                               but weight gradients t times too large and a partial input gradient
    bias_before_reduce         the row-parallel bias is added on every rank before the all-reduce
    drop_reduce_scatter        sequence parallelism: each rank keeps its rows of its own partial sum
    skip_parameter_grad_sync   gradients of parameters that need a sum over ranks are left partial
                               (LayerNorm and row bias under sequence parallelism, replicated KV heads)

The vocabulary-parallel loss (``workers/parallel/vocab.py: vocab_parallel_cross_entropy``) has drills of its own,
``VOCAB_FAULTS``, each replacing one step of it (``vocab_patches``; ``inject`` runs them too):

    max_not_reduced        each rank subtracts its own max: the shards' sums are in different units. Nothing
                           overflows (each rank's largest term is exp(0) = 1), but the loss is off by up to the gap
                           between the ranks' maxima: plausible on ordinary logits, hundreds off on logits scaled
                           by 1e3; the gradient still sums to 0 over the vocabulary
    target_not_masked      where another rank holds the target, column 0 of the shard stands in for it (the lookup
                           stays inside) but the logit it picks is kept: every rank adds a logit, so the loss is off
                           by t - 1 unrelated logits (plausible on ordinary logits, hundreds off on large ones) and
                           every rank subtracts a one-hot (the gradient sums to 1 - t over the vocabulary, not 0)
    sum_exp_not_reduced    each rank normalises over its own words: the loss is low by about log t and differs
                           from rank to rank, and each rank's softmax sums to 1 (the gradient sums to t - 1)
    max_not_subtracted     no max at all: the algebra is right, and exact on ordinary logits, but exp overflows to
                           inf above ~88 (float32) or ~709 (float64): logits scaled by 1e3 give an infinite loss
                           and NaN gradients. Why the max is there, and why it must be the group's

The patches replace module attributes for the duration of the ``with`` and restore them afterwards (the course's
one mechanism for injected faults, ``workers/faults``).
"""
from __future__ import annotations

import contextlib

import torch

from workers.faults import injected, patched
from workers.parallel import attention, block, layers, mappings, vocab
from workers.parallel.comm_stats import PARAMETER

FAULTS = ("drop_forward_all_reduce", "drop_backward_all_reduce", "double_all_reduce", "misplaced_all_reduce",
          "bias_before_reduce", "drop_reduce_scatter", "skip_parameter_grad_sync")
VOCAB_FAULTS = ("max_not_reduced", "target_not_masked", "sum_exp_not_reduced", "max_not_subtracted")


def _identity(input_, group=None):
    return input_


_copy_to = mappings.copy_to_tensor_model_parallel_region  # the correct mappings, whatever is patched later
_reduce_from = mappings.reduce_from_tensor_model_parallel_region


def all_reduce_both_ways(input_, group=None):
    """An all-reduce whose backward all-reduces too (``f`` after ``g``), as ``torch.distributed.nn``'s does.

    Right when every rank's loss is a different term of the total; wrong after a replicated loss, where
    the incoming gradient is already complete and summing it over n ranks makes it n times too large.
    """
    return _copy_to(_reduce_from(input_, group), group)


def _kept_local(t, group):
    return t  # no all-reduce: each rank keeps its own value


def _target_unmasked(target, start, end):
    local, elsewhere = vocab.in_shard(target, start, end)
    return local, torch.zeros_like(elsewhere)  # column 0 of the shard stands in for the target, and is kept


def vocab_patches() -> dict:
    """``{fault: (module, attribute, replacement)}`` for ``VOCAB_FAULTS`` (``workers/faults: injected``)."""
    return {"max_not_reduced": (vocab, "all_reduce_logits_max", _kept_local),
            "target_not_masked": (vocab, "mask_target", _target_unmasked),
            "sum_exp_not_reduced": (vocab, "all_reduce_sum_exp_logits", _kept_local),
            "max_not_subtracted": (vocab, "partition_logits_max", lambda z: z.new_zeros(z.shape[:-1]))}


@contextlib.contextmanager
def inject(fault: str):
    """Run the body with ``fault`` in the tensor-parallel library ("" or None: no fault)."""
    if not fault:
        yield
        return
    if fault in VOCAB_FAULTS:
        with injected(fault, vocab_patches):
            yield
        return
    if fault not in FAULTS:
        raise ValueError(f"no fault named {fault!r}: choose one of {', '.join(FAULTS + VOCAB_FAULTS)}")
    reduce_from = mappings.reduce_from_tensor_model_parallel_region
    with contextlib.ExitStack() as stack:
        if fault == "drop_forward_all_reduce":
            stack.enter_context(patched(mappings, "reduce_from_tensor_model_parallel_region", _identity))
        elif fault == "drop_backward_all_reduce":
            stack.enter_context(patched(mappings, "copy_to_tensor_model_parallel_region", _identity))
        elif fault == "double_all_reduce":
            stack.enter_context(patched(mappings, "reduce_from_tensor_model_parallel_region",
                                         lambda x, group=None: reduce_from(reduce_from(x, group), group)))
        elif fault == "misplaced_all_reduce":
            stack.enter_context(patched(mappings, "reduce_from_tensor_model_parallel_region", all_reduce_both_ways))
            stack.enter_context(patched(mappings, "copy_to_tensor_model_parallel_region", _identity))
        elif fault == "bias_before_reduce":
            def forward(self, x):
                if not self.input_is_parallel:
                    x = mappings.scatter_to_tensor_model_parallel_region(x, self.group)
                y = self.local(x)
                if self.bias is not None:
                    y = y + self.bias  # on every rank, before the sum: t copies of the bias
                return self.output_region(y)
            stack.enter_context(patched(layers.RowParallelLinear, "forward", forward))
        elif fault == "drop_reduce_scatter":
            stack.enter_context(patched(mappings, "reduce_scatter_to_sequence_parallel_region",
                                         lambda x, group=None: mappings.scatter_to_sequence_parallel_region(x, group)))
        elif fault == "skip_parameter_grad_sync":
            original = layers.region

            def region(scope, mapping, input_, *args, group=None, kind="activation", **kwargs):
                if kind == PARAMETER:
                    return input_
                return original(scope, mapping, input_, *args, group=group, kind=kind, **kwargs)
            for module in (layers, attention, block):
                stack.enter_context(patched(module, "region", region))
        yield
