"""Chapter 16's injected faults: four silent MoE bugs, each of which the equivalence check must catch and name.

``with inject("combine_order_not_restored"): ...`` runs the layer with that one mistake, in the style of
``workers/parallel/faults.py``: each fault replaces one method or function of ``workers/moe/`` for the duration of
the ``with`` (``patched``), so the layer never branches on a fault's name.

    router_not_reduced              the router's gradient left as each rank computed it (never averaged)
    expert_grads_averaged_over_edp  expert gradients divided by the expert-data-parallel group's size, not the
                                    world's: ``ep`` times too large (Megatron-LM PR #5956)
    combine_order_not_restored      the combine adds the returned rows in the (token, choice) order they were
                                    listed in, not the expert-sorted order they come back in
    aux_loss_local_statistics       the load-balancing loss's counts f from each rank's own tokens, not the batch's
"""
from __future__ import annotations

from workers.faults import injected

FAULTS = ("none", "router_not_reduced", "expert_grads_averaged_over_edp", "combine_order_not_restored",
          "aux_loss_local_statistics")


def _router_left_alone(dense, router_params):
    router = {id(p) for p in router_params}
    return [p for p in dense if id(p) not in router]


def _rows_in_listed_order(self, out, back, state):
    import torch

    unsorted = torch.empty_like(state.order)
    unsorted[state.order] = torch.arange(len(state.order), device=state.order.device)
    return out.index_add(0, state.token_index[unsorted], back * state.weight[unsorted][:, None])


def _local_balance_loss(self, probs, experts):
    from workers.moe.router import load_balancing_loss

    return load_balancing_loss(probs, experts, self.cfg, local_statistics=True)


def _patches() -> dict:
    from workers.moe import layer
    from workers.moe.dispatch import MoEAlltoAllTokenDispatcher

    return {
        "router_not_reduced": (layer, "dense_to_average", _router_left_alone),
        "expert_grads_averaged_over_edp": (layer, "expert_divisor", lambda mesh: mesh.size("edp")),
        "combine_order_not_restored": (MoEAlltoAllTokenDispatcher, "add_rows", _rows_in_listed_order),
        "aux_loss_local_statistics": (layer.MoELayer, "balance_loss", _local_balance_loss),
    }


def inject(fault: str):
    """``with inject(fault):`` the MoE layer runs with ``fault`` ("none" or "": no fault)."""
    return injected(fault, _patches)
