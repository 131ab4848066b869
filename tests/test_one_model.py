"""One model for the course: every chapter that trains a GPT trains ``workers/model/gpt.py: GPT``.

Start here when a chapter needs a model: ``GPTConfig`` has the flags the chapters differ in (tied head, QKV bias,
qk-layernorm, the logit probe, keyed dropout, the init recipe), and ``make_model(cfg, seed, mlp=...)`` swaps the MLP
(chapter 16). Each test below builds a chapter's model through that chapter's own code path, the one its worker
runs, and finds the same class; the equivalence tests of each chapter hold the parallel versions to it.
"""
import torch

from workers.model import GPT, GPTConfig, make_model
from workers.model.dense import DenseBlock


def _is_the_one_model(model) -> None:
    assert type(model) is GPT
    assert isinstance(model.cfg, GPTConfig)
    assert all(type(b) is DenseBlock for b in model.blocks)


def test_chapter_06_trains_the_one_model_with_its_block_cut_over_tensor_parallel_ranks():
    from workers.model import BlockConfig
    from workers.parallel.gpt import ParallelGPT
    from workers.parallel.harness import gpt_config

    gpt = gpt_config(BlockConfig(hidden=16, heads=4), seq=8)  # the worker's block shape, as a GPT
    dense = make_model(gpt)
    _is_the_one_model(dense)
    assert type(ParallelGPT(dense).blocks["0"]).__name__ == "ParallelBlock"


def test_chapter_09_trains_the_one_model_with_its_logit_probe():
    from workers.gpt.config import split_params
    from workers.gpt.train import Trainer

    mcfg, tcfg = split_params({"hidden": 32, "steps": 1, "global_batch": 4})
    trainer = Trainer(mcfg, tcfg)
    _is_the_one_model(trainer.model)
    assert mcfg.logit_probe and not mcfg.tied
    trainer.model(torch.zeros(1, mcfg.seq, dtype=torch.long))
    assert trainer.model.max_attention_logit() == trainer.model.max_attention_logit()  # a number, not NaN


def test_chapter_11_trains_the_one_model_tied_and_without_qkv_bias():
    from workers.zero.model import MODEL, make_model as make_zero

    model = make_zero(MODEL)
    _is_the_one_model(model)
    assert model.head.weight is model.embed.weight  # one Parameter, two names: chapter 11's trap
    assert len(list(model.parameters())) == len(list(model.named_parameters(remove_duplicate=False))) - 1
    assert all(b.attention.qkv.bias is None for b in model.blocks)
    assert sum(p.numel() for p in model.parameters()) == MODEL.n_params


def test_chapter_12_post_trains_the_one_model():
    from workers.posttrain.train import make_policy

    _is_the_one_model(make_policy())


def test_chapter_15_cuts_the_one_model_and_every_shard_keeps_its_dense_name():
    from workers.composed.model import MODEL, make_dense
    from workers.parallel.gpt import ParallelGPT, Parallelism

    dense = make_dense(MODEL)
    _is_the_one_model(dense)
    names = dict(dense.named_parameters())
    # one process: TP 1, the two stages of a two-stage pipeline, the ends split by vocabulary as chapter 15's trainer
    # cuts them (one TP rank: its block of the vocabulary is all of it)
    for vs in (0, 1):
        stage = ParallelGPT(dense, Parallelism(vocab_parallel=True), vs=vs, stages=2)
        for name, p in stage.named_parameters():
            assert name in names or getattr(p, "tied_to", None) == "embed.weight", name
            assert torch.equal(p, names.get(name, dense.embed.weight)), name
        end = stage.embed.weight if vs == 0 else stage.head.weight  # the tied pair: rows of the dense embedding
        assert end.partition_dim == 0 and end.partition_index.tolist() == list(range(MODEL.vocab))


def test_chapter_16_plugs_its_moe_layer_into_the_one_model_and_keeps_every_other_weight():
    from workers.moe.config import MoEConfig
    from workers.moe.train import make_moe_gpt

    cfg = GPTConfig(vocab=32, seq=8, hidden=16, heads=2, layers=2)
    moe = make_moe_gpt(cfg, MoEConfig(hidden=16, ffn=16, experts=4, top_k=2), None, seed=3)
    _is_the_one_model(moe)
    dense = make_model(cfg, seed=3)
    for name, p in dense.named_parameters():
        if ".mlp." not in name:
            assert torch.equal(p, dict(moe.named_parameters())[name]), name  # the MLP factory changes the MLPs only
    assert all(type(b.mlp).__name__ == "MoELayer" for b in moe.blocks)


def test_the_activation_layout_is_sequence_first_inside_and_batch_first_at_the_ends():
    model = make_model(GPTConfig(vocab=11, seq=6, hidden=8, heads=2, layers=1))
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    h = model.blocks[0].ln1.register_forward_hook(lambda _m, _i, out: seen.append(tuple(out.shape)))
    logits = model(torch.zeros(3, 5, dtype=torch.long))  # [b=3, s=5]
    h.remove()
    assert tuple(logits.shape) == (3, 5, 11)
    assert seen[-1] == (5, 3, 8)  # [s, b, h] inside the blocks


def test_replace_keeps_derived_sizes_following_their_defaults():
    cfg = GPTConfig(hidden=64, heads=4)
    assert (cfg.kv_heads, cfg.ffn) == (4, 256)
    smaller = cfg.replace(hidden=32, heads=2)
    assert (smaller.kv_heads, smaller.ffn) == (2, 128)
    gqa = GPTConfig(hidden=64, heads=8, kv_heads=2, ffn=100).replace(hidden=32)
    assert (gqa.kv_heads, gqa.ffn) == (2, 100)  # explicit values stay
