"""Chapter 15, production side by side: PyTorch's own composable APIs train the chapter's GPT exactly like one
process (``workers/ch15_native.py``), so they equal the course's hand-written composition, which
``tests/test_ch15_composed.py`` holds to the same reference.

Ground truth: ``workers/composed/train.reference_run`` in float64. The ranks run in float64 too, so the bound is
``equivalence.TOLERANCE["float64"]`` = 1e-10 relative to each tensor's largest entry; what the APIs' other
summation orders cost is rounding, measured over every case here under the native AVX-512, AVX2 and plain
(``ATEN_CPU_CAPABILITY=default``) kernels: losses at most 3.4e-16, gradients 1.1e-14, final parameters 2.2e-12
(AdamW turns the key bias's rounding-noise gradient into steps: ``equivalence.py``). Exact properties need no margin:
placements, collective counts, the tied copies bit for bit equal (same start, same summed gradient, same AdamW).
Every case runs on 4 warm ranks, one cold start for the file: tp = 4, FSDP over 4, dp 2 x tp 2, 4 pipeline stages.
"""
import re
from functools import lru_cache

import pytest
import torch

import course_utils as cu
from course_utils import ch15
from course_utils.results import InvalidParameter
from workers.composed.equivalence import TOLERANCE
from workers.composed.model import MODEL
from workers.composed.train import reference_run

WORKER = "workers.ch15_native"
WORLD = 4
pytestmark = pytest.mark.ranks


@lru_cache(maxsize=None)
def reference():
    return reference_run(MODEL, steps=3, global_batch=8, lr=0.01, seed=0, data_seed=1, dtype=torch.float64)


def run(api: str, **params):
    return cu.run(WORKER, world_size=WORLD, timeout=240, api=api, **params).ranks


def errors(ranks: list[dict]) -> dict:
    return ch15.native_errors(ranks, reference())

CASES = {
    "tp": {},  # tp = 4: two of the 8 heads per rank
    "fsdp": {},  # FSDP2 over 4 ranks, 2 samples each
    "tp_fsdp": {"tp": 2},  # dp 2 x tp 2
    "pipelining": {"micro_batches": 4},  # 4 stages of one layer, Schedule1F1B
    "pipelining_gpipe": {"micro_batches": 8, "schedule": "gpipe"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_api_equals_one_process(case):
    api = case.split("_gpipe")[0]
    ranks = run(api, **CASES[case])
    err, names = errors(ranks), set(reference()["params"])
    tol = TOLERANCE["float64"]
    for step in range(3):  # every dense parameter's gradient, at every step, from some rank
        assert err["grad_names"][step] == names, f"step {step}: missing {sorted(names - err['grad_names'][step])}"
        assert err["loss"][step] < tol, f"step {step}: loss off by {err['loss'][step]:.2g}"
        worst = max(err["by_name"][step], key=err["by_name"][step].get)
        assert err["grad"][step] < tol, f"step {step}: gradient of {worst} off by {err['grad'][step]:.2g}"
    assert err["param_names"] == names
    assert err["param"] < tol, f"final parameters off by {err['param']:.2g}"
    assert len(set(reference()["losses"])) == 3  # three different losses: the run learnt something
    check_layout(api, ranks)


def check_layout(api: str, ranks: list[dict]) -> None:
    """What each API made of the parameters, and the collectives of one step (exact: names, placements, counts)."""
    placements, layers = ranks[0]["placements"], MODEL.layers
    colwise, rowwise, plain = "(Shard(dim=0),)", "(Shard(dim=1),)", "plain tensor (replicated)"
    if api == "tp":  # ColwiseParallel cuts rows (the output features), RowwiseParallel columns; the rest replicated
        assert placements["blocks.0.attention.wq.weight"] == placements["blocks.0.mlp.fc1.weight"] == colwise
        assert placements["blocks.0.attention.proj.weight"] == placements["blocks.0.mlp.fc2.weight"] == rowwise
        assert placements["blocks.0.attention.proj.bias"] == "(Replicate(),)"
        assert placements["embed.weight"] == placements["blocks.0.ln1.weight"] == plain
        # Megatron's 4 all-reduces per layer: g after proj and fc2 forward, f before the attention and fc1 backward
        # (PrepareModuleInput sums wq, wk, wv's input gradients first: without it, 3 in the attention's backward)
        assert ranks[0]["collectives"] == {"forward": {"all_reduce": 2 * layers},
                                           "backward": {"all_reduce": 2 * layers}}
    elif api == "fsdp":  # ZeRO-3: every parameter a dim-0 shard
        assert set(placements.values()) == {"(Shard(dim=0),)"}
        # one all-gather per unit (4 blocks + the root) before forward, again before backward except the root's
        # (FSDP2 leaves the root gathered after forward), and one reduce-scatter per unit
        assert ranks[0]["collectives"] == {"forward": {"all_gather": layers + 1},
                                           "backward": {"all_gather": layers, "reduce_scatter": layers + 1}}
    elif api == "tp_fsdp":  # FSDP2 shards dim 0 of the TP shard on the dp dimension: a strided shard of the whole
        assert placements["blocks.0.attention.wq.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert placements["blocks.0.mlp.fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert placements["embed.weight"] == "(Shard(dim=0),)"
    else:  # one layer per stage; the tied embedding's two copies (first and last stage) still bit for bit equal
        assert [r["layers"] for r in ranks] == [[0], [1], [2], [3]]
        assert ranks[0]["tied_copies_equal"] is True and ranks[-1]["tied_copies_equal"] is True
        assert "embed.weight" in ranks[0]["params"] and "ln_f.weight" in ranks[-1]["params"]


def test_colwise_parallel_on_the_fused_qkv_is_the_fused_qkv_trap():
    """ColwiseParallel on the dense fused ``qkv`` ([Q; K; V]) cuts it into 4 contiguous blocks of rows: rank 0 gets
    query heads 0-5, and reads heads 2-3 as its keys and 4-5 as its values. It runs, and computes another model.
    At initialisation the attention's output is small next to the residual stream, so the loss moves only by
    1.1e-3 to 2.1e-3 relative (measured, tp = 4; still 10^7 times the tolerance), while the attention's gradients
    are wrong by more than 100% (1.28 relative for blocks.0's qkv weight): the gradients are where it shows."""
    ranks = run("tp", qkv="fused")
    err = errors(ranks)
    assert all(e > 5e-4 for e in err["loss"]), err["loss"]
    assert err["by_name"][0]["blocks.0.attention.qkv.weight"] > 0.5
    assert err["param"] > 1e-2
    assert ranks[0]["placements"]["blocks.0.attention.qkv.weight"] == "(Shard(dim=0),)"


@pytest.mark.parametrize("params,fragment", [
    ({"api": "zero3"}, "api='zero3' is not one of 'tp', 'fsdp', 'pipelining' or 'tp_fsdp'"),
    ({"api": "pipelining", "micro_batches": 2}, "which torch's Schedule1F1B refuses: choose micro_batches >= 4"),
    ({"api": "fsdp", "qkv": "fused"}, "use api='tp' or 'tp_fsdp'"),
    ({"api": "tp_fsdp", "tp": 3}, "tp=3 does not divide the 4 ranks"),
])
def test_a_bad_parameter_is_refused_before_launch(params, fragment):
    with pytest.raises(InvalidParameter, match=re.escape(fragment)):
        cu.run(WORKER, world_size=WORLD, timeout=60, **params)
