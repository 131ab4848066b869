# %% [markdown]
# # 15 · Composing the parallelisms: DP x TP x PP x CP and ZeRO-1 on one mesh
#
# Each chapter so far built one parallelism and proved it equal to one process: data parallelism (02),
# tensor parallelism with sequence parallelism (04-06), ZeRO-1 (11), the pipeline (13), the ring (14). No
# large model is trained with one of them. Llama 3 405B trained on 16,384 H100s as **TP 8 x CP 16 x PP 16 x DP**
# in its long-context stage (Llama Team 2024, *The Llama 3 Herd of Models*, Table 4), and Megatron-LM's
# trillion-parameter benchmark ran on 3,072 A100s as **TP 8 x PP 64 x DP 6** (Narayanan et al. 2021,
# *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM*, Table 1: 3,072 GPUs at
# TP 8 and PP 64, so DP = 3,072 / 512 = 6).
#
# Composition is where the bugs live. Each parallelism alone has a small, testable contract; composed, every
# contract meets the others, and the bugs sit at the seams: a gradient summed over the group that was right
# *before* another dimension joined, a LayerNorm that sees only part of the sequence, a loss averaged per
# micro-batch, a dropout mask drawn per rank, an embedding whose two copies drift apart. None of them crashes.
# Each trains, with a loss curve that looks plausible, a slightly different model.
#
# This chapter runs one small GPT (tied embedding, 4 layers, 8 heads, float64) on eight layouts, six of eight
# ranks and two of four, with ZeRO 0 and 1, and holds every run to the one-process run: the loss of every step, every gradient put back together from its shards, the final parameters, and
# every replica bit for bit. Then it injects each of those bugs and shows the check catching it, naming the
# tensor, the ranks and their mesh coordinates.
#
# Built here: `workers/composed/` (`model.py`: the model cut four ways; `train.py`: the step, the trainer's refusal
# and the one-process reference; `equivalence.py`: the check; `faults.py`: the bugs) and the worker
# `workers/ch15_composed.py`, on the course's one layout, rule set and mesh (`workers/layout/`: `rules.py`, `grid.py`,
# `mesh.py`).

# %%
from fractions import Fraction

import course_utils as cu
from course_utils import ch15
from course_utils import ch15_truth as truth
from course_utils import plots
from course_utils.published_configs import LLAMA3_405B_TABLE4
from course_utils.results import InvalidParameter
from course_utils.tables import Table
from workers.composed.equivalence import TOLERANCE
from workers.layout import Layout
from workers.composed.faults import FAULTS

plots.style()
WORKER = "workers.ch15_composed"
CFG = ch15.CONFIG
print(f"the model: vocab {CFG.vocab}, seq {CFG.seq}, hidden {CFG.hidden}, heads {CFG.heads}, layers {CFG.layers}, "
      f"ffn {CFG.ffn}\nthe training: global batch {ch15.GLOBAL_BATCH} samples, {ch15.STEPS} AdamW steps, float64")

# %% [markdown]
# ## Real compositions
#
# The rule every layout obeys is TP x CP x PP x DP = GPUs (`course_utils/published_configs.py` holds the rows;
# chapter 00 prints them all). Llama 3 405B's three pre-training stages:

# %%
print(Table.of([{"run": c.name, "GPUs": c.gpus, "TP": c.tp, "CP": c.cp, "PP": c.pp, "DP": c.dp, "seq": c.seq,
                 "TP x CP x PP x DP": c.product} for c in LLAMA3_405B_TABLE4]))

# %% [markdown]
# The long-context stage turns on the fourth dimension without touching the other two model dimensions: the
# same TP 8 inside a node and PP 16 across nodes, with CP 16 taken out of data parallelism. Four parallel
# dimensions, and every one of them changes which ranks must agree on what.
#
# ## Why composition is where the bugs live
#
# Five seams, each invisible while its dimension is alone, each injected by a fault of
# `workers/composed/faults.py` (it replaces one method for the run, so the model and the trainer never branch on a
# fault's name):
#
# * **The gradient's group.** With data parallelism alone, a gradient is summed over "the DP group". Add
#   context parallelism, and the ranks of a CP ring hold the *same parameters* for *other tokens*: their
#   gradients are partial too, so the sum runs over DP x CP (Megatron's
#   `get_data_parallel_group(with_context_parallel=True)`). Summing over DP alone, or over the TP group by
#   mistake, leaves partial gradients that still look like gradients.
# * **LayerNorm under sequence parallelism.** With SP, each TP rank normalises only its rows of the sequence;
#   LayerNorm's weight and bias are replicated, so each rank's gradient is a partial sum over its rows and must be
#   all-reduced over TP (Korthikanti et al. 2022; Megatron marks these parameters `sequence_parallel`).
# * **The loss of ragged micro-batches.** With gradient accumulation (the pipeline's m micro-batches) and DP,
#   averaging each micro-batch over its own tokens, then over m and dp, gives tokens of short micro-batches more
#   weight: it equals the batch's mean only when every micro-batch holds as many tokens (Megatron's
#   `calculate_per_token_loss` divides by the global count instead).
# * **Dropout across TP ranks.** In the replicated region (outside SP) every TP rank computes the same
#   activations, so it must drop the same elements; under SP each rank holds other rows and must use *its slice*
#   of the mask (Megatron's `tensor_parallel.random` keeps two generators for this: the default one, seeded alike
#   across a TP group, and a tracked one that differs per TP rank).
# * **The tied embedding across the pipeline.** The first stage embeds with the matrix the last stage uses as
#   the output head. Each holds a copy; their gradients must be summed over the two stages (Megatron's
#   embedding group) or the copies take different steps and drift apart. Under TP each copy is split by vocabulary
#   (chapter 04's `VocabParallelEmbedding` and loss-parallel cross-entropy): a TP rank holds vocab/tp rows, computes
#   logits for its rows only, and the loss never gathers the [s, b, V] logits; the embedding group sums each TP
#   rank's rows with the same rows on the other stage.
#
# The faults, with what each breaks and the layouts where it can show (a fault that cannot show on a layout is
# refused: it would pass and teach nothing):

# %%
Table.of([{"fault": d, "breaks": what, "shows when": shows} for d, (what, shows) in FAULTS.items() if d != "none"])

# %% [markdown]
# **Predict.** The batch is ragged: each sample has a random number of valid tokens (at least a quarter of the
# sequence), the rest is padding. With dp = 2 and m = 2 micro-batches of 2 samples, how much weight does one token
# get in the loss if each micro-batch is averaged over its own tokens? The right weight is 1/N, N the valid tokens
# of the whole batch (`workers/model/batch.py: make_batch`, step 0; integer counts, the same on every machine):

# %%
weights = ch15.micro_batch_weights(dp=2, micro_batches=2)
print(Table.of([{**w, "right weight": f"1/{w['total']}", "per micro-batch mean": f"1/{w['per_micro_denominator']}"}
                for w in weights], ["dp", "micro", "tokens", "right weight", "per micro-batch mean"]))
right_sum = sum(Fraction(w["tokens"], w["total"]) for w in weights)
per_micro_sum = sum(Fraction(w["tokens"], w["per_micro_denominator"]) for w in weights)
print(f"N = {weights[0]['total']} valid tokens; the weights sum to {right_sum} (right) and {per_micro_sum} "
      "(per micro-batch mean) over the batch")

# %% [markdown]
# Both weightings sum to one over the batch, so the per-micro-batch loss is a plausible number; it just weighs a
# token of a 13-token micro-batch 1/52 and a token of a 17-token one 1/68, where every token should weigh 1/63.
# Its gradient is a different weighted sum: a different model after one step.
#
# ## The layout and the mesh
#
# A layout names the four degrees in the order papers quote them, DP x TP x PP x CP, and the options
# (`workers/layout/rules.py`, the course's one layout and its rules, shared with chapter 00's planner):

# %%
layout = Layout.parse("2x2x2x1", micro_batches=2)
print(layout)
print(f"name {layout.name}, {layout.world} ranks; refusal: {ch15.layout_problem(layout)}")

# %% [markdown]
# A layout that does not fit this model is refused in one sentence that names every offending degree, before any
# process group exists:

# %%
bad = Layout.parse("2x3x1x1")
print(ch15.wrap(ch15.layout_problem(bad, world=8)))
print(ch15.wrap(ch15.layout_problem(Layout.parse("1x2x3x1", micro_batches=3), world=8)))

# %% [markdown]
# The worker checks the same thing through its `check_params`, so `course_utils.run` refuses before launching
# a rank:

# %%
try:
    cu.run(WORKER, world_size=8, dp=2, tp=3, pp=1, cp=1)
except InvalidParameter as exc:
    print(ch15.wrap(f"refused before any rank started: {exc}"))

# %% [markdown]
# **The rank grid.** The ranks are laid out as `arange(world).view(dp, pp, cp, tp)` (`workers/layout/grid.py`),
# tp innermost: a TP group is consecutive ranks, the ones that on a real node share NVLink, because tensor
# parallelism talks in every layer. A group "along" a dimension is the ranks whose other coordinates are equal.
# For 2x2x2x1:

# %%
print(ch15.grid_table(layout))

# %% [markdown]
# The four dimensions give four kinds of groups. The composition needs two more that no single dimension gives
# (`workers/layout/mesh.py: Mesh` makes them next to the `DeviceMesh`):
#
# * **dp_cp**: the ranks that hold the same parameters with other samples (DP) or other tokens (CP). Gradients are
#   summed, and ZeRO-1 shards the optimizer state, over this group. With cp = 1 it is the DP group.
# * **embedding**: the first and last stage of each pipeline, which both hold the tied embedding; its two copies'
#   gradients are summed over this group before anything else. With pp = 1 one stage holds both ends and there is
#   no such group.
#
# Every group, once:

# %%
print(ch15.group_table(layout))
print()
print(ch15.group_table(Layout.parse("1x2x2x2")))

# %% [markdown]
# What each rank holds follows from its coordinates alone: its pipeline stage's layers, its TP shard of every
# layer's heads (and ffn columns), its CP tokens (zigzag: an early chunk and its mirror from the end), its DP
# samples, and the ends of the model on the first and last stage (`ch15.holdings`). Drawn for 2x2x2x1 and, with a
# CP ring, 1x2x2x2:

# %% tags=["nbval-ignore-output"]
plots.savefig(ch15.mesh_figure(layout), "15_mesh_2x2x2x1")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch15.mesh_figure(Layout.parse("1x2x2x2")), "15_mesh_1x2x2x2")

# %% [markdown]
# ## Equal to one process, on eight ranks
#
# The ground truth is the same model, the same batches and the same AdamW in one process
# (`train.reference_run`), computed once. Every layout runs three steps and reports its losses, its gradients of
# every step as shards (with their place in the dense tensor), its final parameters, and a digest of every
# parameter after every step from every rank (`workers/composed/equivalence.py: compare`).
#
# **The tolerance.** Ranks and reference run in float64. Every layout computes the same sums in another order:
# a ring all-reduce adds the DP replicas' gradients in chunks, TP computes a GEMM as a sum of per-shard GEMMs, the
# ring attention merges partial softmaxes. So the differences are float64 rounding, ~1e-16 per operation,
# accumulated over three steps. The check allows 1e-10 relative to each tensor's largest reference entry. The
# largest difference measured over the chapter's layouts, with SP and dropout, seeds 0-2, on AVX-512, AVX2 and the
# plain kernels, is 4.5e-12 (`workers/composed/equivalence.py`): twenty times under the tolerance. Every fault is
# off by more than 1e-4, a million times over it. Replicas need no tolerance: copies of a parameter are compared
# bit for bit.
#
# One part of the model is held to another rule. The key rows of every QKV bias get a gradient that is exactly zero
# in exact arithmetic: adding $b_k$ to every key adds $q \cdot b_k$ to every score of a query's row, and softmax
# ignores a shift of its row. So each run computes rounding noise there, and AdamW divides a gradient by its own
# size: noise, however small, can move those entries by up to lr per step, differently in two correct runs. The
# check asks instead what is true: that gradient is zero (to the tolerance) in both runs, and those entries differ by
# less than AdamW can make of noise, 2 x lr x steps.
#
# **Predict**: does ZeRO-1 (a reduce-scatter of the gradients, each rank stepping its shard of AdamW, an all-gather
# of the updated parameters) end further from one process than a plain all-reduce? (Pipeline layouts run two
# micro-batches per rank so that 1F1B overlaps its stages.)

# %%
print(f"tolerance (float64, relative): {TOLERANCE['float64']:g}")
reference = ch15.reference()
print(f"reference: {len(reference['losses'])} steps, {len(reference['params'])} parameter tensors, "
      f"{sum(p.numel() for p in reference['params'].values())} parameters; the 3 losses differ: "
      f"{len(set(reference['losses'])) == 3}")

# %%
runs, verdicts = {}, {}
# world 8 first: at most 8 ranks stay warm, so one cold start serves all of these; each() says which one is running
for name, zero in cu.each([(n, z) for n in ch15.LAYOUTS_8 for z in (0, 1)], "layout", lambda c: f"{c[0]}, ZeRO-{c[1]}"):
    runs[name, zero], verdicts[name, zero] = ch15.run_layout(name, zero=zero)

# %% [markdown]
# The largest relative difference of each run (float64 rounding: its digits depend on this CPU's kernels, so yours
# may differ from these in the last digit). ZeRO-1 lands as close as the all-reduce: AdamW updates each element on its
# own, so stepping a shard is the same arithmetic as stepping the whole; only the order of the gradient's sum could
# differ:

# %% tags=["nbval-ignore-output"]
print(ch15.equivalence_table([ch15.equivalence_row(n, z, v) for (n, z), v in verdicts.items()]))

# %% [markdown]
# What holds on every machine: every verdict.

# %%
print(ch15.equivalence_table([ch15.equivalence_row(n, z, v) for (n, z), v in verdicts.items()], differences=False))
print("every 8-rank layout equals one process, ZeRO 0 and 1:", all(v["ok"] for v in verdicts.values()))

# %% [markdown]
# The same runs, checked for their mesh: torch's `DeviceMesh` handed every rank the course grid's group along
# every dimension, and every rank reports holding what the layout predicts (its coordinates, layers, ends of the
# model and TP-sharded parameters, against `ch15.holdings`):

# %%
print("DeviceMesh groups are the grid's on every rank of every run:",
      all(ch15.mesh_matches_grid(res.ranks) for res in runs.values()))
print("every rank holds what its layout predicts:", all(not ch15.holdings_mismatches(res.ranks) for res in runs.values()))

# %% [markdown]
# What one step looked like on 2x2x2x1: each rank's forwards and backwards of the last step. The two TP ranks of a
# stage move in step (their all-reduces tie them together); stage 1 starts after stage 0's first forward; the two
# DP replicas run independently until the gradient all-reduce after the schedule (CPU timings on shared cores:
# noisy, and not GPU numbers):

# %% tags=["nbval-ignore-output"]
plots.savefig(ch15.timeline_figure(runs["2x2x2x1", 0].ranks), "15_timeline_2x2x2x1")

# %% [markdown]
# ## The faults: each bug caught, and named
#
# Each fault runs on an 8-rank layout where it shows (`ch15.FAULT_CASES`, the cases of
# `tests/test_ch15_composed.py`). The check names the first thing that differs, in the order training met it (step,
# then the model's parameter order): which tensor, on which ranks with their mesh coordinates, and by how much.
# **Predict** what it names first for each.

# %%
fault_verdicts = {}
for fault, (name, options) in ch15.FAULT_CASES.items():
    if Layout.parse(name).world == 8:
        fault_verdicts[fault] = name, ch15.run_layout(name, fault=fault, **options)[1]

# %% [markdown]
# The check's messages (their error magnitudes vary by CPU in the last digits: yours may read slightly differently):

# %% tags=["nbval-ignore-output"]
for fault, (name, verdict) in fault_verdicts.items():
    print(f"{fault} on {name}:\n{ch15.wrap(verdict['message'], indent='  ')}")

# %%
print(Table.of([ch15.fault_row(d, n, v) for d, (n, v) in fault_verdicts.items()],
               ["fault", "layout", "first named", "caught"]))

# %% [markdown]
# Reading them:
#
# * Gradients summed over **dp alone** on 2x2x1x2 miss the other CP rank's tokens; summed over **tp** on 2x2x2x1
#   they add what the TP ranks hold (copies of a replicated gradient, or different shards) and miss the other DP
#   replica's samples. Either way the first tensor named is the model's first parameter, the position table, on
#   the first stage's ranks.
# * **LayerNorm not reduced** under SP: the first gradient off is `blocks.0.ln1.weight`, the first LayerNorm, on
#   the TP ranks that each hold half its rows.
# * **Per-micro-batch mean**: the loss itself is off (the batch's mean is not the mean of means), so the check
#   names the loss before any gradient.
# * **Dropout**: a mask of its own on each TP rank, or the same slice on every SP rank, changes which activations
#   survive: the loss differs from one process at step 0. A per-rank mask in the replicated region also breaks
#   something that no reference is needed for: the two TP ranks no longer compute the same replicated
#   activations, so their copies of the replicated parameters take different steps, and the digests catch it:

# %%
problems = fault_verdicts["dropout_per_rank"][1]["replica_problems"]
print(f"replica problems found under dropout_per_rank: {len(problems) > 0}; the first:\n  "
      f"{problems[0].split(':')[0]}: copies that should be bit for bit equal differ")

# %% [markdown]
# ## Four ranks: a deep pipeline, a long ring, and the tied embedding
#
# The last two of the chapter's layouts use four ranks on one dimension: four pipeline stages (two micro-batches), and
# a ring of four (zigzag: eight chunks of two tokens). One cold start of four ranks serves them, the last fault,
# and the explorer below.

# %%
for name, zero in cu.each([(n, z) for n in ch15.LAYOUTS_4 for z in (0, 1)], "layout", lambda c: f"{c[0]}, ZeRO-{c[1]}"):
    runs[name, zero], verdicts[name, zero] = ch15.run_layout(name, zero=zero)

# %% [markdown]
# Every layout of the chapter, ZeRO 0 and 1 (the differences vary by CPU in their last digit):

# %% tags=["nbval-ignore-output"]
every_row = [ch15.equivalence_row(n, z, v) for (n, z), v in verdicts.items()]
print(ch15.equivalence_table(every_row))

# %%
print(ch15.equivalence_table([ch15.equivalence_row(n, z, v) for (n, z), v in verdicts.items()
                              if Layout.parse(n).world == 4], differences=False))
print(f"all {len(verdicts)} runs equal one process:", all(v["ok"] for v in verdicts.values()))
print("DeviceMesh groups and holdings as predicted:",
      all(ch15.mesh_matches_grid(r.ranks) and not ch15.holdings_mismatches(r.ranks) for r in runs.values()))

# %% [markdown]
# The tied embedding's fault needs a pipeline, and shows best on the deepest: at pp = 4 the embedding lives on
# stage 0 and its copy, the head, on stage 3. Without the sum over the embedding group, each copy steps with only
# its own part of the gradient.

# %%
name, options = ch15.FAULT_CASES["tied_not_reduced"]
fault_verdicts["tied_not_reduced"] = name, ch15.run_layout(name, fault="tied_not_reduced", **options)[1]

# %% tags=["nbval-ignore-output"]
print(ch15.wrap(fault_verdicts["tied_not_reduced"][1]["message"]))

# %%
print(Table.of([ch15.fault_row(d, n, v) for d, (n, v) in fault_verdicts.items()],
               ["fault", "layout", "first named", "caught"]))
print("every fault caught, at step 0, by far more than rounding:", all(ch15.fault_row(d, n, v)["caught"]
                                                                      for d, (n, v) in fault_verdicts.items()))

# %% [markdown]
# The embedding's gradient is named on ranks 0 and 3, the two stages that hold a copy: each holds only its own
# part of the gradient (stage 0's from the lookup at the input, stage 3's from the head at the output), and nobody
# added them.
#
# ## The planner held to the run
#
# Chapter 00's planner answered three questions from models only: does a layout fit in memory, what share of a
# step is communication, is the work balanced. Here it meets a run. For each layout, three numbers side by side
# (`course_utils/ch15_truth.py`), for the rank the planner models (rank 0: the first stage, dp = cp = tp = 0):
#
# * **planner**: chapter 00's model for the same shapes: `planner.step_collectives` lists the collectives `plan()`
#   times (4 all-reduces per layer for TP, an all-gather and a reduce-scatter of K and V for CP, one message each
#   way per micro-batch for PP, the gradients over dp x cp), here with float64's 8 bytes per element;
# * **this code**: the same bookkeeping written out for what the course's code actually does;
# * **measured**: what rank 0 counted in the step: the size of every TP and SP collective (`CommLedger`), every
#   byte the KV ring and the pipeline sent, the gradient collectives.
#
# Byte counts do not depend on the CPU: your table is this one, to the byte. **Predict** first: along which
# dimension is the planner exact, and where does it overcount or undercount this code?

# %%
zero0 = {name: runs[name, 0] for name in ch15.LAYOUTS_8 + ch15.LAYOUTS_4}
print(truth.truth_table(zero0))
print("measured equals this code's bookkeeping, to the byte, on every layout, stage and step:",
      all(truth.exact_everywhere(res.ranks) for res in runs.values()))

# %% [markdown]
# The same rows as bars of planner / measured, from the line at 1 (exact) on a log axis, so that the planner at half
# the bytes (0.5) and at twice the bytes (2) are bars of the same length on either side; the grey band is within
# 25%. A planner that counts nothing for a dimension it does not model (the tied embedding's sum) has no ratio on a
# log axis: its hatched bar runs off the left edge and says 0.

# %% tags=["nbval-ignore-output"]
plots.savefig(truth.truth_figure(zero0), "15_truth_table")

# %% [markdown]
# Where the planner is off, the error is not noise: each gap has one reason, and a test holds the planner to it
# (`tests/test_ch15_composed.py: check_truth_table`):
#
# * **tp**: the planner counts the layers' four all-reduces (or their SP pairs) per layer exactly, and nothing for
#   the ends. Split by vocabulary, the first stage sums its embedding rows' outputs over TP and the last stage the
#   head's input gradient, each as much as one more all-reduce of an activation, and the loss adds three small
#   all-reduces of [s/cp, b] (the row maximum, the sum of exponentials, the target's logit). The LayerNorm and
#   row-bias gradients, partial sums under SP (with the first stage's position rows), are all-reduced after every
#   micro-batch (`tp_parameters`).
# * **cp**: the planner counts Llama 3's all-gather of K and V forward and a reduce-scatter backward. The ring
#   sends K and V round again in backward (it keeps no copy: memory) and carries dK/dV one hop further, home:
#   (3cp-2)/(2cp-2) times the planner's bytes, 2x at cp = 2, 1.67x at cp = 4.
# * **pp**: the planner charges every GPU a send each way per micro-batch, of 1/tp of the activation (Megatron's
#   scatter-gather optimisation). The first stage only sends forward, and without sequence parallelism every TP
#   rank sends the whole activation: tp/2 of the planner's figure.
# * **dp**: the planner counts weights only and divides all of them by tp. This model has biases, learned
#   positions and LayerNorm biases, and keeps LayerNorms, row biases and positions whole on every TP rank (the
#   embedding is split by vocabulary, as the planner assumes); ZeRO-1 pads each bucket to a multiple of the group.
#
# Memory at the four moments, for 2x2x2x1 with and without ZeRO-1 (parameters, gradients and AdamW's two moments
# are exact bookkeeping; activations are the peak of what autograd saved, against Korthikanti's count):

# %%
for zero in (0, 1):
    print(f"2x2x2x1, zero={zero}, rank 0 (bytes):")
    print(truth.memory_table(runs["2x2x2x1", zero].ranks))

# %% [markdown]
# ZeRO-1 halves the optimizer state over the dp_cp group of 2 and leaves parameters and gradients whole, as the
# ledger says (its `model_state_bytes`). The activation row is the one figure without an exact model: Korthikanti
# et al. count 16-bit activations, 1-byte dropout masks and the s x s attention scores kept for backward; here
# activations are float64 (4x the bytes), there are no masks at dropout 0, and PyTorch's attention saves its output
# and log-sum-exp instead of the scores. Over the chapter's layouts the planner's figure is 0.30-0.39 of the
# measured peak; the tests hold it to that band.
#
# **Work under causal CP.** Every rank of the ring counted the (query, key) scores it computed; chapter 14's block
# rule predicts them. Contiguous chunks give the last rank 4x the first rank's work at cp = 4, zigzag balances it:

# %%
for split in ("zigzag", "contiguous"):
    res = runs["1x1x1x4", 0] if split == "zigzag" else ch15.run_layout("1x1x1x4", split=split)[0]
    work = truth.cp_work(res.ranks)
    print(f"{split:>10}: scores per rank per ring call {work['measured']}, predicted {work['predicted']}, "
          f"equal: {work['measured'] == work['predicted']}")

# %% [markdown]
# **The bubble.** Four stages, four micro-batches, each forward padded to 20 ms and each backward to 40 ms
# (chapter 13's calibrated wait, so that a loaded CPU cannot change the work): idle / total over the pipeline,
# against (p-1)/(v m + p-1). The messages' latency comes on top, so the measurement may exceed the formula but not
# undercut it (CPU timings: they vary by machine and load):

# %% tags=["nbval-ignore-output"]
timed, _ = ch15.run_layout("1x1x4x1", micro_batches=4, steps=1, forward_ms=20.0, backward_ms=40.0)
bubble = truth.bubble(timed.ranks)
print(f"measured idle / total {bubble['measured']:.3f} (per stage {[round(x, 3) for x in bubble['per_stage']]}), "
      f"formula {bubble['formula']:.3f}")

# %% [markdown]
# **The step time, on this machine.** Chapter 00's planner prices a step of Llama 3 on sixteen thousand H100s from a
# device's measured rates. The same code prices the runs of this chapter and of chapter 13 once this machine is a
# device: `calibration.calibrate()` measures it on 2 and 4 ranks with the course's thread settings (matmul rates by
# shape, the fixed cost of one eager op and of one through autograd, fused attention and GELU timed at this model's
# shapes, streaming bandwidth, how ranks sharing the cores slow each other, and gloo's latency and bandwidth per
# collective and world size; about 20 s the first time, stored
# under build/scratch after that), `machine_device.device_from` turns that into a planner `Cluster` (the ops of one
# layer counted on this model, not guessed), and `step_time` prices each run; `measure_runs` times the runs themselves
# (the median step on warm ranks, the first dropped). CPU wall times: they vary by machine and by load, and a shared
# virtual machine's speed also swings on its own, for a third of a second to seconds at a time. So a tiny op is
# timed in this notebook's process before and after the calibration and each run: the table's last column says how
# much slower it ran around the run than at its quickest this session, and a run (or the calibration) around which
# it ran more than 1.3 times slower is measured once more, the quieter of the two kept.

# %% tags=["nbval-ignore-output"]
from course_utils import calibration, machine_device

machine = calibration.calibrate()
measured = calibration.measure_runs(calibration.default_runs(two_rank_layouts=False))
compared = machine_device.compare_runs(machine, measured)
display(machine_device.comparison_table(compared))

# %% [markdown]
# Where a step is padded to calibrated waits (chapter 13's schedules, and the timed run above) the planner's step is the
# simulated schedule plus the messages, and it lands within a few percent of the measurement: the bubble the planner
# charges Llama 3 is the one this machine shows. Where the steps are the tiny model's own work, the planner lands
# within about a quarter of the measured step on the 2-core virtual machine this chapter was written on, further off
# on a busy machine (a step of a few milliseconds there moves by up to a third between launches) or around a slow
# stretch of the host: in one execution there all four runs that missed the band had a host slowdown of 1.5-1.9x (the
# caption counts the runs measured within 1.3x of the host's quickest apart; a slow stretch shorter than a run can
# still pass between its probes unseen), and the table's
# largest term says where it looks: a few microseconds per eager op times the ops counted, the optimizer's hundreds of small ops, and each
# message's wait for a core when four ranks share two (measured by the calibration with the other ranks busy: about
# a millisecond, against a tenth of that when they are idle). One such price cannot hold for chapter 13's unpadded
# pipelines: in one pipeline of four ranks few of them compute at once and a message finds a core free; in two
# pipelines of two, every message queues behind the other pair's work. So those runs are replayed on the cores
# themselves (`machine_device.shared_cores_makespan`): every rank and every message queues for one of the two cores,
# each action costs its own CPU, each message the CPU of the threads that carry it, and an action that follows a
# wait starts cold. The calibration measures both in the pipeline executor's own pattern (`machine.summary()` lists
# them): on a virtual machine whose idle cores sleep, work that resumes after a wait can cost twice its CPU back to
# back. After its last action each rank runs the rest of its trainer's step (the next batch, the step's message
# objects, the gradients and timeline it reports, the optimizer): Python between tiny actions that no op count sees,
# so the calibration times chapter 13's trainer itself, with one stage on every rank (about 0.4 ms of CPU a step on
# a 2-core virtual machine, where its counted ops come to 0.05 ms). In the replay it holds a core, and that matters
# more than its size: the last stages finish first, and while they run it the first stages wait for a core to take
# their last gradients. 1F1B and interleaving, whose messages cross a link both ways at once, were still priced well below their
# step until the pipeline executor sent each direction on a process group of its own: on one group, gloo's
# transport threads polled while their own rank held the link to send (chapter 13, section 7), CPU no calibration
# of single messages sees. A message costs even the replay's price only if its receive was posted before it
# arrived: otherwise it cannot land until the receive is posted, and gloo's transport threads poll without sleeping
# meanwhile, taking the core the rank needs to post it (round trips of 4 ms instead of 0.15 on two cores), which is
# why the pipeline executor posts every receive of a step before the step begins. Attention and GELU are priced
# from their timed calls, not from their FLOPs or bytes: a CPU's attention call on heads of 4 costs its setup per
# head (hundreds of microseconds for this model's layer in float64, where FlashAttention's share of the matmul rate
# would say a few), and float64 erf is compute-bound. What it still misses in this chapter's own runs, the next
# table shows part by part. At the scale chapter 00 prices, fixed costs per op and per message vanish next to the
# matmuls; at this scale they are the step.

# %% [markdown]
# **Where the step went.** A step's total can come out right for the wrong reasons, so the trainer also times its
# parts: the schedule (from the barrier that starts it to its last action; inside it, the time each rank was blocked
# on the CP ring's transfers and in pipeline receives), the gradient sync with the optimizer step, and the rest of
# the step. The table sets each part beside the terms that price it (`machine_device.STEP_PARTS`).

# %% tags=["nbval-ignore-output"]
display(machine_device.parts_table(compared))

# %% [markdown]
# The parts once showed a step that came out near its measurement for the wrong reasons. On the 2-core virtual
# machine this chapter was written on, the context-parallel layout 1x1x1x4 carried two errors of opposite sign: its
# ranks were blocked on the ring's transfers for 27-49 ms a step where a ring priced as one all-gather hidden behind
# attention came to 20 (four ranks share two cores, and a transfer waits for its peer to be given one), while its
# 4,529 counted ops per micro-batch (505 without the ring: the ring's blocks, merges and buffers are many small ops)
# were priced at an `nn.Linear` step's op, 21 ms for a forward and backward that take 16 ms in one process. Each
# error, corrected alone, moved the step further off. So the planner now prices what the ranks do:
#
# - the calibration times one micro-batch of this very model in one process, whole and with a ring of two
#   (`machine.summary()` lists both), and prices the model's ops and the ring's each at what they cost there, after
#   the matmuls, attention and memory-bound work it prices anyway (`machine_device.gpt_op_prices`);
# - the ring is priced exchange by exchange, as chapter 14's ring makes them: per layer cp - 1 exchanges of K and V
#   forward and as many backward, posted before the blocks they overlap (hidden behind those blocks' math and their
#   ops' dispatch, one exchange always exposed), and cp exchanges of the dK/dV accumulator that backward waits for
#   at once, each the one-way message the calibration measured between two ranks while the others compute;
# - every message end, the ring's and a pipeline stage's, costs its rank the CPU the calibration measured a message
#   end to cost in the pipeline executor's pattern, as chapter 13's replay on the cores already charged it.
#
# With those, on that machine the four 4-rank layouts came within 25% of the median of five launches in two
# benchmarks (0.85-0.98; the schedule part within 8% in one, 17% in the other), and at 0.74-0.78 in the execution
# stored above, where the host ran up to 1.5 times slower around the context-parallel runs. The ring's waits are
# priced at a half to three quarters of what its ranks measured: a transfer's wait for its peer's core grows with
# how busy the host is. A
# pipeline's waits read below the bubble priced for them: the table's waits are the median rank's, the bubble is
# the busiest rank's, and a stage that finishes first waits out the others after its schedule. (CPU timings: on
# another machine the parts move.)

# %% [markdown]
# ## Exercises
#
# **Exercise 1: the mesh's groups by hand.** The world's ranks are `arange(dp*pp*cp*tp).view(dp, pp, cp, tp)`, tp
# innermost. Return every group along `dim` (one of `"dp"`, `"pp"`, `"cp"`, `"tp"`): each group a list of the ranks
# whose other three coordinates are equal, every group once. (Every rank must create every group, in one order:
# `dist.new_group` is collective over the world.) The check compares with the rank grid on seven shapes of 8 ranks.

# %% tags=["exercise"]
def mesh_groups(dp, pp, cp, tp, dim):
    raise NotImplementedError

# %% tags=["check"]
cu.check("mesh_groups", mesh_groups)

# %% [markdown]
# **Exercise 2: the loss of one micro-batch.** `summed_ce` is the summed cross-entropy of one micro-batch's valid
# tokens on this rank (a tensor: the trainer backpropagates through your result), `micro_tokens` the valid tokens of
# that micro-batch, `global_tokens` the valid tokens of the whole global batch. The trainer adds your values over the
# `micro_batches` micro-batches of a rank and sums the gradients over the `dp` x `cp` ranks that hold the same
# parameters. Return this micro-batch's loss so that the sum is exactly the global batch's mean token loss, however
# ragged the micro-batches. The check trains 2x1x2x1 and 2x1x1x2 for real on 4 ranks with your rule, against one
# process.

# %% tags=["exercise"]
def micro_batch_loss(summed_ce, micro_tokens, global_tokens, micro_batches, dp, cp):
    raise NotImplementedError

# %% tags=["check"]
cu.check("micro_batch_loss", micro_batch_loss)

# %% [markdown]
# **Exercise 3: a layout for a budget, and its traffic.** Pick a layout of this chapter's model (float64, global batch
# 8) for 8 ranks in which every rank holds at most 600,000 bytes of parameters, gradients and AdamW's two moments, and
# predict the bytes rank 0 sends in one step along tp, cp, pp and dp. Return `(layout, predicted)`: `layout` a dict
# with `dp`, `tp`, `pp`, `cp` (and `zero`, `micro_batches`, `sequence_parallel`), `predicted` a dict of bytes by
# dimension. The check refuses a layout that does not fit, then runs it for one step and compares rank 0's measured
# bytes with yours, to the byte.

# %% tags=["exercise"]
def layout_and_traffic():
    raise NotImplementedError

# %% tags=["check"]
cu.check("layout_and_traffic", layout_and_traffic)

# %% [markdown]
# ## Explore on real ranks
#
# Choose the degrees (their product is the world size, at most 8 here), ZeRO, sequence parallelism and the
# micro-batches. Each change runs the three steps on real ranks, checks them against one process, and draws every
# rank's last step. A layout this model cannot take (pp = 3 does not divide 4 layers; dp x m must divide the batch of
# 8; SP needs tp to divide each CP rank's tokens) is refused before a rank starts, with the sentence that says why.
# A change of world size starts new ranks (tens of seconds here); the same world size reuses the warm ones. The
# verdict's sentence shows beside the controls; the figure below them is always the settings on screen (a refused
# setting clears it, and while a new run is going the text says the figure is still the previous layout's).

# %% tags=["nbval-ignore-output"]
explorer = ch15.LayoutRun()  # the controls: course_utils/ch15.py, explorer_controls
explorer.wait(60)
explorer

# %% [markdown]
# ## PyTorch's own APIs, side by side
#
# torchtitan composes the same parallelisms with PyTorch's composable APIs. They run on gloo too, so the chapter's
# model can be trained with them and held to the same one-process run (`workers/ch15_native.py`, four ranks):
#
# * **tp**: `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`: this course's `ColumnParallelLinear`
#   and `RowParallelLinear`, Megatron's f and g, with torchtitan's separate `wq`, `wk`, `wv` (on the fused
#   [Q; K; V] weight, `ColwiseParallel` cuts contiguous rows: the fused-QKV trap of chapter 05, which runs and
#   computes another model: `api="tp", qkv="fused"`);
# * **fsdp**: FSDP2's `fully_shard`: ZeRO-3, two stages past chapter 11's ZeRO-1 (told to *sum* gradients, since
#   the loss is already the global mean: `set_gradient_divide_factor(1.0)`);
# * **tp_fsdp**: both on a 2-D mesh, dp 2 x tp 2, torchtitan's usual layout;
# * **pipelining**: `torch.distributed.pipelining`'s `PipelineStage` and `Schedule1F1B`, chapter 13's schedule,
#   with the tied embedding's copies summed over the first and last stage as here.

# %%
native = {api: cu.run("workers.ch15_native", world_size=4, timeout=240, api=api, **params).ranks
          for api, params in ch15.NATIVE_CASES.items()}
native_rows = [ch15.native_row(api, ranks, reference) for api, ranks in native.items()]

# %% tags=["nbval-ignore-output"]
print(Table.of(native_rows, formats={"loss": "{:.1e}", "gradients": "{:.1e}", "final parameters": "{:.1e}"}))

# %%
print("every PyTorch API run equals one process (float64, 1e-10):", all(r["equal to one process"] for r in native_rows))

# %% [markdown]
# ## From here to torchtitan and Megatron-LM
#
# The pieces of `workers/composed/` are the pieces of the production frameworks, small enough to read:
#
# | here | torchtitan | Megatron-LM |
# |---|---|---|
# | `Layout`, `problem` | `ParallelDims` (its degrees, checked against the world) | `initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size, ...)` |
# | `Mesh`: grid `(dp, pp, cp, tp)`, tp innermost, as a `DeviceMesh` | `init_device_mesh` over `["pp", "dp_replicate", "dp_shard", "cp", "tp"]` | rank order `--order tp-cp-ep-dp-pp` |
# | `dp_cp` group: gradients, ZeRO shards | the flattened `dp_shard` x `cp` mesh dimension FSDP shards over | `get_data_parallel_group(with_context_parallel=True)` |
# | `embedding` group, tied head copy | (Llama 3 has an untied output layer) | `get_embedding_group()`, `_allreduce_embedding_grads` |
# | ZeRO-1 (`workers/zero/zero1.py`) | FSDP2 `fully_shard` (ZeRO-3-like) | `--use-distributed-optimizer` |
# | TP + SP (chapters 04-06) | `parallelize_module` with `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel` | `--tensor-model-parallel-size`, `--sequence-parallel` |
# | ring attention (chapter 14) | `context_parallel` (`torch.distributed.tensor.experimental`) | `--context-parallel-size` (Transformer Engine attention) |
# | 1F1B, interleaved (chapter 13) | `torch.distributed.pipelining` schedules | `--pipeline-model-parallel-size`, virtual pipeline stages |
# | loss over the global token count | - | `--calculate-per-token-loss` |
#
# One difference of order: both frameworks put pp *outermost* (a pipeline's point-to-point sends are the lightest
# traffic, so they are the ones to cross nodes), where this course's grid puts dp outermost so that one pipeline or
# one ring is a run of consecutive ranks. Both put tp innermost, for the reason above. The grid reads its order from
# one tuple, `grid.DIMS`; the equivalence check does not care.
#
# **On a node of eight GPUs** the worker runs unchanged under torchrun; `workers/runtime.py` picks NCCL when every
# rank has a GPU:
#
# ```bash
# torchrun --nproc-per-node 8 workers/ch15_composed.py --dp 2 --tp 2 --pp 2 --micro-batches 2 --dtype float32
# torchrun --nproc-per-node 8 workers/ch15_composed.py --dp 2 --tp 2 --cp 2 --zero 1 --sequence-parallel true
# ```
#
# Each rank prints its results. From a notebook on that machine, `ch15.run_layout("2x2x2x1", dtype="float32")` runs
# the same check with one rank per GPU. In float32 its tolerance is 5e-3: float32 rounding (~1e-7 per operation),
# accumulated over three steps, leaves differences up to about 1e-4 (`workers/composed/equivalence.py` has the
# measurement), and the key rows of the QKV bias are held to AdamW's bound on noise as in float64. On several nodes, start the same command on each with `--nnodes`, `--rdzv-backend c10d
# --rdzv-endpoint HOST0:29500` (see the README), and keep tp within a node: with tp innermost, a TP group of 8 is
# eight consecutive ranks, one node's NVLink domain.
#
# ## Summary
#
# * A layout is four degrees, DP x TP x PP x CP, whose product is the world; a layout that does not fit the model is
#   refused in one sentence naming every offending degree, before a process group exists.
# * The ranks form one grid, `arange(world).view(dp, pp, cp, tp)`, tp innermost; every group is a slice of it, plus
#   two that no single dimension gives: **dp_cp** (same parameters, other samples or tokens: gradients and ZeRO
#   shards) and **embedding** (the first and last stage's copies of the tied embedding).
# * Every layout of the chapter, with ZeRO 0 and 1, trains exactly like one process: losses, every gradient, the final
#   parameters within float64 rounding (1e-10 relative), replicas bit for bit.
# * The bugs of composition live at the seams (the gradient's group, LayerNorm under SP, ragged micro-batch losses,
#   dropout masks across TP, the tied embedding across stages); none crashes, and each is caught at step 0 by the
#   same check, which names the tensor, the ranks and their coordinates.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
