"""Parallel layouts of published training runs, as data.

Every row is copied from the source named in ``source`` (paper, section, table) and ``page``. Numbers the source
does not print are ``None``, never guessed; where a run needs a value the source does not print (a micro-batch size,
an interleaving depth, a recompute mode, the network), the value used is in ``assumed`` as ``(field, value, why)``,
and ``resolved(field)`` returns the row's value or, where that is ``None``, the assumed one. ``check_product()``
applies the rule every layout must obey, TP x CP x PP x DP = GPUs; the tests run it on every row, and chapter 00
prints ``PUBLISHED_CONFIGS`` as a table. Where a degree is not simply as printed (the source gives no value and it
was derived from the rule or from another table, or copies of the source disagree and the rule picked one),
``derived`` says which and how: for that row the rule holds by construction and checks nothing.

``PUBLISHED_RUNS`` is every row the planner is held to: each prints a throughput (``flops_per_gpu``, ``mfu``,
``iteration_time_s`` or ``tokens_per_second_per_gpu``), counted by the convention ``flop_convention`` names:

- ``"narayanan"``: Narayanan et al. 2021 eq. 3, ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration, the GEMM
  FLOPs of a GPT with full activation recomputation (one extra forward), attention not halved for causality;
- ``"model"``: model FLOPs (PaLM appendix B: ``6N + 12 l H Q T`` per token, no recomputation); ``causal_halved``
  says whether the attention term was halved for the causal mask, where the source's code or text says;
- ``"hardware"``: model FLOPs plus the recomputation actually done;
- ``"6N"``: six times the parameters per token, nothing else;
- ``"derived"``: computed here from what the source prints (GPU-hours and tokens); ``notes`` says how.

Mixture-of-experts rows name their shape in ``moe`` (a ``PUBLISHED_MOE`` entry) and their expert-parallel degree
in ``ep``. EP is not a fifth factor of the GPU count: the routed experts of one layer are split over ``ep`` ranks
carved out of the TP x CP x DP ranks that hold one pipeline stage (DeepSeek-V3: EP 64 inside DP 128 with TP 1;
Megatron-Core's "parallel folding": EP x expert-TP divides TP x CP x DP), so ``check_expert_parallel()`` asks that
``ep`` divide ``tp * cp * dp`` and the expert count.

``cluster`` names a key of ``course_utils.hardware.CLUSTERS``; the keys that module does not have yet are in
``CLUSTERS_TO_ADD`` with their facts and sources. ``PUBLISHED_MOE`` holds two mixture-of-experts models (Mixtral
8x7B, DeepSeek-V3): their shapes as the sources print them and the total and active parameter counts they publish,
which ``planner.moe_parameter_counts`` reproduces (``tests/test_planner_moe.py``).

Units: sequences for ``global_batch`` and ``micro_batch``, tokens for ``seq``, FLOP/s for ``flops_per_gpu`` and
``aggregate_flops``, seconds for ``iteration_time_s``, days for ``training_days``, parameters for
``published_params`` (printed to ``published_params_unit``); ``mfu``, ``hfu`` and ``peak_fraction`` are fractions
(0.514 for 51.4%).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "dualpipe", "zb")
DTYPES = ("fp16", "bf16", "fp8")
MLPS = ("gelu", "swiglu")
FLOP_CONVENTIONS = ("narayanan", "model", "hardware", "6N", "derived")
POSITION_EMBEDDINGS = ("learned", "rope", "alibi")
THROUGHPUT_FIELDS = ("flops_per_gpu", "mfu", "iteration_time_s", "tokens_per_second_per_gpu")


@dataclass(frozen=True)
class PublishedConfig:
    name: str
    source: str
    gpu: str
    gpus: int
    tp: int
    pp: int
    dp: int
    cp: int = 1
    data_parallel: str = "DP"  # how the DP dimension holds model states: "DP", "ZeRO-1", "FSDP", ...
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    seq: int | None = None
    global_batch: int | None = None  # sequences per optimizer step
    micro_batch: int | None = None
    virtual_stages: int = 1  # interleaved pipeline chunks per GPU (Narayanan et al. 2021, sec 2.2.2)
    flops_per_gpu: float | None = None  # achieved, as printed
    mfu: float | None = None
    hfu: float | None = None
    iteration_time_s: float | None = None
    notes: str = ""
    derived: str = ""  # a degree not taken as printed, and how it was obtained ("" when all are printed)
    # -- shape beyond a GPT's (None: kv_heads = heads, ffn = 4 * hidden) ------------------------------------------
    kv_heads: int | None = None
    ffn: int | None = None
    mlp: str = "gelu"  # "gelu": 2 matrices hidden x ffn (GPT; OPT's ReLU too); "swiglu": 3 (Llama)
    tied_embeddings: bool = False
    position_embedding: str = ""  # "learned" (s x h table), "rope", "alibi"
    # -- how it ran ------------------------------------------------------------------------------------------------
    recompute: str | None = None  # "none" | "selective" | "full"; None when not printed (then see assumed)
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # "gpipe" | "1f1b" | "interleaved" | "dualpipe" | "zb"
    grad_overlap: bool | None = None  # DP gradient reduction overlapped with backward, where the source says
    ep_overlap: bool | None = None  # expert all-to-alls hidden behind another micro-batch's compute, where it says
    cluster: str = ""  # a key of course_utils.hardware.CLUSTERS (or of CLUSTERS_TO_ADD)
    dtype: str = "bf16"  # matmul precision: "fp16", "bf16", "fp8"
    moe: str = ""  # name of a PUBLISHED_MOE entry for a mixture-of-experts run
    ep: int = 1  # expert-parallel degree
    # -- what was measured, and how it was counted ------------------------------------------------------------
    tokens_per_second_per_gpu: float | None = None
    flop_convention: str = ""  # one of FLOP_CONVENTIONS
    causal_halved: bool | None = None  # "model" FLOPs with the attention term halved for causality (None: unsaid)
    peak_fraction: float | None = None  # a printed share of peak in the row's own convention (Narayanan Table 1)
    aggregate_flops: float | None = None  # printed FLOP/s over all GPUs
    training_days: float | None = None  # a printed training-time estimate (Narayanan Table 2: 300B tokens)
    published_params: float | None = None  # the model size the source prints, in parameters
    published_params_unit: float | None = None  # the digit it is printed to ("1.7" billion: 0.1e9)
    assumed: tuple[tuple[str, object, str], ...] = ()  # (field, value used, why) for what the source leaves out
    # -- where it is printed -----------------------------------------------------------------------------------
    page: str = ""  # page(s) of the version used ("p. 8"), or "n/a (...)" with the reason
    fused_kernels: bool = True  # elementwise work fused (Megatron's kernels, torch.compile); False: eager PyTorch
    year: int | None = None
    paper: str = ""  # short key of the source; rows sharing it are one paper (leave-one-paper-out)

    @property
    def product(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def check_product(self) -> None:
        """Raise ValueError unless TP x CP x PP x DP equals the GPU count."""
        if self.product != self.gpus:
            raise ValueError(
                f"{self.name}: TP*CP*PP*DP = {self.tp}*{self.cp}*{self.pp}*{self.dp} = {self.product}, "
                f"not the {self.gpus} GPUs the source reports."
            )

    def check_expert_parallel(self, experts: int | None = None) -> None:
        """Raise ValueError unless the EP ranks fit inside one pipeline stage's TP x CP x DP ranks (and, given the
        routed-expert count, split the experts evenly)."""
        inside = self.tp * self.cp * self.dp
        if inside % self.ep:
            raise ValueError(f"{self.name}: EP={self.ep} does not divide TP*CP*DP = {inside}.")
        if experts is not None and experts % self.ep:
            raise ValueError(f"{self.name}: EP={self.ep} does not split {experts} routed experts evenly.")

    def resolved(self, field: str):
        """The row's value of ``field``, or the value ``assumed`` records for it where the source prints none."""
        value = getattr(self, field)
        if value is None:
            for name, used, _why in self.assumed:
                if name == field:
                    return used
        return value

    @property
    def throughputs(self) -> dict[str, float]:
        """The published throughput figures this row carries."""
        return {f: getattr(self, f) for f in THROUGHPUT_FIELDS if getattr(self, f) is not None}


FIELD_NAMES = frozenset(f.name for f in fields(PublishedConfig))


# ----------------------------------------------------------------------------------------------
# Korthikanti et al. 2022 (the rows chapter 00 prints)
# ----------------------------------------------------------------------------------------------

_KORTHIKANTI = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models"
_K_PAGE = ("n/a (pages not checked: no text copy of arXiv:2205.05198 was found here; the MFU/HFU columns match "
           "the Megatron-LM README, commit 2e90a34, and the iteration times reproduce them, see the tests)")
_K_DTYPE = ("dtype", "bf16", "not read in the text; the A100's FP16 and BF16 dense peaks are equal (312 TFLOP/s), "
            "so the choice does not change the step time")
_K_COMMON = dict(gpu="A100 80GB", dp=1, data_parallel="none", vocab=51200, seq=2048,
                 tied_embeddings=True, position_embedding="learned", recompute="selective", sequence_parallel=True,
                 cluster="a100-ib", flop_convention="model", causal_halved=False, page=_K_PAGE, year=2022,
                 paper="korthikanti2022")
# Table 3 gives the layouts; Table 5 ("present work": sequence parallelism + selective recompute)
# gives iteration time, MFU and HFU; section 6 says 175B and 530B use the interleaved schedule with
# 3 stages and that s = 2048, v = 51200 throughout. MFU counts model FLOPs 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
# (attention not halved), HFU adds the selective recompute of attention, 72 B s l h^2 (1 + s/(3h) + V/(12 l h)):
# both reproduce the printed percentages from the iteration times (tests/test_published_configs.py).
KORTHIKANTI_2022_TABLE3 = (
    PublishedConfig("22B", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=8, tp=8, pp=1, layers=48,
                    hidden=6144, heads=64, global_batch=4, micro_batch=4, iteration_time_s=1.10,
                    mfu=0.415, hfu=0.437, schedule="1f1b", published_params=22e9, published_params_unit=1e9,
                    assumed=(_K_DTYPE,), **_K_COMMON),
    PublishedConfig("175B (GPT-3)", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=64, tp=8, pp=8, layers=96,
                    hidden=12288, heads=96, global_batch=64, micro_batch=1, virtual_stages=3,
                    iteration_time_s=13.75, mfu=0.514, hfu=0.528, schedule="interleaved",
                    published_params=175e9, published_params_unit=1e9, assumed=(_K_DTYPE,), **_K_COMMON),
    PublishedConfig("530B (MT-NLG)", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=280, tp=8, pp=35, layers=105,
                    hidden=20480, heads=128, global_batch=280, micro_batch=1, virtual_stages=3,
                    iteration_time_s=37.83, mfu=0.560, hfu=0.570, schedule="interleaved",
                    published_params=530e9, published_params_unit=1e9, assumed=(_K_DTYPE,), **_K_COMMON),
    PublishedConfig("1T", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=512, tp=8, pp=64, layers=128,
                    hidden=25600, heads=160, global_batch=512, micro_batch=1, iteration_time_s=71.49,
                    mfu=0.563, hfu=0.570, schedule="1f1b", published_params=1e12, published_params_unit=1e12,
                    assumed=(_K_DTYPE,), **_K_COMMON),
)

# Section 6.3: the 530B model scaled to 8-way data parallelism, batch size x 8.
KORTHIKANTI_2022_530B_DP8 = PublishedConfig(
    "530B (MT-NLG), 8-way DP", f"{_KORTHIKANTI}, section 6.3", gpu="A100 80GB", gpus=2240, tp=8, pp=35, dp=8,
    layers=105, hidden=20480, heads=128, vocab=51200, seq=2048, global_batch=2240, micro_batch=1,
    virtual_stages=3, iteration_time_s=39.15, mfu=0.542,
    notes="no overlap of the gradient all-reduce with back-propagation",
    tied_embeddings=True, position_embedding="learned", recompute="selective", sequence_parallel=True,
    schedule="interleaved", grad_overlap=False, cluster="a100-ib", flop_convention="model", causal_halved=False,
    published_params=530e9, published_params_unit=1e9, assumed=(_K_DTYPE,), page=_K_PAGE, year=2022,
    paper="korthikanti2022",
)

# ----------------------------------------------------------------------------------------------
# Llama 3 405B
# ----------------------------------------------------------------------------------------------

_LLAMA3 = "Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783)"
_L_COMMON = dict(gpu="H100 80GB", data_parallel="FSDP", layers=126, hidden=16384, heads=128, vocab=128_000,
                 kv_heads=8, ffn=53248, mlp="swiglu", position_embedding="rope", schedule="interleaved",
                 sequence_parallel=True,
                 virtual_stages=8, grad_overlap=True, cluster="h100-roce", dtype="bf16", flop_convention="model",
                 published_params=405e9, published_params_unit=1e9, page="p. 10 (Table 4); pp. 10-12 (sec 3.3.2)",
                 year=2024, paper="llama3")
# V is read, not assumed: sec 3.3.2 (p. 11) takes "one Transformer layer each from the first and the last stages.
# This means that the first model chunk on the first stage has only the embedding, and the last model chunk on the
# last stage has only output projection and loss calculation": taking one layer empties a chunk, so a chunk is one
# layer, 126 layers plus the embedding's and the head's chunks are 128 chunks, V = 128 / 16 = 8. (Figure 6 draws
# V = 2 on 4 ranks as an illustration.) As a check, not a fit: the paper's bubble ratio (PP - 1) / (V * M) with
# V = 8 is 15/256 at 8K GPUs (M = 32) and 15/128 at 16K (M = 16), a 5.5% longer step at 16K, where Table 4's MFU
# falls from 43% to 41% (4.7%).
_L_V = ("V = 8 (sec 3.3.2: the first chunk of the first stage holds only the embedding once one layer is taken "
        "from that stage, so a chunk is one layer; 126 layers + 2 = 128 chunks over PP = 16)")
_L_ASSUMED = (
    ("micro_batch", 1, "not printed: Table 4 gives only 'Batch size/DP' (32, 16, 16 sequences); Figure 6 counts "
                       "micro-batches of whole sequences"),
    ("sequence_parallel", True, "not stated; sec 3.3.2 cites Korthikanti et al. (2023), tensor parallelism with "
                                "sequence parallelism, for TP"),
)
# Table 4 ("Scaling configurations and MFU for each stage of Llama 3 405B pre-training", p. 10); the model
# shape is Table 3 and section 3.2 (126 layers, 16,384 model dimension, 53,248 FFN, 128 heads, 8 KV heads,
# 128K vocabulary). Batch size/DP is per DP group, so global_batch = batch/DP x DP (16M tokens in every row).
# Section 3.3.2: FSDP shards optimizer states and gradients; parameters are not resharded after the
# forward pass (ZeRO-2 in the course's ledger); DP "can tolerate longer network latency by asynchronously
# prefetching sharded model weights and reducing gradients" (p. 12: grad_overlap). Groups are ordered
# [TP, CP, PP, DP] from innermost (Figure 5). "BF16 Model FLOPs Utilization (MFU; Chowdhery et al. (2023))"
# (p. 10): PaLM's model FLOPs; whether attention is halved for causality is not said. "With these
# optimizations, we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing" (p. 11).
LLAMA3_405B_TABLE4 = (
    PublishedConfig("Llama 3 405B, 8K GPUs", f"{_LLAMA3}, Table 4", gpus=8192, tp=8, cp=1, pp=16, dp=64,
                    seq=8192, global_batch=32 * 64, flops_per_gpu=430e12, mfu=0.43, recompute="none",
                    notes=_L_V, assumed=_L_ASSUMED, **_L_COMMON),
    PublishedConfig("Llama 3 405B, 16K GPUs", f"{_LLAMA3}, Table 4", gpus=16384, tp=8, cp=1, pp=16, dp=128,
                    seq=8192, global_batch=16 * 128, flops_per_gpu=400e12, mfu=0.41, recompute="none",
                    notes=_L_V, assumed=_L_ASSUMED, **_L_COMMON),
    PublishedConfig("Llama 3 405B, 16K GPUs, 128K context", f"{_LLAMA3}, Table 4", gpus=16384, tp=8, cp=16,
                    pp=16, dp=8, seq=131_072, global_batch=16 * 8, flops_per_gpu=380e12, mfu=0.38,
                    notes="arXiv v3 prints DP=8; other copies of the paper print DP=4, which breaks both "
                          "8*16*16*DP = 16,384 and the 16M tokens per batch (131,072 x 16 x 8); " + _L_V,
                    derived="DP=8 as in arXiv v3 (other copies print 4)",
                    assumed=_L_ASSUMED + (
                        ("recompute", "none", "printed only for 8K-token sequences; with CP = 16 each rank holds "
                                              "131,072 / 16 = 8,192 tokens, as in the 8K rows"),),
                    **_L_COMMON),
)

# ----------------------------------------------------------------------------------------------
# BLOOM 176B and OPT-175B
# ----------------------------------------------------------------------------------------------

# BigScience tr11-176B-ml README ("Replica setup": TP=4, PP=12, DP=8, MBS=2 on 384 GPUs = 48 nodes of 8;
# "Architecture": 70 layers, hidden 14336, 112 heads; vocabulary 250,680; GBS 2048 at seq 2048;
# BF16Optimizer with ZeRO stage 1). The README also notes training began at GBS=192 with MBS=1.
# Throughput: the README's "Important checkpoints" quotes the log line that ended epoch one (iteration 85376,
# GBS 2048): "elapsed time per iteration (s): 104.70 ... TFLOPs: 149.77". Its "Throughput" section: "Since we
# use activation check-pointing ... it's the hardware TFLOPs that we calculate"; math/README.md: "The exact
# formula is in Equation 3 of Section 5.1" of Narayanan et al. 2021. Eq. 3 with the padded vocabulary 250,880
# (the README's embedding size, 250880 x 14336) gives 149.76 from 104.70 s (tests). Position: ALiBi; the tied
# embedding is partitioned as a pipeline layer ("--pp-partition-method 'type:transformer|embedding'").
BLOOM_176B = PublishedConfig(
    "BLOOM 176B", "bigscience-workshop/bigscience, train/tr11-176B-ml/README.md; Scao et al. 2022, sec 3.4",
    gpu="A100 80GB", gpus=384, tp=4, pp=12, dp=8, data_parallel="ZeRO-1", layers=70, hidden=14336, heads=112,
    vocab=250_680, seq=2048, global_batch=2048, micro_batch=2,
    notes="embeddings counted as pipeline layers to balance stage memory; the throughput is one logged iteration "
          "(iteration 85376, end of epoch one), not an average; the vocabulary is padded to 250,880 in the model",
    flops_per_gpu=149.77e12, iteration_time_s=104.70, tied_embeddings=True, position_embedding="alibi",
    recompute="full", cluster="a100-opa", dtype="bf16", flop_convention="narayanan",
    published_params=176e9, published_params_unit=1e9,
    assumed=(("schedule", "1f1b", "not printed; Megatron-DeepSpeed pipelines with DeepSpeed's engine, whose "
                                  "training schedule is one-forward-one-backward (HF blog 'The Technology Behind "
                                  "BLOOM Training': 'Megatron-Deepspeed uses the Deepspeed implementation')"),),
    page="n/a (a GitHub README: sections 'Important checkpoints', 'Throughput', 'Hardware')", year=2022,
    paper="bloom",
)

# Zhang et al. 2022, OPT, section 2.4: "992 80GB A100 GPUs ... Fully Sharded Data Parallel with
# Megatron-LM Tensor Parallelism ... up to 147 TFLOP/s per GPU ... model weights remained in FP16"; Table 1: 96
# layers, 96 heads, d_model 12288, batch 2M tokens. The tensor-parallel degree, 8, is from the team's logbook
# (facebookresearch/metaseq, projects/OPT/chronicles/10_percent_update.md: "8x Tensor Parallelism");
# FSDP takes the remaining 992 / 8 = 124. ReLU MLP (sec 2.2), two matrices.
OPT_175B = PublishedConfig(
    "OPT-175B", "Zhang et al. 2022, OPT, sec 2.4 and Table 1; metaseq OPT chronicles",
    gpu="A100 80GB", gpus=992, tp=8, pp=1, dp=124, data_parallel="FSDP", layers=96, hidden=12288, heads=96,
    seq=2048, flops_per_gpu=147e12, notes="batch printed as 2M tokens; no pipeline parallelism; 147 TFLOP/s is "
                                          "'up to', a peak rather than an average",
    derived="DP = 992 / 8 (not printed)",
    vocab=50272, tied_embeddings=True, position_embedding="learned", dtype="fp16", cluster="a100-ib",
    flop_convention="narayanan", published_params=175e9, published_params_unit=1e9,
    assumed=(
        ("vocab", 50272, "the paper names the GPT-2 BPE; 50,272 is metaseq's padded size "
                         "(metaseq/cli/interactive_ft.py, --vocab-size default)"),
        ("global_batch", 992, "Table 1 prints 2M tokens; metaseq/launcher/opt_baselines.py sets per-rank batch "
                              "(2M // (992/8)) // 2048 = 8 sequences, so 8 x 124 = 992 sequences (2.03M tokens)"),
        ("micro_batch", 8, "the same launcher: --batch-size 8 per FSDP rank, --update-freq 1"),
        ("recompute", "full", "not in the paper; metaseq's OPT launcher passes --checkpoint-activations"),
        ("cluster", "a100-ib", "the paper prints only '992 80GB A100 GPUs', not their interconnect"),
        ("flop_convention", "narayanan",
         "the paper gives no formula; the logbook (chronicles/final_update.md) puts the run at '~4.30E+23 FLOPs ... "
         "~33 days of continuous training on 1024 80GB A100s': eq. 3 gives 1.434e12 FLOPs per token, x 300B "
         "= 4.30e23, and 4.30e23 / (1024 x 33 days) = 147 TFLOP/s"),
    ),
    page="p. 1 (sec 1: '992 80GB A100 GPUs, reaching 147 TFLOP/s utilization per GPU') and sec 2.4, arXiv v4",
    year=2022, paper="opt",
)

PUBLISHED_CONFIGS = (
    *KORTHIKANTI_2022_TABLE3,
    KORTHIKANTI_2022_530B_DP8,
    *LLAMA3_405B_TABLE4,
    BLOOM_176B,
    OPT_175B,
)


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts models: their shapes and the parameter counts their authors publish
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishedMoE:
    """A mixture-of-experts decoder as its source prints it, and the parameter counts the source publishes.

    The shape is spelt as everywhere in the course (``layers, hidden, heads, kv_heads, ffn, vocab, seq``);
    ``ffn`` is the intermediate size of the dense FFN layers, ``expert_ffn`` that of one expert. The first
    ``dense_layers`` layers have a dense SwiGLU FFN, every other layer an MoE FFN of ``shared_experts`` experts
    every token passes through plus ``experts`` routed experts of which the router picks ``top_k`` per token.
    ``attention`` is "gqa" (q, k, v, o projections, ``kv_heads`` K/V heads of ``head_dim``) or "mla"
    (DeepSeek's multi-head latent attention, whose low-rank dimensions are the ``*_rank`` and ``*_head_dim``
    fields). ``router_bias``: the router also holds one bias per routed expert (DeepSeek-V3's load-balancing
    bias). ``planner.moe_parameter_counts`` counts the parameters; ``published_total`` and
    ``published_active`` are what the source prints, to ``published_unit`` (0.1e9 for "46.7B", 1e9 for "671B").
    """

    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    experts: int
    top_k: int
    expert_ffn: int
    published_total: float
    published_active: float
    published_unit: float
    shared_experts: int = 0
    dense_layers: int = 0
    tied_embeddings: bool = False
    seq: int | None = None
    attention: str = "gqa"
    head_dim: int | None = None  # gqa: None means hidden // heads
    q_lora_rank: int = 0  # mla only, from here to v_head_dim
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_bias: bool = False
    trained_ep: int | None = None  # the expert-parallel degree the source trained with, where it prints one
    notes: str = ""

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers


# Jiang et al. 2024, "Mixtral of Experts" (arXiv:2401.04088), Table 1: dim 4096, n_layers 32, head_dim 128,
# hidden_dim 14336, n_heads 32, n_kv_heads 8, context_len 32768, vocab_size 32000, num_experts 8,
# top_k_experts 2. Every layer is an MoE layer (no dense FFN, no shared expert); the paper's hidden_dim is one
# expert's. Embedding and output head are separate matrices (released config.json: tie_word_embeddings false).
# The counts: Mistral AI's release post ("Mixtral of experts", mistral.ai/news/mixtral-of-experts, 11 Dec 2023):
# "Mixtral has 46.7B total parameters but only uses 12.9B parameters per token"; the paper's text rounds them
# to "47B" and "13B" (abstract: "each token has access to 47B parameters, but only uses 13B active parameters").
MIXTRAL_8X7B = PublishedMoE(
    "Mixtral 8x7B", "Jiang et al. 2024, Mixtral of Experts (arXiv:2401.04088), Table 1; Mistral AI release post",
    layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32_000, seq=32_768, head_dim=128,
    experts=8, top_k=2, expert_ffn=14336,
    published_total=46.7e9, published_active=12.9e9, published_unit=0.1e9,
    notes="the paper's text prints 47B total and 13B active; Mistral AI's release post 46.7B and 12.9B",
)

# DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv:2412.19437), sec 4.2 "Hyper-Parameters": 61 layers,
# hidden 7168, 128 heads of per-head dimension 128, KV compression dimension 512, query compression dimension
# 1536, decoupled RoPE per-head dimension 64; "We substitute all FFNs except for the first three layers with
# MoE layers. Each MoE layer consists of 1 shared expert and 256 routed experts, where the intermediate hidden
# dimension of each expert is 2048. Among the routed experts, 8 experts will be activated for each token";
# "DeepSeek-V3 comprises 671B total parameters, of which 37B are activated for each token". Not printed in the
# report and taken from the released config.json (huggingface.co/deepseek-ai/DeepSeek-V3): the dense FFN's
# intermediate_size 18432, vocab_size 129280, tie_word_embeddings false, num_key_value_heads 128, and the
# router's per-expert e_score_correction_bias (the bias of the auxiliary-loss-free balancing, sec 2.1.2).
# The 671B excludes the multi-token-prediction module (README: 685B on Hugging Face = 671B main model + 14B
# MTP). Sec 3.2: "DeepSeek-V3 applies 16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP)
# spanning 8 nodes, and ZeRO-1 Data Parallelism (DP)" on 2048 H800 GPUs (sec 3.1); sec 4.2 sets the
# pre-training sequence length to 4K (extended to 128K in sec 4.3).
DEEPSEEK_V3 = PublishedMoE(
    "DeepSeek-V3", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437), sec 4.2; config.json",
    layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129_280, seq=4096,
    experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
    attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, router_bias=True, trained_ep=64,
    published_total=671e9, published_active=37e9, published_unit=1e9,
    notes="671B excludes the 14B multi-token-prediction module; each token goes to at most 4 nodes (sec 4.2); "
          "dispatch travels in FP8 and combine in BF16 (sec 3.3.3)",
)

PUBLISHED_MOE = (MIXTRAL_8X7B, DEEPSEEK_V3)


# ----------------------------------------------------------------------------------------------
# Narayanan et al. 2021: Table 1 (weak scaling, 1.7B to 1T) and Table 2 (PTD-P against ZeRO-3)
# ----------------------------------------------------------------------------------------------

_NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM "
              "(arXiv:2104.04473, SC21)")
_SC21 = "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh (commit de7dc40, Aug 2021, 'scripts for sc21')"
_N_FP16 = ("dtype", "fp16", "the paper says 'mixed precision' and a '16-bit precision' peak of 312 TFLOP/s (sec 5); "
                            "the authors' sc21 CONFIG.sh passes --fp16")
_N_COMMON = dict(gpu="A100 80GB", vocab=51200, seq=2048, tied_embeddings=True, position_embedding="learned",
                 cluster="a100-ib", dtype="fp16", flop_convention="narayanan", year=2021, paper="narayanan2021")


def _narayanan_table1(size, heads, hidden, layers, tp, pp, gpus, batch, tflops, percent, petaflops, mbs, chunks,
                      torch_ddp):
    """One row of Table 1 (p. 8). Sec 5 (pp. 7-8): Selene, DGX A100 80GB nodes, eight 200 Gb/s HDR HCAs each. Sec 5.1:
    "we use the interleaved pipeline schedule with the scatter/gather optimization enabled", V = 51,200, s = 2048;
    eq. 3 "assumes activation recomputation" (and the sc21 script passes --checkpoint-activations to every size).
    Micro-batch, chunks per stage and the DDP implementation are not in the paper; the authors' reproduction
    script gives them, and they are recorded in ``assumed``."""
    assumed = [("micro_batch", mbs, f"not in the paper; {_SC21} sets MBS={mbs} for this size"), _N_FP16]
    schedule = "1f1b"
    if pp > 1:
        if chunks > 1:
            schedule = "interleaved"
            why = (f"sec 5.1 uses the interleaved schedule without a depth; {_SC21} sets "
                   f"--num-layers-per-virtual-pipeline-stage {layers // (pp * chunks)}: {layers // pp} layers per "
                   f"stage in {chunks} chunks")
        else:
            why = (f"sec 5.1 says the interleaved schedule is used, but {_SC21} sets no "
                   "--num-layers-per-virtual-pipeline-stage for this size, i.e. non-interleaved 1F1B")
        assumed += [("virtual_stages", chunks, why), ("schedule", schedule, why)]
    ddp = ("--DDP-impl torch: PyTorch DDP, bucketed all-reduce overlapped with the backward pass" if torch_ddp else
           "--DDP-impl local: Megatron's LocalDDP, one all-reduce after the backward pass")
    assumed.append(("grad_overlap", torch_ddp, f"not in the paper; {_SC21} passes {ddp}"))
    return PublishedConfig(
        f"Narayanan 2021 Table 1, {size}B", f"{_NARAYANAN}, Table 1 and sec 5.1", gpus=gpus, tp=tp, pp=pp,
        dp=gpus // (tp * pp), layers=layers, hidden=hidden, heads=heads, global_batch=batch,
        virtual_stages=chunks, schedule=schedule, recompute="full", flops_per_gpu=tflops * 1e12,
        peak_fraction=percent / 100, aggregate_flops=petaflops * 1e15, published_params=size * 1e9,
        published_params_unit=0.1e9, assumed=tuple(assumed), page="p. 8 (Table 1); pp. 7-8 (sec 5, 5.1)",
        **_N_COMMON)


NARAYANAN_2021_TABLE1 = (
    _narayanan_table1(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, mbs=16, chunks=1, torch_ddp=True),
    _narayanan_table1(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, mbs=16, chunks=1, torch_ddp=True),
    _narayanan_table1(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, mbs=16, chunks=1, torch_ddp=True),
    _narayanan_table1(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, mbs=8, chunks=1, torch_ddp=True),
    _narayanan_table1(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, mbs=4, chunks=1, torch_ddp=False),
    _narayanan_table1(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, mbs=2, chunks=3, torch_ddp=False),
    _narayanan_table1(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, mbs=2, chunks=2, torch_ddp=False),
    _narayanan_table1(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, mbs=1, chunks=2, torch_ddp=False),
    _narayanan_table1(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, mbs=1, chunks=3, torch_ddp=False),
    _narayanan_table1(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, mbs=1, chunks=1,
                      torch_ddp=False),
)

# Table 2 (p. 9): ZeRO-3 without model parallelism against PTD-P, at fixed global batch, on the GPT-3 shape
# (sec 5.2: "the standard GPT-3 model architecture": 96 layers, 12288 hidden, 96 heads) and Table 1's 529.6B shape.
# Printed per row: parameters, model-parallel size, batch, GPUs, micro-batch, TFLOP/s per GPU and the training
# time for 300B tokens (eq. 4 with eq. 3's exact count, which the tests reproduce). The 2560* batch: "The
# 530-billion-parameter GPT model did not fit on 560 GPUs when using a microbatch size of 4 with ZeRO-3, so we
# increased the number of GPUs used to 640 and global batch size to 2560".
_SHAPES_T2 = {174.6: dict(layers=96, hidden=12288, heads=96), 529.6: dict(layers=105, hidden=20480, heads=128)}
_T2_RECOMPUTE = ("recompute", "full", "Table 2 does not say; eq. 3, by which the paper counts every throughput, "
                                      "'assumes activation recomputation'")


def _narayanan_table2_zero3(size, batch, gpus, mbs, tflops, days):
    return PublishedConfig(
        f"Narayanan 2021 Table 2, ZeRO-3 {size}B, {gpus} GPUs", f"{_NARAYANAN}, Table 2 and sec 5.2", gpus=gpus,
        tp=1, pp=1, dp=gpus, data_parallel="ZeRO-3", global_batch=batch, micro_batch=mbs,
        flops_per_gpu=tflops * 1e12, training_days=days, published_params=size * 1e9, published_params_unit=0.1e9,
        notes="ZeRO-3 from the DeepSpeed library inside Megatron (sec 5.2); no model parallelism",
        assumed=(_T2_RECOMPUTE, _N_FP16), page="p. 9 (Table 2, sec 5.2)", **_SHAPES_T2[size], **_N_COMMON)


def _narayanan_table2_ptd(size, batch, gpus, tflops, days):
    if size == 174.6:
        tp, pp, chunks = 8, 12, 4
        derived = ("TP=8, PP=12: Table 2 prints only the model-parallel size, 96; the authors' sc21 "
                   "run_figure_12.sh and run_figure_18.sh run this 96-layer GPT-3 on 96 GPUs as TP=8, PP=12")
        why = ("not printed for Table 2; sc21 run_figure_12.sh runs this model interleaved with "
               "--num-layers-per-virtual-pipeline-stage 2: 8 layers per stage in 4 chunks")
    else:
        tp, pp, chunks = 8, 35, 3
        derived = "TP=8, PP=35: Table 2 prints only the model-parallel size, 280; Table 1's 529.6B row prints 8 x 35"
        why = ("not printed for Table 2; sc21 run_table_1.sh runs this model with "
               "--num-layers-per-virtual-pipeline-stage 1: 3 layers per stage in 3 chunks")
    return PublishedConfig(
        f"Narayanan 2021 Table 2, PTD-P {size}B, {gpus} GPUs", f"{_NARAYANAN}, Table 2 and sec 5.2", gpus=gpus,
        tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch=batch, micro_batch=1, virtual_stages=chunks,
        schedule="interleaved", flops_per_gpu=tflops * 1e12, training_days=days, published_params=size * 1e9,
        published_params_unit=0.1e9, derived=derived,
        assumed=(("virtual_stages", chunks, why), ("schedule", "interleaved", why), _T2_RECOMPUTE, _N_FP16,
                 ("grad_overlap", False, "not printed; the sc21 scripts run this model with --DDP-impl local "
                                         "(one all-reduce after the backward pass)")),
        page="p. 9 (Table 2, sec 5.2)", **_SHAPES_T2[size], **_N_COMMON)


NARAYANAN_2021_TABLE2 = (
    _narayanan_table2_zero3(174.6, 1536, 384, 4, 144, 90),
    _narayanan_table2_zero3(174.6, 1536, 768, 2, 88, 74),
    _narayanan_table2_zero3(174.6, 1536, 1536, 1, 44, 74),
    _narayanan_table2_zero3(529.6, 2560, 640, 4, 138, 169),
    _narayanan_table2_zero3(529.6, 2240, 1120, 2, 98, 137),
    _narayanan_table2_zero3(529.6, 2240, 2240, 1, 48, 140),
    _narayanan_table2_ptd(174.6, 1536, 384, 153, 84),
    _narayanan_table2_ptd(174.6, 1536, 768, 149, 43),
    _narayanan_table2_ptd(174.6, 1536, 1536, 141, 23),
    _narayanan_table2_ptd(529.6, 2240, 560, 171, 156),
    _narayanan_table2_ptd(529.6, 2240, 1120, 167, 80),
    _narayanan_table2_ptd(529.6, 2240, 2240, 159, 42),
)

# ----------------------------------------------------------------------------------------------
# Megatron-Turing NLG 530B (Smith et al. 2022, arXiv:2201.11990), sec 2.4
# ----------------------------------------------------------------------------------------------

# NOT READ IN THE PRIMARY TEXT: no copy of the MT-NLG paper was found here. The numbers are as two independent
# secondary copies quote sec 2.4 (p. 7): "with global batch size 1920 on 280, 350, and 420 DGX A100 servers ...
# the latency per iteration observed is 60.1, 50.2, and 44.4 seconds respectively. These correspond to 126, 121,
# and 113 TFLOP/s per GPU" (cli99/llm-analysis, examples/megatron-turing-nlg/README.md; and a compiled dataset
# citing "PDF p7, s2.4"); the layout, "8-way tensor-slicing within a node and 35-way pipeline parallelism across
# nodes", is quoted by several; 105 layers, hidden 20480, 128 heads, sequence 2048, batch 1920 (sec 3.2). The
# printed TFLOP/s follow from the iteration times by eq. 3 of Narayanan et al. 2021 (125.7, 120.4, 113.5: tests),
# so the convention is "narayanan"; PaLM (Chowdhery et al. 2022) quotes the same run at 65.43K tokens/s
# (= 1920 x 2048 / 60.1 s).
_MTNLG = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B (arXiv:2201.11990), "
          "sec 2.4 (as quoted; primary text not read)")


def _mtnlg(nodes, seconds, tflops):
    gpus = nodes * 8
    return PublishedConfig(
        f"MT-NLG 530B, {nodes} DGX A100 ({gpus} GPUs)", _MTNLG, gpu="A100 80GB", gpus=gpus, tp=8, pp=35,
        dp=gpus // 280, layers=105, hidden=20480, heads=128, seq=2048, global_batch=1920,
        iteration_time_s=seconds, flops_per_gpu=tflops * 1e12, tied_embeddings=True, position_embedding="learned",
        cluster="a100-ib", flop_convention="narayanan", published_params=530e9, published_params_unit=1e9,
        notes="UNVERIFIED against the primary text (see the comment above the rows); throughput benchmarks of the "
              "training stack, not the whole run",
        assumed=(
            ("vocab", 51200, "not read; the GPT-2 BPE padded as in Narayanan et al. 2021 and Korthikanti et al. "
                             "2022 for the same 530B shape (the 'narayanan' count moves by 0.01% either way)"),
            ("micro_batch", 1, "not read; Narayanan et al. 2021 and Korthikanti et al. 2022 run this shape at 1"),
            ("recompute", "full", "not read; the printed TFLOP/s equal eq. 3, which counts full recomputation"),
            ("schedule", "1f1b", "not read; DeepSpeed's pipeline engine (non-interleaved 1F1B) ran the pipeline"),
            ("dtype", "bf16", "not read; the A100's FP16 and BF16 dense peaks are equal (312 TFLOP/s)"),
        ),
        page="p. 7 (sec 2.4) as quoted by secondary sources; not checked against the PDF", year=2022, paper="mtnlg")


MTNLG_530B = (_mtnlg(280, 60.1, 126), _mtnlg(350, 50.2, 121), _mtnlg(420, 44.4, 113))

# ----------------------------------------------------------------------------------------------
# torchtitan benchmarks (Llama 3.1 8B, 70B, 405B on H100s)
# ----------------------------------------------------------------------------------------------

# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024/12/26) and
# benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torchtitan 820504e, June 2025). Hardware, as both print:
# Grand Teton hosts of 8 H100s "fully connected with NVLink", each H100 "equipped with 96GB HBM2e with 2.4 TB/sec",
# "backend RDMA network with 400 Gb/s per GPU", "the default 500W power limit"; footnote 2: "the actual peak
# TFLOPs number is between SXM and NVL, and we don't know its exact value". Throughput is "TPS/GPU" read at the
# 90th iteration. Shapes: torchtitan/models/llama/__init__.py at 9dec370 (8B: 32 layers, dim 4096, 32 heads, 8 KV
# heads, FFN 14336; 70B: 80, 8192, 64, 8, 28672; 405B: 126, 16384, 128, 8, 53248, from ffn_dim_multiplier and
# multiple_of) and the Llama 3 tokenizer, 128,256 entries (train.py: vocab_size = tokenizer.n_words). torchtitan's
# MFU (utils.get_num_flop_per_token) counts 6 x (parameters - embedding) + 12 l h q t per token, attention not
# halved ("we follow the convention and do not account for sparsity in causal attention"): "model". The rows print
# tokens/s, which need no FLOP convention; the text quotes 33% to 39% MFU for the 8B FSDP rows without Float8.
_TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
_TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
_TITAN_SHAPE = {
    8: dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, published_params=8.03e9,
            published_params_unit=0.01e9),
    70: dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, published_params=70.55e9,
             published_params_unit=0.01e9),
    405: dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, published_params=405e9,
              published_params_unit=1e9),
}
_TITAN_COMMON = dict(gpu="H100 96GB HBM2e (500 W)", vocab=128_256, mlp="swiglu", position_embedding="rope",
                     data_parallel="FSDP", cluster="h100-96gb-rdma", flop_convention="model", causal_halved=False,
                     page="n/a (a GitHub markdown file; the table is named in the row's source)", paper="torchtitan")


def _titan_seq(size):
    return ("seq", 8192, f"not printed; torchtitan's train_configs/llama3_{size}b.toml at 9dec370 sets seq_len = 8192")


_PARAMS_NOTE = ("published_params: the released checkpoint's count (the benchmark names the model only '{}B'); "
                "the course's tests/test_planner.py holds the same count")
TORCHTITAN_LLAMA31 = (
    PublishedConfig("torchtitan Llama 3.1 8B, 8 H100, FSDP", f"{_TITAN}, Table 1 (row 'FSDP')", gpus=8, tp=1, pp=1,
                    dp=8, global_batch=16, micro_batch=2, recompute="selective", dtype="bf16",
                    tokens_per_second_per_gpu=5762, fused_kernels=False,
                    notes="1D FSDP (FSDP2, parameters resharded after forward), no torch.compile, no Float8; "
                          "selective AC is torchtitan's per-op policy (selective_ac_option 'op'); memory 82.4 GiB; "
                          + _PARAMS_NOTE.format(8),
                    assumed=(_titan_seq(8),), year=2024, **_TITAN_SHAPE[8], **_TITAN_COMMON),
    PublishedConfig("torchtitan Llama 3.1 8B, 128 H100, FSDP", f"{_TITAN}, Table 3 (row 'FSDP')", gpus=128, tp=1,
                    pp=1, dp=128, global_batch=256, micro_batch=2, recompute="selective", dtype="bf16",
                    tokens_per_second_per_gpu=5605, fused_kernels=False,
                    notes="as the 8-GPU row, on 16 hosts; memory 67.0 GiB; " + _PARAMS_NOTE.format(8),
                    assumed=(_titan_seq(8),), year=2024, **_TITAN_SHAPE[8], **_TITAN_COMMON),
    PublishedConfig("torchtitan Llama 3.1 70B, 256 H100, FSDP 32 + TP 8", f"{_TITAN_ASYNC}, 'Llama3 70b on 256 "
                    "H100s' table, row 'None (bfloat16)', column 'Vanilla TP'", gpus=256, tp=8, pp=1, dp=32,
                    global_batch=16 * 32, micro_batch=16, recompute="full", dtype="bf16",
                    tokens_per_second_per_gpu=597.3, sequence_parallel=True,
                    notes="FSDP=32, TP=8, torch.compile, full AC, local batch size 16, bfloat16, without async TP "
                          "(async TP: 652.4); " + _PARAMS_NOTE.format(70),
                    assumed=(_titan_seq(70),
                             ("sequence_parallel", True, "not printed; torchtitan's TP plan "
                              "(parallelisms/parallelize_llama.py) shards the norms with SequenceParallel()")),
                    year=2025, **_TITAN_SHAPE[70], **_TITAN_COMMON),
    *(PublishedConfig(f"torchtitan Llama 3.1 405B, 512 H100, FSDP 8 + TP 8 + PP 8, {label}",
                      f"{_TITAN}, Table 5 (row '{label}')", gpus=512, tp=8, pp=8, dp=8, global_batch=256,
                      virtual_stages=chunks, schedule=schedule, recompute="full", dtype="fp8",
                      tokens_per_second_per_gpu=tps, sequence_parallel=True,
                      notes="torch.compile + Float8 (torchao, on nn.Linear) + async TP; local batch size 32 per DP "
                            f"rank, full AC; memory {memory} GiB",
                      assumed=(_titan_seq(405),
                               ("micro_batch", 4, "not printed; torchtitan 9dec370 splits the local batch of 32 into "
                                                  "pipeline_parallel_microbatches, default = the PP degree (8)"),
                               ("sequence_parallel", True, "not printed; torchtitan's TP plan shards the norms with "
                                                           "SequenceParallel()"))
                      + ((("virtual_stages", 2, "not printed; torchtitan 9dec370 gives a looped schedule 2 stages "
                                                "per rank when no split points are set "
                                                "(pipelining_utils.generate_split_points)"),) if chunks > 1 else ()),
                      year=2024, **_TITAN_SHAPE[405], **_TITAN_COMMON)
      for label, schedule, chunks, tps, memory in (("1F1B", "1f1b", 1, 100, 82.5),
                                                   ("Interleaved 1F1B", "interleaved", 2, 128, 72.7))),
)

# ----------------------------------------------------------------------------------------------
# Mixture of experts: DeepSeek-V3 on 1024 H100 (Megatron-Bridge), and DeepSeek-V3's own pre-training (derived)
# ----------------------------------------------------------------------------------------------

# NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, "25.09 NeMo Container", "System: DGX-H100" (commit
# fa0315a, Oct 2025; kept in docs/performance-summary-archive.md): "DeepSeekV3 (dropless) | 1024 | 8192 | 1 | 4096
# | 0 | 2 | 8 | 1 | 4 | 64 | 128 | 1297 | 338 (330)" = GPUs, GBS, MBS, sequence, FSDP, TP, PP, CP, VP, EP, GA,
# tokens/s/GPU, model TFLOP/s/GPU; "The numbers in parentheses indicate the use of different quantization
# granularities ... For H100 system, 128x128 for weights and 1x128 for activations"; "we force-balance the token
# distribution among experts". The recipe (scripts/performance/configs/deepseek/deepseek_v3_llm_pretrain.yaml at
# the same commit): recompute_granularity "selective", pipeline_model_parallel_layout "Et|(tt|)*30mL" (embedding
# + 1 layer, 30 stages of 2 layers, the MTP layer and the loss: 32 = PP 8 x VP 4 stages), H100 precisions bf16,
# fp8_cs, fp8_ss. Model FLOPs (src/megatron/bridge/training/utils/flop_utils.py): the attention term uses
# seq_len / 2 (causal halved) and the MTP layer is counted.
MEGATRON_BRIDGE_DEEPSEEK_V3_H100 = PublishedConfig(
    "DeepSeek-V3, 1024 H100 (Megatron-Bridge 25.09)",
    "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.09 NeMo Container, DGX-H100 table",
    gpu="H100 80GB", gpus=1024, tp=2, pp=8, dp=64, cp=1, ep=64, moe="DeepSeek-V3", data_parallel="DP",
    layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129_280, mlp="swiglu", position_embedding="rope",
    seq=4096, global_batch=8192, micro_batch=1, virtual_stages=4, schedule="interleaved", recompute="selective",
    sequence_parallel=True, cluster="h100-ib", dtype="fp8", flop_convention="model", causal_halved=True,
    tokens_per_second_per_gpu=1297, flops_per_gpu=338e12,
    notes="dropless MoE with force-balanced routing (a benchmark, not a training run); model TFLOP/s count the "
          "one MTP layer; the parenthesized 330 is the same run with DeepSeek's 1x128/128x128 blockwise FP8; the "
          "table's FSDP column 0 means data-parallel, not fully sharded",
    assumed=(
        ("dtype", "fp8", "the 25.09 table prints no precision column; its footnote gives the parenthesized value "
                         "to blockwise FP8, so 338 is the recipe's other FP8 mode (fp8_cs, per-tensor current "
                         "scaling): Llama rows of the same table at 725-763 TFLOP/s exceed the BF16 peak"),
        ("sequence_parallel", True, "not printed; Megatron-Core requires sequence parallelism for MoE with TP > 1"),
        ("cluster", "h100-ib", "printed only as 'DGX-H100'; the interconnect is not printed"),
        ("ep_overlap", False, "not printed: the 25.09 recipe's YAML sets no all-to-all overlap; the repository's "
                              "later H100 recipe for this run (scripts/performance/configs/deepseek/"
                              "deepseek_llm_pretrain.py) enables DeepEP and set_moe_a2a_overlap_overrides, which "
                              "hides the dispatch and combine behind another micro-batch's compute"),
    ),
    page="n/a (a GitHub docs page: 25.09 NeMo Container, Pre-Training Performance, System: DGX-H100)", year=2025,
    paper="megatron-bridge",
)

# DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437 v2). Table 1 (p. 5): pre-training 2664K H800
# GPU hours; sec 1 (p. 5): "training DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU hours, i.e.,
# 3.7 days on our cluster with 2048 H800 GPUs"; sec 3.1 (p. 11): 2048 H800, 8 per node on NVLink/NVSwitch,
# InfiniBand across nodes; sec 3.2 (p. 12): "16-way Pipeline Parallelism (PP), 64-way Expert Parallelism (EP)
# spanning 8 nodes, and ZeRO-1 Data Parallelism (DP)", "without using costly Tensor Parallelism (TP)", DualPipe;
# sec 3.2.3 (p. 14): "We recompute all RMSNorm operations and MLA up-projections during back-propagation";
# sec 3.3 (p. 14-15): FP8 GEMMs (Fprop, Dgrad, Wgrad); sec 4.2 (pp. 22-23): 14.8T tokens, sequence 4K, "the
# batch size is gradually increased from 3072 to 15360 in the training of the first 469B tokens, and then keeps
# 15360 in the remaining training"; "for each layer, the routed experts will be uniformly deployed on 64 GPUs
# belonging to 8 nodes". DP = 2048 / 16 = 128 (TP 1), and EP 64 lives inside it (64 of the 128 DP ranks of one
# pipeline stage share one layer's 256 experts, 4 each; two such groups).
DEEPSEEK_V3_TOKENS = 14.8e12
DEEPSEEK_V3_PRETRAIN_GPU_HOURS = 2664e3
DEEPSEEK_V3_PRETRAINING = PublishedConfig(
    "DeepSeek-V3 pre-training, 2048 H800", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv:2412.19437), "
    "Table 1, sec 1, sec 3.1-3.3, sec 4.2", gpu="H800 80GB", gpus=2048, tp=1, pp=16, dp=128, ep=64,
    moe="DeepSeek-V3", data_parallel="ZeRO-1", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432,
    vocab=129_280, mlp="swiglu", position_embedding="rope", seq=4096, schedule="dualpipe", recompute="selective",
    cluster="h800-ib", dtype="fp8", flop_convention="derived",
    tokens_per_second_per_gpu=DEEPSEEK_V3_TOKENS / (DEEPSEEK_V3_PRETRAIN_GPU_HOURS * 3600),
    notes="derived: tokens/s per GPU = 14.8e12 tokens / (2,664,000 GPU-hours x 3600 s) = 1543.2, the whole "
          "pre-training's average including every stop, restart and evaluation (sec 1's 180K GPU-hours per "
          "trillion tokens gives the same); selective recompute = RMSNorm and MLA up-projections only; "
          "DualPipe holds two copies of the parameters (Table 2)",
    assumed=(
        ("global_batch", 15360, "sec 4.2 ramps 3072 -> 15360 sequences over the first 469B tokens and keeps 15360 "
                                "for the remaining 14.33T (96.8% of the tokens)"),
        ("micro_batch", 1, "not printed (Figure 5 shows DualPipe with 20 micro-batches on 8 ranks, no size)"),
    ),
    page="p. 5 (Table 1, sec 1); pp. 11-12 (sec 3.1, 3.2); p. 14 (sec 3.2.3); pp. 22-23 (sec 4.2)", year=2024,
    paper="deepseek-v3",
)

# ----------------------------------------------------------------------------------------------
# Every row the planner is held to, and the clusters course_utils.hardware does not have yet
# ----------------------------------------------------------------------------------------------

PUBLISHED_RUNS = (
    *NARAYANAN_2021_TABLE1,
    *NARAYANAN_2021_TABLE2,
    *KORTHIKANTI_2022_TABLE3,
    KORTHIKANTI_2022_530B_DP8,
    *LLAMA3_405B_TABLE4,
    BLOOM_176B,
    OPT_175B,
    *MTNLG_530B,
    *TORCHTITAN_LLAMA31,
    MEGATRON_BRIDGE_DEEPSEEK_V3_H100,
    DEEPSEEK_V3_PRETRAINING,
)

# Cluster keys the rows use that course_utils.hardware.CLUSTERS lacks: what each is, with its sources.
CLUSTERS_TO_ADD: dict[str, str] = {
    "h800-ib": (
        "DeepSeek-V3's cluster: NVIDIA H800 SXM 80GB, 8 per node on NVLink + NVSwitch, InfiniBand between nodes "
        "(DeepSeek-V3 report sec 3.1). Measured/usable: NVLink 160 GB/s, IB 50 GB/s per GPU (sec 3.2.2, p. 13). "
        "Spec (secondary sources, no NVIDIA datasheet read): H100's GH100 die with NVLink cut to 400 GB/s total "
        "(200 each way) instead of 900; dense BF16 989.5 TFLOP/s and dense FP8 1979 TFLOP/s as H100 SXM."),
    "h100-96gb-rdma": (
        "torchtitan's Grand Teton hosts: 8 H100 per host fully connected with NVLink, 96 GB HBM2e at 2.4 TB/s, "
        "400 Gb/s RDMA per GPU, 500 W power limit (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "
        "'Hardware'); peak 'between SXM and NVL, and we don't know its exact value' (footnote 2): dense BF16 "
        "between 835 (H100 NVL) and 989.5 (SXM) TFLOP/s, torchtitan divides by 989 for MFU (utils.get_peak_flops)."),
    "a100-opa": (
        "BLOOM's Jean Zay partition: 8 A100 80GB per node, 'NVLink 4 inter-gpu connects, 4 OmniPath links', "
        "inter-node 'Omni-Path Architecture (OPA)' (bigscience tr11-176B-ml README, 'Hardware'); the OPA link "
        "rate is not printed there (Omni-Path 100 series: 100 Gb/s per link, so 4 x 100 Gb/s per 8 GPUs)."),
}
