"""Ring vs tree all-reduce models, the ECMP balls-into-bins simulation, and the runbook (course_utils.*)."""
import math
from fractions import Fraction

import numpy as np
import pytest

from course_utils import collective_models as cm
from course_utils import ecmp, runbook
from course_utils.ledger import collective_time

P = cm.ModelParams()


def test_ring_with_one_latency_is_the_ledgers_collective_time():
    # Same alpha for NVLink and network hops: the model must reduce to chapter 01's formula exactly.
    p = cm.ModelParams(alpha_nvlink=3e-6, alpha_net=3e-6, nvlink_bus_bandwidth=400e9)
    for nodes in (1, 2, 32, 1024):
        n = nodes * p.gpus_per_node
        for size in (1 << 10, 1 << 30):
            want = collective_time("all_reduce", size, n, cm.ring_bus_bandwidth(nodes, p), 3e-6)
            assert cm.allreduce_time("ring", size, nodes, p) == pytest.approx(want, rel=1e-12)


def test_ring_latency_is_linear_and_tree_latency_logarithmic_in_nodes():
    # Ring: 2(N-1) steps, so doubling the nodes ~doubles it. Tree (NCCL 2.4 double binary trees): each doubling
    # of the nodes adds one level, i.e. exactly 2 x alpha_net.
    for nodes in (32, 128, 512):
        ring1, ring2 = cm.ring_allreduce(nodes, P).latency, cm.ring_allreduce(2 * nodes, P).latency
        assert ring2 / ring1 == pytest.approx(2, rel=0.01)
        tree1, tree2 = cm.tree_allreduce(nodes, P).latency, cm.tree_allreduce(2 * nodes, P).latency
        assert tree2 - tree1 == pytest.approx(2 * P.alpha_net, rel=1e-12)


def test_crossover_is_where_the_times_meet_and_moves_up_with_scale():
    prev = 0
    for nodes in (2, 8, 32, 128, 1024):
        s = cm.crossover_bytes(nodes, P)
        assert cm.allreduce_time("ring", s, nodes, P) == pytest.approx(cm.allreduce_time("tree", s, nodes, P), rel=1e-9)
        assert cm.winner(s / 2, nodes, P) == "tree" and cm.winner(s * 2, nodes, P) == "ring"
        assert s > prev  # the ring's latency grows faster than the tree's, so it needs ever larger messages
        prev = s


def test_at_1024_nodes_the_tree_wins_every_practical_gradient_bucket():
    assert all(cm.winner(s, 1024, P) == "tree" for s in (1 << 20, 64 << 20, 1 << 30, 8 << 30))
    assert cm.winner(8 << 30, 2, P) == "ring"  # ...while on 2 nodes the ring wins large messages


def test_without_a_tree_bandwidth_penalty_the_ring_hardly_ever_wins():
    # With tree_efficiency = 1 the tree moves 2S against the ring's 2(N-1)/N S: the ring's only edge is 1/N.
    p = cm.ModelParams(tree_efficiency=1.0)
    # at 32 nodes (N = 256) that edge is 1/256 against 1/0.9 - 1 + 1/256: a crossover ~29x further out
    assert cm.crossover_bytes(32, p) > 20 * cm.crossover_bytes(32, P)


def test_modelled_busbw_approaches_the_nic_limit_for_large_messages():
    assert cm.busbw("ring", 64 << 30, 32, P) == pytest.approx(P.node_network_bandwidth, rel=0.01)


@pytest.mark.parametrize("flows, links, exact", [(2, 2, Fraction(3, 2)), (3, 3, Fraction(51, 27)), (1, 8, 1),
                                                 (4, 1, 4)])
def test_expected_max_load_matches_hand_counted_cases(flows, links, exact):
    # 3 flows on 3 links: 6/27 all apart (max 1), 3/27 all together (max 3), 18/27 two together (max 2).
    assert ecmp.expected_max_load(flows, links) == pytest.approx(float(exact), abs=1e-12)


@pytest.mark.parametrize("flows, links", [(16, 16), (64, 16), (8, 32)])
def test_simulation_agrees_with_the_exact_expectation(flows, links):
    # 20000 seeded trials: the simulated mean must sit within 4 standard errors of the exact expectation.
    loads = ecmp.simulate_link_loads(flows, links, trials=20_000, seed=1)
    assert (loads.sum(axis=1) == flows).all()  # every flow lands somewhere, once
    maxima = loads.max(axis=1)
    se = maxima.std() / math.sqrt(len(maxima))
    assert abs(maxima.mean() - ecmp.expected_max_load(flows, links)) < 4 * se


def test_more_qps_even_the_load():
    rows = ecmp.qp_sweep(pairs=16, links=16, qps_list=(1, 2, 4, 8), trials=2000)
    eff = [r["efficiency"] for r in rows]
    assert eff == sorted(eff) and eff[0] < 0.5 and eff[-1] > eff[0] + 0.2


def test_runbook_goes_from_one_node_to_bisection():
    titles = [s.title for s in runbook.RUNBOOK]
    assert titles[0] == "Each node alone" and titles[-1] == "Stragglers by bisection"
    assert titles.index("Nodes in pairs") < titles.index("All nodes") < titles.index("What NCCL chose")
    text = runbook.render()
    assert text.count("   check:") == len(runbook.RUNBOOK) and "NCCL_DEBUG=INFO" in text
