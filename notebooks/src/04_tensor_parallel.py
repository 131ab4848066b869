# %% [markdown]
# # 04 · Tensor parallelism 101: column, row, and the Megatron MLP
#
# Data parallelism (chapter 02) copies the whole model onto every rank. That stops working when one
# layer's weights, gradients and optimizer state no longer fit on one GPU, or when one layer's matmuls
# are too slow for one GPU. **Tensor parallelism** splits the *matrices themselves* over t ranks: each
# rank stores 1/t of a weight and does 1/t of its FLOPs. The price is that communication becomes part of
# the layer's arithmetic: partial results must be summed or gathered *inside* the forward and backward
# passes, on the critical path.
#
# This chapter builds the two ways to split one matmul, the Megatron MLP that combines them with one
# all-reduce each way, and proves on real ranks that the sharded model is the **same function with the
# same gradients** as the dense one. Then we count exactly what crosses the wire. Last, the model's two ends,
# where the matrices are split by words: the embedding, the LM head, and a loss computed from logits that no
# rank ever holds whole.
#
# Sources: Shoeybi et al., *Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
# Parallelism*, 2019 ([arXiv:1909.08053](https://arxiv.org/abs/1909.08053)), section 3 and Figure 3.
# The code follows `megatron/core/tensor_parallel/layers.py` in vocabulary: `ColumnParallelLinear(...,
# gather_output=...)`, `RowParallelLinear(..., input_is_parallel=...)`.
#
# The library you will read and extend lives in `workers/parallel/`: `layers.py` (the two layers),
# `mlp.py`, `vocab.py` (the two ends), and the communication regions `f` and `g` from chapter 03 (`mappings.py`).

# %%
import torch
import torch.nn.functional as F

import course_utils as cu
from course_utils import plots, tp_check, tp_figures, tp_viz, tp_vocab
from course_utils.ledger import tp_comm_bytes_per_layer

plots.style()
LIMITS = {"timeout": 60}  # per run; the ranks stay warm between runs (and the exercise checks reuse them)
SEQ, BATCH, HIDDEN = 4, 2, 16  # small enough to print, big enough that a wrong sum cannot hide
LAYERS = "workers.ch04_tp_layers"
VOCAB = "workers.ch04_vocab_parallel"  # section 6: the embedding, the LM head and the loss split by vocabulary


WORLD = 4  # one set of 4 warm ranks; TP 1, 2 and 4 run as tensor-parallel groups inside it


def run_layer(tp, **params):
    """One forward + backward of a sharded module at tensor-parallel size ``tp``, and its comparison with the dense one.

    The 4 ranks form 4/tp independent groups ([0], [1], [2], [3] at TP 1; [0, 1], [2, 3] at TP 2; all four at
    TP 4), each running the whole module; ``compare`` rebuilds and checks every group.
    """
    res = cu.run(LAYERS, world_size=WORLD, tp=tp, seq=SEQ, batch=BATCH, hidden=HIDDEN, **LIMITS, **params)
    cfg = tp_check.config_of(res[0]["config"])
    return res, tp_check.compare(res, params.get("module", "mlp"), cfg, seq=SEQ, batch=BATCH)


# %% [markdown]
# ## 1. One matmul, two ways to split it
#
# A linear layer computes $Y = XA + b$ with $X$ of shape $[s, b, h_{in}]$ and $A$ of shape $[h_{in},
# h_{out}]$ (PyTorch stores $A^\top$: `weight` is `[out, in]`). There are two natural cuts.
#
# **Column parallel**: $A = [A_1, A_2, \dots, A_t]$, each rank holds $h_{out}/t$ output columns and
# computes $Y_r = X A_r + b_r$: its own slice of the output, with no communication at all in the
# forward pass. But look at the backward: every rank's $Y_r$ depends on *all* of $X$, so
# $\partial L/\partial X = \sum_r \partial L/\partial Y_r \, A_r^\top$, a sum over ranks. That is why $X$
# enters through `f` (chapter 03): identity forward, all-reduce backward.
#
# **Row parallel**: $A = [A_1; A_2; \dots; A_t]$ split by input rows, $X = [X_1, \dots, X_t]$ split by
# columns to match. Each rank computes a *partial sum* $X_r A_r$ of the whole output; the output is
# $\sum_r X_r A_r + b$, so the partial sums go through `g`: all-reduce forward, identity backward.
# And the bias? It must be added **once**, after the sum. Added on every rank before the all-reduce, the
# sum would contain it t times.
#
# **Predict**: with `Linear(16, 64)` split by columns over 4 ranks, what shape is rank 2's weight shard,
# and what shape is its output for an input of shape `[4, 2, 16]`?

# %%
res_col, rep_col = run_layer(4, module="column")
for r, d in enumerate(res_col.ranks):
    print(f"rank {r}: weight shard {tuple(d['grads']['weight']['value'].shape)} = rows "
          f"{d['grads']['weight']['index'][0].item()}..{d['grads']['weight']['index'][-1].item()} of the dense "
          f"[64, 16]; output {tuple(d['output']['value'].shape)}")
print(rep_col.verdict())

# %% [markdown]
# `compare` puts the ranks' pieces back together (each rank sends its shard of every tensor with the
# indices of the dense entries it holds) and measures them against the dense layer computed here, in one
# process, in float64. "Equal" means every entry of the output, the input gradient and each parameter
# gradient is within $10^{-5} + 10^{-5}|x|$: float32 on the ranks, summed in a different order.
#
# The column-parallel output stays split, which is what the next (row-parallel) layer wants. When the
# whole output is needed on every rank instead (a final projection, say), `gather_output=True` adds an
# all-gather along the last dimension, and its backward keeps only this rank's slice of the gradient:

# %%
res_gather, rep_gather = run_layer(4, module="column", gather_output=True)
print(f"output on rank 0: {tuple(res_gather[0]['output']['value'].shape)} (the whole [4, 2, 64]); {rep_gather.verdict()}")
print("communication of rank 0:", [(r["collective"], r["pass"], r["calls"]) for r in tp_check.comm_rows(res_gather)])

# %% [markdown]
# Now the row-parallel layer `Linear(64, 16)`: its input arrives already split (it is the output of a
# column-parallel layer, `input_is_parallel=True`), and its bias is **replicated**, whole on every rank.

# %%
res_row, rep_row = run_layer(4, module="row")
print(rep_row.verdict())
print("communication of rank 0:", [(r["collective"], r["pass"], r["calls"]) for r in tp_check.comm_rows(res_row)])
bias_grads = [d["grads"]["bias"]["value"] for d in res_row.ranks]
print("bias gradient identical on every rank:", all(torch.equal(g, bias_grads[0]) for g in bias_grads))

# %% [markdown]
# The bias gradient is identical on all ranks *bit for bit*: the bias acts on the all-reduced output,
# which every rank holds in full, so every rank computes the same gradient from the same numbers.
#
# **Predict**: if the bias were added on every rank *before* the all-reduce, by how much would the output
# be off at t = 4?

# %%
res_bad, rep_bad = run_layer(4, module="row", fault="bias_before_reduce")
dense_bias = tp_check.D.build("row", tp_check.config_of(res_bad[0]["config"])).bias.detach().double()
shift = res_bad[0]["output"]["value"].double() - tp_check.D.reference(
    "row", tp_check.config_of(res_bad[0]["config"]), SEQ, BATCH)["output"]
print(rep_bad.verdict())
print("output - dense output == 3 x bias:", torch.allclose(shift, 3 * dense_bias.expand_as(shift), atol=1e-5))

# %% [markdown]
# ## 2. The Megatron MLP: column first, then row
#
# A transformer MLP is $Y = \mathrm{GeLU}(XA)\,B$ with $A: h \to 4h$ and $B: 4h \to h$. Megatron splits
# $A$ by **columns** and $B$ by **rows**. The column split makes the GeLU local: GeLU acts elementwise,
# so $\mathrm{GeLU}(X[A_1, A_2]) = [\mathrm{GeLU}(XA_1), \mathrm{GeLU}(XA_2)]$, and each rank applies it
# to its own columns. Its output is exactly the row-split input that $B$'s row-parallel layer wants. One
# `g` after $B$ finishes the forward; one `f` before $A$ handles the backward.
#
# Why not split $A$ by rows? Then each rank would hold a partial sum $X_rA_r$, and GeLU does not
# distribute over sums. The partial sums would need an all-reduce *before* the GeLU: a second
# synchronisation in every MLP. One line shows the problem:

# %%
g = torch.Generator().manual_seed(0)  # its own generator: the same numbers whatever ran before this cell
a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
print(f"max |GeLU(a + b) - (GeLU(a) + GeLU(b))| = {(F.gelu(a + b) - (F.gelu(a) + F.gelu(b))).abs().max():.2f}")

# %% [markdown]
# **Predict** before running: for the MLP at TP 4, how many all-reduces run in the forward pass, and how
# many in the backward? Which layer runs each?

# %%
mlp_runs = {t: run_layer(t, module="mlp") for t in (1, 2, 4)}
for t, (res, rep) in mlp_runs.items():
    print(f"TP {t}: {rep.verdict()}")
    print("       communication of rank 0:",
          [(r["scope"], r["collective"], r["pass"], r["calls"]) for r in tp_check.comm_rows(res)] or "none")

# %% [markdown]
# One all-reduce forward (`g`, in `fc2`, the row layer) and one backward (`f`, in `fc1`, the column layer),
# and none at TP 1 (a group of one rank has nothing to sum). Every tensor of the dense MLP matches: the
# output, the input gradient and the gradient of each of the four parameters. The error sizes:

# %% tags=["nbval-ignore-output"]
for t, (_, rep) in mlp_runs.items():
    print(f"TP {t}:", rep)
plots.savefig(tp_figures.equivalence_figure({f"TP {t}": rep for t, (_, rep) in mlp_runs.items()},
                                            "Megatron MLP (GeLU, h=16 -> 64 -> 16) vs the dense MLP"),
              "04_equivalence");

# %% [markdown]
# All errors sit around $10^{-7}$ to $10^{-6}$: float32 rounding against a float64 reference, one to two
# orders of magnitude inside the tolerance. (TP 1 is not zero either: the ranks compute in float32.)
#
# ## 3. Counting bytes
#
# Each all-reduce sums one activation of $b \cdot s \cdot h$ elements. A ring all-reduce (chapter 01)
# makes every rank send $2(t-1)/t$ times the message, so per MLP and per step a rank sends
#
# $$ 2 \times \frac{2(t-1)}{t}\, b\,s\,h \times \text{bytes per element} $$
#
# (one all-reduce forward, one backward). The ledger on the ranks records every collective the regions
# run, with the size of the tensor handed to it, and turns that size into bytes sent per rank with the
# ring algorithm's factor (the same convention as nccl-tests' bus bandwidth); gloo's own wire traffic is
# not sniffed. `course_utils.ledger.tp_comm_bytes_per_layer` is the formula of the cost model. **Predict** the bytes one rank sends for one all-reduce at t = 4, with b = 2, s = 4, h = 16 in
# float32.

# %%
message = BATCH * SEQ * HIDDEN * 4
measured = {t: tp_check.comm_rows(res)[0]["wire_bytes"] for t, (res, _) in mlp_runs.items() if t > 1}
measured[1] = 0.0
for t in sorted(measured):
    formula = tp_comm_bytes_per_layer(BATCH, SEQ, HIDDEN, t, bytes_per_element=4).wire_bytes_per_all_reduce
    print(f"TP {t}: message {message} B, counted {measured[t]:.0f} B sent per rank per all-reduce, "
          f"formula 2(t-1)/t x message = {formula:.0f} B")

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_figures.comm_bytes_figure(dict(sorted(measured.items())), message), "04_comm_bytes");

# %% [markdown]
# The bytes per rank *grow* with t and approach twice the message: tensor parallelism does not reduce
# the traffic per rank, it adds it, and it sits on the critical path of every layer. That is why TP stays
# inside one node, on NVLink (chapter 00's bandwidth tiers), and why the next chapters count it so carefully.
#
# ## 4. The check catches a broken collective
#
# A test that passes is only worth something if it would fail on a broken model. Here are four classic
# mistakes, injected one at a time into the same library (`workers/parallel/faults.py`): `g` forgotten,
# `f` forgotten, `g` applied twice, and the backward all-reduce moved from before the column layer to
# after the row layer (same count, wrong place).

# %%
faults = ["", "drop_forward_all_reduce", "drop_backward_all_reduce", "double_all_reduce", "misplaced_all_reduce"]
print(tp_figures.fault_table({f: run_layer(2, module="mlp", fault=f)[1] for f in faults}))

# %% [markdown]
# The misplaced all-reduce is the instructive one: it runs exactly one all-reduce forward and one
# backward, so counting collectives alone cannot catch it. Its weight gradients come out t times too
# large and its input gradient partial, and only the comparison with the dense module shows that.
#
# ## 5. Who holds what
#
# Megatron's plan for a whole transformer layer, drawn for a small shape: each colour is a rank. QKV is
# split by heads (chapter 05), the output projection and `fc2` by input columns (row parallel), `fc1` by
# output rows (column parallel). LayerNorms and the row-parallel biases are replicated.

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_viz.sharding_figure(hidden=64, ffn=256, heads=8, kv_heads=8, tp=4), "04_sharding");

# %%
for row in tp_viz.layout(64, 256, 8, 8, 4)["per_rank"][:2]:
    print(row)
print("dense layer parameters:", tp_viz.layout(64, 256, 8, 8, 4)["dense_params"])

# %% [markdown]
# Move the sliders: hidden size, FFN size, heads, KV heads and TP. A combination that cannot be split is
# explained in a sentence instead of drawn: try 8 heads at TP 3; or hidden 48 with 3 heads and 3 KV heads
# at TP 3, where the heads split but the FFN of 256 does not.

# %% tags=["nbval-ignore-output"]
tp_viz.sharding_widget(hidden=64, ffn=256, heads=8, kv_heads=8, tp=4)

# %% [markdown]
# ## 6. The two ends: the vocabulary
#
# Everything so far split the hidden dimension. The model's two ends are matrices of **words**: the embedding
# table `[V, h]` turns token ids into vectors, and the LM head `[h, V]` turns the last hidden state into one
# score per word of the vocabulary, the logits `[b, s, V]`, which the cross-entropy turns into the loss. V is
# large: Llama 3 has a vocabulary of 128K tokens (Llama Team, *The Llama 3 Herd of Models*, 2024,
# [arXiv:2407.21783](https://arxiv.org/abs/2407.21783), section 3.2 and Table 3; the released tokenizer has
# 128,256 entries). Per token, that is 31 times the hidden state:

# %%
print(tp_vocab.largest_activations())

# %% [markdown]
# So the logits are the largest activation of a training step: 2.1 GB for one sequence of 8,192 tokens in bf16,
# before the loss's softmax (usually computed in float32: twice that), the softmax it keeps for the backward,
# and the logits' gradient, each as large again. Attention's scores, `[s, s]` for each of the 32 heads, would be
# larger still, but FlashAttention (chapter 07) never stores them; the logits are stored.
#
# Megatron splits both ends by vocabulary: rank r of t holds the words `[r V/t, (r+1) V/t)`. The embedding
# (`VocabParallelEmbedding`) looks up the tokens it holds, writes zeros for the others, and one all-reduce (`g`)
# sums the ranks' rows: every token gets its row. The head is a column-parallel layer over the vocabulary: rank r
# ends with the logits of its own words, `[s, b, V/t]`.
#
# And then the loss needs all V scores of every token. `gather_output=True` and `F.cross_entropy` would work, and
# would defeat the point: the all-gather moves $(t-1)/t \cdot b\,s\,V$ elements to every rank, and afterwards
# every rank holds the whole `[s, b, V]` again, exactly as without tensor parallelism. **Loss parallelism**
# computes the loss from the shards instead. With $m$ the largest logit of a token,
#
# $$ \mathrm{loss} = \log \sum_{j=1}^{V} e^{z_j} - z_{\mathrm{target}}
#    = \log \sum_{j=1}^{V} e^{z_j - m} - (z_{\mathrm{target}} - m), $$
#
# and every term is a sum or a max over the vocabulary, which the ranks can each do over their own words and then
# combine with one all-reduce of `[s, b]` (one number per token):
#
# 1. **the max** (all-reduce with MAX): each rank's largest logit, then the group's. It buys numerical safety:
#    $z_j - m \le 0$, so no exponential overflows; and because every rank subtracts the *same* m, the ranks'
#    sums below are in the same unit and can be added.
# 2. **the target's logit** (SUM): the target word lives on exactly one rank, which picks $z_{target} - m$;
#    the others contribute 0. The sum hands every rank the one number.
# 3. **the sum of exponentials** (SUM): each rank sums $e^{z_j - m}$ over its V/t words; the sum over ranks is
#    the softmax's denominator over the whole vocabulary.
#
# The backward, $\mathrm{softmax} - \mathrm{onehot}(target)$, needs no communication at all: each rank writes
# its own columns (the one-hot's 1 sits on the rank that holds the target). Megatron-LM implements this in
# `megatron/core/tensor_parallel/cross_entropy.py`; PyTorch's `torch.distributed.tensor.parallel.loss_parallel`
# runs the same three reductions. The course's version is `workers/parallel/vocab.py`.
#
# The worker `workers/ch04_vocab_parallel.py` builds the dense embedding and head (a vocabulary of 32 words,
# h = 16, b = 4 sequences of s = 8 tokens, every word a target once), splits them at tp = 1, 2 and 4, runs forward
# and backward, and holds every rank's loss and gradients to the dense ends computed in one process, in float64.
# **Predict**: at tp = 4, how many bytes of logits does one rank hold (float64 is 8 bytes), and how large is each
# of the loss's all-reduces?

# %%
vocab_runs = [tp_vocab.run(VOCAB, t) for t in (1, 2, 4)]
for r in vocab_runs:
    print(tp_vocab.equality_line(r))
print(tp_vocab.bytes_table(vocab_runs))

# %% [markdown]
# Equal in float64 to within $10^{-12}$ of each tensor's size: the same sums as the dense loss, added in another
# order. Each rank holds $1/t$ of the logits, and the loss sent three all-reduces of one number per token; the
# ledger's records on rank 0 at tp = 4, in the order they ran:

# %%
print(tp_vocab.reductions_table(vocab_runs[-1]))

# %% [markdown]
# Three messages of $b\,s$ elements, against an all-gather whose result is $b\,s\,V$ elements on every rank: the
# messages are $V/3$ times smaller ($V/6$ on a ring's wire, where an all-reduce sends twice its message and an
# all-gather once). At the toy's size the difference is small; at a real model's size it is the difference
# between fitting and not. The lines below are the formula for one sequence of Llama 3 8B; the
# points are the runs above, measured here on the toy (float64, so 8 bytes per element), on the same formula:

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_vocab.bytes_figure(vocab_runs), "04_vocab_bytes");

# %% [markdown]
# Each doubling of tp halves the logits a rank holds, and the gathered line does not move: gathering them puts
# the whole 2.1 GB (Llama 3's vocabulary) back on every rank, whatever the tensor-parallel size.
#
# ### Each reduction left out
#
# Four drills (`workers/parallel/faults.py`, `VOCAB_FAULTS`) each remove one step of the loss: the max not
# all-reduced (each rank subtracts its own), the target's logit not masked on the ranks that do not hold it, the
# sum of exponentials not all-reduced, and no max subtracted at all. The comparison with the dense ends names
# each from what the group sees together: whether the ranks' losses agree, whether the loss is finite, and what
# each token's gradient sums to over the vocabulary (softmax minus one-hot: exactly 0). **Predict**: which drills
# change the loss on ordinary logits (of order 1), and which only on large ones (of order $10^3$)?

# %%
vocab_drills = {(fault, scale): tp_vocab.run(VOCAB, 4, fault=fault, logit_scale=scale)
                for scale in tp_vocab.SCALES for fault in ("",) + tp_vocab.DRILLS}
print(tp_vocab.drill_verdicts(vocab_drills))

# %% [markdown]
# The losses themselves (their last digits vary from machine to machine):

# %% tags=["nbval-ignore-output"]
print(tp_vocab.drills_table(vocab_drills))
plots.savefig(tp_vocab.drills_figure(vocab_drills), "04_vocab_drills");

# %% [markdown]
# On ordinary logits every drill gives a finite loss. The unreduced max is the quiet one: close to the right loss,
# the same on every rank, its gradient still summing to 0; only the comparison with the dense loss shows it. The
# unmasked target adds t - 1 unrelated logits; the unreduced sum leaves each rank with its own, smaller loss (on
# large logits, minus infinity for tokens whose every word on that rank is far below the group's max: $e^{z-m}$
# underflows to 0). Without the max at all the algebra is still right, and on ordinary logits the loss is exact;
# only logits large enough that $e^z$ overflows (above 709 in float64, above 88.7 in float32 and in bf16, which
# shares float32's range of exponents) make it infinite. That is what the max is for, and why it must be the
# group's: with each rank's own max the shards' sums are in different units, and the loss is off by up to the gap
# between the ranks' maxima, hundreds on large logits.
#
# Explore: the vocabulary, tp, the size of the logits and a drill. The left panel is the bytes of logits each
# rank holds against the gathered logits; the right, each rank's loss against the dense loss, with the verdict.
# A tp that does not divide the 4 ranks, or the vocabulary (try vocab 30 at tp 4), is refused in a sentence
# before anything starts.

# %% tags=["nbval-ignore-output"]
vocab_live = tp_vocab.live(VOCAB)
vocab_live.wait(60)
vocab_live

# %% [markdown]
# ## 7. Exercises
#
# Each function below runs on real ranks (world sizes 2 and 4) inside the check, against the dense layer,
# forward *and* backward (exercise 4: against the dense loss, forward). Use the regions from chapter 03:
# `from workers.parallel.mappings import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region`
# (`group` is the process group: pass it on). Imports go inside the function: it travels to the ranks as
# source.
#
# **Exercise 1: column-parallel forward.** `x` is the whole input `[s, b, in]` (the same on every rank,
# `requires_grad`), `weight` this rank's `[out/t, in]` shard and `bias` its `[out/t]` shard. Return this
# rank's output columns `[s, b, out/t]`, such that the gradient of `x` after backward is the full one.

# %% tags=["exercise"]
def column_parallel_forward(x, weight, bias, group):
    raise NotImplementedError

# %% tags=["check"]
cu.check("column_parallel_forward", column_parallel_forward)

# %% [markdown]
# **Exercise 2: row-parallel forward, the bias once.** `x` is this rank's `[s, b, in/t]` slice, `weight`
# its `[out, in/t]` shard, `bias` the whole `[out]` bias (replicated). Return the whole output
# `[s, b, out]` on every rank.

# %% tags=["exercise"]
def row_parallel_forward(x, weight, bias, group):
    raise NotImplementedError

# %% tags=["check"]
cu.check("row_parallel_forward", row_parallel_forward)

# %% [markdown]
# **Exercise 3: the SwiGLU split.** SwiGLU (Shazeer 2020, [arXiv:2002.05202](https://arxiv.org/abs/2002.05202))
# replaces GeLU by $\mathrm{silu}(XW_{gate}) \odot XW_{up}$. Implementations often store the two first
# projections fused, `fc1.weight = [gate; up]` of shape `[2 ffn, h]`, and then split the output in two
# halves. Column parallelism is still right (everything stays elementwise), *if* each rank holds matching
# columns of gate and up. Given the fused weight `w` (or bias), return the rows rank `rank` of
# `tp` must hold, laid out `[gate_r; up_r]` so that the local output splits into two halves too.

# %% tags=["exercise"]
def swiglu_shard(w, rank, tp):
    raise NotImplementedError

# %% tags=["check"]
cu.check("swiglu_shard", swiglu_shard)

# %% [markdown]
# **Exercise 4: the loss from logits split by vocabulary.** `logits` is this rank's block `[s, b, V/t]` of the
# logits (float32; rank r of the group holds the words `[r V/t, (r+1) V/t)`), `target` the `[s, b]` word ids,
# over the whole vocabulary, and `group` the tensor-parallel group. Return the loss of every token, `[s, b]`,
# equal on every rank to `F.cross_entropy(..., reduction="none")` on the whole logits, without gathering them:
# the three all-reduces of section 6, each of an `[s, b]` tensor, with `dist.all_reduce(t, op=..., group=group)`
# (`import torch.distributed as dist` inside the function; `dist.ReduceOp.MAX` for the max, the default is SUM). Leave `logits` as it is. Only the forward: its backward,
# softmax minus one-hot, needs no communication. The check tries logits of order 1 and of order $10^3$.

# %% tags=["exercise"]
def vocab_parallel_loss(logits, target, group):
    raise NotImplementedError

# %% tags=["check"]
cu.check("vocab_parallel_loss", vocab_parallel_loss)

# %% [markdown]
# ## 8. Explore on real ranks
#
# Pick a module and a TP size: the widget reruns the equivalence on real ranks and draws the error of
# every tensor. It opens on the right split, equal to the dense MLP; then try the naive SwiGLU split
# (`split="naive"`), or a fault, or TP 3 (which does not divide the 4 ranks: refused in a sentence before anything
# starts). The MLP and split menus apply to the MLP only, and the split to SwiGLU only: elsewhere they are greyed.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider


def draw_equivalence(res, params):
    cfg = tp_check.config_of(res[0]["config"])
    rep = tp_check.compare(res, params["module"], cfg, seq=SEQ, batch=BATCH)
    verdict = "equal to the dense module" if rep.ok else f"DIFFERENT in {len(rep.failed + rep.problems)} tensor(s)"
    return tp_figures.equivalence_figure({f"TP {params['tp']}": rep},
                                         f"{params['module']}, {params['activation']}, {params['split']} split, "
                                         f"{params['fault'] or 'no fault'}: {verdict}")


live = LiveRun(LAYERS, {"tp": slider("TP", 2, 1, 4),
                        "module": W.Dropdown(options=["mlp", "column", "row"], value="mlp", description="module"),
                        "activation": W.Dropdown(options=["gelu", "swiglu"], value="swiglu", description="MLP"),
                        "split": W.Dropdown(options=["right", "naive"], value="right", description="split"),
                        "fault": W.Dropdown(options=[""] + faults[1:] + ["bias_before_reduce"], value="",
                                            description="fault")},
               draw_equivalence, params={"world_size": WORLD, "seq": SEQ, "batch": BATCH, "hidden": HIDDEN},
               applies={"activation": lambda s: s["module"] == "mlp",
                        "split": lambda s: s["module"] == "mlp" and s["activation"] == "swiglu"}, timeout=60)
live.wait(60)
live

# %% [markdown]
# ## Summary
#
# * Column parallel: split the output features; no communication forward, `f` (all-reduce) backward.
#   Row parallel: split the input features; `g` (all-reduce) forward, nothing backward; bias once, after.
# * The Megatron MLP puts them back to back so the nonlinearity stays local: **one all-reduce forward,
#   one backward**, each of $b\,s\,h$ elements, $2(t-1)/t$ of it sent per rank.
# * The sharded MLP is the same function as the dense one, gradients included, to float32 rounding; and
#   the same check fails loudly on a dropped, doubled or misplaced collective, or a bias added t times.
# * The vocabulary is split too: the embedding by rows (zeros for the words elsewhere, then `g`), the head by
#   columns, and the loss computed from the `[s, b, V/t]` shards with **three all-reduces of one number per token**
#   (the max, the target's logit, the sum of exponentials). The logits, the largest activation of a step, never
#   exist whole on any rank; leave out any one reduction and the loss is wrong, sometimes only on large logits.
#
# Next: attention, where the natural unit to split is the head (chapter 05).

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
