"""The Megatron block (with and without sequence parallelism) equals the dense block on real ranks, and trains
to the same losses.

Tolerances: one forward/backward as in ``course_utils.tp_check`` (|got - want| <= 1e-5 + 1e-5 |want|,
float32 ranks against float64 dense); losses of 4 Adam steps within 1e-5 relative of the dense block's.
"""
import pytest
import torch

import course_utils as cu
from course_utils import tp_check

pytestmark = pytest.mark.ranks
WORKER = "workers.ch06_block"
SEQ, BATCH = 8, 2
REPLICATED = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attention.proj.bias", "mlp.fc2.bias")


def run(world_size, **params):
    res = cu.run(WORKER, world_size=world_size, seq=SEQ, batch=BATCH, **params)
    return res, tp_check.config_of(res[0]["config"])


CASES = [{}, {"sequence_parallel": True}, {"n_heads": 8, "n_kv_heads": 2, "activation": "swiglu"},
         {"sequence_parallel": True, "n_kv_heads": 1, "hidden_dropout": 0.1}]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()) or "plain")
def test_block_equals_dense(world_size, params):
    res, cfg = run(world_size, **params)
    report = tp_check.compare(res, "block", cfg, seq=SEQ, batch=BATCH)
    assert report.ok, report
    assert len(report.errors) == 2 + 12  # output, input gradient, every parameter of the block


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_replicated_parameters_get_identical_gradients_on_every_rank(sequence_parallel):
    # Without SP these parameters act on the replicated tensor: every rank computes the same gradient.
    # With SP each rank sees its own rows, and f sums the partial gradients: identical again, bit for bit.
    res, _ = run(4, sequence_parallel=sequence_parallel)
    for name in REPLICATED:
        grads = [r["grads"][name]["value"] for r in res.ranks]
        assert all(torch.equal(g, grads[0]) for g in grads), name
        assert grads[0].abs().sum() > 0, name


@pytest.mark.parametrize("fault", ["drop_reduce_scatter", "skip_parameter_grad_sync", "drop_backward_all_reduce"])
def test_broken_sequence_parallelism_is_caught(fault):
    res, cfg = run(2, sequence_parallel=True, fault=fault)
    report = tp_check.compare(res, "block", cfg, seq=SEQ, batch=BATCH)
    assert not report.ok
    if fault == "skip_parameter_grad_sync":  # the forward is still right: only LayerNorm/bias grads are partial
        assert report.errors["output"] < 1e-5
        assert any(name.startswith("grads.ln") for name in report.failed) or report.problems


STEPS, LR = 4, 1e-3


@pytest.mark.parametrize("world_size,params", [(1, {}), (2, {}), (4, {}), (2, {"sequence_parallel": True}),
                                               (4, {"sequence_parallel": True, "n_heads": 8, "n_kv_heads": 2})])
def test_training_steps_give_the_dense_losses(world_size, params):
    res, cfg = run(world_size, steps=STEPS, lr=LR, **params)
    want, got, worst = tp_check.compare_training(res, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=LR)
    assert worst < 1e-5, (want, got)
    assert want[-1] < want[0]  # it does train
    # replicated parameters (and replicated KV heads) are still identical on every rank after the steps
    _, problems = tp_check.assemble([r["params"] for r in res.ranks],
                                    {n: tuple(t.shape) for n, t in tp_check.D.build("block", cfg).state_dict().items()})
    assert not problems, problems


def test_training_with_a_missing_backward_all_reduce_drifts_from_dense():
    # LayerNorm gradients miss the other ranks' contributions; the first loss is right, then they drift.
    res, cfg = run(2, steps=STEPS, lr=10 * LR, fault="drop_backward_all_reduce")
    want, got, worst = tp_check.compare_training(res, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=10 * LR)
    assert abs(got[0][0] - want[0]) < 1e-5 * want[0]
    assert worst > 1e-4, (want, got)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_the_plan_table_describes_the_modules(activation):
    # plan.BLOCK_PLAN is the TP plan as data; the modules carry the same facts on their parameters.
    from workers.parallel.block import ParallelBlock
    from workers.parallel.dense import BlockConfig, build
    from workers.parallel.plan import REPLICATED, ROW, block_plan

    cfg = BlockConfig(hidden=16, n_heads=4, activation=activation)
    block = ParallelBlock.from_dense(build("block", cfg))
    plan = block_plan(activation)
    assert {f"{m}.{p}" for m, p, _ in plan} == {n for n, _ in block.named_parameters()}
    for module, param, how in plan:
        p = block.get_parameter(f"{module}.{param}")
        want = None if how == REPLICATED else (1 if how == ROW else 0)
        assert getattr(p, "partition_dim", None) == want, (module, param, how)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_tensor_parallel_groups_inside_one_world(tp_size):
    # World 4 split into groups of tp_size ranks: each group is a complete tensor-parallel block on its own,
    # and every group must equal the dense block (compare checks each group separately).
    res, cfg = run(4, tp_size=tp_size, sequence_parallel=True, n_heads=8, n_kv_heads=1)
    assert [d["tp_group_ranks"] for d in res.ranks][0] == list(range(tp_size))
    assert len(tp_check.tensor_parallel_groups(res)) == 4 // tp_size
    report = tp_check.compare(res, "block", cfg, seq=SEQ, batch=BATCH)
    assert report.ok, report
    broken, cfg = run(4, tp_size=2, fault="drop_forward_all_reduce")
    assert not tp_check.compare(broken, "block", cfg, seq=SEQ, batch=BATCH).ok


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_a_refused_block_creates_no_process_group(activation):
    # n_kv_heads=1 < tp=2 replicates the KV head, so the attention makes a KV-replica group; ffn_hidden=33 does
    # not split over 2 ranks. Every size must be checked before any dist.new_group: a group made and then
    # abandoned by the refusal stays on the warm ranks, one more per failed attempt.
    res = cu.run("tests.rank_helpers.block_refusals", world_size=2, n_kv_heads=1, ffn_hidden=33,
                 activation=activation, timeout=60)
    for r in res.ranks:
        assert r["new_group_calls"] == 0 and r["groups_added"] == 0, r
        assert r["error"] == ("ffn_hidden=33 is not divisible by the tensor-parallel size 2: "
                              "choose a tensor-parallel size that divides 33")
