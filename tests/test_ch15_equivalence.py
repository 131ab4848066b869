"""Chapter 15's equivalence check (``workers/composed/equivalence.compare``) on results made up in this process: no
ranks. A copy of the one-process run, reported as a 1x1x1x2 layout would report it (rank 0 holds every shard, rank 1
a copy), passes; the same copy with one NaN or infinity in a loss, a gradient or a parameter fails and says so.
The key rows of every QKV bias, whose gradient is zero in exact arithmetic, are held to that property and to
AdamW's bound on noise, not to the reference's rounding.
"""
import copy
import math
from functools import lru_cache

import pytest
import torch

from workers.composed.equivalence import (compare, loss_error, noise_step_bound, parameter_error, relative_error,
                                          zero_gradient_masks)
from workers.composed.model import MODEL
from workers.composed.train import digest, reference_run

STEPS, LR = 3, 0.01
QKV_BIAS = "blocks.1.attention.qkv.bias"
KEYS, QUERIES = slice(32, 64), slice(0, 32)  # hidden 32, 8 heads of 4: queries, then keys, then values


@lru_cache(maxsize=None)
def _reference():
    return reference_run(MODEL, steps=STEPS, global_batch=8, lr=LR)


def reference():
    return copy.deepcopy(_reference())


def _record(tensors: dict) -> dict:
    return {n: {"dim": -1, "index": torch.empty(0, dtype=torch.long), "value": t.clone()} for n, t in tensors.items()}


def run_copy(ref: dict) -> list[dict]:
    """What the ranks of a correct 1x1x1x2 run report, built from ``ref``: rank 0 reports every gradient and the
    final parameters, rank 1 (its context-parallel copy) only digests; the last stage both, so both report the loss."""
    config = {**MODEL.as_dict(), "steps": STEPS, "global_batch": 8, "lr": LR, "seed": 0, "data_seed": 1,
              "dtype": "float64", "fault": "none"}
    digests = [{n: digest(p) for n, p in ref["params"].items()}] * STEPS  # the copies agree (only the last is real)
    return [{"config": config, "layout_name": "1x1x1x2", "coords": {"dp": 0, "tp": 0, "pp": 0, "cp": cp},
             "losses": list(ref["losses"]), "grads": [_record(g) for g in ref["grads"]] if cp == 0 else [None] * STEPS,
             "params": _record(ref["params"]) if cp == 0 else None, "digests": digests, "sharded": []}
            for cp in (0, 1)]


def test_a_copy_of_the_one_process_run_passes():
    verdict = compare(run_copy(reference()), reference())
    assert verdict["ok"], verdict["message"]
    assert verdict["message"].startswith("layout 1x1x1x2 equals one process")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_fails(bad):
    ranks = run_copy(reference())
    for r in ranks:
        r["losses"][1] = bad
    verdict = compare(ranks, reference())
    assert not verdict["ok"] and verdict["first"]["what"] == "loss" and verdict["first"]["step"] == 1
    assert "the loss is NaN or infinite" in verdict["message"], verdict["message"]
    assert verdict["max_error"] == math.inf


def test_a_missing_loss_fails():
    ranks = run_copy(reference())
    for r in ranks:
        r["losses"] = [None] * STEPS
    verdict = compare(ranks, reference())
    assert not verdict["ok"] and "no rank reported the loss" in verdict["message"]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_non_finite_gradient_entry_fails_naming_the_tensor(bad):
    ranks = run_copy(reference())
    ranks[0]["grads"][2]["blocks.2.mlp.fc1.weight"]["value"][3, 5] = bad
    verdict = compare(ranks, reference())
    first = verdict["first"]
    assert not verdict["ok"] and (first["step"], first["what"], first["tensor"]) == (2, "gradient",
                                                                                     "blocks.2.mlp.fc1.weight")
    assert "is NaN or infinite on rank 0" in verdict["message"], verdict["message"]


@pytest.mark.parametrize("name", ["ln_f.bias", QKV_BIAS])
def test_one_nan_parameter_fails(name):
    ranks = run_copy(reference())
    ranks[0]["params"][name]["value"][20 if name == "ln_f.bias" else 40] = math.nan  # 40: a key row of the QKV bias
    verdict = compare(ranks, reference())
    assert not verdict["ok"] and verdict["first"]["tensor"] == name, verdict["message"]
    assert verdict["first"]["what"] == "parameter after the last step"


def test_a_run_that_is_nan_everywhere_fails():
    """What the per-micro-batch mean makes of a micro-batch without a valid token: 0 / 0 in the loss, then NaN in
    every gradient and parameter."""
    ranks = run_copy(reference())
    for r in ranks:
        r["losses"] = [math.nan] * STEPS
    for grads in ranks[0]["grads"]:
        for item in grads.values():
            item["value"].fill_(math.nan)
    for item in ranks[0]["params"].values():
        item["value"].fill_(math.nan)
    verdict = compare(ranks, reference())
    assert not verdict["ok"] and verdict["first"]["what"] == "loss" and "NaN" in verdict["message"]
    assert all(e == math.inf for e in verdict["loss_errors"] + verdict["grad_errors"])


def test_the_error_functions_never_let_nan_through():
    assert relative_error(torch.tensor([1.0, math.nan]), torch.tensor([1.0, 2.0])) == math.inf
    assert relative_error(torch.tensor([1.0, 2.0]), torch.tensor([math.inf, 2.0])) == math.inf
    assert loss_error(math.nan, 1.0) == loss_error(None, 1.0) == loss_error(1.0, math.nan) == math.inf
    assert parameter_error(torch.tensor([math.nan, 0.0]), torch.zeros(2), torch.tensor([False, True])) == \
        (math.inf, math.inf)


def test_the_key_rows_of_the_qkv_bias_have_a_zero_gradient_to_rounding():
    ref = reference()
    masks = zero_gradient_masks(run_copy(ref)[0]["config"], {n: tuple(t.shape) for n, t in ref["params"].items()})
    assert sorted(masks) == [f"blocks.{i}.attention.qkv.bias" for i in range(4)]
    for grads in ref["grads"]:
        for name, mask in masks.items():
            g = grads[name]
            assert torch.equal(mask.nonzero().flatten(), torch.arange(32, 64))
            assert g[mask].abs().max() <= 1e-14 * g.abs().max(), name  # rounding of a sum that is 0
            assert g[~mask].abs().min() > 0  # the query and value rows do learn


def test_the_key_rows_may_differ_by_adamw_noise_but_the_query_rows_may_not():
    assert noise_step_bound(LR, STEPS) == pytest.approx(2 * LR * STEPS, rel=1e-3)  # ~lr per step and run
    ranks = run_copy(reference())
    ranks[0]["params"][QKV_BIAS]["value"][KEYS] += 1e-6  # 2e-5 of the tensor's largest entry: far over 1e-10
    verdict = compare(ranks, reference())
    assert verdict["ok"], verdict["message"]

    ranks = run_copy(reference())
    ranks[0]["params"][QKV_BIAS]["value"][QUERIES] += 1e-6
    verdict = compare(ranks, reference())
    assert not verdict["ok"] and verdict["first"]["tensor"] == QKV_BIAS, verdict["message"]

    ranks = run_copy(reference())
    ranks[0]["params"][QKV_BIAS]["value"][40] += 2 * noise_step_bound(LR, STEPS)  # more than noise can do
    verdict = compare(ranks, reference())
    assert not verdict["ok"] and "more than AdamW's steps on rounding noise can make" in verdict["message"]


def test_a_key_row_gradient_that_is_not_zero_fails_even_when_both_runs_agree():
    ranks, ref = run_copy(reference()), reference()
    for grads in (ranks[0]["grads"][0][QKV_BIAS]["value"], ref["grads"][0][QKV_BIAS]):
        grads[KEYS] += 1e-3  # both runs agree, but the property does not hold: a model where q . b_k is not a shift
    verdict = compare(ranks, ref)
    assert not verdict["ok"] and "zero in exact arithmetic" in verdict["message"], verdict["message"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_replicated_copies_that_are_not_finite_are_named_not_overwritten(bad):
    """``plan.assemble`` puts the ranks' parts back together; a replicated part that one rank holds as NaN and a later
    rank as a number must not come out as the later rank's number (a "max difference > 0" test passes NaN)."""
    from workers.parallel.plan import assemble

    good = torch.arange(6, dtype=torch.float64).view(2, 3)
    poisoned = good.clone()
    poisoned[1, 2] = bad
    for first, second in ((poisoned, good), (good, poisoned)):
        records = [_record({"w": first}), _record({"w": second})]
        _, problems = assemble(records, {"w": (2, 3)})
        assert problems and "not finite" in problems[0], problems
    full, problems = assemble([_record({"w": good}), _record({"w": good})], {"w": (2, 3)})
    assert not problems and torch.equal(full["w"], good)


def run_vocab_split(ref: dict, pp: int = 1) -> list[dict]:
    """What a correct 1x2xPPx1 run reports about the ends split by vocabulary, built from ``ref``: TP rank t holds
    rows ``[16 t, 16 t + 16)`` of ``embed.weight`` (its gradient and value), the other parameters whole (as if
    replicated); with pp 2 the last stage's ranks report the tied copy ``head.weight``, the same rows, and nothing
    else. ``sharded`` names the split parameters, so that their digests are compared per TP rank."""
    config = run_copy(ref)[0]["config"]

    def split(tensors: dict, tp: int, names) -> dict:
        rows = torch.arange(16 * tp, 16 * tp + 16)
        out = {}
        for name in names:
            t = tensors["embed.weight" if name == "head.weight" else name]
            out[name] = ({"dim": 0, "index": rows, "value": t[rows].clone()} if name in ("embed.weight", "head.weight")
                         else {"dim": -1, "index": torch.empty(0, dtype=torch.long), "value": t.clone()})
        return out

    ranks = []
    for stage in range(pp):
        names = list(ref["params"]) if stage == 0 else ["head.weight"]
        for tp in (0, 1):
            rows = torch.arange(16 * tp, 16 * tp + 16)
            digests = {n: digest(ref["params"]["embed.weight"][rows] if n in ("embed.weight", "head.weight")
                                 else ref["params"][n]) for n in names}
            ranks.append({"config": config, "layout_name": f"1x2x{pp}x1",
                          "coords": {"dp": 0, "tp": tp, "pp": stage, "cp": 0},
                          "losses": list(ref["losses"]) if stage == pp - 1 else [None] * STEPS,
                          "grads": [split(g, tp, names) for g in ref["grads"]],
                          "params": split(ref["params"], tp, names), "digests": [digests] * STEPS,
                          "sharded": [n for n in names if n in ("embed.weight", "head.weight")]})
    return ranks


@pytest.mark.parametrize("pp", [1, 2])
def test_an_embedding_split_by_vocabulary_is_put_back_together_and_equals_one_process(pp):
    """Chapter 15 splits the embedding and its tied copy on the last stage by vocabulary over TP: the check assembles
    the TP ranks' row blocks (and the head's copies, under the embedding's name) into the dense table; the two TP
    ranks' different shards are not mistaken for diverging replicas."""
    verdict = compare(run_vocab_split(reference(), pp), reference())
    assert verdict["ok"], verdict["message"]


def test_a_vocab_shard_reported_at_the_wrong_rows_fails_naming_the_embedding_and_its_rank():
    ranks = run_vocab_split(reference(), pp=2)
    head = ranks[3]["grads"][0]["head.weight"]  # stage 1, TP rank 1: its copy of rows 16-31 ...
    head["index"] = torch.arange(0, 16)  # ... put back at rows 0-15, where TP rank 0's shard sits
    verdict = compare(ranks, reference())
    first = verdict["first"]
    assert not verdict["ok"] and (first["step"], first["tensor"]) == (0, "embed.weight"), verdict["message"]
    assert first["what"] == "gradient" and first["ranks"] == [3], verdict["message"]  # only its shard is off
    # and the assembly says why: rank 3 claims rows that TP rank 0's copies (ranks 0 and 2) hold, with other values
    assert any(f["what"] == "shards" and "rank 3 disagrees" in f["detail"] for f in verdict["findings"])
