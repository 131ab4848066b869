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
    from workers.model.dense import BlockConfig, build

    cfg = BlockConfig(hidden=64, heads=8, kv_heads=2, ffn=256)
    dense = build("block", cfg)
    plan = tp_viz.layout(64, 256, 8, 2, 1)
    assert plan["dense_params"] == sum(p.numel() for p in dense.parameters()) == plan["per_rank"][0]["params"]


@pytest.mark.parametrize("args,fragment", [
    ((64, 256, 6, 6, 4), "hidden=64 is not divisible by heads=6"),
    ((48, 192, 6, 6, 4), "tp=4 does not divide heads=6: choose 1, 2, 3 or 6"),
    ((96, 384, 12, 6, 4), "tp=4 and kv_heads=6 do not divide one another"),
    ((64, 250, 8, 8, 4), "tp=4 does not divide ffn=250: choose 1, 2, 5, 10, 25, 50, 125 or 250"),
    ((64, 256, 8, 3, 1), "not a multiple of kv_heads=3"),
    ((64, 256, 8, 8, 0), "tp=0 must be at least 1"),
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
    assert "tp=3 does not divide heads=8: choose 1, 2, 4 or 8" in w.message
    assert w.out.outputs[0]["text"].startswith("tp=3 does not divide heads=8")
    w.controls["tp"].value = 8  # 4 KV heads, TP 8: replicated twice, a valid split (drawn in the background)
    assert w.wait(60) and w.message == "" and "image/png" in w.out.outputs[0]["data"]


def test_the_ffn_refusal_the_notebook_suggests_can_be_reached_with_the_sliders():
    # chapter 04 tells the learner which slider settings show the FFN refusal: the sliders must allow them
    # (the FFN slider moves in steps of 16, so every settable FFN splits over TP 1, 2, 4, 8 and 16)
    w = tp_viz.ShardingWidget(hidden=64, ffn=256, heads=8, kv_heads=8, tp=4)
    settings = {"hidden": 48, "heads": 3, "kv_heads": 3, "tp": 3}
    for name, value in settings.items():
        c = w.controls[name]
        assert c.min <= value <= c.max and (value - c.min) % c.step == 0, (name, value)
        c.value = value
    assert w.controls["ffn"].value == 256
    assert w.message.startswith("tp=3 does not divide ffn=256"), w.message


def test_head_table_counts_the_kv_copy_gradient_all_reduce_only_when_kv_heads_are_replicated():
    # Llama 3 405B's attention (h 16384, 128 heads, 8 KV heads): split up to TP 8, replicated twice at TP 16,
    # where each rank's K and V rows (2 x 128 x 16384 bf16 = 8 MiB) are all-reduced over their 2 copies
    rows = {r["TP"]: r for r in tp_viz.head_table(16384, 128, 8, tps=(8, 16), seq=8192)}
    assert rows[8]["KV-copy grad all-reduce (bwd)"] == "none"
    assert rows[16]["KV-copy grad all-reduce (bwd)"] == "1 x 8 MiB over 2 copies"
    sync = tp_viz.kv_copy_grad_sync(16384, 128, 8, 16, bytes_per_element=2)
    assert sync["message_bytes"] == [2 * 128 * 16384 * 2] and sync["wire_bytes"] == 2 * (2 - 1) / 2 * 2 * 128 * 16384 * 2
    assert tp_viz.kv_copy_grad_sync(64, 8, 2, 4, bias=True)["all_reduces"] == 2  # weight rows, then bias rows


def test_the_sharding_widget_draws_only_the_newest_settings_and_says_it_is_busy_meanwhile():
    w = tp_viz.ShardingWidget(hidden=64, ffn=256, heads=8, kv_heads=8, tp=4)
    assert w.drawn == [w.settings()]
    busy = []
    w.status.observe(lambda change: busy.append(change["new"]), names="value")
    for ffn in (272, 288, 304, 320):  # four moves faster than a figure renders
        w.controls["ffn"].value = ffn
    w.controls["activation"].value = "swiglu"
    assert w.wait(60)
    assert w.drawn[-1] == {**w.settings(), "ffn": 320, "activation": "swiglu"}
    assert len(w.drawn) <= 3, f"stale settings were drawn one after another: {w.drawn}"
    assert busy and "drawing hidden 64, ffn 320" in busy[-2] and busy[-1] == "", busy
    assert "image/png" in w.out.outputs[0]["data"] and w.message == ""
