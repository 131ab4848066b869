"""Attention split by heads, with GQA (split or replicated KV heads), equals the dense module on real ranks.

Tolerance as in ``course_utils.tp_check``: float32 on the ranks, |got - want| <= 1e-5 + 1e-5 |want|
against the dense module in float64.
"""
import pytest
import torch

import course_utils as cu
from course_utils import tp_check
from workers.parallel.attention import head_problem, kv_heads_for_rank, naive_qkv_rows, qkv_rows

pytestmark = pytest.mark.ranks
WORKER = "workers.ch05_attention_tp"
SEQ, BATCH = 8, 2


def run(world_size, **params):
    res = cu.run(WORKER, world_size=world_size, seq=SEQ, batch=BATCH, **params)
    return res, tp_check.config_of(res[0]["config"])


CASES = [
    {"heads": 4},  # multi-head
    {"heads": 8, "kv_heads": 4},  # GQA, KV heads split at TP 2 and 4
    {"heads": 8, "kv_heads": 2},  # GQA: split at TP 2, replicated twice at TP 4
    {"heads": 4, "kv_heads": 1},  # MQA: replicated on every rank
    {"heads": 4, "causal": False},
    {"heads": 8, "kv_heads": 2, "sequence_parallel": True},
]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_attention_by_head_equals_dense(world_size, params):
    res, cfg = run(world_size, **params)
    report = tp_check.compare(res, "attention", cfg, seq=SEQ, batch=BATCH)
    assert report.ok, report
    assert len(report.errors) == 6  # output, input grad, qkv.weight, qkv.bias, proj.weight, proj.bias


def test_replicated_kv_heads_get_identical_summed_gradients():
    # TP 4 with 2 KV heads: ranks 0,1 hold KV head 0 and ranks 2,3 KV head 1. Each copy sees only its
    # own query heads, so without a sum its gradient would be partial; with f over the copies it is the
    # full gradient, the same bit for bit on both copies.
    res, cfg = run(4, heads=8, kv_heads=2)
    assert [r["kv_head_ids"] for r in res.ranks] == [[0], [0], [1], [1]]
    q_rows = 2 * cfg.head_dim  # 2 query heads per rank come first in the local QKV weight
    grads = [r["grads"]["qkv.weight"]["value"][q_rows:] for r in res.ranks]
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[2], grads[3])
    assert not torch.equal(grads[0], grads[2])
    kv_syncs = [row for row in tp_check.comm_rows(res, kind="parameter") if row["scope"].endswith("kv_copies")]
    assert sum(row["calls"] for row in kv_syncs) == 2  # weight and bias, backward only
    assert all(row["pass"] == "backward" and row["collective"] == "all_reduce" for row in kv_syncs)
    # chapter 05's table models exactly these all-reduces: 2 d h weight and 2 d bias elements, float32 here
    from course_utils.tp_viz import kv_copy_grad_sync

    model = kv_copy_grad_sync(cfg.hidden, 8, 2, 4, bytes_per_element=4, bias=True)
    assert model["all_reduces"] == 2 and model["copies"] == 2
    assert sum(row["message_bytes"] for row in kv_syncs) == sum(model["message_bytes"])
    assert abs(sum(row["wire_bytes"] for row in kv_syncs) - model["wire_bytes"]) < 1e-9


def test_replicated_kv_heads_without_the_gradient_sum_are_caught():
    res, cfg = run(4, heads=8, kv_heads=2, fault="skip_parameter_grad_sync")
    report = tp_check.compare(res, "attention", cfg, seq=SEQ, batch=BATCH)
    assert not report.ok
    assert any("qkv.weight" in p for p in report.problems + report.failed)


@pytest.mark.parametrize("world_size", [2, 4])
def test_naive_chunking_of_fused_qkv_runs_and_is_wrong(world_size):
    res, cfg = run(world_size, heads=4, split="naive")
    report = tp_check.compare(res, "attention", cfg, seq=SEQ, batch=BATCH)
    assert not report.ok and report.errors["output"] > 1e-2


@pytest.mark.parametrize("fault", ["drop_forward_all_reduce", "drop_backward_all_reduce", "double_all_reduce"])
def test_broken_collectives_in_attention_are_caught(fault):
    res, cfg = run(2, heads=4, fault=fault)
    assert not tp_check.compare(res, "attention", cfg, seq=SEQ, batch=BATCH).ok


@pytest.mark.parametrize("world_size,params,fragment", [
    (4, {"heads": 6}, "tp=4 does not divide heads=6: choose 1, 2, 3 or 6"),
    (4, {"heads": 12, "kv_heads": 6}, "tp=4 and kv_heads=6 do not divide one another"),
    (4, {"tp": 3}, "tp=3 does not divide the 4 ranks: choose 1, 2 or 4"),
    (2, {"dtype": "float16", "split": "sideways"},
     "dtype='float16' is not one of 'float32' or 'float64'; split='sideways' is not one of 'right' or 'naive'"),
])
def test_invalid_head_counts_are_refused_in_one_sentence(world_size, params, fragment):
    with pytest.raises(cu.InvalidParameter, match=fragment):
        cu.run(WORKER, world_size=world_size, hidden=48, **params)


# -- a saved notebook's old names still run, one release -------------------------------------------------

def test_a_saved_notebooks_old_keywords_still_run_with_a_warning_naming_the_new_ones():
    # A learner's notebook saved before the rename says tp_size= and n_heads=: cu.run translates each into its new
    # name (workers/runtime.py: RENAMED) with a FutureWarning, and the run is the one the new names give.
    with pytest.warns(FutureWarning) as caught:
        old = cu.run(WORKER, world_size=2, tp_size=2, n_heads=4, n_kv_heads=2, seq=SEQ, batch=BATCH)
    said = " ".join(str(w.message) for w in caught)
    for before, after in (("tp_size", "tp"), ("n_heads", "heads"), ("n_kv_heads", "kv_heads")):
        assert f"{before}= is now called {after}=" in said, said
    new, cfg = run(2, tp=2, heads=4, kv_heads=2)
    assert (cfg.heads, cfg.kv_heads) == (4, 2) and old[0]["config"] == new[0]["config"]
    assert [r["tp"] for r in old.ranks] == [2, 2] and [r["kv_head_ids"] for r in old.ranks] == [[0], [1]]
    assert tp_check.compare(old, "attention", cfg, seq=SEQ, batch=BATCH).ok
    with pytest.warns(FutureWarning), pytest.raises(cu.InvalidParameter, match="tp=3 does not divide the 2 ranks"):
        cu.run(WORKER, world_size=2, tp_size=3)  # an old name is refused in the new one's words


def test_a_saved_answer_with_the_old_parameter_names_still_passes():
    # The exercises' parameters were renamed (heads, kv_heads, tp); the checks call the answer positionally, so
    # an answer written against the old signature is graded the same.
    from course_utils.exercises import PASS, check

    def kv_heads_for_rank(n_heads, n_kv_heads, world_size, rank):
        group = n_heads // n_kv_heads
        q_per = n_heads // world_size
        return sorted({j // group for j in range(rank * q_per, (rank + 1) * q_per)})

    verdict = check("kv_heads_for_rank", kv_heads_for_rank)
    assert verdict.status == PASS, verdict.message


# -- no ranks needed -----------------------------------------------------------------------------------

def test_head_aware_split_of_fused_qkv():
    # 4 query heads, 2 KV heads, head size 1: rows are q0 q1 q2 q3 | k0 k1 | v0 v1
    assert qkv_rows(4, 2, 1, 0, 2).tolist() == [0, 1, 4, 6]
    assert qkv_rows(4, 2, 1, 1, 2).tolist() == [2, 3, 5, 7]
    assert naive_qkv_rows(4, 2, 1, 0, 2).tolist() == [0, 1, 2, 3]  # rank 0 gets four query heads, no K or V
    # replicated KV: TP 4 over 2 KV heads -> ranks 0,1 read KV head 0, ranks 2,3 KV head 1
    assert [kv_heads_for_rank(8, 2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    assert qkv_rows(8, 2, 1, 3, 4).tolist() == [6, 7, 9, 11]


def test_head_problem_sentences():
    assert head_problem(8, 2, 4) is None and head_problem(8, 8, 4) is None and head_problem(8, 1, 8) is None
    # the course's one rule (workers/layout/rules.py: heads_problem), which the planner and chapter 15 ask too
    assert head_problem(6, 6, 4) == "tp=4 does not divide heads=6: choose 1, 2, 3 or 6"
    assert "do not divide one another" in head_problem(12, 6, 4)
    assert "not a multiple of kv_heads=3" in head_problem(8, 3, 1)


def test_kv_replica_groups_wait_as_long_as_the_world_not_torchs_30_minutes(monkeypatch):
    # dist.new_group without a timeout falls back to torch's 30-minute default: a hang in a replicated KV
    # head's gradient sum would then freeze a notebook for half an hour instead of the world's timeout.
    import datetime

    from workers.parallel import attention

    calls = []

    class FakeDist:  # a world of 4 ranks, seen from rank 0, that records the groups created
        def get_rank(self, group=None):
            return 0

        def get_world_size(self, group=None):
            return 4

        def get_process_group_ranks(self, group):
            return [0, 1, 2, 3]

        def new_group(self, ranks, timeout=None, **kwargs):
            calls.append((list(ranks), timeout))
            return f"group{ranks}"

    import torch.distributed

    monkeypatch.setattr(attention, "dist", FakeDist())
    monkeypatch.setattr(torch.distributed, "new_group", FakeDist().new_group)  # the groups: workers/layout/grid.py
    monkeypatch.setattr(attention, "group_size_rank", lambda group=None: (4, 0))
    monkeypatch.setenv("COURSE_COLLECTIVE_TIMEOUT", "12")
    group, created = attention.kv_replica_group(2, None)  # 2 KV heads on TP 4: each replicated on 2 ranks
    assert [ranks for ranks, _ in calls] == [[0, 1], [2, 3]]
    assert all(timeout == datetime.timedelta(seconds=12) for _, timeout in calls), calls
    assert group == "group[0, 1]" and created == [group]
