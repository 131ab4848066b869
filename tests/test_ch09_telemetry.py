"""Chapter 09 without ranks: the tiny GPT, its data, its telemetry and the detectors, each against an
independent single-process computation (CS336 style: small inputs, stated tolerances, the reason in a comment)."""
import math

import pytest
import torch

from course_utils.ch09_tables import (LLAMA3_INTERRUPTIONS, LLAMA3_TOTAL_INTERRUPTIONS, LLAMA3_TOTAL_UNEXPECTED,
                                      TRIAGE, by_category, percent_of_total)
from workers.gpt import telemetry as tm
from workers.gpt.config import FAULTS, MODEL, TrainConfig
from workers.gpt.data import Loader, MarkovDataset, entropy_rate
from workers.gpt.detect import SpikeDetector, first_divergence, odd_ones_out
from workers.gpt.telemetry import layer_groups, token_loss
from workers.model import make_model
from workers.gpt.reduce import gradient_fingerprint, projection_probes, reduction_culprits
from workers.gpt.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = MODEL.replace(vocab=16, seq=8, hidden=32, heads=2, layers=2)  # chapter 09's model, smaller


def _one_step(cfg=SMALL, tcfg=TrainConfig(steps=1, global_batch=4)):
    trainer = Trainer(cfg, tcfg)
    return trainer, trainer.run()["trajectory"][0]


# -- telemetry against torch's own numbers ------------------------------------------------------------------

def test_global_grad_norm_is_what_clip_grad_norm_reports():
    # The gradient the step used is still in .grad after the run (the loop zeroes it at the start of a step).
    trainer, rec = _one_step()
    want = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), max_norm=float("inf"))
    # telemetry sums squares in float64, clip_grad_norm_ in fp32: equal to fp32 rounding
    assert rec["grad_norm"] == pytest.approx(float(want), rel=1e-6)


def test_layer_norms_partition_the_parameters_and_add_up_to_the_global_norm():
    trainer, rec = _one_step()
    groups = layer_groups(trainer.model)
    ids = [id(p) for ps in groups.values() for p in ps]
    assert sorted(ids) == sorted(id(p) for p in trainer.model.parameters())  # every parameter exactly once
    # the squares of disjoint groups add up: ||g||^2 = sum over groups of ||g_group||^2
    total = math.sqrt(sum(v * v for v in rec["layer_grad_norms"].values()))
    assert total == pytest.approx(rec["grad_norm"], rel=1e-12)


def test_update_ratio_loss_and_log_z_against_a_recomputation():
    tcfg = TrainConfig(steps=1, global_batch=4)
    model = make_model(SMALL, seed=tcfg.seed)
    before = tm.flat_params(model.parameters())
    data = MarkovDataset(SMALL.vocab, SMALL.seq, 64, tcfg.data_seed)
    tokens = data.batch(Loader(64, 4).next_ids())
    logits = model(tokens[:, :-1])  # [4, 8, 16]
    want_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SMALL.vocab), tokens[:, 1:].reshape(-1))
    want_log_z = torch.logsumexp(logits, dim=-1).mean()
    trainer, rec = _one_step(SMALL, tcfg)
    after = tm.flat_params(trainer.model.parameters())
    assert rec["loss"] == pytest.approx(want_loss.item(), rel=1e-6)
    assert rec["log_z_mean"] == pytest.approx(want_log_z.item(), rel=1e-6)
    assert rec["update_ratio"] == pytest.approx(((after - before).norm() / before.norm()).item(), rel=1e-5)
    # Adam's first step moves every element with a gradient by lr (bias-corrected m/sqrt(v) = sign(g))
    assert (after - before).abs().max().item() == pytest.approx(tcfg.lr_at(0), rel=1e-3)


def test_max_attention_logit_is_the_largest_causal_q_dot_k():
    model = make_model(SMALL, seed=3)
    tokens = torch.randint(0, SMALL.vocab, (2, SMALL.seq))
    model(tokens)
    attn = model.blocks[0].attention
    x = model.blocks[0].ln1(model.embed(tokens) + model.pos)  # the first block's attention input, [2, 8, 32]
    q, k, _ = attn.qkv(x).split(SMALL.hidden, dim=-1)
    q = q.view(2, SMALL.seq, SMALL.heads, -1).transpose(1, 2)
    k = k.view(2, SMALL.seq, SMALL.heads, -1).transpose(1, 2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(SMALL.head_dim)  # [2, a, 8, 8]
    causal = torch.tril(torch.ones(SMALL.seq, SMALL.seq, dtype=torch.bool))
    assert attn.max_logit == pytest.approx(scores[..., causal].max().item(), rel=1e-6)


def test_qk_layernorm_bounds_the_logits_whatever_the_weights():
    # |LN(q) . LN(k)| / sqrt(d) <= sqrt(d) with unit gains (each normalised vector has norm sqrt(d)),
    # however large the projection weights grow. Without it the logits scale with the weights squared.
    for qk in (False, True):
        cfg = MODEL.replace(vocab=16, seq=8, hidden=32, heads=2, layers=1, qk_layernorm=qk)
        model = make_model(cfg)
        with torch.no_grad():
            model.blocks[0].attention.qkv.weight.mul_(1000)
        model(torch.randint(0, 16, (2, 8)))
        if qk:
            assert model.max_attention_logit() <= math.sqrt(cfg.head_dim) + 1e-4
        else:
            assert model.max_attention_logit() > 100


def test_z_loss_adds_coeff_times_mean_log_z_squared():
    logits = torch.randn(3, 5, 7) * 3 + 2
    targets = torch.randint(0, 7, (3, 5))
    plain, stats = token_loss(logits, targets)
    with_z, _ = token_loss(logits, targets, z_loss=1e-2)
    assert (with_z - plain).item() == pytest.approx(1e-2 * (torch.logsumexp(logits, -1) ** 2).mean().item(), rel=1e-5)
    assert stats["loss"] == pytest.approx(plain.item())  # telemetry reports the cross-entropy alone


# -- checksums, bit flips and divergence --------------------------------------------------------------------

def test_bitwise_checksum_sees_every_bit_and_every_position():
    t = torch.randn(1000)
    base = tm.bitwise_checksum(t)
    assert tm.bitwise_checksum(t.clone()) == base  # equal bits, equal checksum
    for bit in (0, 11, 22, 23, 30, 31):  # lowest mantissa bit ... exponent ... sign
        flipped = t.clone()
        tm.flip_bit_(flipped, 17, bit)
        assert tm.bitwise_checksum(flipped) != base, bit
        tm.flip_bit_(flipped, 17, bit)  # flipping twice restores the value exactly
        assert torch.equal(flipped, t)
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert tm.bitwise_checksum(swapped) != base  # an order-blind sum of bits would not change


def test_flip_of_bit_20_changes_a_value_by_one_eighth_in_relative_terms():
    t = torch.tensor([1.0])
    old, new = tm.flip_bit_(t, 0, 20)
    assert (old, new) == (1.0, 1.125)  # mantissa bit 20 is worth 2^(20-23) = 1/8 of the leading bit


def test_first_divergence_and_the_majority_rule():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1.0, 2.0, 3.0], [1.0, 2.0 * (1 + 1e-9), 4.0], rtol=1e-6) == 2
    assert first_divergence([1.0, 2.0], [1.0, float("nan")], rtol=0.5) == 1
    assert first_divergence([1.0, 2.0], [1.0, float("inf")], rtol=0.5) == 1  # inf <= 0.5 * inf would pass it
    assert first_divergence([float("inf")], [float("inf")], rtol=0.5) == 0  # both blew up: no agreement
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert odd_ones_out([5, 5, 7]) == [2]
    assert odd_ones_out([5, 7]) == [0, 1]  # two ranks cannot vote
    assert odd_ones_out([5, 5]) == []


def test_the_reference_solutions_match_the_workers_implementations():
    import solutions.ch09 as sol

    assert sol.first_divergence([1.0, 2.0, 3.0], [1.0, 2.5, 3.0], 0.01) == first_divergence([1.0, 2.0, 3.0],
                                                                                            [1.0, 2.5, 3.0], 0.01)
    logits = torch.randn(2, 3, 5)
    assert sol.z_loss(logits, 1.0).item() == pytest.approx((torch.logsumexp(logits, -1) ** 2).mean().item())


def test_spike_detector_waits_for_a_window_and_treats_nan_as_a_spike():
    det = SpikeDetector(window=3, factor=1.5)
    assert not det.is_spike(100.0)  # no verdict before 3 accepted losses
    for v in (2.0, 2.1, 1.9):
        det.accept(v)
    assert not det.is_spike(2.9) and det.is_spike(3.1)  # median 2.0, threshold 3.0
    assert det.is_spike(float("nan"))


# -- the reduction check -----------------------------------------------------------------------------------

def _fingerprints(local, reduced, probes):
    return [gradient_fingerprint(g, r, probes) for g, r in zip(local, reduced)]


def test_reduction_check_names_a_summing_rank_even_where_the_plain_sums_cancel():
    # Two ranks' local gradients whose elements sum to exactly 0 (small integers and halves: every sum and
    # the average are exact in fp32 and float64). Rank 1 sums instead of averaging.
    g = torch.Generator().manual_seed(0)
    local = [torch.randint(-8, 9, (1000,), generator=g).float() for _ in range(2)]
    for v in local:
        v[-1] -= v.sum()
    mean, total = (local[0] + local[1]) / 2, local[0] + local[1]
    fps = _fingerprints(local, [mean, total], projection_probes(1000))
    # the plain-sum check is blind: every sum is 0, the summing rank's included (twice 0 is 0)
    assert [(f["local_sum"], f["reduced_sum"]) for f in fps] == [(0.0, 0.0), (0.0, 0.0)]
    # random projections are not: they are about ||g|| in size whatever the gradient's structure
    assert reduction_culprits(fps) == [1]
    assert reduction_culprits(_fingerprints(local, [mean, mean], projection_probes(1000))) == []


def test_reduction_check_names_a_rank_whose_reduced_gradient_is_nan():
    # NaN > tol is False: a comparison written the other way round would call the NaN rank honest
    local = [torch.ones(100), 3 * torch.ones(100)]
    mean = (local[0] + local[1]) / 2
    poisoned = mean.clone()
    poisoned[17] = float("nan")
    probes = projection_probes(100)
    assert reduction_culprits(_fingerprints(local, [mean, poisoned], probes)) == [1]
    poisoned[17] = float("inf")
    assert reduction_culprits(_fingerprints(local, [mean, poisoned], probes)) == [1]


def test_reduction_check_on_real_head_gradients_whose_sum_is_rounding():
    # The output layer's weight gradient sums to 0 up to rounding (each position's softmax gradient sums to 0
    # over the vocabulary): the plain sum is rounding noise, the projections are the gradient's size. Two ranks
    # each see half a batch; the honest rank's reduced gradient is the fp32 average, as the all-reduce computes it.
    model = make_model(SMALL, seed=0)
    tokens = MarkovDataset(SMALL.vocab, SMALL.seq, 8, 1234).batch(list(range(8)))
    local = []
    for rows in (slice(0, 4), slice(4, 8)):
        model.zero_grad()
        token_loss(model(tokens[rows, :-1]), tokens[rows, 1:])[0].backward()
        local.append(model.head.weight.grad.reshape(-1).clone())
    assert abs(float(local[0].double().sum())) < 1e-6 * float(local[0].double().abs().sum())  # it cancels
    probes = projection_probes(local[0].numel())
    mean, total = (local[0] + local[1]) / 2, local[0] + local[1]
    assert reduction_culprits(_fingerprints(local, [mean, total], probes)) == [1]
    assert reduction_culprits(_fingerprints(local, [total, mean], probes)) == [0]
    assert reduction_culprits(_fingerprints(local, [mean, mean], probes)) == []  # no false alarm from rounding


# -- first gradients, the fp32 probe and the freeze ------------------------------------------------------------

def test_woken_elements_count_first_nonzero_gradients_and_adam_moves_them_by_lr_at_step_0():
    tcfg = TrainConfig(steps=3, global_batch=4)
    trainer = Trainer(SMALL, tcfg)
    out = trainer.run()["trajectory"]
    n = sum(p.numel() for p in trainer.params)
    # an fp32 run: (almost) every element has a gradient at step 0, so (almost) nothing is new afterwards
    assert out[0]["woken_elements"] > 0.99 * n
    assert sum(r["woken_elements"] for r in out) == int(trainer.seen.sum()) <= n
    # Adam's first step on an element with no history is lr * sign(g): 1 in units of lr, up to eps
    assert out[0]["woken_update"] == pytest.approx(1.0, rel=1e-3)
    assert out[0]["woken_sign_agreement"] is None  # the probe is off


def test_fp32_probe_agrees_with_an_fp32_run_and_changes_nothing():
    tcfg = TrainConfig(steps=3, global_batch=4)
    plain = Trainer(SMALL, tcfg).run()["trajectory"]
    probed = Trainer(SMALL, tcfg.replace(fp32_grad_probe=True)).run()["trajectory"]
    # in fp32 the gradient the run uses is the exact one: the signs agree everywhere
    assert probed[0]["woken_sign_agreement"] == 1.0
    assert [r["param_checksum"] for r in probed] == [r["param_checksum"] for r in plain]


def test_freezing_dormant_weights_from_step_0_freezes_every_weight():
    # At step 0 no element has had a gradient yet, so every weight is dormant: none may move, although the
    # gradients are there (the telemetry reports them before the freeze).
    tcfg = TrainConfig(steps=3, global_batch=4, freeze_dormant_from=0)
    trainer = Trainer(SMALL, tcfg)
    start = tm.flat_params(trainer.params)
    out = trainer.run()["trajectory"]
    assert torch.equal(tm.flat_params(trainer.params), start)
    assert all(r["grad_norm"] > 0 and r["update_ratio"] == 0 for r in out)
    free = Trainer(SMALL, tcfg.replace(freeze_dormant_from=-1)).run()["trajectory"]
    assert out[0]["loss"] == free[0]["loss"] and out[1]["loss"] != free[1]["loss"]


# -- data -----------------------------------------------------------------------------------------------------

def test_samples_do_not_depend_on_the_dataset_size_and_skipped_ids_never_come_back():
    # a run of 60 steps and one of 120 must read the same samples, or their prefixes could not be compared
    small, large = MarkovDataset(32, 32, 100, 7), MarkovDataset(32, 32, 3000, 7)
    assert torch.equal(small.tokens, large.tokens[:100])
    loader = Loader(100, 4, skip={1, 2})
    assert loader.next_ids() == [0, 3, 4, 5] and loader.next_ids() == [6, 7, 8, 9]


def test_the_chain_has_structure_a_model_can_learn():
    table = MarkovDataset(32, 32, 1, 1234).table
    assert torch.allclose(table.sum(-1), torch.ones(32))
    # the floor is far below uniform guessing: there is something to learn
    assert entropy_rate(table) < 0.5 * math.log(32)


def test_fp16_fault_multiplier_is_exact_in_fp32():
    # Multiplying the loss by 2^-14 and the gradients back by 2^14 commutes with fp32 rounding (powers of
    # two, far from fp32's range limits): the fp32 run is bit-identical to the run without the multiplier.
    cfg = TrainConfig(steps=4, global_batch=4)
    plain = Trainer(SMALL, cfg).run()["trajectory"]
    scaled = Trainer(SMALL, cfg.replace(fault="fp16_underflow", dtype="float32")).run()["trajectory"]
    assert [r["param_checksum"] for r in plain] == [r["param_checksum"] for r in scaled]


# -- the tables ------------------------------------------------------------------------------------------------

def test_llama3_counts_add_up_to_the_published_total():
    # Dubey et al. 2024, Table 5: 419 unexpected interruptions (of 466; 47 were planned)
    assert sum(r[2] for r in LLAMA3_INTERRUPTIONS) == LLAMA3_TOTAL_UNEXPECTED == 419
    assert LLAMA3_TOTAL_INTERRUPTIONS - LLAMA3_TOTAL_UNEXPECTED == 47
    assert sum(by_category().values()) == 419 and by_category()["GPU"] == 268
    # every published percentage but the first is count/419 rounded to 0.1; the first is the paper's slip
    mismatched = [r[0] for r in LLAMA3_INTERRUPTIONS if round(percent_of_total(r[2]), 1) != r[3]]
    assert mismatched == ["Faulty GPU"]
    assert round(sum(r[3] for r in LLAMA3_INTERRUPTIONS), 1) == 94.9
    # the paper's "GPU issues 58.7%" is the sum of the printed GPU percentages
    assert round(sum(r[3] for r in LLAMA3_INTERRUPTIONS if r[1] == "GPU"), 1) == 58.7


def test_triage_covers_every_fault_and_layer():
    assert {row["fault"] for row in TRIAGE} == set(FAULTS) - {"none"}
    assert {row["layer"] for row in TRIAGE} == {"data", "numeric", "communication", "hardware"}
