"""The planner's mixture-of-experts arithmetic reproduces what Mistral AI and DeepSeek publish.

Start here: ``planner.moe_parameter_counts(cfg)`` counts every matrix and norm vector of an MoE decoder whose shape
is copied from its source (``published_configs.MIXTRAL_8X7B``, ``DEEPSEEK_V3``); ``ep_rank_parameters`` is what one
rank holds when the routed experts are split over EP ranks; ``all_to_all_bytes`` is what one rank sends in one
dispatch under uniform routing. Every quantity here is integer arithmetic (or a float of an exact integer ratio),
so the expected values are exact: no tolerance, and nothing a CPU's kernels can change.

Rounding rule for the published counts: a figure printed to its last digit ``unit`` ("46.7B": unit 0.1e9;
"671B": unit 1e9) is matched by a count within unit / 2 of it, i.e. the count rounds to the printed figure.
"""
from dataclasses import replace
from itertools import combinations

import pytest

from course_utils.planner import (LayoutError, all_to_all_bytes, ep_rank_parameters, ep_traffic_per_step,
                                  moe_parameter_counts)
from course_utils.published_configs import DEEPSEEK_V3, MIXTRAL_8X7B, PUBLISHED_MOE

# Hand counts (the sums are written out in the test that uses each).
MIXTRAL_TOTAL, MIXTRAL_ACTIVE = 46_702_792_704, 12_879_925_248
DEEPSEEK_TOTAL, DEEPSEEK_ACTIVE = 671_026_419_200, 37_552_297_472


def rounds_to(count: int, published: float, unit: float) -> bool:
    return abs(count - published) <= unit / 2


# ------------------------------------------------------------------------------------------------
# Parameter counts
# ------------------------------------------------------------------------------------------------


def test_mixtral_counts_by_hand():
    # Per layer: attention W_q, W_o 4096 x 4096 and W_k, W_v 4096 x (8 x 128) = 41,943,040; two RMSNorms 8,192;
    # router 8 x 4096 = 32,768; one SwiGLU expert 3 x 4096 x 14336 = 176,160,768.
    attention, norms, router, expert = 41_943_040, 8_192, 32_768, 176_160_768
    assert 2 * 4096 * 4096 + 2 * 4096 * 1024 == attention and 3 * 4096 * 14336 == expert
    embeddings = 2 * 32_000 * 4096 + 4096  # untied embedding and LM head, final norm
    total = 32 * (attention + norms + router + 8 * expert) + embeddings
    active = 32 * (attention + norms + router + 2 * expert) + embeddings
    assert (total, active) == (MIXTRAL_TOTAL, MIXTRAL_ACTIVE)
    n = moe_parameter_counts(MIXTRAL_8X7B)
    assert (n["total"], n["active"]) == (MIXTRAL_TOTAL, MIXTRAL_ACTIVE)
    assert n["experts"] == 32 * 8 * expert and n["dense"] + n["experts"] == n["total"]
    assert n["active_experts"] == 32 * 2 * expert and n["input_embedding"] == 32_000 * 4096


def test_deepseek_v3_counts_by_hand():
    # MLA per layer: q_a 7168 x 1536, its norm 1536, q_b 1536 x 128 x (128 + 64); kv_a 7168 x (512 + 64), its norm
    # 512, kv_b 512 x 128 x (128 + 128); o 128 x 128 x 7168: 187,107,328. Two RMSNorms 14,336.
    mla = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert mla == 187_107_328
    attention = mla + 2 * 7168
    expert = 3 * 7168 * 2048  # 44,040,192
    dense_layer = attention + 3 * 7168 * 18432  # first three layers: SwiGLU FFN of 18,432
    router = 256 * 7168 + 256  # weight, plus the per-expert bias of auxiliary-loss-free balancing
    moe_shared = attention + router + 1 * expert  # attention, router, the shared expert
    embeddings = 2 * 129_280 * 7168 + 7168  # untied embedding and LM head, final norm
    total = 3 * dense_layer + 58 * (moe_shared + 256 * expert) + embeddings
    active = 3 * dense_layer + 58 * (moe_shared + 8 * expert) + embeddings
    assert (total, active) == (DEEPSEEK_TOTAL, DEEPSEEK_ACTIVE)
    n = moe_parameter_counts(DEEPSEEK_V3)
    assert (n["total"], n["active"]) == (DEEPSEEK_TOTAL, DEEPSEEK_ACTIVE)
    assert n["experts"] == 58 * 256 * expert and n["dense"] == total - n["experts"]
    assert n["active"] - n["input_embedding"] == 36_625_618_432


def test_the_published_counts_within_their_rounding():
    mixtral, deepseek = moe_parameter_counts(MIXTRAL_8X7B), moe_parameter_counts(DEEPSEEK_V3)
    # Mistral AI's release post: "46.7B total parameters but only uses 12.9B parameters per token".
    assert rounds_to(mixtral["total"], 46.7e9, 0.1e9) and rounds_to(mixtral["active"], 12.9e9, 0.1e9)
    # DeepSeek-V3 report, sec 4.2: "671B total parameters, of which 37B are activated for each token".
    assert rounds_to(deepseek["total"], 671e9, 1e9)
    # 37B is reproduced with one vocab x hidden table fewer (the input embedding, a lookup): 36.63B. Counting it,
    # 37.55B rounds to 38B, so the report counts "active" as Mistral does not (or cut 37.55 down to 37).
    assert rounds_to(deepseek["active"] - deepseek["input_embedding"], 37e9, 1e9)
    assert round(deepseek["active"] / 1e9) == 38 and int(deepseek["active"] / 1e9) == 37
    # Mistral's 12.9B does include the embedding table: without it, 12.75B would round to 12.7B.
    assert not rounds_to(mixtral["active"] - mixtral["input_embedding"], 12.9e9, 0.1e9)


@pytest.mark.parametrize("config", PUBLISHED_MOE, ids=lambda c: c.name)
def test_each_published_model_matches_its_own_record(config):
    n = moe_parameter_counts(config)
    assert rounds_to(n["total"], config.published_total, config.published_unit)
    assert n["active"] < n["total"] and n["experts"] + n["dense"] == n["total"]
    assert n["active"] == n["dense"] + n["active_experts"]
    assert n["active_experts"] * config.experts == n["experts"] * config.top_k


@pytest.mark.parametrize("mistake, field", [
    ("forgot the shared expert", dict(shared_experts=0)),
    ("made the first three layers MoE too", dict(dense_layers=0)),
    ("tied the embedding and the LM head", dict(tied_embeddings=True)),
    ("dropped the router's balancing bias", dict(router_bias=False)),
    ("read the dense FFN's size for the experts'", dict(expert_ffn=18432)),
])
def test_each_mistake_in_deepseek_v3s_shape_changes_the_count(mistake, field):
    # The exact integer catches every one; the first four also miss the published 671B or 37B.
    wrong = moe_parameter_counts(replace(DEEPSEEK_V3, **field))
    assert wrong["total"] != DEEPSEEK_TOTAL or wrong["active"] != DEEPSEEK_ACTIVE, mistake
    if field != dict(router_bias=False):  # 58 x 256 bias entries are far below the rounding
        missed = (not rounds_to(wrong["total"], 671e9, 1e9)
                  or not rounds_to(wrong["active"] - wrong["input_embedding"], 37e9, 1e9))
        assert missed, mistake


def test_forgetting_the_lm_head_misses_mixtrals_active_count():
    n = moe_parameter_counts(replace(MIXTRAL_8X7B, tied_embeddings=True))
    assert not rounds_to(n["active"], 12.9e9, 0.1e9) and not rounds_to(n["total"], 46.7e9, 0.1e9)


def test_an_unknown_attention_kind_is_refused():
    with pytest.raises(LayoutError, match="attention must be 'gqa' or 'mla'"):
        moe_parameter_counts(replace(MIXTRAL_8X7B, attention="mqa"))


# ------------------------------------------------------------------------------------------------
# Expert parallelism: parameters per rank
# ------------------------------------------------------------------------------------------------


def test_parameters_per_rank_at_ep_1_8_64():
    # dense part whole, routed experts / ep. Mixtral: dense 1,605,636,096, experts 45,097,156,608.
    assert ep_rank_parameters(MIXTRAL_8X7B, 1) == MIXTRAL_TOTAL
    assert ep_rank_parameters(MIXTRAL_8X7B, 8) == 1_605_636_096 + 45_097_156_608 // 8 == 7_242_780_672
    # DeepSeek-V3: dense 17,117,648,384, experts 653,908,770,816; it trained with EP 64 (report sec 3.2).
    assert ep_rank_parameters(DEEPSEEK_V3, 1) == DEEPSEEK_TOTAL
    assert ep_rank_parameters(DEEPSEEK_V3, 8) == 17_117_648_384 + 653_908_770_816 // 8 == 98_856_244_736
    assert ep_rank_parameters(DEEPSEEK_V3, 64) == 17_117_648_384 + 653_908_770_816 // 64 == 27_334_972_928


@pytest.mark.parametrize("config", PUBLISHED_MOE, ids=lambda c: c.name)
def test_the_ranks_together_hold_the_model_once_plus_the_replicas(config):
    n = moe_parameter_counts(config)
    for ep in (1, 2, 4, 8):
        assert ep * ep_rank_parameters(config, ep) == n["total"] + (ep - 1) * n["dense"]


@pytest.mark.parametrize("config, ep", [(MIXTRAL_8X7B, 3), (MIXTRAL_8X7B, 64), (DEEPSEEK_V3, 48)])
def test_an_ep_that_does_not_divide_the_experts_is_refused_in_one_sentence(config, ep):
    with pytest.raises(ValueError, match=rf"ep={ep} does not divide the {config.experts} routed experts") as err:
        ep_rank_parameters(config, ep)
    assert "use an ep from" in str(err.value) and str(err.value).count(". ") == 0


@pytest.mark.parametrize("ep", [0, -8, 2.0, True])
def test_an_ep_that_is_not_a_whole_number_of_ranks_is_refused(ep):
    with pytest.raises(ValueError, match="ep must be a whole number"):
        ep_rank_parameters(MIXTRAL_8X7B, ep)


# ------------------------------------------------------------------------------------------------
# Expert parallelism: all-to-all bytes
# ------------------------------------------------------------------------------------------------


def _reference_dispatch_bytes(experts: int, top_k: int, ep: int, hidden: int, bytes_per_element: int):
    """Exact uniform routing on rank 0: one token for every set of top_k distinct experts, experts placed in
    contiguous blocks of experts/ep per rank; count the copies whose expert lives on another rank."""
    owner = [e // (experts // ep) for e in range(experts)]
    choices = list(combinations(range(experts), top_k))
    leaving = sum(owner[e] != 0 for chosen in choices for e in chosen)
    return len(choices), leaving * hidden * bytes_per_element


@pytest.mark.parametrize("experts, top_k, ep", [(8, 2, 4), (8, 2, 8), (16, 4, 8), (12, 3, 6), (8, 1, 2)])
def test_all_to_all_bytes_equal_an_exact_uniform_routing(experts, top_k, ep):
    tokens, sent = _reference_dispatch_bytes(experts, top_k, ep, hidden=64, bytes_per_element=2)
    assert all_to_all_bytes(tokens, 64, top_k, ep, 2) == sent


def test_all_to_all_bytes_by_hand():
    # Mixtral, 4,096 tokens, bf16, EP 8: 4096 x 4096 x 2 bytes x top-2 x 7/8 = 58,720,256 bytes = 56 MiB.
    assert all_to_all_bytes(4096, 4096, 2, 8, 2) == 4096 * 4096 * 2 * 2 * 7 / 8 == 58_720_256
    # DeepSeek-V3, EP 64: 4096 x 7168 x 2 x top-8 x 63/64 = 462,422,016 bytes.
    assert all_to_all_bytes(4096, 7168, 8, 64, 2) == 462_422_016
    assert all_to_all_bytes(4096, 7168, 8, 1, 2) == 0  # one rank: every expert is local
    assert all_to_all_bytes(4096, 7168, 8, 64, 1) == 462_422_016 / 2  # FP8 halves it


@pytest.mark.parametrize("name, args", [("tokens", (0, 64, 2, 8, 2)), ("top_k", (16, 64, 0, 8, 2)),
                                        ("ep", (16, 64, 2, 0, 2)), ("bytes_per_element", (16, 64, 2, 8, 0))])
def test_all_to_all_bytes_refuses_sizes_below_one(name, args):
    with pytest.raises(ValueError, match=f"{name} must be a whole number"):
        all_to_all_bytes(*args)


def test_traffic_per_layer_and_per_step():
    t = ep_traffic_per_step(DEEPSEEK_V3, 4096, 64, 2, num_microbatches=3)
    one = all_to_all_bytes(4096, 7168, 8, 64, 2)
    # dispatch + combine, forward + backward; 58 MoE layers (61 minus the 3 dense ones)
    assert t["per_all_to_all"] == one and t["all_to_alls_per_layer"] == 4 and t["per_layer"] == 4 * one
    assert t["moe_layers"] == 58 and t["per_step"] == 4 * one * 58 * 3
    assert ep_traffic_per_step(MIXTRAL_8X7B, 4096, 8)["per_step"] == 4 * 58_720_256 * 32
    with pytest.raises(ValueError, match="ep=16 does not divide the 8 routed experts"):
        ep_traffic_per_step(MIXTRAL_8X7B, 4096, 16)
