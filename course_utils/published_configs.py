"""Parallel layouts of published training runs, as data.

Every row is copied from the source named in ``source`` (paper, section, table). Numbers the source
does not print are ``None``, never guessed. ``check_product()`` applies the rule every layout must
obey, TP x CP x PP x DP = GPUs; the tests run it on every row, and chapter 00 prints the table. Where a
degree is not simply as printed (the source gives no value and it was derived from the rule, or copies of
the source disagree and the rule picked one), ``derived`` says which and how: for that row the rule holds
by construction and checks nothing.

``PUBLISHED_MOE`` holds two mixture-of-experts models (Mixtral 8x7B, DeepSeek-V3): their shapes as the sources
print them and the total and active parameter counts they publish, which ``planner.moe_parameter_counts``
reproduces (``tests/test_planner_moe.py``).

Units: sequences for ``global_batch``, tokens for ``seq``, FLOP/s for ``flops_per_gpu``, seconds for
``iteration_time_s``; ``mfu`` and ``hfu`` are fractions (0.514 for 51.4%).
"""

from __future__ import annotations

from dataclasses import dataclass


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


_KORTHIKANTI = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models"
_K_COMMON = dict(gpu="A100 80GB", dp=1, data_parallel="none", vocab=51200, seq=2048)
# Table 3 gives the layouts; Table 5 ("present work": sequence parallelism + selective recompute)
# gives iteration time, MFU and HFU; section 6 says 175B and 530B use the interleaved schedule with
# 3 stages and that s = 2048, v = 51200 throughout.
KORTHIKANTI_2022_TABLE3 = (
    PublishedConfig("22B", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=8, tp=8, pp=1, layers=48,
                    hidden=6144, heads=64, global_batch=4, micro_batch=4, iteration_time_s=1.10,
                    mfu=0.415, hfu=0.437, **_K_COMMON),
    PublishedConfig("175B (GPT-3)", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=64, tp=8, pp=8, layers=96,
                    hidden=12288, heads=96, global_batch=64, micro_batch=1, virtual_stages=3,
                    iteration_time_s=13.75, mfu=0.514, hfu=0.528, **_K_COMMON),
    PublishedConfig("530B (MT-NLG)", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=280, tp=8, pp=35, layers=105,
                    hidden=20480, heads=128, global_batch=280, micro_batch=1, virtual_stages=3,
                    iteration_time_s=37.83, mfu=0.560, hfu=0.570, **_K_COMMON),
    PublishedConfig("1T", f"{_KORTHIKANTI}, Table 3 and Table 5", gpus=512, tp=8, pp=64, layers=128,
                    hidden=25600, heads=160, global_batch=512, micro_batch=1, iteration_time_s=71.49,
                    mfu=0.563, hfu=0.570, **_K_COMMON),
)

# Section 6.3: the 530B model scaled to 8-way data parallelism, batch size x 8.
KORTHIKANTI_2022_530B_DP8 = PublishedConfig(
    "530B (MT-NLG), 8-way DP", f"{_KORTHIKANTI}, section 6.3", gpu="A100 80GB", gpus=2240, tp=8, pp=35, dp=8,
    layers=105, hidden=20480, heads=128, vocab=51200, seq=2048, global_batch=2240, micro_batch=1,
    virtual_stages=3, iteration_time_s=39.15, mfu=0.542,
    notes="no overlap of the gradient all-reduce with back-propagation",
)

_LLAMA3 = "Llama Team 2024, The Llama 3 Herd of Models (arXiv:2407.21783)"
_L_COMMON = dict(gpu="H100 80GB", data_parallel="FSDP", layers=126, hidden=16384, heads=128, vocab=128_000)
# Table 4 ("Scaling configurations and MFU for each stage of Llama 3 405B pre-training"); the model
# shape is Table 3 and section 3.2 (126 layers, 16,384 model dimension, 128 heads, 128K vocabulary).
# Batch size/DP is per DP group, so global_batch = batch/DP x DP (16M tokens in every row).
# Section 3.3.2: FSDP shards optimizer states and gradients; parameters are not resharded after the
# forward pass. Groups are ordered [TP, CP, PP, DP] from innermost (Figure 5).
LLAMA3_405B_TABLE4 = (
    PublishedConfig("Llama 3 405B, 8K GPUs", f"{_LLAMA3}, Table 4", gpus=8192, tp=8, cp=1, pp=16, dp=64,
                    seq=8192, global_batch=32 * 64, flops_per_gpu=430e12, mfu=0.43, **_L_COMMON),
    PublishedConfig("Llama 3 405B, 16K GPUs", f"{_LLAMA3}, Table 4", gpus=16384, tp=8, cp=1, pp=16, dp=128,
                    seq=8192, global_batch=16 * 128, flops_per_gpu=400e12, mfu=0.41, **_L_COMMON),
    PublishedConfig("Llama 3 405B, 16K GPUs, 128K context", f"{_LLAMA3}, Table 4", gpus=16384, tp=8, cp=16,
                    pp=16, dp=8, seq=131_072, global_batch=16 * 8, flops_per_gpu=380e12, mfu=0.38,
                    notes="arXiv v3 prints DP=8; other copies of the paper print DP=4, which breaks both "
                          "8*16*16*DP = 16,384 and the 16M tokens per batch (131,072 x 16 x 8)",
                    derived="DP=8 as in arXiv v3 (other copies print 4)",
                    **_L_COMMON),
)

# BigScience tr11-176B-ml README ("Replica setup": TP=4, PP=12, DP=8, MBS=2 on 384 GPUs = 48 nodes of 8;
# "Architecture": 70 layers, hidden 14336, 112 heads; vocabulary 250,680; GBS 2048 at seq 2048;
# BF16Optimizer with ZeRO stage 1). The README also notes training began at GBS=192 with MBS=1.
BLOOM_176B = PublishedConfig(
    "BLOOM 176B", "bigscience-workshop/bigscience, train/tr11-176B-ml/README.md; Scao et al. 2022, sec 3.4",
    gpu="A100 80GB", gpus=384, tp=4, pp=12, dp=8, data_parallel="ZeRO-1", layers=70, hidden=14336, heads=112,
    vocab=250_680, seq=2048, global_batch=2048, micro_batch=2,
    notes="embeddings counted as pipeline layers to balance stage memory",
)

# Zhang et al. 2022, OPT, section 2.4: "992 80GB A100 GPUs ... Fully Sharded Data Parallel with
# Megatron-LM Tensor Parallelism ... up to 147 TFLOP/s per GPU"; Table 1: 96 layers, 96 heads,
# d_model 12288, batch 2M tokens. The tensor-parallel degree, 8, is from the team's logbook
# (facebookresearch/metaseq, projects/OPT/chronicles/10_percent_update.md: "8x Tensor Parallelism");
# FSDP takes the remaining 992 / 8 = 124.
OPT_175B = PublishedConfig(
    "OPT-175B", "Zhang et al. 2022, OPT, sec 2.4 and Table 1; metaseq OPT chronicles",
    gpu="A100 80GB", gpus=992, tp=8, pp=1, dp=124, data_parallel="FSDP", layers=96, hidden=12288, heads=96,
    seq=2048, flops_per_gpu=147e12, notes="batch printed as 2M tokens; no pipeline parallelism",
    derived="DP = 992 / 8 (not printed)",
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
