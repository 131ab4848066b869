"""What crosses the wire: collectives counted per layer and pass, bytes against the formulas.

Megatron (Shoeybi et al. 2019, sec. 3): one all-reduce forward (g, after the row-parallel layer) and one
backward (f, before the column-parallel layer) per MLP and per attention, so 2 + 2 per block, each of a
b*s*h activation; a ring all-reduce sends 2(t-1)/t of it per rank (``course_utils.ledger.tp_comm_bytes_per_layer``).
Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2) swaps each all-reduce for an all-gather and a
reduce-scatter of the same total volume. The counts come from the ledger on the ranks
(``workers/parallel/comm_stats.py``), which sees every collective the mappings run.
"""
import pytest

import course_utils as cu
from course_utils import tp_check
from course_utils.ledger import tp_comm_bytes_per_layer
from workers.parallel.comm_stats import message_bytes, wire_factor

pytestmark = pytest.mark.ranks
SEQ, BATCH, HIDDEN, FP32 = 8, 2, 32, 4


def activation_rows(res, rank=0):
    return [(r["scope"], r["collective"], r["pass"], r["calls"]) for r in tp_check.comm_rows(res, rank)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_one_all_reduce_each_way_with_the_ring_bytes(world_size):
    res = cu.run("workers.ch04_tp_layers", world_size=world_size, module="mlp", hidden=HIDDEN, seq=SEQ, batch=BATCH)
    for rank in range(world_size):
        # g after fc2 in forward, f before fc1 in backward: and nothing else
        assert sorted(activation_rows(res, rank)) == [("fc1", "all_reduce", "backward", 1),
                                                      ("fc2", "all_reduce", "forward", 1)]
    per_all_reduce = tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, world_size, bytes_per_element=FP32)
    for row in tp_check.comm_rows(res):
        assert row["message_bytes"] == per_all_reduce.message_bytes == BATCH * SEQ * HIDDEN * FP32
        assert row["wire_bytes"] == pytest.approx(per_all_reduce.wire_bytes_per_all_reduce)
        assert row["wire_bytes"] == pytest.approx(2 * (world_size - 1) / world_size * BATCH * SEQ * HIDDEN * FP32)


def test_tp_1_communicates_nothing():
    res = cu.run("workers.ch06_block", world_size=1, hidden=HIDDEN, seq=SEQ, batch=BATCH)
    assert res[0]["comm"] == []


@pytest.mark.parametrize("world_size", [2, 4])
def test_attention_one_all_reduce_each_way(world_size):
    res = cu.run("workers.ch05_attention_tp", world_size=world_size, hidden=HIDDEN, heads=4, seq=SEQ, batch=BATCH)
    assert sorted(activation_rows(res)) == [("proj", "all_reduce", "forward", 1), ("qkv", "all_reduce", "backward", 1)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_block_two_plus_two_all_reduces_and_the_ledger_bytes(world_size):
    res = cu.run("workers.ch06_block", world_size=world_size, hidden=HIDDEN, seq=SEQ, batch=BATCH)
    assert sorted(activation_rows(res)) == [
        ("attention.proj", "all_reduce", "forward", 1), ("attention.qkv", "all_reduce", "backward", 1),
        ("mlp.fc1", "all_reduce", "backward", 1), ("mlp.fc2", "all_reduce", "forward", 1)]
    assert tp_check.comm_rows(res, kind="parameter") == []  # no gradient syncs without SP or replicated KV
    expected = tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, world_size, bytes_per_element=FP32)
    assert expected.all_reduces_forward == tp_check.comm_count(res, "all_reduce", "forward") == 2
    assert expected.all_reduces_backward == tp_check.comm_count(res, "all_reduce", "backward") == 2
    assert tp_check.comm_wire_bytes(res) == pytest.approx(expected.total_wire_bytes)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallel_block_swaps_each_all_reduce_for_reduce_scatter_plus_all_gather(world_size):
    res = cu.run("workers.ch06_block", world_size=world_size, hidden=HIDDEN, seq=SEQ, batch=BATCH,
                 sequence_parallel=True)
    rows = sorted(activation_rows(res))
    assert rows == sorted([
        ("attention.qkv", "all_gather", "forward", 1), ("attention.proj", "reduce_scatter", "forward", 1),
        ("mlp.fc1", "all_gather", "forward", 1), ("mlp.fc2", "reduce_scatter", "forward", 1),
        ("mlp.fc2", "all_gather", "backward", 1), ("mlp.fc1", "reduce_scatter", "backward", 1),
        ("attention.proj", "all_gather", "backward", 1), ("attention.qkv", "reduce_scatter", "backward", 1)])
    assert tp_check.comm_count(res, "all_reduce", "forward") == 0
    for row in tp_check.comm_rows(res):  # every one of them moves a whole b*s*h activation
        assert row["message_bytes"] == BATCH * SEQ * HIDDEN * FP32
    # same wire bytes as the four all-reduces it replaces
    expected = tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, world_size, bytes_per_element=FP32)
    assert tp_check.comm_wire_bytes(res) == pytest.approx(expected.total_wire_bytes)
    # and the replicated parameters' gradient sums, backward only: 2 LayerNorms x 2 + 2 row biases
    params = tp_check.comm_rows(res, kind="parameter")
    assert sum(r["calls"] for r in params) == 6 and all(r["pass"] == "backward" for r in params)


@pytest.mark.parametrize("fault,forward,backward", [
    ("drop_forward_all_reduce", 0, 2),   # dropped: one fewer in each layer's forward
    ("drop_backward_all_reduce", 2, 0),
    ("double_all_reduce", 4, 2),         # doubled
])
def test_counts_see_a_dropped_or_doubled_collective(fault, forward, backward):
    res = cu.run("workers.ch06_block", world_size=2, hidden=HIDDEN, seq=SEQ, batch=BATCH, fault=fault)
    assert tp_check.comm_count(res, "all_reduce", "forward") == forward
    assert tp_check.comm_count(res, "all_reduce", "backward") == backward


def test_a_misplaced_all_reduce_has_the_right_count_in_the_wrong_layer():
    # The backward all-reduce moved from before the column layer (f) into the row layer's g: 2 + 2 still,
    # so counting alone cannot catch it; the ledger's scopes can, and the equivalence check does.
    res = cu.run("workers.ch06_block", world_size=2, hidden=HIDDEN, seq=SEQ, batch=BATCH, fault="misplaced_all_reduce")
    assert tp_check.comm_count(res, "all_reduce", "forward") == 2
    assert tp_check.comm_count(res, "all_reduce", "backward") == 2
    backward_scopes = sorted(r[0] for r in activation_rows(res) if r[2] == "backward")
    assert backward_scopes == ["attention.proj", "mlp.fc2"]  # should be attention.qkv and mlp.fc1
    assert not tp_check.compare(res, "block", tp_check.config_of(res[0]["config"]), seq=SEQ, batch=BATCH).ok


def test_wire_factors_are_the_ring_algorithms():
    assert wire_factor("all_reduce", 4) == 1.5 and wire_factor("all_gather", 4) == 0.75
    assert wire_factor("reduce_scatter", 2) == 0.5 and wire_factor("all_reduce", 1) == 0.0
    assert message_bytes("all_gather", 100, 4) == 400 and message_bytes("reduce_scatter", 400, 4) == 400


def test_groups_of_two_inside_a_world_of_four_send_the_bytes_of_tp_2():
    res = cu.run("workers.ch06_block", world_size=4, tp=2, hidden=HIDDEN, seq=SEQ, batch=BATCH)
    expected = tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, 2, bytes_per_element=FP32)
    for rank in range(4):
        assert tp_check.comm_count(res, "all_reduce", "forward", rank) == 2
        assert tp_check.comm_wire_bytes(res, rank) == pytest.approx(expected.total_wire_bytes)
        assert all(r["group_size"] == 2 for r in res[rank]["comm"])
