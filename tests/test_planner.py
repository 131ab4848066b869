"""The planner agrees with what published runs did, and refuses layouts that cannot run.

Memory "fits" is a prediction a real run can contradict: a layout that trained on 80 GB GPUs must
fit, and the configurations a paper says did not fit must not. Each test cites the run it checks.
"""

import pytest

from course_utils.ledger import GB, GiB, collective_time, pipeline_bubble_fraction
from course_utils.planner import (
    CLUSTERS,
    GPUS,
    H100_80GB_NVIDIA_SMI_BYTES,
    MODEL_SHAPES,
    NETWORK_TIERS,
    Layout,
    LayoutError,
    ModelShape,
    Practice,
    candidate_layouts,
    min_gpus_to_fit,
    model_shape,
    plan,
    step_collectives,
    zero_collectives_per_step,
)
from course_utils.published_configs import (
    KORTHIKANTI_2022_530B_DP8,
    KORTHIKANTI_2022_TABLE3,
    LLAMA3_405B_TABLE4,
    PUBLISHED_CONFIGS,
    PublishedConfig,
)

# ------------------------------------------------------------------------------------------------
# Model shapes and published configurations
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, billions",
    [
        ("llama-2-7b", 6.74),  # Llama 2 7B: 6.74B parameters (released checkpoint)
        ("llama-3-8b", 8.03),  # Llama 3 8B: 8.03B
        ("llama-3-70b", 70.55),  # Llama 3 70B: 70.55B
        ("llama-3.1-405b", 405.85),  # Llama 3.1 405B: 405.85B
        ("gpt-3-175b", 174.58),  # GPT-3 Table D.1: 174,600M (no biases or position embeddings here)
    ],
)
def test_model_shapes_count_the_published_parameters(key, billions):
    # The shapes come from Llama 3 Table 3 / Llama 2 / GPT-3 Table 2.1; if a layer count, FFN width
    # or KV-head count were wrong, the parameter count would miss the published size.
    assert round(model_shape(key).n_params / 1e9, 2) == billions


def test_size_aliases_and_unknown_model():
    # "70B" is how the syllabus names models; an unknown name is a LayoutError naming the choices.
    assert model_shape("70B") is MODEL_SHAPES["llama-3-70b"]
    with pytest.raises(LayoutError, match="unknown model 'llama-9b'; use one of"):
        model_shape("llama-9b")


@pytest.mark.parametrize("config", PUBLISHED_CONFIGS, ids=lambda c: c.name)
def test_every_published_layout_obeys_the_product_rule(config):
    # TP x CP x PP x DP must equal the GPU count (Llama 3 sec 3.3.2, Figure 5; Narayanan et al. 2021
    # sec 3: n = p * t * d). Each row was copied from its source; a typo in any degree fails here.
    config.check_product()


def test_llama3_dp4_misprint_breaks_the_product_rule():
    # Copies of Llama 3 Table 4 that print DP=4 in the 128K-context row give 8*16*16*4 = 8192, not
    # the 16,384 GPUs of that row; the rule catches it. DP=8 also gives the row's 16M tokens/batch.
    row = LLAMA3_405B_TABLE4[2]
    with pytest.raises(ValueError, match="8192, not the 16384 GPUs"):
        PublishedConfig(**{**row.__dict__, "dp": 4}).check_product()
    for r in LLAMA3_405B_TABLE4:
        assert r.seq * r.global_batch == 16 * 2**20  # "Tokens/Batch 16M"


def test_llama3_table4_tflops_are_the_printed_mfu():
    # Table 4's MFU column is TFLOPs/GPU over the H100's 989.5 TFLOP/s dense BF16 peak: 430 -> 43%,
    # 380 -> 38%. The 400 TFLOP/s row computes to 40.4% but is printed as 41%, so it is allowed
    # one point of slack; the other two must match to the printed integer.
    peak = CLUSTERS["h100-roce"].gpu.peak_flops
    for row in LLAMA3_405B_TABLE4:
        pct = 100 * row.flops_per_gpu / peak
        tolerance = 1.0 if row.flops_per_gpu == 400e12 else 0.5
        assert abs(pct - 100 * row.mfu) <= tolerance, (row.name, pct)


# ------------------------------------------------------------------------------------------------
# Memory: the planner against runs that happened
# ------------------------------------------------------------------------------------------------


def _korthikanti_shape(c: PublishedConfig) -> ModelShape:
    # Korthikanti sec 3: GPT block, 4h GeLU MLP, tied embeddings, v = 51200.
    return ModelShape(c.name, c.layers, c.hidden, c.heads, c.heads, 4 * c.hidden, c.vocab, mlp="gelu",
                      tied_embeddings=True)


def _korthikanti_plan(c: PublishedConfig, recompute: str, sequence_parallel: bool):
    layout = Layout(tp=c.tp, pp=c.pp, dp=c.dp, micro_batch=c.micro_batch, seq=c.seq,
                    micro_batches=c.global_batch // (c.dp * c.micro_batch), recompute=recompute,
                    sequence_parallel=sequence_parallel, virtual_stages=c.virtual_stages)
    # 2022's kernels stored the attention scores (no FlashAttention), which is what "none" costs here
    return plan(_korthikanti_shape(c), layout, c.gpus, cluster_name="a100-ib", practice=Practice(flash_attention=False))


@pytest.mark.parametrize("config", KORTHIKANTI_2022_TABLE3 + (KORTHIKANTI_2022_530B_DP8,), ids=lambda c: c.name)
def test_korthikanti_configs_fit_only_with_sp_and_selective_recompute(config):
    # Korthikanti et al. 2022, Figure 1 and sec 6.1: for all four Table 3 models the tensor-parallel
    # baseline needs more than an A100's 80 GB, and sequence parallelism with selective recompute
    # makes them fit ("Without the memory savings provided by sequence parallelism and selective
    # recompute together, none of these models will fit into memory"); they then trained (Table 5).
    assert _korthikanti_plan(config, "selective", True).fits
    baseline = _korthikanti_plan(config, "none", False)
    assert not baseline.fits
    assert baseline.total_memory_bytes > 80 * GiB


@pytest.mark.parametrize("row", LLAMA3_405B_TABLE4, ids=lambda r: r.name)
def test_llama3_405b_table4_fits_on_80gb_h100s(row):
    # Llama 3 sec 3.3.2: these three layouts trained 405B on 80 GB H100s, with FSDP sharding
    # optimizer states and gradients (ZeRO-2 in this ledger) and FlashAttention-style attention
    # (no stored s x s scores: "selective"). The planner must agree that they fit; storing the
    # 8192 x 8192 (or 131,072-token) attention scores instead must not fit.
    layout = Layout(tp=row.tp, cp=row.cp, pp=row.pp, dp=row.dp, zero=2, seq=row.seq,
                    micro_batches=row.global_batch // row.dp, recompute="selective", sequence_parallel=True)
    assert plan("405B", layout, row.gpus, cluster_name="h100-roce").fits
    assert not plan("405B", Layout(**{**layout.__dict__, "recompute": "none"}), row.gpus,
                    cluster_name="h100-roce", practice=Practice(flash_attention=False)).fits
    # with FlashAttention the scores are never stored: no recomputation holds what selective recomputation holds
    flash = plan("405B", Layout(**{**layout.__dict__, "recompute": "none"}), row.gpus, cluster_name="h100-roce")
    assert flash.memory["activations"] == pytest.approx(plan("405B", layout, row.gpus, cluster_name="h100-roce").memory["activations"])


def test_first_stage_holds_p_microbatches_of_activations():
    # Korthikanti sec 4.2.3 (1F1B): the first stage stores activations for p micro-batches (or m,
    # if fewer), so with p = 4, going from m = 2 to m = 8 doubles them (2 -> 4 in flight), and
    # m = 8 -> 16 changes nothing.
    def acts(m):
        return plan("8B", Layout(tp=1, pp=4, dp=2, micro_batches=m, sequence_parallel=True), 8).memory["activations"]

    assert acts(8) == pytest.approx(2 * acts(2))
    assert acts(16) == pytest.approx(acts(8))


def test_zero_stages_lower_memory_and_stage3_moves_1_5x_the_bytes():
    # ZeRO sec 5: each stage shards one more state, so memory strictly falls; sec 7: stages 0-2
    # move 2 Psi per step (all-reduce = reduce-scatter + all-gather) and stage 3 moves 3 Psi
    # (an extra all-gather). With one micro-batch and bandwidth-dominated messages, the DP time
    # of stage 3 must be 1.5x that of stage 0, and stages 1 and 2 must equal stage 0.
    plans = [plan("8B", Layout(dp=64, zero=z, micro_batches=1), 64) for z in range(4)]
    totals = [p.total_memory_bytes for p in plans]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    wire = [sum(c.wire_bytes for c in step_collectives(p.model, p.layout)["dp"]) for p in plans]
    assert wire[1] == pytest.approx(wire[0]) and wire[2] == pytest.approx(wire[0])
    assert wire[3] == pytest.approx(1.5 * wire[0])


@pytest.mark.parametrize("stage, expected", [
    (0, {"all_reduce": 1, "reduce_scatter": 0, "all_gather": 0}),
    (1, {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 1}),
    (2, {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 1}),
    (3, {"all_reduce": 0, "reduce_scatter": 4, "all_gather": 8}),
])
def test_zero_collectives_with_gradient_accumulation(stage, expected):
    # m = 4 micro-batches per step. Stages 0 and 1 keep full-size gradients, so they accumulate locally and
    # reduce once (DDP no_sync; DeepSpeed ZeRO-1 at the accumulation boundary). Stages 2 and 3 keep only their
    # shard, so every micro-batch's backward ends in a reduce-scatter (DeepSpeed ZeRO-2; FSDP's default, as
    # pytorch/pytorch PR #126166 describes); stage 3 gathers the weights for each forward and each backward.
    assert zero_collectives_per_step(stage, 4) == expected
    # the planner's byte count is exactly those collectives over the GPU's slice of the model
    p = plan("8B", Layout(dp=64, zero=stage, micro_batches=4), 64)
    calls = {c.collective: c.count for c in step_collectives(p.model, p.layout)["dp"]}
    assert calls == {name: count for name, count in expected.items() if count}
    # and its time model leaves some of that traffic exposed, the rest hidden behind compute (never more than sent)
    assert p.comm_time_s["dp"] > 0 and p.hidden_comm_s["dp"] >= 0


def test_global_batch_sets_the_microbatches_so_layouts_train_on_the_same_tokens():
    # Step times only compare layouts that train on the same global batch: global_batch = dp x m x micro_batch.
    plans = [plan("70B", lay, 256, global_batch=256) for lay in
             (Layout(zero=1, tp=8, sequence_parallel=True), Layout(tp=8, pp=4, zero=1, sequence_parallel=True), Layout(tp=8, pp=4, micro_batch=2, sequence_parallel=True))]
    assert [p.layout.micro_batches for p in plans] == [8, 32, 16]
    assert {p.tokens_per_step for p in plans} == {256 * 4096}
    assert {p.sequences_per_step for p in plans} == {256}
    p = plans[1]
    assert p.tokens_per_second == pytest.approx(p.tokens_per_step / p.step_time_s)
    with pytest.raises(LayoutError, match="choose a multiple of 64"):
        plan("70B", Layout(tp=4, sequence_parallel=True), 256, global_batch=100)
    with pytest.raises(LayoutError, match="set only one of the two"):
        plan("70B", Layout(tp=8, pp=4, micro_batches=4, sequence_parallel=True), 256, global_batch=256)


def test_min_gpus_to_fit_405b_with_fsdp_only():
    # Chapter 00, exercise 3's follow-up: Llama 3.1 405B with FSDP alone (full recomputation, seq 4096, FlashAttention:
    # the layer being recomputed holds no scores). The bisection must give what counting up one GPU at a time gives,
    # and the count below must not fit.
    layout = Layout(zero=3, recompute="full", seq=4096)
    p = min_gpus_to_fit("405B", layout)
    n = 76  # 16 bytes x 405.85e9 / 80 GiB, rounded up: the model-states-only bound
    while not plan("405B", layout, n).fits:
        n += 1
    assert p.n_gpus == n == 113 and p.fits and 0 < p.headroom_bytes < 0.6 * GB
    assert plan("405B", layout, 112).headroom_bytes < 0
    # The answer is sensitive to capacity: nvidia-smi's 81,559 MiB for an H100 80GB HBM3 is 0.4% under the
    # planner's 80 GiB and still fits at 113; reading "80 GB" as 80e9 bytes costs twelve more.
    assert H100_80GB_NVIDIA_SMI_BYTES < GPUS["h100"].memory_bytes
    assert min_gpus_to_fit("405B", layout, gpu_memory_bytes=H100_80GB_NVIDIA_SMI_BYTES).n_gpus == 113
    assert min_gpus_to_fit("405B", layout, gpu_memory_bytes=80e9).n_gpus == 125


def test_min_gpus_to_fit_keeps_model_parallel_degrees_and_refuses_the_impossible():
    # Llama 3 70B with TP8 and ZeRO-1: 17.6 GB of bf16 weights, as much gradient and 11.7 GB of activations
    # stay on every GPU, the 106 GB of Adam state shards over dp; dp=3 (24 GPUs) is the first that fits in 80 GiB.
    p = min_gpus_to_fit("70B", Layout(tp=8, zero=1, dp=5, sequence_parallel=True))  # dp is the search variable, ignored
    assert (p.layout.tp, p.layout.pp, p.layout.dp, p.n_gpus) == (8, 1, 3, 24) and p.fits
    assert not plan("70B", Layout(tp=8, zero=1, sequence_parallel=True), 16).fits
    assert min_gpus_to_fit("70B", Layout(tp=8, pp=4, zero=1, sequence_parallel=True)).n_gpus == 32  # dp=1 already fits
    with pytest.raises(LayoutError) as info:  # ZeRO-0 never shards: more GPUs never help
        min_gpus_to_fit("70B", Layout(zero=0))
    assert "does not fit even on" in str(info.value) and _one_sentence(str(info.value))


# ------------------------------------------------------------------------------------------------
# Time: compute, bubble, communication tiers
# ------------------------------------------------------------------------------------------------


def test_bubble_time_is_near_the_ideal_denominator_fraction_of_compute():
    # The planner simulates chapter 13's schedule with each stage's own time; Llama 3 8B's head (a 128K vocabulary)
    # makes the last stage the slowest, so the bubble is near, not at, (p-1)/m of the busiest stage (Narayanan et
    # al. 2021 sec 2.2: 3/16 for p = 4, m = 16); tests/test_step_time.py holds equal stages to the formula exactly.
    p = plan("8B", Layout(pp=4, dp=2, micro_batches=16), 8)
    busiest = max(p.time.stage_busy)
    assert 0.7 * pipeline_bubble_fraction(4, 16) < p.bubble_time_s / busiest < 1.5 * pipeline_bubble_fraction(4, 16)


def test_tp_stays_on_nvlink_inside_a_node_and_leaves_it_beyond():
    # Groups are laid out [TP, CP, PP, DP] from the innermost (Llama 3 Figure 5): TP=8 fills an
    # 8-GPU node and runs over NVLink; TP=16 spans two nodes, so its all-reduces cross InfiniBand
    # and get ~9x slower per byte (450 vs 50 GB/s). This is why TP stays inside the NVLink domain.
    inside = plan("405B", Layout(tp=8, pp=16, dp=8, seq=4096, micro_batches=64, sequence_parallel=True), 1024)
    assert inside.links["tp"] == NETWORK_TIERS["nvlink4"].name
    assert inside.links["dp"] == NETWORK_TIERS["ib-ndr400"].name
    shape = ModelShape("wide", layers=32, hidden=8192, heads=64, kv_heads=16, ffn=28672, vocab=32000)
    within = plan(shape, Layout(tp=8, dp=4, sequence_parallel=True), 32)
    across = plan(shape, Layout(tp=16, dp=2, sequence_parallel=True), 32)
    assert across.links["tp"] == NETWORK_TIERS["ib-ndr400"].name
    assert any("leaves NVLink" in n for n in across.notes)
    # half of each TP16 collective crosses InfiniBand (hierarchically, on the node's 8 NICs at once): slower per
    # layer even though each rank holds half the activations of TP8
    assert across.comm_time_s["tp"] > 1.2 * within.comm_time_s["tp"]


def test_nvlink4_tier_against_measured_h200_all_reduce():
    # shared/reference/allreduce_8xH200_published.csv (stas00/ml-engineering, 8x H200, NCCL 2.27.7):
    # 32 KiB all_reduce at algbw 0.82 GB/s = 40 us, latency-bound; 1 GiB at busbw 463.58 GB/s
    # (NVLS) = 4.05 ms. The alpha-beta tier (3.4 us x 14 ring steps; 450 GB/s) should land within
    # a factor 1.5 of the first and 10% of the second; it is a model, not a measurement.
    link = NETWORK_TIERS["nvlink4"]
    small = collective_time("all_reduce", 32768, 8, link.bandwidth, link.latency)
    assert 40e-6 / 1.5 < small < 40e-6 * 1.5
    big = collective_time("all_reduce", 2**30, 8, link.bandwidth, link.latency)
    measured = 2**30 * 1.75 / 463.58e9
    assert abs(big / measured - 1) < 0.10


def test_summary_reports_the_verdict():
    p = plan("70B", Layout(tp=8, pp=4, zero=1, micro_batches=32, sequence_parallel=True), 256)
    text = p.summary()
    assert "fits" in text and f"{p.total_memory_bytes / GB:.2f}" in text
    assert "tp" in text and "over NVLink 4" in text and "communication" in text and "% of the step" in text


def test_candidate_layouts_for_70b_on_256_h100():
    # Chapter 00 exercise: TP/PP/DP for Llama 3 70B on 256 H100s under 80 GB. Candidates keep TP
    # inside a node and dividing the 8 KV heads; fitting layouts come first, fastest first.
    plans = candidate_layouts("70B", 256, seq=4096, global_batch=1024)
    assert plans and plans[0].fits
    assert all(p.layout.tp in (1, 2, 4, 8) for p in plans)
    assert all(p.layout.tp * p.layout.pp * p.layout.dp == 256 for p in plans)
    fitting = [p for p in plans if p.fits]
    assert [p.step_time_s for p in fitting] == sorted(p.step_time_s for p in fitting)
    assert any(not p.fits for p in plans)  # e.g. tp=1, pp=1: 70B of ZeRO-1 states per GPU


# ------------------------------------------------------------------------------------------------
# Layouts that cannot run: one sentence, saying what to change
# ------------------------------------------------------------------------------------------------


def _one_sentence(message: str) -> bool:
    body = message.replace("et al.", "et al").rstrip(".")  # a citation's "et al." is not a full stop
    return message.endswith(".") and ". " not in body


@pytest.mark.parametrize(
    "model, layout, n_gpus, expected",
    [
        ("70B", Layout(tp=8, pp=4, dp=4, sequence_parallel=True), 256, "4x8x4x1 makes 128 ranks, not the world's 256"),
        ("70B", Layout(tp=3, sequence_parallel=True), 256, "tp=3 does not divide the 256 ranks"),
        (ModelShape("GQA 12/4", layers=4, hidden=768, heads=12, kv_heads=4, ffn=3072, vocab=1000), Layout(tp=6), 6,
         "tp=6 and kv_heads=4 do not divide one another"),
        ("7B", Layout(tp=64, dp=1, sequence_parallel=True), 64, "tp=64 does not divide heads=32"),
        ("8B", Layout(pp=64, dp=1), 64, "pp=64 is more than layers=32"),
        ("8B", Layout(cp=3, dp=1, seq=4096), 3, "cp=3 cuts seq=4096 into 6 chunks"),
        ("8B", Layout(zero=4), 8, "zero=4 is not one of 0, 1, 2 or 3"),
        ("8B", Layout(recompute="some"), 8, "recompute='some' is not one of"),
        ("8B", Layout(pp=4, dp=2, virtual_stages=2, micro_batches=6), 8, "multiple of pp=4"),
        ("8B", Layout(tp=0, sequence_parallel=True), 8, "tp=0 must be a whole number of at least 1"),
    ],
)
def test_impossible_layouts_raise_one_sentence(model, layout, n_gpus, expected):
    # Style guide: errors a learner can cause are reported in one sentence that says what to change.
    # LayoutError is a ValueError, so generic handlers still catch it.
    with pytest.raises(LayoutError) as info:
        plan(model, layout, n_gpus)
    message = str(info.value)
    assert expected in message
    assert _one_sentence(message), message
    assert isinstance(info.value, ValueError)


def test_dp_is_filled_in_from_the_gpu_count():
    # dp=None means "whatever is left": 256 GPUs with tp=8, pp=4 leave dp=8, and the default
    # micro-batch count is 4p (GPipe sec 2.3: the bubble is negligible for m >= 4p).
    p = plan("70B", Layout(tp=8, pp=4, sequence_parallel=True), 256)
    assert (p.layout.dp, p.layout.micro_batches) == (8, 16)
    assert p.tokens_per_step == 8 * 16 * 1 * 4096
