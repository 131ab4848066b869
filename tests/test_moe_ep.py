"""Chapter 16's MoE layer on expert-parallel ranks (issue 17): equal to the one-process reference that loops token by
token, the known bugs caught and named, the all-to-all's bytes, and the refusals.

Ground truth: ``workers/moe/layer.reference_forward`` in float64, the same weights and batch, the batch split into
the same groups (one per rank) so the same token choices are dropped. The ranks add the same products in other
orders (a batched matmul against one token at a time, all-reduces), so the bound is
``workers/moe/equivalence.TOLERANCE`` = 1e-10; measured over the 32 cases of the four layouts below, outputs
and gradients together: at most 1.8e-15 (native AVX-512), 2.2e-15 (AVX2), 1.3e-15 (plain kernels): float64 rounding
of the last bits. Counts, split sizes, drops and bytes are exact: integers fixed by the routing.
"""
import math

import pytest
import torch

import course_utils as cu
from course_utils.results import InvalidParameter
from workers.moe.batch import SWEEP
from workers.moe.config import MoEConfig
from workers.moe.equivalence import TOLERANCE, compare, reference
from workers.moe.router import keep_mask, load_balancing_loss, z_loss

WORKER = "workers.ch16_moe"
pytestmark = pytest.mark.ranks


def _cases(res, i):
    return [res[r]["cases"][i] for r in range(len(res.ranks))]


# -- the router's pieces, in one process ---------------------------------------------------------------------------

def test_capacity_queue_takes_first_choices_before_second_choices():
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])  # [T=4, k=2]
    # expert 0's queue: the first choices of tokens 0, 1, 3, then token 2's second choice: capacity 2 keeps tokens
    # 0 and 1. Expert 1's: token 2's first choice, then the second choices of tokens 0 and 3: token 3's is dropped
    keep = keep_mask(experts, 3, capacity=2)
    assert keep.tolist() == [[True, True], [True, True], [True, False], [False, False]]
    assert keep_mask(experts, 3, capacity=None).all()
    assert MoEConfig(experts=4, top_k=2, capacity_factor=1.0).capacity(10) == 5  # ceil(1.0 * 10 * 2 / 4)
    assert MoEConfig(experts=8, top_k=1, capacity_factor=1.25).capacity(16) == 3  # ceil(2.5)
    assert MoEConfig(capacity_factor=0.0).capacity(16) is None


def test_load_balancing_loss_is_one_when_even_and_experts_when_collapsed():
    cfg = MoEConfig(experts=4, top_k=1)
    even = torch.full((8, 4), 0.25, dtype=torch.float64)
    spread = torch.arange(8)[:, None] % 4
    assert float(load_balancing_loss(even, spread, cfg)) == pytest.approx(1.0, abs=1e-15)
    collapsed = torch.zeros(8, 4, dtype=torch.float64)
    collapsed[:, 2] = 1.0
    assert float(load_balancing_loss(collapsed, torch.full((8, 1), 2), cfg)) == pytest.approx(4.0, abs=1e-15)
    logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    want = (math.log(2) ** 2 + (1 + math.log(2)) ** 2) / 2  # logsumexp of [a, a] is a + log 2
    assert float(z_loss(logits)) == pytest.approx(want, abs=1e-14)


# -- equal to one process ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2), (4, 4), (4, 2)], ids=["ep1", "ep2", "ep4", "ep2xdp2"])
def test_expert_parallel_layer_equals_one_process(world, ep):
    """Experts 4 and 8, top-1 and top-2, dropless and capacity factor 1 (with 8 experts, one shared expert too):
    outputs, routing, the same choices dropped, the aux loss, every expert's gradient, the router's, the shared
    expert's and the input's."""
    res = cu.run(WORKER, world, timeout=180, ep=ep, sweep=True)
    assert len(res[0]["cases"]) == len(SWEEP) == 8
    for i in range(len(SWEEP)):
        cases = _cases(res, i)
        cfg = MoEConfig(**cases[0]["config"])
        ref = reference(cfg, res[0])
        assert compare(cases, ref, world, ep) == [], cfg
        y = torch.cat([c["y"] for c in cases])
        assert float((y - ref["y"]).abs().max()) <= TOLERANCE
        dropped = sum(c["dropped"] for c in cases)
        assert (dropped > 0) == (cfg.capacity_factor > 0), (cfg, dropped)  # the drop cases do drop
        held = sorted(e for c in cases for e in c["local_experts"])
        assert held == sorted(list(range(cfg.experts)) * (world // ep))  # each expert once per EP group
        for c in cases:  # an expert's gradient exists only where it lives
            assert {n.split(".")[1] for n in c["grads"] if n.startswith("experts.")} == {str(e) for e in c["local_experts"]}


def test_split_sizes_agree_between_sender_and_receiver():
    world, ep = 4, 2
    res = cu.run(WORKER, world, timeout=180, ep=ep, experts=8, top_k=2, capacity_factor=1.0)
    cases = _cases(res, 0)
    for r, c in enumerate(cases):
        group = [g for g in range(world) if g // ep == r // ep]  # the EP group: consecutive ranks
        for j, dest in enumerate(group):
            assert c["send_splits"][j] == cases[dest]["recv_splits"][group.index(r)]
        assert sum(c["send_splits"]) == c["kept"]  # every kept choice leaves once (dropped ones never leave)
        assert sum(c["tokens_per_local_expert"]) == sum(c["recv_splits"])
        assert c["dispatch_bytes"] == (c["kept"] - c["send_splits"][c["ep_rank"]]) * 16 * 8


@pytest.mark.parametrize("world, ep, top_k", [(2, 2, 1), (4, 4, 2), (4, 2, 2)])
def test_all_to_all_bytes_equal_the_model_when_routing_is_even(world, ep, top_k):
    """The model tokens x hidden x bytes x k x (n-1)/n assumes every expert gets as many tokens: route a batch so
    that they do, and each rank's dispatch (and combine) moves exactly that."""
    from course_utils.planner import all_to_all_bytes

    tokens = 64
    res = cu.run(WORKER, world, timeout=180, ep=ep, experts=8, top_k=top_k, balanced=True, tokens=tokens)
    for c in _cases(res, 0):
        model = all_to_all_bytes(tokens // world, 16, top_k, ep, 8)
        assert c["dispatch_bytes"] == c["combine_bytes"] == model
        assert c["counts"].tolist() == [tokens // world * top_k // 8] * 8


# -- the faults: each bug caught and named -------------------------------------------------------------------------

FAULTS = {
    "router_not_reduced": ["router.weight's gradient differs on ranks 0, 1, 2, 3", "never all-reduced"],
    "expert_grads_averaged_over_edp": ["exactly 2.00x the reference's = ep (2)", "not the world"],
    "combine_order_not_restored": ["the output differs at", "chose and kept the same experts"],
    "aux_loss_local_statistics": ["the load-balancing loss is", "whole batch"],
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_caught_and_named(fault):
    world, ep = 4, 2
    res = cu.run(WORKER, world, timeout=180, ep=ep, experts=8, top_k=2, capacity_factor=1.0, fault=fault)
    cases = _cases(res, 0)
    found = compare(cases, reference(MoEConfig(**cases[0]["config"]), res[0]), world, ep)
    assert found, fault
    text = " | ".join(found)
    for fragment in FAULTS[fault]:
        assert fragment in text, (fault, found)


# -- refused before launch -----------------------------------------------------------------------------------------

@pytest.mark.once  # what is refused does not depend on a CPU's kernels
@pytest.mark.parametrize("params, fragment", [
    ({"ep": 4, "experts": 6}, "ep=4 does not divide experts=6"),
    ({"experts": 4, "top_k": 5}, "top_k=5 must be between 1 and experts=4"),
    ({"ep": 3}, "ep=3 does not divide experts=4"),
    ({"tokens": 30}, "tokens=30 does not split evenly over world_size=4"),
    ({"fault": "swap_experts"}, "fault='swap_experts' is not one of"),
])
def test_invalid_layouts_are_refused_before_launch(params, fragment):
    with pytest.raises(InvalidParameter) as err:
        cu.run(WORKER, 4, timeout=60, **params)
    assert fragment in str(err.value)
