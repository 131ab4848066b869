"""One layout and one rule set: chapter 00's planner and the rank side accept and refuse the same layouts.

Start here when a refusal surprises you: ``workers/layout/rules.py: problem`` is the one rule set; the planner
(``course_utils/planner.py: resolve_layout``), chapter 05's attention split (``workers/parallel/attention.py:
head_problem``) and chapter 15's composed trainer (``workers/composed/train.py: layout_problem``) all ask it. The
table below is given to each of them, with Llama 3 70B's shape (64 query heads, 8 KV heads) among the models: at
TP 16 each KV head is copied onto 2 ranks, the answer chapter 05 teaches, and every side accepts it.
"""
import pytest

from course_utils.planner import LayoutError, ModelShape, resolve_layout
from workers.composed.train import layout_problem
from workers.layout import Layout, problem
from workers.model import GPTConfig
from workers.parallel.attention import head_problem

LLAMA3_70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128_256)
# vocab 48: a multiple of every tp below that the heads allow, since chapter 15's trainer splits the vocabulary over
# TP without padding it (a refusal of its own, not a rule of the layout: see the last test)
SMALL_GQA = dict(layers=4, hidden=48, heads=12, kv_heads=4, ffn=192, vocab=48)

# (model, layout, world, valid): layouts within what every side implements (ZeRO 0-1, equal pipeline stages), so
# that the sides can only disagree about the rules themselves
TABLE = [
    (LLAMA3_70B, Layout(tp=8, pp=4, dp=8), 256, True),
    (LLAMA3_70B, Layout(tp=16, pp=2, dp=8), 256, True),  # KV heads copied onto tp / 8 = 2 ranks
    (LLAMA3_70B, Layout(tp=64, dp=4), 256, True),  # one query head per rank, each KV head on 8 ranks
    (LLAMA3_70B, Layout(tp=3, dp=1), 3, False),  # 64 heads over 3 ranks
    (LLAMA3_70B, Layout(tp=8, pp=4, dp=4), 256, False),  # 128 ranks' worth of layout on 256
    (LLAMA3_70B, Layout(tp=8, pp=160, dp=1), 1280, False),  # more stages than layers
    (LLAMA3_70B, Layout(tp=8, cp=3, dp=1, seq=4096), 24, False),  # cp=3 cuts 4096 tokens into 6 chunks
    (LLAMA3_70B, Layout(tp=8, pp=4, dp=8, virtual_stages=2, schedule="interleaved", micro_batches=6), 256, False),
    (SMALL_GQA, Layout(tp=4, dp=2), 8, True),  # 4 KV heads, one per rank
    (SMALL_GQA, Layout(tp=12, dp=1), 12, True),  # each of the 4 KV heads on 3 ranks
    (SMALL_GQA, Layout(tp=6, dp=1), 6, False),  # 6 and 4 KV heads do not divide one another
    (SMALL_GQA, Layout(tp=2, cp=2, dp=2, sequence_parallel=True, seq=8), 8, True),
    (SMALL_GQA, Layout(tp=2, cp=2, dp=2, sequence_parallel=True, seq=10), 8, False),  # zigzag: 10 % (2 cp) != 0
    (SMALL_GQA, Layout(tp=4, cp=1, dp=2, sequence_parallel=True, seq=6), 8, False),  # 6 tokens over tp = 4
]


def _planner_accepts(model: dict, layout: Layout, world: int) -> bool:
    shape = ModelShape("table", **model)
    try:
        resolve_layout(shape, layout, world)
    except LayoutError:
        return False
    return True


def _rank_side_accepts(model: dict, layout: Layout, world: int) -> bool:
    """Chapter 15's composed trainer, for a GPT of the same shape (its refusal is what its worker's check_params
    returns), and chapter 05's attention split of the same heads."""
    cfg = GPTConfig(vocab=model["vocab"], seq=layout.seq or 4096, hidden=model["hidden"], heads=model["heads"],
                    kv_heads=model["kv_heads"], ffn=model["ffn"], layers=model["layers"])
    global_batch = (layout.dp or 1) * (layout.micro_batches or 1)
    composed = layout_problem(layout.resolve(world), world, cfg, global_batch) is None
    attention = head_problem(model["heads"], model["kv_heads"], layout.tp) is None
    assert attention or not composed, "the composed trainer accepted heads that chapter 05 refuses"
    return composed


@pytest.mark.parametrize("model, layout, world, valid", TABLE)
def test_the_planner_and_the_rank_side_agree_on_every_layout(model, layout, world, valid):
    assert _planner_accepts(model, layout, world) == valid, problem(layout, world, ModelShape("table", **model))
    assert _rank_side_accepts(model, layout, world) == valid


def test_llama3_70b_at_tp16_copies_each_kv_head_and_the_planner_counts_the_copies():
    from course_utils.planner import plan

    tp8, tp16 = (plan("70B", Layout(tp=tp, pp=2, zero=1), 16 * tp) for tp in (8, 16))
    assert any("copied onto 2 ranks" in note for note in tp16.notes)
    # per rank: the 64 query heads' weights halve from TP 8 to TP 16, the K and V weights do not (each of the 8 KV
    # heads is held whole on 2 of the 16 ranks); everything else of a layer halves
    m = tp16.model
    kv_per_layer = 2 * m.hidden * m.head_dim  # W_k and W_v of one KV head
    halved = m.params_per_layer - 8 * kv_per_layer
    layers = m.layers // 2
    per_rank = {tp: (layers * (halved / tp + kv_per_layer * 8 / min(tp, 8)) + m.vocab * m.hidden / tp)
                for tp in (8, 16)}
    ratio = tp16.memory["params"] / tp8.memory["params"]
    assert ratio == pytest.approx(per_rank[16] / per_rank[8], rel=1e-9)
    assert ratio > 0.5  # the copies cost memory: not the 1/2 a split of every weight would give


def test_a_layout_is_refused_naming_every_offending_value_in_one_sentence():
    why = problem(Layout(tp=3, pp=160, dp=1), 480, ModelShape("table", **LLAMA3_70B))
    assert why.count(";") == 2 and "tp=3 does not divide heads=64" in why and "tp=3 does not divide ffn" in why
    assert "pp=160 is more than layers=80" in why and ". " not in why


def test_without_context_parallelism_any_sequence_length_is_fine_and_a_sequence_parallel_refusal_names_tp():
    from workers.composed.model import model_config

    odd = model_config(seq=11)
    assert layout_problem(Layout(dp=2), 2, odd, global_batch=8) is None  # no ring: nothing to cut into chunks
    why = layout_problem(Layout(dp=1, tp=2, sequence_parallel=True), 2, model_config(seq=9), global_batch=8)
    assert why == "tp=2 does not divide seq=9 (sequence parallelism gives each TP rank its rows)"


def test_a_vocabulary_that_tp_does_not_divide_is_refused_by_the_composed_trainer_not_by_the_layout_rules():
    """Chapter 15 splits the embedding and the head by vocabulary over TP in equal blocks and does not pad. Megatron
    pads the vocabulary to a multiple of 128 tp (GPT-2's 50257 to 51200 at tp 8), so the layout's rules, which the
    planner prices published runs with, accept it; only the trainer, which does not pad, refuses."""
    from workers.composed.model import model_config

    gpt2_vocab = model_config(vocab=50257)
    assert problem(Layout(dp=1, tp=8), 8, gpt2_vocab, global_batch=8) is None
    assert layout_problem(Layout(dp=1, tp=8), 8, gpt2_vocab, global_batch=8) == \
        "tp=8 does not divide vocab=50257: choose 1, 29, 1733 or 50257"
    assert layout_problem(Layout(dp=1, tp=8), 8, model_config(), global_batch=8) is None  # the chapter's vocab 32
