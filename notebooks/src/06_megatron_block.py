# %% [markdown]
# # 06 · A Megatron-style transformer block from scratch
#
# Chapters 04 and 05 built the two halves of a transformer layer. This chapter puts them into one
# **pre-LN block**, the layer of GPT-2 and Megatron-LM:
#
# $$ h = x + \mathrm{Attention}(\mathrm{LN}_1(x)), \qquad y = h + \mathrm{MLP}(\mathrm{LN}_2(h)) $$
#
# With tensor parallelism each sub-layer is wrapped in an `f` (identity forward, all-reduce backward) and
# a `g` (all-reduce forward, identity backward): **2 all-reduces forward and 2 backward per layer**
# (Shoeybi et al. 2019, [arXiv:1909.08053](https://arxiv.org/abs/1909.08053), Figure 4). Everything
# between the sub-layers (LayerNorms, residual additions, dropout) runs *replicated*: every rank repeats
# the same work on the whole `[s, b, h]` tensor and stores the same activations.
#
# **Sequence parallelism** (Korthikanti et al. 2022, *Reducing Activation Recomputation in Large
# Transformer Models*, [arXiv:2205.05198](https://arxiv.org/abs/2205.05198), section 4.2.2, Figure 5)
# removes that waste: the replicated regions work on a `[s/t, b, h]` slice of the sequence, each `g`
# becomes a **reduce-scatter** and each `f` an **all-gather**. A ring all-reduce *is* a reduce-scatter
# followed by an all-gather, so the bytes are the same; what changes is that the LayerNorm and dropout
# activations shrink by t.
#
# We build it (`workers/parallel/block.py`), prove that it is the dense block, forward and backward, train a GPT
# made of it for a few optimizer steps against the same GPT in one process, count its communication, and look at
# where its time goes.

# %%
import os

import torch

import course_utils as cu
from course_utils import paths, plots, reference_data, tp_check, tp_figures
from course_utils.ledger import activation_bytes_per_layer, tp_comm_bytes_per_layer
from course_utils.scratch import scratch_dir

plots.style()
LIMITS = {"timeout": 90}  # per run; the ranks stay warm between runs (and the exercise checks reuse them)
SEQ, BATCH, HIDDEN = 8, 2, 32
BLOCK = "workers.ch06_block"


WORLD = 4  # one set of 4 warm ranks; TP 1, 2 and 4 run as tensor-parallel groups inside it


def run_block(tp, **params):
    """One forward + backward of the block split over ``tp`` ranks (or ``steps`` optimizer steps of a GPT made of it).

    The 4 ranks form 4/tp independent tensor-parallel groups, each running the whole block (or GPT); ``compare``
    and ``compare_training`` rebuild and check every group.
    """
    res = cu.run(BLOCK, world_size=WORLD, tp=tp, seq=SEQ, batch=BATCH, hidden=HIDDEN, **LIMITS, **params)
    return res, tp_check.config_of(res[0]["config"])


# %% [markdown]
# ## 1. The block equals the dense block
#
# The dense reference (`DenseBlock`: LayerNorm, attention with a fused QKV, LayerNorm, GeLU MLP, both
# residuals) is built from one seed on every rank; each rank keeps its shard with `ParallelBlock.from_dense`.
# TP 1, 2 and 4 run on one set of 4 ranks, split into tensor-parallel groups of 1, 2 or 4 ranks, each group a
# complete block of its own (and each checked).
# Its LayerNorm weights are moved away from 1 and 0, so that a wrong LayerNorm gradient cannot hide.
# We compare the output, the input gradient and the gradients of all 12 parameters at TP 1, 2 and 4, with
# and without sequence parallelism.
#
# **Predict**: with sequence parallelism, which parameters' gradients need an all-reduce that they did not
# need without it?

# %%
equivalence = {}
for t in (1, 2, 4):
    for sp in (False, True):
        res, cfg = run_block(t, sequence_parallel=sp)
        equivalence[(t, sp)] = (res, tp_check.compare(res, "block", cfg, seq=SEQ, batch=BATCH))
        print(f"TP {t}{' + SP' if sp else '     '}: {equivalence[(t, sp)][1].verdict()}")

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_figures.equivalence_figure({f"TP {t}{' SP' if sp else ''}": rep for (t, sp), (_, rep) in
                                             equivalence.items() if t > 1},
                                            "Megatron block vs dense block: every tensor"), "06_equivalence");

# %% [markdown]
# Every tensor of the block (output, input gradient, the gradient of every weight, bias and LayerNorm
# parameter) at TP 2 and 4, with and without SP: all errors are float32 rounding against the float64 dense
# block, well inside the tolerance.

# %% [markdown]
# The replicated parameters (both LayerNorms, the two output-projection biases) must end with the same
# gradient on every rank. Without SP that is automatic: they act on the replicated tensor. With SP each
# rank sees only its own rows, so each gradient is a partial sum; the block routes these parameters
# through `f` as well, and the all-reduce in its backward sums the partial gradients.

# %%
replicated = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attention.proj.bias", "mlp.fc2.bias"]
for sp in (False, True):
    res = equivalence[(4, sp)][0]
    same = all(torch.equal(d["grads"][n]["value"], res[0]["grads"][n]["value"]) for d in res.ranks for n in replicated)
    print(f"TP 4{' + SP' if sp else ''}: replicated parameters have bit-identical gradients on all ranks: {same}")
res_nosync, cfg = run_block(2, sequence_parallel=True, fault="skip_parameter_grad_sync")
print("SP without summing those gradients:", tp_check.compare(res_nosync, "block", cfg, seq=SEQ, batch=BATCH).verdict())

# %% [markdown]
# ## 2. What crosses the wire
#
# **Predict** for TP 4, b = 2, s = 8, h = 32 in float32: how many collectives per step, of which kinds,
# and how many bytes does one rank send in total? Then with sequence parallelism.

# %%
for sp in (False, True):
    res = equivalence[(4, sp)][0]
    print(f"TP 4{' + SP' if sp else ''}, activations:")
    for row in tp_check.comm_rows(res):
        print(f"   {row['scope']:<16} {row['collective']:<15} {row['pass']:<9} message {row['message_bytes']} B, "
              f"sent {row['wire_bytes']:.0f} B")
    params = tp_check.comm_rows(res, kind="parameter")
    print(f"   total sent per rank: {tp_check.comm_wire_bytes(res):.0f} B"
          + (f"; plus {sum(r['calls'] for r in params)} small gradient all-reduces of replicated parameters "
             f"({sum(r['message_bytes'] for r in params)} B)" if params else ""))
expected = tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, 4, bytes_per_element=4)
print(f"formula: {expected.all_reduces} all-reduces x 2(t-1)/t x b*s*h*4 B = {expected.total_wire_bytes:.0f} B")

# %% [markdown]
# Four all-reduces without SP; with SP, two all-gathers and two reduce-scatters in each direction, each
# moving 3/4 of a `b*s*h` message, half of what one all-reduce sends: the same 12288 bytes in total. What SP
# buys is memory. Korthikanti et al.'s count of the activations one layer keeps for backward (Table 2,
# 16-bit activations) for GPT-3 175B's layer (h = 12288, 96 heads, s = 2048, b = 1) at t = 8:

# %%
for sp in (False, True):
    for recompute in ("none", "selective"):
        gib = activation_bytes_per_layer(2048, 1, 12288, 96, tp=8, sequence_parallel=sp, recompute=recompute) / 2**30
        print(f"TP 8, sequence parallel {str(sp):<5}, recompute {recompute:<9}: {gib:.3f} GiB per layer")

# %% [markdown]
# Those are the paper's counts. We can measure the same quantity on our block, here on the CPU: every tensor
# autograd saves for the backward passes through `torch.autograd.graph.saved_tensors_hooks`
# (`workers/parallel/activations.py: saved_for_backward`). Each is counted with its own bytes, once (the same
# memory saved under two shapes counts once), without the parameters (a weight saved for the input
# gradient is not an activation), and labelled with the submodule that saved it. `recompute=True` runs the
# block under `torch.utils.checkpoint`: **full recomputation** (Korthikanti et al., section 5), which keeps
# only the block's input and runs the forward again during the backward.
#
# The block is the chapter's (no dropout), in float32, at s = 128, b = 2, h = 64, a = 4 heads, so that
# $5as/h = 40$ weighs as much as the 34. Korthikanti's terms are written for 16-bit activations ("2sbh" is
# $sbh$ elements of 2 bytes) and 1-byte dropout masks; in float32 every activation term doubles and a mask
# stays one byte. **Predict**: which of the paper's terms can this block not have? What does full
# recomputation keep, in bytes?

# %%
from workers.parallel.activations import recompute_gradient_error, saved_for_backward

S_MEM, B_MEM, H_MEM, A_MEM = 128, 2, 64, 4
mem_block = tp_check.D.build("block", tp_check.D.BlockConfig(hidden=H_MEM, heads=A_MEM), seed=0)  # float32
x_mem = torch.randn(S_MEM, B_MEM, H_MEM, generator=torch.Generator().manual_seed(0), requires_grad=True)
saved = {"math attention": saved_for_backward(mem_block, x_mem, math_attention=True),
         "default kernel": saved_for_backward(mem_block, x_mem),
         "full recompute": saved_for_backward(mem_block, x_mem, recompute=True)}
mem_terms = tp_check.activation_terms(S_MEM, B_MEM, H_MEM, A_MEM, bytes_per_element=4,
                                      hidden_dropout=False, attention_dropout=False)
print("bytes saved for backward, by the submodule that saved them:")
print(tp_check.activation_table(mem_terms, {k: v["by_segment"] for k, v in saved.items()}))

# %%
sbh = S_MEM * B_MEM * H_MEM
every_term = tp_check.activation_terms(S_MEM, B_MEM, H_MEM, A_MEM, bytes_per_element=4)
for label, nbytes in [("Korthikanti, sbh(34 + 5as/h), 16-bit", activation_bytes_per_layer(S_MEM, B_MEM, H_MEM, A_MEM)),
                      ("the same terms in float32, sbh(66 + 9as/h)", sum(t["bytes"] for t in every_term)),
                      ("the terms that apply here, sbh(64 + 4as/h)", sum(t["bytes"] for t in mem_terms if t["applies"]))] + \
        [(f"measured, {name}", r["total_bytes"]) for name, r in saved.items()]:
    print(f"{label:<46}{nbytes:>12,.0f} B = {nbytes / sbh:6.2f} sbh bytes")
print("full recompute keeps exactly the block's input:", saved["full recompute"]["total_bytes"] == x_mem.numel() * 4)
print("same gradients with and without recompute:", recompute_gradient_error(mem_block, x_mem) < 1e-6)
for name in ("math attention", "default kernel"):
    print(f"{name}, tensors saved inside attention:",
          [(t["shape"], t["dtype"]) + (() if t["counted"] else ("same memory",)) for t in saved[name]["tensors"]
           if t["segment"] == "attention"])
drop_block = tp_check.D.build("block", tp_check.D.BlockConfig(hidden=H_MEM, heads=A_MEM, hidden_dropout=0.1), seed=0)
extra = saved_for_backward(drop_block, x_mem)["total_bytes"] - saved["default kernel"]["total_bytes"]
print(f"the same block with hidden_dropout=0.1 saves {extra:,} B more = {extra / sbh:g} sbh: two bool masks")

# %% [markdown]
# Term by term (the table's rows):
#
# * **Every 16-bit activation term applies, doubled.** LayerNorm inputs, the QKV input, Q and K, V, the output
#   projection's input, fc1's input, GeLU's input and fc2's input: the paper's $32sbh$ bytes are $16\,sbh$
#   elements, $64\,sbh = 1{,}048{,}576$ bytes in float32, and each row matches to the byte.
# * **Dropout: no term applies.** The chapter's block runs with `hidden_dropout=0`, and our attention has no
#   dropout on its probabilities. So the two $sbh$ masks (after attention and after the MLP), the $as^2b$
#   softmax-dropout mask and the $2as^2b$ dropout output are all absent: of $34 + 5as/h$, what remains is
#   $32 + 2as/h$ in 16-bit terms, $64 + 4as/h$ in float32. The last line puts a dropout of 0.1 back: exactly
#   $2sbh$ bytes more, the two 1-byte (`bool`) masks of the formula.
# * **LayerNorm's statistics are extra.** Each LayerNorm also keeps a mean and a $1/\sigma$ per token,
#   $2sb$ floats: $4 \times 256 \times 4 = 4{,}096$ bytes for the two, the $+2{,}048$ in each `ln` row. The
#   paper leaves them out ($1/h$ of the input's size).
# * **Math attention** (PyTorch's reference path, forced with `sdpa_kernel`) keeps the softmax output,
#   $as^2b$ elements, $4 \times 131{,}072 = 524{,}288$ bytes: the paper's $2as^2b$, doubled. Softmax saves it
#   for its own backward and $P\cdot V$ saves it again as `[b*a, s, s]`: one memory, counted once. Measured
#   total: the applicable terms plus the LayerNorm statistics, exactly.
# * **The default CPU kernel** (a flash-attention kernel, as on a GPU) keeps **no** $s \times s$ tensor: Q, K,
#   V, its output (which the output projection's input merely views: the `attention.proj` row is 0) and
#   a log-sum-exp per row, $b \cdot a \cdot s$ floats ($4{,}096$ bytes). The whole $5as/h$ term is gone,
#   which is what Korthikanti's *selective* recomputation buys by recomputing the softmax (section 5): the
#   kernel recomputes the probabilities in its backward.
# * **Full recomputation** keeps only the block's input, $sbh$ elements: $2sbh$ bytes in 16-bit, $4sbh =
#   65{,}536$ bytes here, 16x less than the default kernel; the price is a second forward inside the
#   backward (about a third more compute per step), and the gradients are the same.
#
# On a GPU the same count is what CUDA memory holds: `tools/gpu/tp_block_bench.py` measures it with the CUDA
# allocator in bf16, with and without full recomputation, next to these formulas, and section 5 shows its
# table once a run is committed.

# %% [markdown]
# ## 3. Training the GPT made of these blocks
#
# Equal gradients at one point do not yet prove that training is the same: the optimizer must also update
# every shard as the dense optimizer would update the corresponding slice. Adam is elementwise, so it
# should. So we train the course's GPT (`workers/model/gpt.py`), made of two of these blocks: token and position
# embeddings, two pre-LN layers of this chapter's shape, a final LayerNorm and an LM head tied to the embedding.
# `ParallelGPT` (`workers/parallel/gpt.py`) cuts each layer with `ParallelBlock.from_dense` and keeps the
# embedding, the final LayerNorm and the head whole on every rank (with sequence parallelism it gathers the rows
# before the head). Its biases are random and its LayerNorms moved away from 1 and 0, so that a wrong gradient
# anywhere would show.
#
# Four Adam steps on the next-token cross-entropy of one fixed batch of random tokens, whose samples have different
# numbers of valid tokens (the loss is the mean over the valid tokens of the whole batch), from the same weights on
# every rank, against the same GPT trained in float64 in this process. We compare the loss of every step, and every
# parameter after the last step, relative to its tensor's largest entry.

# %%
STEPS, LR = 4, 1e-3
training = {}
for t, sp in ((1, False), (2, False), (4, False), (4, True)):
    res, cfg = run_block(t, steps=STEPS, lr=LR, sequence_parallel=sp)
    run = tp_check.compare_training(res, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=LR)
    training[f"TP {t}{' + SP' if sp else ''}"] = run.losses[0]
    print(f"TP {t}{' + SP' if sp else '     '}: {run.verdict()}; all ranks report the same losses: {run.ranks_agree}")
# 3 decimals: the float64 reference's losses move by ~1e-8 with the CPU's kernels (AVX-512, AVX2, plain)
print("losses of the GPT in one process:", [round(v, 3) for v in run.dense_losses])

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_figures.training_figure(run.dense_losses, training), "06_training");
print(f"largest differences (they vary with the CPU): losses {run.loss_error:.1e} relative, "
      f"parameters {run.worst[1]:.1e} of their largest entry ({run.worst[0]})")

# %% [markdown]
# The loss curves of the one-process GPT and of every TP layout lie on top of each other, and so do the parameters
# after the last step: the parallel GPT is still the same model after four Adam steps, not just the same function
# at initialisation. The largest parameter difference is in the fused QKV bias, and it is Adam, not the layout:
# the key bias has a gradient that is exactly zero in exact arithmetic (adding it shifts every score of a query's
# row by the same amount, which softmax ignores), so what it gets is rounding noise, which Adam divides by its own
# size and turns into a real step. In float32 that noise (about 1e-9) is not small against Adam's eps of 1e-8; in
# the float64 reference (about 1e-17) it is. Hence the tolerance: each parameter within 5e-3 of its largest entry.
#
# A broken collective does not hide in training either. With sequence parallelism, forget to sum the replicated
# parameters' gradients over the ranks (the fault of section 1): the first loss is still right, since the forward
# is, and then the ranks step away from the one-process GPT.

# %%
res_fault, cfg = run_block(2, steps=STEPS, lr=LR, sequence_parallel=True, fault="skip_parameter_grad_sync")
broken = tp_check.compare_training(res_fault, cfg, seq=SEQ, batch=BATCH, steps=STEPS, lr=LR)
first = max(abs(got[0] - broken.dense_losses[0]) / broken.dense_losses[0] for got in broken.losses)
print(f"SP without summing those gradients: first loss within {tp_check.LOSS_RTOL:g}: {first <= tp_check.LOSS_RTOL}; "
      f"trains like the GPT in one process: {broken.ok}")

# %% [markdown]
# ## 4. Where the time goes
#
# The FLOPs of one layer's forward (Narayanan et al. 2021, [arXiv:2104.04473](https://arxiv.org/abs/2104.04473):
# the per-GEMM count of its appendix on floating-point operations, whose total section 5.1 uses; a multiply-add
# is 2 FLOPs): QKV $6bsh^2$, scores $QK^\top$ $2bs^2h$, $PV$ $2bs^2h$,
# output projection $2bsh^2$, MLP $16bsh^2$; in total $24bsh^2 + 4bs^2h$. Attention's share is
# $(8bsh^2 + 4bs^2h)/(24bsh^2 + 4bs^2h) = (2h + s)/(6h + s)$: a third for short sequences, growing with s.
#
# `workers/ch06_profile.py` times each stage of the block's forward (with `time.perf_counter` on a CPU,
# CUDA events on a GPU), the communication inside attention and the MLP separately (the communication
# ledger's markers), and the backward as a whole. **CPU caveats**: the ranks share this machine's two
# cores (and other jobs), so ranks slow each other down and an all-reduce waits for the slowest rank;
# a CPU runs matmuls slowly relative to memory-bound work, so shares differ from a GPU's. The method is
# the one you would use on a GPU; these numbers are CPU numbers.
#
# **Predict**: at h = 128, what share of the forward time is attention at s = 64, and at s = 1024?

# %% tags=["nbval-ignore-output"]
SEQS, PROF_HIDDEN = [64, 256, 1024], 128
trace_dir = str(scratch_dir("06_traces"))  # build/scratch/06_traces: this run's trace files only
# 2 ranks, one per core: at TP 1 each rank runs its own block, at TP 2 they share one
profiles = {t: cu.run("workers.ch06_profile", world_size=2, tp=t, hidden=PROF_HIDDEN, heads=8, seqs=SEQS,
                      batch=2, repeats=5, warmup=2, trace_dir=trace_dir if t == 2 else "", **LIMITS)[0]["profiles"]
            for t in (1, 2)}
for t, profs in profiles.items():
    for p in profs:
        print(f"TP {t}, s={p['seq']:>5}: forward {p['forward_s'] * 1e3:6.1f} ms, backward {p['backward_s'] * 1e3:6.1f} ms; "
              "shares " + ", ".join(f"{k} {v:.0%}" for k, v in p["forward_share"].items()))
print("torch.profiler traces (open in chrome://tracing or https://ui.perfetto.dev):",
      sorted({os.path.relpath(p["trace"], paths.ROOT) for p in profiles[2]}))

# %% tags=["nbval-ignore-output"]
one = profiles[1][-1]
flops = tp_check.layer_forward_flops(one["seq"], PROF_HIDDEN, 2)
predicted = {"attention": flops["attention"] / flops["total"], "mlp": flops["mlp"] / flops["total"]}
plots.savefig(tp_figures.profile_figure(one, predicted, f"TP 1, h={PROF_HIDDEN}, s={one['seq']}, CPU"), "06_profile");

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_figures.attention_share_figure(SEQS, [p["forward_share"]["attention"] /
                                                       (p["forward_share"]["attention"] + p["forward_share"]["mlp"])
                                                       for p in profiles[1]], PROF_HIDDEN), "06_attention_share");

# %% [markdown]
# The measured attention share (of attention + MLP compute time, TP 1) follows the FLOPs share's trend: the
# $s^2$ terms take over as the sequence grows. Where it departs from the FLOPs line, the cause is the
# kernels, not the arithmetic: on this CPU the small attention matmuls and the softmax run at a different
# efficiency from the big MLP matmuls. At TP 2 (the lines printed above) communication takes a large share of
# each pass: two processes on two shared cores, with gloo over the loopback, is the worst case for communication;
# on NVLink the same bytes take microseconds (chapter 00's bandwidth tiers; chapter 10 models NCCL's time).
#
# ## 5. On a GPU
#
# The same block at TP 1 on one H200, bf16, h = 4096, 32 heads, s = 1024 and 4096, next to a plain
# PyTorch pre-LN block of the same shape and a bf16 matmul (`tools/gpu/tp_block_bench.py`). The notebook
# shows a GPU run only from a file committed in `data/gpu/`, labelled with its device, versions and date:

# %%
gpu_runs = tp_figures.gpu_results()
if gpu_runs:
    print(tp_figures.gpu_table(gpu_runs[0]))
    for i, fig in enumerate(tp_figures.gpu_profile_figures(gpu_runs[0])):  # CUDA events, same segments as above
        plots.savefig(fig, f"06_profile_gpu_{i}")
else:
    print("Not measured on a GPU yet: no data/gpu/tp_block_*.json in this repository. A session with an H200 runs\n"
          "  python tools/gpu/tp_block_bench.py --profile --out data/gpu/tp_block_h200.json\n"
          "and commits the file; this cell then shows it.\n")
    ref = reference_data.load("h200_block_fp8_baseline")
    print("For orientation only, a plain PyTorch block (not the course's), one earlier run on "
          + reference_data.label(ref) + ":")
    print(reference_data.block_baseline_table(ref))

# %% [markdown]
# ## 6. Hiding TP's communication behind the matmuls
#
# With sequence parallelism each sub-layer opens with an all-gather and closes with a reduce-scatter, and in
# between each side waits for the other: the column-parallel matmul cannot start before the all-gather has brought
# every rank's rows, and the reduce-scatter cannot start before the row-parallel matmul has finished. Section 4 found
# that communication takes a large share of each pass; on a GPU, the SMs sit idle while those bytes move.
#
# Wang et al. 2023 (*Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
# Models*, ASPLOS 2023, [doi:10.1145/3567955.3567959](https://doi.org/10.1145/3567955.3567959)) notice that the
# dependence holds only block by block. Row block $j$ of $\mathrm{AllGather}(x)\,W$ needs only rank $j$'s shard of
# $x$, so the all-gather can be cut into $t$ steps around a ring: at each step every rank sends the shard it holds to
# its right neighbour, receives the next one from its left, and **meanwhile multiplies the shard it holds**. After $t$
# steps every rank has multiplied every shard: the same product, with $t-1$ transfers running under $t$ matmul chunks.
# The reduce-scatter after the row-parallel matmul is cut the same way: each rank computes its addend for one block
# of rows, adds the running sum of that block that arrived from its left, and sends it on while it computes the next
# block's addend; after $t$ steps every block has collected every rank's addend and stopped at the rank that keeps it.
# (The paper's ring steps are CollectivePermutes, and it also runs two rings in opposite directions at once; ours
# turns one way.)
#
# The two rings are conjugates, like `f` and `g`: the backward of the all-gather ring is a reduce-scatter ring of
# the input gradient, and the backward of the reduce-scatter ring is an all-gather ring of the output gradient.
# `workers/parallel/collective_matmul.py` has both (`all_gather_matmul`, `matmul_reduce_scatter`), and its
# `decomposed_mlp` is the sequence-parallel MLP with both collectives cut into rings.
# `workers/ch06_collective_matmul.py` runs one forward and backward of that MLP three ways: **blocking** (the MLP of
# sections 1-3, whole collectives), **decomposed** (the rings, each transfer running while a chunk multiplies) and
# **serialized** (the same rings, each transfer waited for as soon as it is posted: the decomposition without the
# overlap).
#
# First: is it still the same computation? In float64, so that only the order of the sums can differ.

# %%
from course_utils import tp_overlap

OVERLAP = "workers.ch06_collective_matmul"
overlap_runs = {t: cu.run(OVERLAP, world_size=WORLD, tp=t, seq=SEQ, batch=BATCH, hidden=HIDDEN, **LIMITS)
                for t in (2, 4)}
for res in overlap_runs.values():
    print("\n".join(tp_overlap.equality_lines(res)))

# %% [markdown]
# Every tensor, at TP 2 (two groups of 2 in the 4 ranks) and TP 4, equals the dense MLP and the blocking collectives
# to within $10^{-12}$; the errors are around $10^{-15}$, float64 rounding of sums taken in another order, while a
# block lost or counted twice would miss by about 1.
#
# **Predict**: at TP 4, how many transfers does one ring make, and does it send more bytes per rank than the
# all-gather it replaces, or fewer?

# %%
print(tp_overlap.ring_table(overlap_runs[4]))
mlp_bytes = 2 * tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, 4, bytes_per_element=8).wire_bytes_per_all_reduce
print(f"the four rings together: {sum(r['sent'] for r in tp_overlap.ring_rows(overlap_runs[4][0])):,} B per rank; "
      f"section 2's count for the MLP (one all-reduce's bytes forward, one backward): {mlp_bytes:,.0f} B")

# %% [markdown]
# Each ring multiplies $t$ chunks and makes $t-1$ transfers: a rank already holds its own shard (all-gather), and
# keeps its own block (reduce-scatter). Each transfer carries one block of $s/t$ rows, so a ring sends $(t-1)/t$ of
# the $[s, b, h]$ activation per rank: exactly what the ring all-gather or reduce-scatter it replaces sends.
# Decomposing changes *when* the bytes move, not how many.
#
# Does it pay? The same MLP in float32 at s = 512, h = 512, b = 1 on 2 ranks, three runs. In each, every mode runs
# one step with its timeline recorded, then two timed steps (the modes take turns, so that a burst of load on the
# shared cores falls on all three), then one more recorded step. **Predict**: on this machine, which mode has the
# shortest step?

# %% tags=["nbval-ignore-output"]
TIMED = {"seq": 512, "batch": 1, "hidden": 512, "dtype": "float32", "repeats": 2}
timed_runs = [cu.run(OVERLAP, world_size=2, **TIMED, **LIMITS)
              for _ in cu.each(range(3), "timed run", lambda i: "blocking, decomposed, serialized")]
print(tp_overlap.timing_table(timed_runs))
print(tp_overlap.chunks_line(timed_runs))

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_overlap.timeline_figure(tp_overlap.run_timelines(tp_overlap.typical_run(timed_runs)),
                                         "one step of the sequence-parallel MLP, TP 2, s = h = 512, float32"),
              "06_overlap_timeline");

# %% [markdown]
# In the decomposed step, every chunk but the last of each ring (outlined) multiplies while a transfer is in flight
# (the line in its ring's colour above its row), and the waits that follow are short: its exposed wait is far below
# the blocking and serialized steps'. **The step gains little.** Compare each step with the blocking step of the
# same round (the `vs blocking` column): the decomposed step is at most a little shorter, by less than the spread
# of the steps. On this machine a gloo transfer is a memory copy made by the CPU (through the loopback network
# stack), on the same two cores that multiply: overlap can hide the time a rank spends
# waiting for the other to arrive (each ring step and each collective is a rendezvous), not the copy itself, which
# still takes the cores' time. The line under the table compares the chunks multiplied during a transfer with the
# same chunks multiplied alone, in the serialized step: when the cores are busy, the copy can slow the chunks that
# run beside it. All these numbers vary from run to run and from machine to machine.
#
# On a GPU the transfer runs on hardware that does not multiply: NVLink and the GPU's copy engines move a peer's
# shard while the SMs run the GEMM, so hidden time is saved time, as long as each chunk's matmul lasts as long as its
# transfer and the chunks stay large enough for the GEMMs to stay efficient. PyTorch's **async TP** does this:
# `torch.ops.symm_mem.fused_all_gather_matmul` and `fused_matmul_reduce_scatter`
# (`torch/distributed/_symmetric_memory/__init__.py`), which the Inductor pass
# `torch/_inductor/fx_passes/micro_pipeline_tp.py` puts into a compiled graph when
# `torch._inductor.config._micro_pipeline_tp = True`; torchtitan turns it on with
# `--parallelism.enable_async_tensor_parallel` together with `--compile.enable`
# (`torchtitan/distributed/tensor_parallel.py: maybe_enable_async_tp`). It is built on **symmetric memory**: a
# buffer that every GPU of the group maps, so a rank copies a peer's shard straight out of the peer's memory (flags
# in the same memory serve as barriers), and the copies and the matmuls alternate between two CUDA streams. Its order
# is not a ring: inside an NVLink node every GPU reaches every other directly, so at step $k$ rank $r$ reads the shard
# of rank $r + k$. These ops exist for CUDA only, so nothing in this chapter runs them. The PyTorch team reports up to
# ~20% faster forward passes and ~8% faster training steps for Llama 3 70B with async TP in torchtitan
# ([the announcement](https://discuss.pytorch.org/t/distributed-w-torchtitan-introducing-async-tensor-parallelism-in-pytorch/209487)).
#
# Chapter 00's planner prices this as `Practice(tp_overlap=True)`: each TP collective hides under the GEMMs of the
# layer it belongs to, up to their time, and one ring step ($1/t$ of the collective) stays exposed. One layer of
# Llama 3 70B's shape, TP 8 with SP inside one node of H100s, one micro-batch of 8192 tokens:

# %%
print(tp_overlap.planner_table("llama-3-70b", tp=8, seq=8192, cluster="h100-ib"))

# %% [markdown]
# The layer's collectives take a fraction of its GEMM time, so all but the last ring step of each hides: the TP time
# per layer falls to $1/8$, and the step's TP term with it (the last two columns). That is the planner's model of the
# step, not a measurement: the ~8% that the PyTorch team measured end to end for Llama 3 70B is the number to hold it
# against.

# %% [markdown]
# ## 7. Exercises
#
# **Exercise 1: the block's two all-reduces.** `parts` holds this rank's pieces of the block, with no
# communication inside: `parts.ln1(x)`, `parts.ln2(x)` (the LayerNorms), `parts.attention_partial(y)` and
# `parts.mlp_partial(y)` (this rank's heads / FFN columns applied to `y`: one addend of the sub-layer's
# output, bias not added), and `parts.attention_bias`, `parts.mlp_bias` (whole on every rank). Write the
# block's forward with `f` and `g` where they belong:
# `from workers.parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region`.
# The check runs forward and backward on real ranks and compares every gradient with the dense block's.

# %% tags=["exercise"]
def block_forward(x, parts, group):
    raise NotImplementedError

# %% tags=["check"]
cu.check("block_forward", block_forward)

# %% [markdown]
# **Exercise 2: attention's share of the FLOPs.** Return the fraction of one layer's forward FLOPs spent
# in the attention sub-layer (QKV, scores, $PV$, output projection), for sequence length `seq` and hidden
# size `hidden`, with a 4h MLP and no causal saving.

# %% tags=["exercise"]
def attention_flop_share(seq, hidden):
    raise NotImplementedError

# %% tags=["check"]
cu.check("attention_flop_share", attention_flop_share)

# %% [markdown]
# **Exercise 3: the order of the rings.** In `workers/parallel/collective_matmul.py` the TP group is a ring: at
# every step each rank sends one block to rank $r + 1$ and receives one from rank $r - 1$ (mod $t$). Write
# `collective_matmul_blocks(rank, tp, step)`, for steps 0 to tp - 1, returning a pair:
#
# * the rank whose sequence shard `rank` multiplies at that step of the **all-gather** ring, and
# * the block of rows whose partial sum `rank` computes at that step of the **reduce-scatter** ring: it adds its
#   addend to the running sum of that block that arrived from its left and sends the sum on to its right; at the
#   last step nothing is sent, and the block it completes is the one it keeps.
#
# The check tries every rank and every step at several TP sizes.

# %% tags=["exercise"]
def collective_matmul_blocks(rank, tp, step):
    raise NotImplementedError

# %% tags=["check"]
cu.check("collective_matmul_blocks", collective_matmul_blocks)

# %% [markdown]
# ## 8. Explore on real ranks
#
# TP size, sequence parallelism and a fault: the widget reruns the block on real ranks and draws every
# tensor's error against the dense block, with the collectives it counted.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider


def draw_block(res, params):
    cfg = tp_check.config_of(res[0]["config"])
    rep = tp_check.compare(res, "block", cfg, seq=SEQ, batch=BATCH)
    counts = {}
    for r in tp_check.comm_rows(res):
        counts[f"{r['collective']} {r['pass']}"] = counts.get(f"{r['collective']} {r['pass']}", 0) + r["calls"]
    tp = params["tp"]
    calls = ", ".join(f"{n} {name.replace('_', '-')}" for name, n in counts.items()) or "no communication"
    title = f"TP {tp}{' + SP' if params['sequence_parallel'] else ''}, {params['fault'] or 'no fault'}: {calls}"
    return tp_figures.equivalence_figure({f"TP {tp}": rep}, title)


block_live = LiveRun(BLOCK, {"tp": slider("TP", 4, 1, 4),
                             "sequence_parallel": W.Checkbox(value=True, description="sequence parallel"),
                             "fault": W.Dropdown(options=["", "drop_reduce_scatter", "skip_parameter_grad_sync",
                                                          "drop_backward_all_reduce", "misplaced_all_reduce"],
                                                 value="", description="fault")},
                     draw_block, params={"world_size": WORLD, "seq": SEQ, "batch": BATCH, "hidden": HIDDEN},
                     timeout=90)
block_live.wait(90)
block_live

# %% [markdown]
# The overlap: TP size and hidden size. Each change runs the three modes again on warm ranks (float32, s = 512, one
# timed step of each) and draws their timelines, with each mode's step time. A chunk's matmul grows with $h^2$ while
# its transfer grows with $h$ (per row, $2 \cdot 4h/t$ FLOPs of fc1 for every element sent), so a larger $h$ gives
# each transfer more compute to hide under, and a larger $t$ less.

# %% tags=["nbval-ignore-output"]
overlap_live = LiveRun(OVERLAP, {"tp": W.Dropdown(options=[2, 4], value=2, description="TP"),
                                    "hidden": slider("hidden", 512, 128, 512, 128)},
                       tp_overlap.live_figure, params={"seq": 512, "batch": 1, "dtype": "float32", "repeats": 1},
                       derive=lambda s: {"world_size": s["tp"]}, timeout=90)
overlap_live.wait(90)
overlap_live

# %% [markdown]
# ## Summary
#
# * A Megatron layer is two parallel regions, each opened by `f` and closed by `g`: 2 all-reduces forward,
#   2 backward, each of a `b*s*h` activation; the replicated parameters get identical gradients for free.
# * Sequence parallelism replaces each all-reduce by a reduce-scatter and an all-gather of the same bytes,
#   and shards the LayerNorm/dropout region; its replicated parameters then need their gradients summed.
# * A GPT made of the sharded blocks trains like the same GPT in one process: the same losses step after step,
#   the same parameters after the last step (within float32 rounding, which Adam amplifies only where a gradient
#   is pure noise).
# * Attention's share of the FLOPs is $(2h+s)/(6h+s)$; measured shares follow it where the kernels are
#   equally efficient, and a profile is what tells you where they are not.
# * Collective matmul cuts TP's all-gather and reduce-scatter into $t-1$ ring transfers of one block each (the same
#   bytes), each running while a block multiplies: the same results to float64 rounding, and the waits shrink. It
#   pays where the transfer runs on hardware that does not multiply (NVLink and copy engines: PyTorch's async TP); on
#   CPU ranks, whose copies share the cores, the waits shrink but the step barely does.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
