"""The Megatron block (with and without sequence parallelism) equals the dense block on real ranks, and the course's
GPT made of it trains like the same GPT in one process.

Tolerances: one forward/backward as in ``course_utils.tp_check`` (|got - want| <= 1e-5 + 1e-5 |want|,
float32 ranks against float64 dense); training: the losses of 4 Adam steps within ``tp_check.LOSS_RTOL`` = 1e-5
relative, the final parameters within ``tp_check.PARAM_RTOL`` = 5e-3 of their tensor's largest entry (measured and
explained next to the constants).
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


CASES = [{}, {"sequence_parallel": True}, {"heads": 8, "kv_heads": 2, "activation": "swiglu"},
         {"sequence_parallel": True, "kv_heads": 1, "hidden_dropout": 0.1}]


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
                                               (4, {"sequence_parallel": True, "heads": 8, "kv_heads": 2}),
                                               (2, {"sequence_parallel": True, "kv_heads": 1, "activation": "swiglu",
                                                    "hidden_dropout": 0.1})])
def test_the_gpt_trains_like_one_process(world_size, params):
    # The course's GPT made of two of the chapter's blocks, cut by ParallelGPT: same losses, same parameters.
    res, cfg = run(world_size, steps=STEPS, lr=LR, **params)
    run_ = tp_check.compare_training(res, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=LR)
    assert run_.ok, run_
    assert run_.ranks_agree  # every rank computes the whole loss from the whole logits: bit for bit the same
    assert run_.dense_losses[-1] < run_.dense_losses[0]  # it does train
    # every parameter of the GPT came back (embedding, positions, the layers, ln_f; the head is the embedding)
    assert len(run_.param_errors) == 2 + 2 * 12 + 2 and not run_.problems  # replicas (LayerNorms, KV copies) agree
    assert res[0]["model"]["tied"] and res[0]["model"]["layers"] == 2 and res[0]["model"]["hidden"] == cfg.hidden


@pytest.mark.parametrize("fault,sequence_parallel", [("drop_backward_all_reduce", False),
                                                     ("skip_parameter_grad_sync", True), ("drop_reduce_scatter", True)])
def test_a_broken_collective_shows_in_training(fault, sequence_parallel):
    # A gradient fault leaves the first loss right (the forward is right) and then the ranks drift: their
    # parameters miss by 0.14 to 0.21 of their largest entry after 4 steps (measured), 10 x the tolerance is 0.05.
    # drop_reduce_scatter breaks the forward itself: wrong from the first loss.
    res, cfg = run(2, steps=STEPS, lr=LR, fault=fault, sequence_parallel=sequence_parallel)
    run_ = tp_check.compare_training(res, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=LR)
    assert not run_.ok and "losses" in run_.failed, run_
    assert run_.worst[1] > 10 * tp_check.PARAM_RTOL, run_
    first = max(abs(got[0] - run_.dense_losses[0]) / run_.dense_losses[0] for got in run_.losses)
    assert (not first <= tp_check.LOSS_RTOL) == (fault == "drop_reduce_scatter"), first  # NaN counts as off


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_the_plan_table_describes_the_modules(activation):
    # plan.BLOCK_PLAN is the TP plan as data; the modules carry the same facts on their parameters.
    from workers.parallel.block import ParallelBlock
    from workers.model.dense import BlockConfig, build
    from workers.parallel.plan import REPLICATED, ROW, block_plan

    cfg = BlockConfig(hidden=16, heads=4, activation=activation)
    block = ParallelBlock.from_dense(build("block", cfg))
    plan = block_plan(activation)
    assert {f"{m}.{p}" for m, p, _ in plan} == {n for n, _ in block.named_parameters()}
    for module, param, how in plan:
        p = block.get_parameter(f"{module}.{param}")
        want = None if how == REPLICATED else (1 if how == ROW else 0)
        assert getattr(p, "partition_dim", None) == want, (module, param, how)


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_parallel_groups_inside_one_world(tp):
    # World 4 split into groups of tp ranks: each group is a complete tensor-parallel block on its own,
    # and every group must equal the dense block (compare checks each group separately).
    res, cfg = run(4, tp=tp, sequence_parallel=True, heads=8, kv_heads=1)
    assert [d["tp_group_ranks"] for d in res.ranks][0] == list(range(tp))
    assert [d["tp"] for d in res.ranks] == [tp] * 4
    assert [d["tp_group"] for d in res.ranks] == [r // tp for r in range(4)]
    assert len(tp_check.tensor_parallel_groups(res)) == 4 // tp
    report = tp_check.compare(res, "block", cfg, seq=SEQ, batch=BATCH)
    assert report.ok, report
    broken, cfg = run(4, tp=2, fault="drop_forward_all_reduce")
    assert not tp_check.compare(broken, "block", cfg, seq=SEQ, batch=BATCH).ok


def test_two_gpts_train_side_by_side_in_one_world():
    # tp=2 on 4 ranks: two TP groups, each training its own copy of the GPT; each group is put back together and
    # compared on its own.
    res, cfg = run(4, tp=2, steps=STEPS, lr=LR, sequence_parallel=True)
    run_ = tp_check.compare_training(res, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=LR)
    assert run_.ok and run_.ranks_agree, run_
    assert len(tp_check.tensor_parallel_groups(res)) == 2


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_a_refused_block_creates_no_process_group(activation):
    # kv_heads=1 < tp=2 replicates the KV head, so the attention makes a KV-replica group; ffn=33 does
    # not split over 2 ranks. Every size must be checked before any dist.new_group: a group made and then
    # abandoned by the refusal stays on the warm ranks, one more per failed attempt.
    res = cu.run("tests.rank_helpers.block_refusals", world_size=2, kv_heads=1, ffn=33,
                 activation=activation, timeout=60)
    for r in res.ranks:
        assert r["new_group_calls"] == 0 and r["groups_added"] == 0, r
        assert r["error"].startswith("ffn=33 is not divisible by tp=2"), r["error"]


def test_the_worker_refuses_in_one_sentence_before_launching():
    with pytest.raises(cu.InvalidParameter, match=r"tp=3 does not divide the 4 ranks: choose 1, 2 or 4"):
        cu.run(WORKER, world_size=4, tp=3)
    with pytest.raises(cu.InvalidParameter, match=r"tp=2 does not divide ffn=33: choose 1, 3, 11 or 33"):
        cu.run(WORKER, world_size=2, ffn=33)
    with pytest.raises(cu.InvalidParameter, match=r"steps=-1 must be at least 0; tp=3 does not divide the 2 ranks"):
        cu.run(WORKER, world_size=2, steps=-1, tp=3)
