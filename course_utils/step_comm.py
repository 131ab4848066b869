"""The planner's communication model: which collectives one GPU runs in a training step, and over which tier.

``step_collectives(model, layout)`` lists, per parallel dimension (TP, CP, PP, DP), the collectives one GPU of the
first pipeline stage runs in one optimizer step, each with its message size, group size and count;
``zero_collectives_per_step`` says how often data parallelism runs each collective at each ZeRO stage. ``_link``
says which network tier a group crosses: groups are laid out [TP, CP, PP, DP] from the innermost, as in Llama 3,
Figure 5, so a group stays on NVLink while its ranks fit in one node. ``course_utils.planner.plan`` times each call
with the alpha-beta model (``ledger.collective_time``) over that tier and adds nothing overlapped with compute (an
upper bound: DP and CP traffic usually overlap well in practice); chapter 15 holds the bytes to what a composed run
sends. Every byte count's formula and citation are in ``course_utils.ledger`` and the docstrings below.
``course_utils.planner`` re-exports every public name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.layout.rules import ZERO_STAGES, Layout

from .hardware import Cluster, Link
from .ledger import bus_bandwidth_factor, tp_comm_bytes_per_layer
from .model_shapes import LayoutError, ModelShape, _check_degree


def zero_collectives_per_step(zero_stage: int, num_microbatches: int = 1) -> dict[str, int]:
    """How often data parallelism runs each collective in one optimizer step of m micro-batches.

    Each count is one pass over the model slice a GPU holds (2 bytes per parameter); a real run splits a
    pass into buckets (DDP, ZeRO-1/2) or layers (ZeRO-3) with the same total bytes. Gradients are reduced
    once per step when a GPU keeps a full-size gradient anyway, and after every micro-batch's backward when
    it keeps only its shard:

    - stage 0 (DDP) and stage 1: gradients accumulate locally in full over the m micro-batches
      (``DistributedDataParallel.no_sync()``; Megatron's main_grad buffer; DeepSpeed ZeRO-1 reduces only at
      the accumulation boundary), then one all-reduce (stage 0) or one reduce-scatter (stage 1); stage 1
      all-gathers the updated weights once after the step.
    - stage 2: a GPU stores only its gradient shard, so it reduce-scatters after each micro-batch
      (DeepSpeed's stage_1_and_2.py reduces every micro-step when gradients are partitioned); one
      all-gather of the weights after the step.
    - stage 3 (FSDP): all-gather the weights before each micro-batch's forward and again before its
      backward, reduce-scatter the gradients after its backward: 2m + m. This is FSDP's default with
      gradient accumulation; FSDP's ``no_sync()`` (FSDP2: ``set_requires_gradient_sync(False)``) would
      reduce-scatter once per step but keep unsharded gradients, 2 bytes per parameter more per GPU than
      the ledger's stage 3 counts (pytorch/pytorch PR #126166 describes both flavours).

    Rajbhandari et al. 2020, section 7: with m = 1, stages 0-2 move 2 Psi per step and stage 3 moves 3 Psi.
    """
    if zero_stage not in ZERO_STAGES:
        raise LayoutError(
            f"zero_stage={zero_stage!r} is not a ZeRO stage (Rajbhandari et al. 2020, sec 5); use 0, 1, 2 or 3."
        )
    m = _check_degree("num_microbatches", num_microbatches)
    if zero_stage == 0:
        return {"all_reduce": 1, "reduce_scatter": 0, "all_gather": 0}
    reduce_scatters = 1 if zero_stage == 1 else m
    all_gathers = 2 * m if zero_stage == 3 else 1
    return {"all_reduce": 0, "reduce_scatter": reduce_scatters, "all_gather": all_gathers}


def _link(cl: Cluster, stride: int, size: int) -> Link:
    """Tier a group of ``size`` ranks, ``stride`` apart, crosses: NVLink if it fits in one node."""
    return cl.intra_node if stride * size <= cl.gpus_per_node else cl.inter_node


@dataclass(frozen=True)
class Collective:
    """One kind of collective a GPU runs in a training step: ``count`` calls on ``message_bytes`` over ``ranks``."""

    collective: str
    message_bytes: float
    ranks: int
    count: float

    @property
    def wire_bytes(self) -> float:
        """Bytes one GPU sends for all ``count`` calls, by the ring algorithms nccl-tests assumes."""
        return self.count * bus_bandwidth_factor(self.collective, self.ranks) * self.message_bytes


def step_collectives(model: ModelShape, layout: Layout, *, weight_bytes: float = 2, grad_bytes: float = 2,
                     bytes_per_element: float = 2) -> dict[str, list[Collective]]:
    """The collectives one GPU of the first pipeline stage runs in one optimizer step, per parallel dimension.

    ``layout`` must be resolved (``resolve_layout``: dp and m filled in). This is the whole communication model
    of ``plan``, which times each of these calls with the alpha-beta model of the link its group spans; chapter
    15 holds it to the bytes a composed run measures. Activations are ``bytes_per_element`` wide (bf16: 2).

    - tp: 4 all-reduces of ``b s/cp h`` per layer and micro-batch (Shoeybi et al. 2019, sec 3; with sequence
      parallelism the same bytes as all-gathers and reduce-scatters, Korthikanti et al. 2022, sec 4.2.2), 6 with
      full recomputation;
    - cp: per layer and micro-batch, K and V of the whole sequence all-gathered forward (again when recomputing)
      and their gradients reduce-scattered backward (Llama 3, sec 3.3.2);
    - pp: one activation forward and one gradient backward per micro-batch and chunk, 1/tp of ``b s/cp h`` each
      (the scatter-gather optimisation, Narayanan et al. 2021, sec 4.1);
    - dp: the stage's gradients (``grad_bytes`` per parameter, 1/tp of them) reduced over DP x CP and, from
      ZeRO-1 on, its weights all-gathered, as often as ``zero_collectives_per_step`` says (ZeRO, sec 7).
    """
    tp, pp, cp, dp, v = layout.tp, layout.pp, layout.cp, layout.dp, layout.virtual_stages
    b, seq, m = layout.micro_batch, layout.seq, layout.micro_batches
    if dp is None or m is None or seq is None:
        raise LayoutError("step_collectives needs a resolved layout (dp, micro_batches and seq filled in): "
                          "pass it through resolve_layout first.")
    s_local = seq // cp
    layers_per_stage = math.ceil(model.layers / pp)
    held = model.held_by_tp(tp)  # KV heads copied when tp is a multiple of them
    stage_params = held.n_params if pp == 1 else layers_per_stage * held.params_per_layer + model.vocab * model.hidden
    out: dict[str, list[Collective]] = {"tp": [], "cp": [], "pp": [], "dp": []}
    if tp > 1:
        tpb = tp_comm_bytes_per_layer(b, s_local, model.hidden, tp, bytes_per_element=bytes_per_element,
                                      full_recompute=layout.recompute == "full")
        out["tp"].append(Collective("all_reduce", tpb.message_bytes, tp, tpb.all_reduces * layers_per_stage * m))
    if cp > 1:
        kv_bytes = 2.0 * b * seq * held.kv_dim / tp * bytes_per_element  # K and V of the whole sequence
        gathers = 2 if layout.recompute == "full" else 1
        out["cp"] += [Collective("all_gather", kv_bytes, cp, gathers * layers_per_stage * m),
                      Collective("reduce_scatter", kv_bytes, cp, layers_per_stage * m)]
    if pp > 1:
        message = b * s_local * model.hidden * bytes_per_element / tp
        out["pp"].append(Collective("send_recv", message, 2, 2 * m * v))
    group = dp * cp
    if group > 1:
        counts = zero_collectives_per_step(layout.zero, m)
        grads, weights = grad_bytes * stage_params / tp, weight_bytes * stage_params / tp
        for name, nbytes in (("all_reduce", grads), ("reduce_scatter", grads), ("all_gather", weights)):
            if counts[name]:
                out["dp"].append(Collective(name, nbytes, group, counts[name]))
    return out

