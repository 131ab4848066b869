"""Chapter 15's injected faults: one composition bug each, which the equivalence check must catch and name.

``with inject("grads_over_tp"): ...`` runs the composed trainer with that one mistake, in the style of
``workers/parallel/faults.py``: each fault replaces one method of the library or the trainer for the duration of
the ``with`` (``patched``), so neither the model nor the trainer branches on a fault's name.

    grads_over_dp_only     gradients summed over dp alone, forgetting the context-parallel replicas
    grads_over_tp          gradients summed over the tensor-parallel group instead of dp x cp
    layernorm_not_reduced  LayerNorm gradients left partial under sequence parallelism
    per_microbatch_mean    each micro-batch's loss averaged over its own tokens, then over m and dp
    dropout_per_rank       a different dropout mask on each TP rank in the replicated region
    dropout_shared         the same dropout mask on every TP rank's sequence shard
    tied_not_reduced       the tied embedding's gradient not summed between the first and last stage

A fault only shows on layouts that exercise what it breaks (``FAULTS[name][1]``): ``fault_problem`` refuses the
others, so a check never passes a fault that had nothing to break.
"""
from __future__ import annotations

import torch.nn.functional as F

from workers.layout import Layout
from workers.parallel.block import ParallelLayerNorm
from workers.faults import injected
from workers.parallel.gpt import ParallelGPT

# fault -> (what it breaks, the layouts it needs to show)
FAULTS = {
    "none": ("nothing", None),
    "grads_over_dp_only": ("gradients summed over dp alone, forgetting the context-parallel replicas", "cp > 1"),
    "grads_over_tp": ("gradients summed over the tensor-parallel group instead of dp x cp", "tp > 1 or dp x cp > 1"),
    "layernorm_not_reduced": ("LayerNorm gradients left partial under sequence parallelism",
                              "sequence_parallel and tp > 1"),
    "per_microbatch_mean": ("each micro-batch's loss averaged over its own tokens, then over m and dp",
                            "micro_batches > 1 or dp > 1"),
    "dropout_per_rank": ("a different dropout mask on each TP rank in the replicated region",
                         "dropout > 0, tp > 1, no sequence parallelism"),
    "dropout_shared": ("the same dropout mask on every TP rank's sequence shard", "dropout > 0, tp > 1, sequence parallelism"),
    "tied_not_reduced": ("the tied embedding's gradient not summed between the first and last stage", "pp > 1"),
}


def fault_problem(fault: str, layout: Layout, dropout: float) -> str | None:
    """One sentence when ``fault`` cannot show on this layout (so the check would pass and teach nothing)."""
    from workers.runtime import one_of

    unknown = one_of("fault", fault, FAULTS)
    if unknown:
        return unknown
    sp, tp, dp = layout.sequence_parallel, layout.tp, layout.dp or 1
    shows = {"none": True, "grads_over_dp_only": layout.cp > 1,
             "grads_over_tp": tp > 1 or dp * layout.cp > 1,
             "layernorm_not_reduced": sp and tp > 1,
             "per_microbatch_mean": (layout.micro_batches or 1) > 1 or dp > 1,
             "dropout_per_rank": dropout > 0 and tp > 1 and not sp,
             "dropout_shared": dropout > 0 and tp > 1 and sp,
             "tied_not_reduced": layout.pp > 1}[fault]
    if not shows:
        return f"fault={fault!r} cannot show on layout {layout.name}: it needs {FAULTS[fault][1]}"
    return None


def _layernorm_without_gradient_sum(self, x):
    return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # no f: partial gradients


def _shared_rows(self, where, rows):
    return where.positions[:rows]  # rank 0's rows of the mask on every TP rank


def _seed_per_rank(self):
    return self.seed + 7919 * self.par.tp_rank


def _per_microbatch_mean(self, summed, micro_tokens, total_tokens):
    L = self.layout
    return summed / (micro_tokens * L.micro_batches * L.dp)  # each micro-batch's own mean, then / m, / dp


def _patches() -> dict:
    from workers.composed.train import ComposedTrainer

    return {
        "grads_over_dp_only": (ComposedTrainer, "gradient_group", lambda self: self.mesh.group("dp")),
        "grads_over_tp": (ComposedTrainer, "gradient_group", lambda self: self.mesh.group("tp")),
        "layernorm_not_reduced": (ParallelLayerNorm, "forward", _layernorm_without_gradient_sum),
        "per_microbatch_mean": (ComposedTrainer, "normalise_loss", _per_microbatch_mean),
        "dropout_per_rank": (ParallelGPT, "dropout_seed", _seed_per_rank),
        "dropout_shared": (ParallelGPT, "dropout_positions", _shared_rows),
        "tied_not_reduced": (ComposedTrainer, "sum_tied_gradients", lambda self: None),
    }


def inject(fault: str):
    """``with inject(fault):`` the composed trainer and its model run with ``fault`` ("none" or "": no fault)."""
    return injected(fault, _patches)
