"""Chapter 12, full fine-tuning vs LoRA: what a rank holds after a real AdamW step, counted from the tensors,
against the ledger's bytes per parameter; and the merge of a *trained* adapter. Seeds are fixed (seed 0);
the runs are 20 steps, so the module takes a few seconds."""
import re

import pytest
import torch

import course_utils as cu
from course_utils import posttrain_ledger as L
from workers.posttrain.lora import LORA_TARGETS, LoRALinear, apply_lora, merged_copy_and_gap
from workers.posttrain.state import measured_state_bytes
from workers.posttrain.train import TOY, adamw, make_policy, sft

LIMITS = {"timeout": 120}
STEPS, RANK = 20, 4
FP32_BYTES = 4
N_BASE = L.toy_params(TOY.hidden, TOY.layers, TOY.vocab, TOY.seq)
N_LORA = L.toy_lora_params(TOY.hidden, TOY.layers, TOY.vocab, RANK, LORA_TARGETS)


@pytest.fixture(scope="module")
def runs():
    full = cu.run("workers.ch12_sft", world_size=1, **LIMITS, steps=STEPS, lr=3e-3)[0]
    lora = cu.run("workers.ch12_sft", world_size=1, **LIMITS, steps=STEPS, lr=1e-2, lora_rank=RANK)[0]
    return {"full": full, "lora": lora}


@pytest.mark.ranks
@pytest.mark.parametrize("method", ["full", "lora"])
def test_adamw_holds_8_bytes_per_trainable_parameter(runs, method):
    s = runs[method]["state_bytes"]
    assert s["trainable_params"] == (N_BASE if method == "full" else N_LORA)
    # fp32 AdamW: m and v, each fp32 and the parameter's shape = 8 bytes per *trainable* parameter, and
    # state for no other parameter (a frozen one never gets a grad, so it never takes a step)
    assert s["optimizer_moment_bytes"] == 2 * FP32_BYTES * s["trainable_params"]
    assert s["optimizer_state_params"] == s["trainable_tensors"]
    # plus torch's `step`: one 0-d fp32 counter per parameter *tensor*, which the ledger does not count
    assert s["optimizer_step_bytes"] == FP32_BYTES * s["trainable_tensors"]
    assert s["optimizer_bytes"] == s["optimizer_moment_bytes"] + s["optimizer_step_bytes"]


@pytest.mark.ranks
@pytest.mark.parametrize("method", ["full", "lora"])
def test_gradients_exist_only_for_trainable_parameters(runs, method):
    s = runs[method]["state_bytes"]
    assert s["frozen_with_grad"] == 0
    assert s["grad_bytes"] == FP32_BYTES * s["trainable_params"]  # summed over *all* parameters' .grad
    # LoRA: the whole base is frozen, kept in fp32, with no gradient and no state; full FT freezes nothing
    assert s["frozen_params"] == (0 if method == "full" else N_BASE)
    assert s["frozen_weight_bytes"] == FP32_BYTES * s["frozen_params"]


@pytest.mark.ranks
@pytest.mark.parametrize("method", ["full", "lora"])
def test_measured_bytes_equal_the_ledger_at_fp32(runs, method):
    # the same function that prices 7B and 70B, fed the toy's shape-derived counts and fp32 bytes per parameter
    s = runs[method]["state_bytes"]
    want = (L.memory_from_counts("full", N_BASE, per=L.FP32_ADAM) if method == "full"
            else L.memory_from_counts("lora", N_LORA, N_BASE, per=L.FP32_ADAM))
    rows = L.against_measured(want, s)
    assert [q for q, _, _ in rows] == ["trainable parameters", "trained weights, bytes", "frozen weights, bytes",
                                       "gradients, bytes", "Adam m + v, bytes"]
    assert all(rank == ledger for _, rank, ledger in rows), rows
    # the fp32 mapping is what makes it match: with the 7B rows' mixed-precision bytes it would not
    mixed = L.memory_from_counts(want.method, want.trainable, s["frozen_params"], per=L.MIXED_BF16)
    assert not all(rank == ledger for _, rank, ledger in L.against_measured(mixed, s))


@pytest.mark.ranks
def test_full_over_lora_optimizer_state_is_the_trainable_ratio(runs):
    full, lora = runs["full"]["state_bytes"], runs["lora"]["state_bytes"]
    assert full["optimizer_moment_bytes"] * N_LORA == lora["optimizer_moment_bytes"] * N_BASE


@pytest.mark.ranks
def test_lora_learns(runs):
    # seed 0, lr 1e-2: 2.52 -> about 1.35 after 20 steps; demand a 25% drop of the answer-token loss
    hist = runs["lora"]["history"]
    last = sum(h["answer_loss"] for h in hist[-5:]) / 5
    assert last < 0.75 * hist[0]["answer_loss"], [h["answer_loss"] for h in hist]
    # B = 0 at init: LoRA starts from the base model itself, so both runs see the same model at step 0
    assert runs["lora"]["before"] == runs["full"]["before"]
    assert runs["lora"]["history"][0]["answer_loss"] == runs["full"]["history"][0]["answer_loss"]


@pytest.mark.ranks
def test_merged_trained_adapter_equals_the_adapter_model(runs):
    m = runs["lora"]["merge"]
    # fp32 rounding over a 2-layer forward: (W0 + s B A) x vs W0 x + s B (A x), relative 1e-5 of the logits'
    # scale (seed 0 measures about 1e-6); a merge that dropped alpha / r or a layer would be off by O(1)
    assert m["max_abs_logit_diff"] <= 1e-5 * m["max_abs_logit"], m
    assert m["max_abs_logit"] > 1.0  # the adapters trained: the logits left the near-zero init
    assert m["merged_params"] == N_BASE == runs["lora"]["base_params"] and m["lora_modules_left"] == 0


@pytest.mark.ranks
def test_unknown_lora_target_is_refused_in_one_sentence():
    with pytest.raises(cu.InvalidParameter, match="lora_targets"):
        cu.run("workers.ch12_sft", world_size=1, lora_rank=4, lora_targets=["q_proj"])


@pytest.mark.parametrize("world_size, params, message", [
    # each rank trains on batch / world_size rows: a batch that does not split evenly is refused
    (2, {"batch": 7}, "batch=7 does not split evenly over world_size=2 (choose a positive multiple of 2)"),
    (4, {"batch": 2}, "batch=2 does not split evenly over world_size=4"),
    # alpha / r scales the update: 0 would train nothing, a negative alpha would flip the update's sign
    (1, {"lora_rank": 4, "lora_alpha": 0.0}, "lora_alpha=0.0 must be positive"),
    (1, {"lora_rank": 4, "lora_alpha": -8.0}, "lora_alpha=-8.0 must be positive"),
    # lora_rank=0 is full fine-tuning: LoRA's own settings would be ignored without a word
    (1, {"lora_targets": ["qkv"]}, "lora_targets only applies to LoRA"),
    (1, {"lora_alpha": 16.0}, "lora_alpha only applies to LoRA"),
])
def test_sft_parameters_that_cannot_work_are_refused_in_one_sentence(world_size, params, message):
    # refused before any rank starts (the launcher calls the worker's check_params first)
    with pytest.raises(cu.InvalidParameter, match=re.escape(message)):
        cu.launch("workers.ch12_sft", world_size=world_size, **params)


def test_sft_parameters_that_work_are_accepted():
    from course_utils.validate import check_params

    # a multiple of the world size that is not a multiple of 4 (the old rule's concern was never sharding);
    # LoRA settings with a rank; the default targets with full fine-tuning
    check_params("workers.ch12_sft", 2, {"batch": 6})
    check_params("workers.ch12_sft", 1, {"lora_rank": 4, "lora_alpha": 16.0, "lora_targets": ["qkv", "head"]})
    check_params("workers.ch12_sft", 1, {"lora_rank": 0, "lora_targets": list(LORA_TARGETS)})


# -- the same counters without ranks ----------------------------------------------------------------------

def test_sft_shards_partition_the_batch(one_thread):
    # Without a process group nothing is averaged, so each "rank" below trains on its shard alone: at step 0
    # (the same model for all) rank 0's and rank 1's answer-token losses are the two halves' means, which
    # differ, and whose mean is the whole batch's (2 answer tokens in every row): disjoint, equal halves.
    def first_loss(rank, world_size):
        model = make_policy(0)
        return sft(model, steps=1, batch=8, rank=rank, world_size=world_size)[0]["answer_loss"]

    whole, half0, half1 = first_loss(0, 1), first_loss(0, 2), first_loss(1, 2)
    assert half0 != pytest.approx(half1, rel=1e-3)
    assert (half0 + half1) / 2 == pytest.approx(whole, rel=1e-6)
    with pytest.raises(ValueError, match="batch=8 does not split evenly over world_size=3"):
        sft(make_policy(0), steps=1, batch=8, world_size=3)


def test_measured_state_counts_what_the_optimizer_holds(one_thread):
    model = make_policy(0)
    apply_lora(model, ("qkv",), r=2)
    opt = adamw(model, 1e-2)
    before = measured_state_bytes(model, opt)
    assert before["optimizer_bytes"] == 0 and before["grad_bytes"] == 0  # Adam allocates m, v on its first step
    sft(model, steps=1, opt=opt)
    after = measured_state_bytes(model, opt)
    n = TOY.layers * 2 * (3 * TOY.hidden + TOY.hidden)  # r (d + k) for qkv, per layer
    assert after["trainable_params"] == n and after["optimizer_moment_bytes"] == 8 * n
    # an optimizer over *every* parameter still holds no state for the frozen ones: they have no .grad
    opt_all = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sft(model, steps=1, opt=opt_all)
    assert measured_state_bytes(model, opt_all)["optimizer_moment_bytes"] == 8 * n


def test_merged_copy_leaves_the_adapter_model_alone(one_thread):
    model = make_policy(0)
    apply_lora(model, ("qkv", "head"), r=2)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, LoRALinear):
                mod.lora_B.normal_(std=0.5)  # a trained adapter
    tokens = torch.randint(0, TOY.vocab, (4, 5))
    merged, gap, scale = merged_copy_and_gap(model, tokens)
    assert gap <= 1e-5 * scale
    assert any(isinstance(m, LoRALinear) for m in model.modules())  # the original still has its adapters
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    assert sum(p.numel() for p in merged.parameters()) == N_BASE


def test_rendered_check_has_a_row_per_quantity_and_a_column_pair_per_run():
    memory = L.memory_from_counts("lora", 10, 100, per=L.FP32_ADAM)
    state = {"trainable_params": 10, "trained_weight_bytes": 40, "frozen_weight_bytes": 400, "grad_bytes": 40,
             "optimizer_moment_bytes": 80}
    text = L.render_against_measured({"a": L.against_measured(memory, state), "b": L.against_measured(memory, state)})
    lines = text.splitlines()
    assert len(lines) == 2 + 5 and lines[0].count("ledger") == 2
    assert lines[-1].split()[-4:] == ["80", "80", "80", "80"]


def test_ledger_from_counts_refuses_frozen_parameters_in_full_fine_tuning():
    with pytest.raises(ValueError, match="freezes nothing"):
        L.memory_from_counts("full", 10, frozen=5)
