"""The embedding, the LM head and the cross-entropy split by vocabulary equal the dense ones; the loss's drills are
caught and named; the logits a rank holds are 1/tp of the dense logits.

Start here when changing ``workers/parallel/vocab.py``: every rank runs ``workers/ch04_vocab_parallel.py`` (gloo,
CPU) on its block of the vocabulary; the test puts the shards back together (``plan.assemble``) and compares them
with the dense ends computed here, in float64, with ``F.cross_entropy``. Tolerance: |got - want| <= 1e-12 of the
tensor's largest entry (float64 sums of a few dozen terms in another order agree to ~1e-16 of their size; measured
<= 6.7e-16 here, <= 5.2e-16 under ATEN_CPU_CAPABILITY=default: an exact property with a margin of 1000). The targets cover every word, so every rank's shard holds some of them, and the large-logit cases
scale the logits by 1e3, past float64's exp overflow (709.8): an unshifted exponential is infinite there.
"""
import functools
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils.paths import ROOT
from workers.parallel.plan import assemble
from workers.parallel.vocab import vocab_parallel_cross_entropy
from workers.parallel.vocab_harness import build_dense, make_tokens

pytestmark = pytest.mark.ranks
WORKER = "workers.ch04_vocab_parallel"
WORLD = 4  # tp = 1, 2 and 4 on one set of warm ranks: tp < 4 runs 4/tp groups side by side
SHAPE = dict(vocab=32, hidden=16, seq=8, batch=4)  # b s = 32 tokens: every word is a target once
RTOL = 1e-12
DRILLS = ("max_not_reduced", "target_not_masked", "sum_exp_not_reduced", "max_not_subtracted")


@functools.lru_cache(maxsize=None)
def run(tp: int, tied: bool = False, logit_scale: float = 1.0, fault: str = ""):
    return cu.run(WORKER, world_size=WORLD, tp=tp, tied=tied, logit_scale=logit_scale, fault=fault, **SHAPE)


def dense(tied: bool, logit_scale: float) -> dict:
    """The dense ends in one process, written here: loss per token [s, b], the logits and every gradient."""
    model = build_dense(SHAPE["vocab"], SHAPE["hidden"], tied=tied)
    tokens, targets = make_tokens(SHAPE["vocab"], SHAPE["batch"], SHAPE["seq"])
    x = model.embed(tokens).transpose(0, 1)  # [s, b, h]
    x.retain_grad()
    logits = model.head(x) * logit_scale  # [s, b, V]
    logits.retain_grad()
    losses = F.cross_entropy(logits.reshape(-1, SHAPE["vocab"]), targets.t().reshape(-1), reduction="none")
    losses.mean().backward()
    grads = {"embed.weight": model.embed.weight.grad, "input": x.grad, "logits": logits.grad}
    if not tied:
        grads["head.weight"] = model.head.weight.grad
    return {"losses": losses.detach().view(SHAPE["seq"], SHAPE["batch"]), "logits": logits.detach(), "grads": grads,
            "targets": targets}


def groups(res) -> list[list[dict]]:
    """The ranks' results, one list per tensor-parallel group."""
    by_group: dict[int, list[dict]] = {}
    for r in res.ranks:
        by_group.setdefault(r["tp_group"], []).append(r)
    return list(by_group.values())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()  # NaN stays NaN: `not err <= RTOL` fails it


@pytest.mark.parametrize("logit_scale", [1.0, 1e3], ids=["logits~1", "logits~1e3"])
@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_loss_and_every_gradient_equal_the_dense_ends(tp, tied, logit_scale):
    res, want = run(tp, tied, logit_scale), dense(tied, logit_scale)
    if logit_scale > 1:  # the case has teeth: exp of the largest logit overflows float64 unless it is subtracted
        assert not torch.isfinite(want["logits"].max().exp())
    shapes = {name: tuple(g.shape) for name, g in want["grads"].items()}
    for ranks in groups(res):
        assert len(ranks) == tp
        # every rank holds some targets of its own: the masked lookup and the one-hot run on every shard
        for r in ranks:
            start, end = r["vocab_range"]
            assert ((want["targets"] >= start) & (want["targets"] < end)).any()
        got, problems = assemble([r["grads"] for r in ranks], shapes)
        assert not problems, problems  # every entry held by one rank; replicated ones (the input) bit for bit equal
        assert set(got) == set(want["grads"])
        for name, g in got.items():
            assert relative_error(g, want["grads"][name]) <= RTOL, name
        # every rank of the group computes the same per-token loss, bit for bit, from the same three reductions
        losses = [r["token_losses"] for r in ranks]
        assert all(torch.equal(t, losses[0]) for t in losses)
        assert relative_error(losses[0], want["losses"]) <= RTOL
        assert abs(ranks[0]["loss"] - want["losses"].mean().item()) <= RTOL * want["losses"].abs().max().item()
        assert all(r["verdict"]["ok"] and r["verdict"]["mistake"] == "" for r in ranks)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_rank_holds_one_tp_th_of_the_logits_and_the_loss_sends_three_reductions_of_b_s(tp):
    res = run(tp)
    b, s, v, h, element = SHAPE["batch"], SHAPE["seq"], SHAPE["vocab"], SHAPE["hidden"], 8  # float64
    for r in res.ranks:
        assert r["logits_shape"] == [s, b, v // tp]
        assert r["logits_bytes"] == b * s * v // tp * element  # measured: numel * element_size
        assert r["dense_logits_bytes"] == b * s * v * element
        reduces = r["loss_all_reduces"]
        if tp == 1:  # one rank holds the whole vocabulary: nothing to reduce
            assert reduces == []
            continue
        assert [x["what"] for x in reduces] == ["logits_max", "predicted_logits", "sum_exp_logits"]
        assert all(x["collective"] == "all_reduce" and x["pass"] == "forward" and x["shape"] == [s, b]
                   and x["bytes"] == b * s * element for x in reduces)
        # the rest: the embedding's g forward and the head's f backward, one [b, s, h] all-reduce each; the logits
        # are never gathered
        rows = {(x["scope"], x["collective"], x["pass"]): x for x in r["comm_summary"]}
        assert set(rows) == {("embed", "all_reduce", "forward"), ("head", "all_reduce", "backward"),
                             ("loss", "all_reduce", "forward")}
        assert rows["embed", "all_reduce", "forward"]["message_bytes"] == b * s * h * element
        assert rows["head", "all_reduce", "backward"]["message_bytes"] == b * s * h * element
        assert rows["loss", "all_reduce", "forward"]["calls"] == 3


@pytest.mark.parametrize("logit_scale", [1.0, 1e3], ids=["logits~1", "logits~1e3"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fault", DRILLS)
def test_each_drill_is_caught_and_named_by_the_comparison_with_the_dense_loss(fault, tp, logit_scale):
    res, want = run(tp, False, logit_scale, fault), dense(False, logit_scale)
    verdicts = [r["verdict"] for r in res.ranks]
    assert all(v == verdicts[0] for v in verdicts)  # judged together: the same verdict on every rank
    verdict = verdicts[0]
    if fault == "max_not_subtracted" and logit_scale == 1.0:
        # the algebra is right: without the max it is still exact on ordinary logits; only large ones overflow
        assert verdict["ok"], verdict
        return
    assert not verdict["ok"] and verdict["mistake"] == fault, verdict
    ranks = groups(res)[0]
    err = relative_error(ranks[0]["token_losses"], want["losses"])
    assert not err <= 1e-3  # caught by the loss itself, not by rounding: off by far more (or not finite)
    if fault == "max_not_subtracted":
        assert not torch.isfinite(ranks[0]["token_losses"]).all()
    elif fault == "sum_exp_not_reduced":  # each rank normalised over its own words: their losses differ
        assert not all(torch.equal(r["token_losses"], ranks[0]["token_losses"]) for r in ranks)
        assert not verdict["ranks_agree"]
    else:  # a plausible-looking loss: finite, the same on every rank, and wrong
        assert torch.isfinite(ranks[0]["token_losses"]).all() and verdict["ranks_agree"]
        assert verdict["grad_row_sum"] == pytest.approx(1 - tp if fault == "target_not_masked" else 0.0, abs=1e-9)


@pytest.mark.parametrize("fault", ["max_not_reduced", "target_not_masked", "sum_exp_not_reduced"])
def test_the_reductions_drills_change_nothing_on_one_rank(fault):
    # with tp = 1 there is no group to reduce over and every target is this rank's: the same numbers as without
    res = run(1, False, 1e3, fault)
    assert all(r["verdict"]["ok"] for r in res.ranks)


@pytest.mark.parametrize("fault,where", [("drop_forward_all_reduce", "the logits already differ"),
                                         ("drop_backward_all_reduce", "grad input")])
def test_a_broken_collective_before_the_loss_is_not_blamed_on_the_loss(fault, where):
    verdict = run(2, False, 1.0, fault)[0]["verdict"]
    assert not verdict["ok"] and verdict["mistake"] == "" and where in verdict["why"], verdict


def test_sizes_that_do_not_split_are_refused_in_one_sentence_before_any_rank_starts():
    with pytest.raises(cu.InvalidParameter, match="tp=4 does not divide vocab=30: choose 1, 2, 3, 5, 6, 10, 15 or 30"):
        cu.run(WORKER, world_size=4, vocab=30)
    with pytest.raises(cu.InvalidParameter, match="tp=3 does not divide the 4 ranks: choose 1, 2 or 4"):
        cu.run(WORKER, world_size=4, tp=3)
    with pytest.raises(cu.InvalidParameter, match="fault='no_max' is not one of"):
        cu.run(WORKER, world_size=2, fault="no_max")
    with pytest.raises(cu.InvalidParameter, match="logit_scale=0.0 must be a positive number"):
        cu.run(WORKER, world_size=2, logit_scale=0.0)


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=tmp)
        env.pop("COURSE_RESULTS_ADDR", None)
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", "workers/ch04_vocab_parallel.py", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_under_plain_torchrun_a_drill_is_named_and_a_bad_size_refused():
    out = torchrun(2, "--fault", "target_not_masked")
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank {rank}] verdict = {{'ok': False, 'mistake': 'target_not_masked'" in out.stdout, out.stdout
    out = torchrun(2, "--vocab", "31")
    assert out.returncode != 0 and "tp=2 does not divide vocab=31: choose 1 or 31" in out.stderr


def test_in_one_process_the_loss_is_cross_entropy_its_backward_passes_gradcheck_and_the_logits_are_untouched():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 2, 7, generator=g, dtype=torch.float64) * 30).requires_grad_()
    target = torch.randint(7, (3, 2), generator=g)
    before = logits.detach().clone()
    loss = vocab_parallel_cross_entropy(logits, target)
    want = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), reduction="none").view(3, 2)
    assert relative_error(loss.detach(), want.detach()) <= RTOL
    assert torch.equal(logits.detach(), before)  # Megatron subtracts the max in place; this one never writes to them
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_cross_entropy(z, target), (logits,))
    with pytest.raises(ValueError, match=r"target has shape \(2, 3\) but the logits \(3, 2, 7\)"):
        vocab_parallel_cross_entropy(logits, target.t())
