"""Column-parallel, row-parallel and the Megatron MLP on real ranks (gloo, CPU) equal the dense modules.

Each run: every rank builds the same dense module from one seed, keeps its shard with ``from_dense``,
runs forward and backward on its part of one input; the test rebuilds the full output, input gradient
and every parameter gradient from the ranks' shards and compares them with the dense module computed
here in float64 (``course_utils.tp_check``: |got - want| <= 1e-5 + 1e-5 |want|, float32 on the ranks).

Start here when adding a tensor-parallel layer: write its ``from_dense``, add a case below that runs it through
``workers/ch04_tp_layers.py`` (or a worker of its own), and compare with ``tp_check.compare``: outputs and every
gradient, against the dense module, at every TP size the world allows.
"""
import pytest
import torch

import course_utils as cu
from course_utils import tp_check
from workers.model.dense import build
from workers.parallel.layers import ColumnParallelLinear, RowParallelLinear
from workers.parallel.mlp import naive_rows, swiglu_rows

pytestmark = pytest.mark.ranks
WORKER = "workers.ch04_tp_layers"
SEQ, BATCH = 4, 2


def run(world_size, **params):
    res = cu.run(WORKER, world_size=world_size, seq=SEQ, batch=BATCH, **params)
    return res, tp_check.config_of(res[0]["config"])


CASES = [("column", {}), ("column", {"gather_output": True}), ("row", {}), ("row", {"input_is_parallel": False}),
         ("mlp", {}), ("mlp", {"activation": "swiglu"}), ("mlp", {"bias": False, "ffn": 24})]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("module,extra", CASES, ids=lambda c: str(c))
def test_sharded_module_equals_dense_outputs_and_every_gradient(world_size, module, extra):
    res, cfg = run(world_size, module=module, **extra)
    report = tp_check.compare(res, module, cfg, seq=SEQ, batch=BATCH)
    assert report.ok, report
    # every tensor of the dense module was compared: output, input gradient, all parameter gradients
    dense_params = {n for n, _ in build(module, cfg).named_parameters()}
    assert set(report.errors) == {"output", "grad_input"} | {f"grads.{n}" for n in dense_params}


@pytest.mark.parametrize("world_size", [2, 4])
def test_row_bias_is_replicated_with_identical_gradients(world_size):
    # The bias is added once, to the all-reduced (replicated) output, so every rank computes the same
    # gradient for it from the same replicated output gradient: bit for bit, not just within tolerance.
    res, _ = run(world_size, module="mlp")
    grads = [r["grads"]["fc2.bias"] for r in res.ranks]
    assert all(g["dim"] == -1 for g in grads)
    assert all(torch.equal(g["value"], grads[0]["value"]) for g in grads)
    assert grads[0]["value"].abs().sum() > 0


@pytest.mark.parametrize("fault", ["bias_before_reduce", "drop_forward_all_reduce", "drop_backward_all_reduce",
                                   "double_all_reduce", "misplaced_all_reduce"])
def test_a_broken_collective_is_caught_by_the_equivalence_check(fault):
    # The same check that passes above must fail when one collective is dropped, doubled or misplaced.
    res, cfg = run(2, module="mlp", fault=fault)
    report = tp_check.compare(res, "mlp", cfg, seq=SEQ, batch=BATCH)
    assert not report.ok
    assert report.worst[1] > 1e-2, report


def test_bias_added_on_every_rank_shifts_the_output_by_t_minus_1_biases():
    world = 4
    res, cfg = run(world, module="row", fault="bias_before_reduce")
    dense = build("row", cfg)
    got = res[0]["output"]["value"].double()
    want = tp_check.D.reference("row", cfg, SEQ, BATCH)["output"]
    assert torch.allclose(got - want, (world - 1) * dense.bias.detach().double().expand_as(want), atol=1e-5)


def test_invalid_sizes_are_refused_in_one_sentence():
    with pytest.raises(cu.InvalidParameter, match="tp=4 does not divide ffn=18: choose 1, 2, 3, 6, 9 or 18"):
        cu.run(WORKER, world_size=4, module="mlp", ffn=18)
    with pytest.raises(cu.InvalidParameter, match="tp=3 does not divide the 4 ranks: choose 1, 2 or 4"):
        cu.run(WORKER, world_size=4, tp=3)
    with pytest.raises(cu.InvalidParameter, match="module='block' is not one of 'column', 'row' or 'mlp'"):
        cu.run(WORKER, world_size=2, module="block")


# -- no ranks needed: how from_dense cuts the weights -------------------------------------------------

def test_from_dense_keeps_the_right_rows_and_columns():
    torch.manual_seed(0)
    dense = torch.nn.Linear(6, 8)
    # outside a process group the layers behave as TP 1; the split itself is checked through the indices
    col = ColumnParallelLinear.from_dense(dense)
    row = RowParallelLinear.from_dense(dense)
    assert torch.equal(col.weight, dense.weight) and col.weight.partition_dim == 0
    assert torch.equal(row.weight, dense.weight) and row.weight.partition_dim == 1
    assert not hasattr(row.bias, "partition_dim")  # replicated


def test_swiglu_rows_pair_gate_and_up_while_the_naive_chunk_does_not():
    ffn, tp = 8, 2
    assert swiglu_rows(ffn, 0, tp).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert swiglu_rows(ffn, 1, tp).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert naive_rows(ffn, 0, tp).tolist() == list(range(8))  # all gate, no up


def test_naive_swiglu_split_runs_and_is_wrong():
    res, cfg = run(2, module="mlp", activation="swiglu", split="naive")
    assert not tp_check.compare(res, "mlp", cfg, seq=SEQ, batch=BATCH).ok
