"""The sharding view: every weight entry is held by exactly the ranks the plan says; bad shapes are one sentence."""
import pytest

from course_utils import tp_viz


@pytest.mark.parametrize("shape", [(64, 256, 8, 8, 4), (64, 256, 8, 2, 4), (64, 256, 8, 1, 8), (96, 384, 12, 4, 2)])
def test_every_weight_entry_is_covered_once_per_copy(shape):
    hidden, ffn, heads, kv, tp = shape
    plan = tp_viz.layout(hidden, ffn, heads, kv, tp)
    for name, (rows, cols, blocks) in plan["weights"].items():
        area = sum((b.r1 - b.r0) * (b.c1 - b.c0) for b in blocks)
        assert area == rows * cols, name  # the blocks tile the weight
    copies = tp // kv if tp > kv else 1
    qkv_blocks = list(plan["weights"].values())[0][2]
    assert all(len(b.ranks) == (copies if b.label[0] in "kv" else 1) for b in qkv_blocks)
    # every rank holds the same number of parameters, 1/tp of the split ones plus the replicated ones
    assert len({r["params"] for r in plan["per_rank"]}) == 1


def test_parameter_count_matches_the_real_modules():
    # the drawing's arithmetic against the parallel block's actual parameters (TP 1: the dense layer)
    from workers.parallel.dense import BlockConfig, build

    cfg = BlockConfig(hidden=64, n_heads=8, n_kv_heads=2, ffn_hidden=256)
    dense = build("block", cfg)
    plan = tp_viz.layout(64, 256, 8, 2, 1)
    assert plan["dense_params"] == sum(p.numel() for p in dense.parameters()) == plan["per_rank"][0]["params"]


@pytest.mark.parametrize("args,fragment", [
    ((64, 256, 6, 6, 4), "hidden=64 is not divisible by n_heads=6"),
    ((48, 192, 6, 6, 4), "n_heads=6 is not divisible by TP=4"),
    ((96, 384, 12, 6, 4), "do not divide one another"),
    ((64, 250, 8, 8, 4), "ffn=250 is not divisible by TP=4"),
    ((64, 256, 8, 3, 1), "not a multiple of n_kv_heads=3"),
])
def test_invalid_combinations_are_one_sentence(args, fragment):
    message = tp_viz.problem(*args)
    assert fragment in message and "\n" not in message
    with pytest.raises(ValueError, match=fragment):
        tp_viz.layout(*args)


def test_widget_shows_a_sentence_for_an_invalid_choice_and_a_figure_otherwise():
    w = tp_viz.ShardingWidget()
    assert w.message == "" and "image/png" in w.out.outputs[0]["data"]
    w.controls["tp"].value = 3  # 8 heads over 3 ranks
    assert "n_heads=8 is not divisible by TP=3" in w.message
    assert w.out.outputs[0]["text"].startswith("n_heads=8")
    w.controls["tp"].value = 8  # 4 KV heads, TP 8: replicated twice, a valid split
    assert w.message == ""
