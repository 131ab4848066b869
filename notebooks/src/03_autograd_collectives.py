# %% [markdown]
# # 03 · Collective communication inside autograd
#
# In data parallelism (chapter 02) communication happens *between* backward passes: each rank runs an
# ordinary backward, and DDP averages the finished gradients. Tensor parallelism is different. A single
# layer is split across ranks, so the **forward pass itself** needs collectives (an all-reduce of partial
# sums, an all-gather of slices), and then the **backward pass must go back through them**. Autograd
# cannot do that on its own: `dist.all_reduce` is an in-place operation with no registered gradient
# formula. Backpropagate through it and PyTorch (2.13) warns that "an autograd kernel was not registered
# [...] This may lead to silently incorrect behavior", then passes the gradient through as if the
# collective had not happened. We have to give every collective a backward, on purpose.
#
# Which backward? That is the whole chapter, and it is subtler than it looks. The obvious guess,
# "the backward of an all-reduce is an all-reduce", is what `torch.distributed.nn.functional.all_reduce`
# implements, and in a tensor-parallel model it makes every gradient $n$ times too large. Megatron-LM's
# answer (Shoeybi et al., *Megatron-LM*, 2019, [arXiv:1909.08053](https://arxiv.org/abs/1909.08053),
# Section 3 and Figure 3) is a pair of operators, `f` and `g`, each the other's mirror image:
#
# | | forward | backward |
# |---|---|---|
# | `f` = `copy_to_tensor_model_parallel_region` | identity | all-reduce |
# | `g` = `reduce_from_tensor_model_parallel_region` | all-reduce | identity |
#
# This chapter
#
# 1. builds `f`, `g` and their relatives (split/gather, reduce-scatter/all-gather, all-to-all) as small
#    `torch.autograd.Function`s, in `workers/parallel/mappings.py`, the library chapters 04-06 build on;
# 2. says what "correct" means, with a single-process reference that simulates every rank and takes its
#    gradients from plain autograd, and checks every mapping against it, bit for bit, on real ranks;
# 3. runs `torch.autograd.gradcheck` *through the collectives*, in float64, on real ranks;
# 4. reproduces the world-size scaling trap and measures the ratio against $n$;
# 5. derives why this is all that row-parallel layers need for their gradients, and measures it;
# 6. and then you write `f`/`g` and split/gather yourself, graded on real ranks.

# %%
import inspect

import course_utils as cu
from course_utils import ch03, plots
from course_utils.tables import Table
from workers.parallel import mappings
from workers.parallel.reference import LAYOUTS, MAPPING_NAMES

plots.style()
# Every run uses the same 4 ranks (started once, then kept warm), grouped as each experiment needs:
# tp=2 makes two tensor-parallel groups, ranks [0, 1] and [2, 3], and every mapping runs inside its
# own group. 60 s per run; the collective timeout keeps its default, so these runs, the widget and the
# exercise checks all share the same warm ranks.
WORLD = 4
LIMITS = {"timeout": 60}

# %% [markdown]
# ## 1. Replicated, per rank, sharded: what a tensor *is* decides its gradient
#
# On $n$ ranks, a tensor can mean three different things, and the backward of a collective depends only
# on which one it is:
#
# * **replicated**: the same value on every rank, and *one* logical tensor. The output of an all-reduce
#   is replicated; so is a model input that every rank reads. A loss computed from replicated tensors on
#   every rank is *one* loss, computed $n$ times, not $n$ losses.
# * **per rank**: rank $r$'s tensor is its own logical tensor. A partial sum $X_r W_r$ that will be added
#   up, or a copy of the input that feeds rank $r$'s own slice of the model.
# * **sharded**: rank $r$ holds block $r$ of one logical tensor, cut along some dimension.
#
# Now the two rules. Take $g$: its inputs are per-rank partial sums $p_r$ and its output is replicated,
# $y = \sum_r p_r$. The loss $L(y)$ is one number, so
#
# $$ \frac{\partial L}{\partial p_r} = \frac{\partial L}{\partial y}\,\frac{\partial y}{\partial p_r} = \frac{\partial L}{\partial y} ,$$
#
# which every rank already holds (it is computed from replicated tensors): **the backward of $g$ is the
# identity**. Take $f$: its input $x$ is replicated and its output $y_r = x$ is a per-rank copy that
# feeds rank $r$'s part of the model, contributing $L_r(y_r)$ to a loss that a later $g$ makes whole. Then
#
# $$ \frac{\partial L}{\partial x} = \sum_r \frac{\partial L}{\partial y_r} ,$$
#
# and each rank holds one term: **the backward of $f$ is an all-reduce**. Every other mapping follows
# from the same two facts. Here is the library's table, generated from the code:

# %%
rows = []
for name in MAPPING_NAMES:
    doc = inspect.getdoc(mappings.MAPPINGS[name]).splitlines()[0].replace("``", "")
    rows.append({"mapping": ch03.SHORT[name], "input -> output": " -> ".join(LAYOUTS[name]),
                 "forward / backward": doc.split(" (conjugate")[0].rstrip("."),
                 "conjugate": ch03.SHORT[mappings.CONJUGATE[name].split("(")[0]]
                 + (" (tensor_parallel_output_grad=False)" if "False" in mappings.CONJUGATE[name] else "")})
print(Table.of(rows, ["mapping", "input -> output", "forward / backward"]))
print()
print(Table.of(rows, ["mapping", "conjugate"]))

# %% [markdown]
# Notice the **conjugate** column: each mapping's backward is its conjugate's forward. This is not a
# coincidence of naming. A collective is a linear map, and the backward of a linear map is its
# transpose (adjoint). On the *logical* tensors, `g` is a sum $\mathbb{R}^{n \times d} \to \mathbb{R}^{d}$ and
# `f` a copy $\mathbb{R}^{d} \to \mathbb{R}^{n \times d}$: each is the other's transpose. So are splitting and
# concatenating, and reduce-scatter and all-gather. An all-to-all is a permutation, whose transpose is
# its inverse: the all-to-all back. (Count `g`'s replicated output as $n$ separate tensors instead, and
# `g` becomes "every rank gets the sum", a symmetric map whose transpose is itself: an all-reduce in
# backward. That other convention is the trap of section 6.)
#
# `gather_from_sequence_parallel_region` has a flag: by default its output feeds a tensor-parallel region
# (sequence parallelism, Korthikanti et al. 2022, [arXiv:2205.05198](https://arxiv.org/abs/2205.05198),
# Section 4.2.2), where each rank's copy gets a different gradient, so its backward is a
# **reduce-scatter**; with `tensor_parallel_output_grad=False` the output is replicated and the backward
# only keeps the rank's slice.
#
# ## 2. `f` and `g`, as code
#
# Each mapping is a `torch.autograd.Function` (a forward, and a backward that autograd calls with the
# gradient of the output) plus a one-line public function. This is all of `f` and `g`:

# %%
for code in (mappings._CopyToModelParallelRegion, mappings._ReduceFromModelParallelRegion, mappings._reduce):
    print(inspect.getsource(code))

# %% [markdown]
# Two details matter beyond the math. `_reduce` all-reduces a **clone**: an all-reduce is in place, and
# the tensor handed to `g` may be one that autograd saved for another backward (the output of `tanh` is
# saved by `tanh`'s backward), or one the caller still needs. And with one rank there is nothing to
# communicate, so every mapping returns its input unchanged.
#
# ## 3. On real ranks
#
# `workers/ch03_mappings.py` runs each mapping forward and backward on every rank, with small integer
# inputs (so sums are exact in any order) and a different output gradient on each rank. We look at the
# group of ranks 0 and 1.
#
# **Predict.** Two ranks run `f`. Rank 0 receives output gradient $A$, rank 1 receives $B$. What is the
# gradient of `x` on rank 0? Then `g`: rank 0 holds partial sum $p_0$, rank 1 holds $p_1$, and both
# receive the same output gradient $C$. What is the gradient of $p_0$?

# %%
pairs = cu.run("workers.ch03_mappings", world_size=WORLD, tp=2, **LIMITS)
print("groups:", ch03.groups_of(pairs))

# %% tags=["nbval-ignore-output"]
plots.savefig(ch03.draw_mapping(pairs, "copy_to_tensor_model_parallel_region"), "03_copy_to_region");

# %% [markdown]
# Rank 0's `dL/dx` is $A + B$: rank 0 did not compute $B$, it *received* it, in the all-reduce of `f`'s
# backward. And both ranks hold the same sum, as a replicated tensor's gradient must.

# %% tags=["nbval-ignore-output"]
plots.savefig(ch03.draw_mapping(pairs, "reduce_from_tensor_model_parallel_region"), "03_reduce_from_region");

# %% [markdown]
# `g`'s output is the sum, identical on both ranks; its backward hands $C$ back unchanged to each
# partial sum. No communication in backward. Here is what the two ranks did, from the instrumented
# library (`mappings.record_communication()`):

# %%
print(ch03.communication_table(pairs[0]["communication"]))

# %% [markdown]
# ## 4. Ground truth: every mapping against a single-process reference
#
# A figure is not a proof. `workers/parallel/reference.py` simulates all $n$ ranks in one process. It
# writes each mapping's forward with explicit `torch.cat`, sums and slices over the list of every rank's
# tensor, for example
#
# ```python
# if name == "reduce_from_tensor_model_parallel_region":   # g
#     total = _sum(xs); return [total] * n
# if name == "gather_from_sequence_parallel_region":
#     whole = torch.cat(xs, dim=0); return [whole] * n
# ```
#
# and gets every gradient from **plain autograd** through those ops: no collective and no hand-written
# backward. The only modelling choice is the layout of section 1: a replicated input is one leaf tensor
# shared by all ranks, and a replicated output's loss is counted once. If the library's backward rules
# are right, the ranks reproduce the reference exactly.
#
# The 4 ranks, grouped three ways: 4 groups of 1, 2 groups of 2 (the run above), and 1 group of 4.

# %%
equivalence = {1: cu.run("workers.ch03_mappings", world_size=WORLD, tp=1, **LIMITS), 2: pairs,
               4: cu.run("workers.ch03_mappings", world_size=WORLD, tp=4, **LIMITS)}
for tp, res in equivalence.items():
    rows = ch03.mapping_rows(res)
    print(f"groups of {tp}: {sum(r['exact'] for r in rows)}/{len(rows)} (group, mapping) pairs bit-identical "
          "to the reference, outputs and input gradients on every rank")

# %%
print(ch03.mapping_table(equivalence[4]))

# %% [markdown]
# Every output and every input gradient is **bit-identical** to the reference (the data are small
# integers in float64, so no rounding can hide in the order of a sum). `tests/test_mappings.py` runs the
# same comparison at world 1, 2 and 4, in float64 and again in float32 (the integers stay exact), and for an
# all-to-all with unequal splits (as in expert parallelism); and it checks, at world 2, that a deliberately
# wrong backward for each of the eight mappings *fails* it.
#
# Explore any mapping with groups of 1, 2 or 4 ranks (a real run on the 4 ranks per change; the figure
# shows the group of rank 0):

# %% tags=["nbval-ignore-output"]
import ipywidgets as W  # noqa: E402

from course_utils.widgets import LiveRun  # noqa: E402

explorer = LiveRun(
    "workers.ch03_mappings",
    {"mapping": W.Dropdown(options=list(MAPPING_NAMES), value="gather_from_sequence_parallel_region",
                           description="mapping"),
     "tp": W.SelectionSlider(options=[1, 2, 4], value=2, description="ranks per group",
                                  continuous_update=False, style={"description_width": "initial"})},
    lambda res, p: ch03.draw_mapping(res, p["mapping"]),
    params={"world_size": WORLD, "rows": 1, "cols": 2}, timeout=30,
)
explorer

# %% tags=["nbval-ignore-output"]
explorer.wait(60)  # headless: let the first run finish before the next cells use the ranks

# %% [markdown]
# ## 5. `gradcheck` through the collectives
#
# `torch.autograd.gradcheck` compares a backward with finite differences of the forward, in float64.
# Can it run on ranks, with collectives inside? Yes, if we are careful about *what function* it checks.
# Every rank runs gradcheck at the same time, and every rank perturbs entry $i$ of its input at the same
# moment. If the input is **replicated**, that is exactly perturbing entry $i$ of the one logical input;
# if the output is **replicated**, every rank seeding the backward with the same output gradient is
# exactly differentiating the one logical output. So we check *circuits* that start replicated, go
# through a parallel region where each rank does its own work (weights that depend on the rank), and end
# replicated, for example $y = g(\tanh(f(x)\,W_r)) = \sum_r \tanh(x W_r)$.
#
# To see that gradcheck would notice, each column below swaps one library mapping for a plausible wrong
# one (an `f` that forgot to all-reduce, a `g` that all-reduces in backward too, a gather whose backward
# sums, a split that keeps the wrong slice), in groups of 2 ranks. Each cell also shows the ratio of one
# vector-Jacobian product from the backward to the same from finite differences: 1 when right.

# %%
gradchecks = {"correct": cu.run("workers.ch03_gradcheck", world_size=WORLD, **LIMITS)}
print(Table.of(ch03.gradcheck_rows(gradchecks), ["ranks", "circuit", "gradcheck", "ratio"]))

# %%
wrong_variants = ["f_backward_identity", "g_backward_all_reduce", "gather_backward_sums", "scatter_wrong_chunk"]
at_two = {v: cu.run("workers.ch03_gradcheck", world_size=WORLD, tp=2, variant=v, **LIMITS)
          for v in ["correct"] + wrong_variants}
gradcheck_rows = ch03.gradcheck_rows(at_two)

# %% tags=["nbval-ignore-output"]
plots.savefig(ch03.draw_gradcheck(gradcheck_rows), "03_gradcheck");

# %%
print(Table.of([r for r in gradcheck_rows if r["gradcheck"] != "pass"], ["variant", "circuit", "gradcheck", "ratio"]))

# %% [markdown]
# Each wrong mapping fails exactly the circuits that use it, on every rank, and passes the others. The
# ratios tell the story: a `g` or gather that sums in backward is off by exactly $n = 2$; an `f` that
# forgot to sum sees only its own rank's share of the gradient (in the first circuit the ratios of the
# two ranks of a group add up to 1: each holds one of the two terms of the sum that `f`'s all-reduce
# would have made). The ratio columns list ranks 0 to 3; both groups ran the same circuits, in parallel.
#
# One limit, worth knowing: gradcheck checks that the backward matches the *forward you wrote*. A split
# that keeps the wrong slice fails here only because its backward still puts the gradient back in the
# right place. Had both been consistently wrong, gradcheck would pass. That is why section 4 compares
# outputs too, against an independent reference.
#
# ## 6. The world-size scaling trap
#
# Now the mistake this chapter is named after. A row-parallel linear layer, and then a loss that every
# rank computes from the replicated output:
#
# $$ X_r = \text{scatter}(X),\qquad Y = \text{all\_reduce}(X_r W_r) = XW,\qquad L = \tfrac12\lVert Y\rVert^2 .$$
#
# Three backwards for the all-reduce: Megatron's `g` (identity); a hand-written "symmetric" one that
# all-reduces the gradient too; and `torch.distributed.nn.functional.all_reduce`, whose backward is also
# an all-reduce (PyTorch source, `torch/distributed/nn/functional.py`, class `_AllReduce`).
#
# **Predict.** With 2 tensor-parallel ranks, how much larger than the single-process gradient is
# $\partial L/\partial W$ with the symmetric backward? With 4?

# %%
TRAP = {"batch": 4, "hidden": 8, "out": 4, "seed": 0}
trap = {tp: cu.run("workers.ch03_scaling_trap", world_size=WORLD, tp=tp, **TRAP, **LIMITS) for tp in (1, 2, 4)}

# %% [markdown]
# Eight ranks need a torchrun start of their own (eight more processes importing torch), so the headless
# run stops at 4. Set `RUN_WORLD_8 = True` to add $n = 8$ (predict it first), on ranks of its own that
# stop afterwards, so the 4 warm ranks stay up for the exercises.

# %% tags=["nbval-ignore-output"]
from course_utils.validate import max_world_size  # noqa: E402

RUN_WORLD_8 = False
if RUN_WORLD_8 and max_world_size() >= 8:
    trap[8] = cu.run("workers.ch03_scaling_trap", world_size=8, warm=False, **TRAP, **LIMITS)
    print(trap[8].describe())

# %%
from workers.parallel.problems import scaling_trap_problem  # noqa: E402

x_full, w_full = scaling_trap_problem(TRAP["seed"], TRAP["batch"], TRAP["hidden"], TRAP["out"])
scaling = ch03.scaling_rows(trap, x_full, w_full)
print(ch03.scaling_table([r for r in scaling if r["n"] <= 4]))

# %% tags=["nbval-ignore-output"]
if any(r["n"] > 4 for r in scaling):
    print(ch03.scaling_table([r for r in scaling if r["n"] > 4]))
plots.savefig(ch03.draw_scaling(scaling), "03_scaling_trap");

# %% [markdown]
# The loss is identical in all three (the forward does not change), and the gradients are exactly
# $n\times$ too large whenever the backward all-reduces. Why: $\partial L/\partial Y = Y$ is computed
# from the replicated $Y$, so every rank already holds the *whole* gradient; the all-reduce adds $n$
# identical copies of it. Every gradient upstream inherits the factor, weights and inputs alike. With
# plain SGD it is a learning rate $n$ times too large, with Adam it mostly hides (Adam divides the scale
# out), and with gradient clipping or weight decay it silently changes the training. It does not show up
# in the loss of the first step, which is why it is a trap.
#
# Is `torch.distributed.nn.functional.all_reduce` wrong, then? No: it implements the *other* convention,
# where every rank has a **different** loss $L_r$ and the objective is their sum $\sum_r L_r$. Then each
# rank's gradient of $y$ is one term of the total and summing them is right. The two conventions meet
# in the wild: see PyTorch issue [#58005](https://github.com/pytorch/pytorch/issues/58005) ("gradients are
# scaled up by the world size") and flash-attention issue
# [#1244](https://github.com/Dao-AILab/flash-attention/issues/1244) ("Why do we have an all_reduce with
# wrong backward?", about an all-reduce with an identity backward, Megatron's `g`). A backward is right
# only *relative to what the loss is*. In tensor parallelism the loss is replicated, so `g` is right.
#
# ## 7. Why this is all row-parallel layers need
#
# A row-parallel linear layer $Y = XW + b$ splits $W \in \mathbb{R}^{h\times o}$ by rows and $X$ by
# columns (`RowParallelLinear(input_is_parallel=True)` in Megatron):
#
# $$ W = \begin{bmatrix} W_1 \\ \vdots \\ W_n \end{bmatrix},\quad X = [X_1 \;\cdots\; X_n],\qquad
#    Y = \sum_r X_r W_r + b = g(X_r W_r) + b . $$
#
# The bias is added once, after the reduce (added before it, it would be counted $n$ times). Backward,
# given $G = \partial L/\partial Y$:
#
# $$ \frac{\partial L}{\partial W_r} = X_r^\top G,\qquad \frac{\partial L}{\partial X_r} = G\,W_r^\top,\qquad
#    \frac{\partial L}{\partial b} = \mathbf{1}^\top G . $$
#
# Each needs only $X_r$ and $W_r$, which rank $r$ has, and $G$, which **every rank already has**:
# $Y$ is replicated, everything after it is computed identically on every rank, so $G$ is replicated
# too. That is precisely `g`'s identity backward, and it means the row-parallel layer needs **no
# collective at all in backward**: its weight gradients are complete on each rank, unlike data
# parallelism where every weight gradient must be all-reduced.
#
# Where does tensor parallelism synchronise gradients, then? At the *input*. In Megatron's MLP the
# row-parallel layer follows a column-parallel one, $Z_r = \text{GeLU}(f(X) A_r)$, whose input $X$ is
# replicated and used by every rank:
#
# $$ \frac{\partial L}{\partial X} = \sum_r \frac{\partial L}{\partial Z_r}\,\frac{\partial Z_r}{\partial X} ,$$
#
# one term per rank: the all-reduce in **`f`'s backward**, the mirror image of `g`'s all-reduce in
# forward. One all-reduce forward, one backward, per MLP (Shoeybi et al., Section 3).
#
# **Predict** the collectives of backward in three runs: the row-parallel layer with its input already
# split; with a replicated input it must split first; the whole MLP.

# %%
from workers.parallel.problems import row_parallel_problem as row_problem  # noqa: E402

for mode, input_is_parallel in (("row", True), ("row", False), ("mlp", False)):
    res = cu.run("workers.ch03_row_parallel", world_size=WORLD, mode=mode, input_is_parallel=input_is_parallel,
                 **LIMITS)
    comm = ch03.count_collectives(res[0]["communication"])
    label = f"{mode}, input_is_parallel={input_is_parallel}" if mode == "row" else "mlp (f, column, GeLU, row, g)"
    print(f"{label}\n  forward:  {comm['forward']}\n  backward: {comm['backward'] or 'no collective'}")
    rows = ch03.row_parallel_rows(res, row_problem(mode, 0, 4, 8, 6, 16), mode, input_is_parallel)
    print("  against the single-process layer:",
          ", ".join(f"{r['tensor']} {'ok' if r['within_1e-12'] else 'WRONG'}" for r in rows), "\n")

# %% [markdown]
# Measured on 4 ranks: with a split input, backward runs **no collective**, and the stacked $W_r$
# gradients equal the single-process $\partial L/\partial W$ (to $10^{-12}$ in float64; here the order of
# additions differs, so we do not claim bits). A replicated input costs one all-gather in backward, the
# conjugate of its split. The MLP costs one all-reduce each way, and its backward all-reduce is `f`'s.
#
# ## 8. Exercises
#
# ### Exercise 1: `f` and `g`
#
# Write Megatron's `f` and `g` as `torch.autograd.Function`s. Define the classes **inside** the function
# below (it is sent to the ranks as source code) and return the pair `(copy_to, reduce_from)`, each called
# as `fn(x, group=None)`. The checker runs them on 4 and then 2 real ranks against the reference,
# gradchecks $g(\tanh(f(x)W_r))$ in float64, and runs them inside sub-groups.
#
# Hints: `forward(ctx, x, group)` and `backward(ctx, grad_output)`; `backward` returns one gradient per
# input of `forward` (`None` for `group`); keep what backward needs on `ctx`; never all-reduce a tensor
# you were given: clone it first.

# %% tags=["exercise"]
def f_and_g():
    """Return (copy_to, reduce_from): f = identity forward / all_reduce backward, g = the conjugate."""
    import torch
    import torch.distributed as dist

    # class CopyToRegion(torch.autograd.Function):
    #     @staticmethod
    #     def forward(ctx, x, group): ...
    #     @staticmethod
    #     def backward(ctx, grad_output): ...
    raise NotImplementedError


# %% tags=["check"]
from course_utils.exercises import check  # noqa: E402

check("f_and_g", f_and_g)

# %% [markdown]
# ### Exercise 2: split and gather
#
# Write the last-dimension pair: `scatter_to` keeps this rank's slice of the last dimension (backward:
# all-gather the slices' gradients), `gather_from` concatenates every rank's slice along the last
# dimension in rank order (backward: keep this rank's slice of the gradient). Return
# `(scatter_to, gather_from)`, each called as `fn(x, group=None)`.
#
# Hints: `dist.get_rank(group)` and `dist.get_world_size(group)` are the rank and size *in the group*;
# `dist.all_gather(list_of_tensors, tensor, group=group)` needs a contiguous `tensor`, and a slice of the
# last dimension is not contiguous until you call `.contiguous()`.

# %% tags=["exercise"]
def split_and_gather():
    """Return (scatter_to, gather_from) along the last dimension, each the other's backward."""
    import torch
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("split_and_gather", split_and_gather)

# %% [markdown]
# ## What to remember
#
# * A collective inside a model needs a backward, and the backward is the transpose: all-reduce and
#   copy, all-gather and reduce-scatter (or split), all-to-all and its inverse.
# * Which one depends on the layout: a **replicated** tensor is one tensor and its gradient is already
#   complete; **per-rank** copies of one tensor have gradients that must be **summed**.
# * Get it wrong and nothing crashes: the gradients are $n$ times too large, or a fraction of what they
#   should be. Test against a single-process reference, outputs *and* gradients, and run gradcheck on
#   circuits that start and end replicated.
# * `f` (all-reduce in backward) and `g` (all-reduce in forward) are all a Megatron MLP or attention
#   block needs; chapter 04 builds `ColumnParallelLinear` and `RowParallelLinear` on this library.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
