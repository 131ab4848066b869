"""Parallel layouts of published training runs, as data.

Every row is copied from the source named in ``source`` (paper, section, table). Numbers the source
does not print are ``None``, never guessed. ``check_product()`` applies the rule every layout must
obey, TP x CP x PP x DP = GPUs; the tests run it on every row, and chapter 00 prints the table. Where a
degree is not simply as printed (the source gives no value and it was derived from the rule, or copies of
the source disagree and the rule picked one), ``derived`` says which and how: for that row the rule holds
by construction and checks nothing.

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
