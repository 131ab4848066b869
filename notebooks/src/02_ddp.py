# %% [markdown]
# # 02 · DDP in one line
#
# Data parallelism is the first thing anyone does with a second GPU: every rank holds a **full copy of
# the model**, reads a **different slice of the batch**, and the ranks **average their gradients** before
# the optimizer step. The promise is strong. If the ranks really average, every rank takes exactly the
# step that one process looking at the whole batch would have taken: not roughly, but to the last few
# bits of rounding. That is why data parallelism is safe to switch on: it changes how fast you train,
# not what you train.
#
# In PyTorch the promise is one line, `model = DistributedDataParallel(model)`. This chapter
#
# 1. checks the promise on real ranks: DDP at world 1, 2 and 4 against a single process, gradient, loss and
#    weights, after every step;
# 2. opens the line up: a broadcast when it is built, gradient averaging from autograd hooks during
#    `backward()`, and *buckets* that decide how many all-reduces you pay for;
# 3. shows three mistakes that train the wrong thing without any error: a sampler whose epoch never
#    changes, a loss summed instead of averaged, and gradient accumulation that talks too much;
# 4. and then you write DDP yourself, with hooks and buckets, graded on real ranks.
#
# The design of DDP is described by its authors in Li et al., *PyTorch Distributed: Experiences on
# Accelerating Data Parallel Training*, PVLDB 13(12), 2020 ([arXiv:2006.15704](https://arxiv.org/abs/2006.15704)),
# Section 3.2 (gradient reduction: bucketing, overlap with backward, `no_sync`).

# %%
import torch

import course_utils as cu
from course_utils import ch02, plots
from workers.data_parallel.model import FP32_TOL, Setup, make_model, train_single

plots.style()
LIMITS = {"timeout": 60}  # seconds per run; collectives keep the default limit, so runs and checks share warm ranks
setup = Setup()
print(setup)
print("parameters:", sum(p.numel() for p in make_model(setup).parameters()))

# %% [markdown]
# ## 1. Why averaging is exact
#
# Take a global batch of $B$ rows and a loss that is the **mean** over rows. One process computes
#
# $$ g = \frac{1}{B}\sum_{i<B} \nabla \ell_i . $$
#
# With $n$ ranks, rank $r$ holds $B/n$ of the rows and computes the mean over its own rows. DDP sums those
# gradients over the ranks (an all-reduce) and divides by $n$:
#
# $$ \frac{1}{n}\sum_{r<n} \frac{1}{B/n}\sum_{i \in \text{rows}(r)} \nabla \ell_i \;=\; \frac{1}{B}\sum_{i<B}\nabla\ell_i \;=\; g .$$
#
# Same number, added in a different order. Floating-point addition is not associative, so we expect
# agreement to rounding (a few units in the last place of fp32), and we state the tolerance we check:
# `atol=1e-6, rtol=1e-5`. The ranks, on the other hand, all receive *the same* all-reduced bits, so they
# should agree with each other exactly.
#
# The model is a small MLP (`x * in_scale -> Linear -> tanh -> Linear`, with `in_scale` a buffer), the
# data a fixed random regression problem, and the optimizer plain SGD. The single-process baseline runs
# here, in the notebook process, from the same module the ranks use (`workers/data_parallel/model.py`):

# %%
baseline = train_single(setup)
print("baseline loss per step:", [round(v, 4) for v in baseline["losses"].tolist()])

# %% [markdown]
# ## 2. DDP at world 1, 2 and 4
#
# The worker, `workers/ch02_ddp.py`, is the single-process loop with two changes: the model is wrapped,
# and each rank keeps its own $B/n$ rows of every batch.
#
# ```python
# model = make_model(setup).to(ctx.device)
# ddp = DDP(model, device_ids=...)                      # <- the one line
# opt = torch.optim.SGD(ddp.parameters(), lr=lr)        # the optimizer does not know about DDP
# for batch in make_batches(setup):
#     x, y = shard(batch, ctx.rank, ctx.world_size)     # rows [r*B/n, (r+1)*B/n)
#     opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
# ```
#
# Each rank sends back, for every step, the gradient DDP left in `.grad` (after its all-reduce, before
# `opt.step()`), its loss, and the weights after the step.
#
# **Predict** before running: at world 4, will the gradients and the weights after step 5 be bit-identical
# to the baseline, equal to rounding, or merely close (say 1e-3)? And will the four ranks agree with *each
# other* bit for bit?

# %% tags=["nbval-ignore-output"]
ddp_runs = {w: cu.run("workers.ch02_ddp", world_size=w, **LIMITS, **setup.as_params()) for w in (1, 2, 4)}
for w, res in ddp_runs.items():
    print(res.describe())

# %%
comparisons = {w: ch02.compare_to_baseline(res, baseline) for w, res in ddp_runs.items()}
print(f"within atol={FP32_TOL['atol']:g}, rtol={FP32_TOL['rtol']:g} of the baseline at every step, every rank:")
for w, c in comparisons.items():
    print(f"world {w}: gradients {c['grads_within_tol']}, loss {c['loss_within_tol']}, "
          f"weights {c['weights_within_tol']}; ranks bit-identical to each other: {c['ranks_identical']}")

# %% [markdown]
# The size of the difference, per step (worst rank):

# %% tags=["nbval-ignore-output"]
def per_step(values):
    return ", ".join(f"{v:.1e}" for v in values.tolist())


for w, c in comparisons.items():  # worst rank at each step
    print(f"world {w}:\n  max |g_DDP - g_single|, steps 1-{setup.steps}: {per_step(c['grad_max_abs'].max(dim=0).values)}"
          f"\n  max |w_DDP - w_single|, steps 0-{setup.steps}: {per_step(c['max_abs'].max(dim=0).values)}"
          f"\n  |mean of the ranks' losses - baseline loss|, steps 1-{setup.steps}: {per_step(c['loss_abs'])}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_ddp_vs_baseline(comparisons, baseline), "02_ddp_vs_single");

# %% [markdown]
# World 1 on the CPU is bit-identical: one rank, an all-reduce over one process, the same kernels as the
# notebook's baseline (on a GPU the kernels differ, and so do the last bits). At world 2 and 4 the
# gradients, the losses and the weights differ from the baseline by a few $10^{-8}$, an ulp or two of
# numbers of size 0.1 to 1: the sums were taken in another order, nothing more. That is 30 times below
# the tolerance, while a rank that skipped the all-reduce would have a gradient off by more than
# $10^{-4}$ (`tests/test_ch02_ddp.py` checks that, and that `compare_to_baseline` catches it). The ranks agree with each other exactly, because each received the same
# all-reduced gradient and applied the same SGD step to the same weights.
#
# The loss each rank prints is the mean over *its* rows only, so it differs from rank to rank; the mean
# of the ranks' losses is the global loss. Log that one (or all-reduce it) when you compare runs at
# different world sizes.

# %% [markdown]
# ## 3. What the one line does
#
# ### 3a. A broadcast when DDP is built
#
# Averaging gradients only keeps ranks equal if they *start* equal. DDP does not trust your seeds: its
# constructor broadcasts rank 0's parameters and buffers to every rank. To see it, the worker
# `workers/ch02_internals.py --part broadcast` gives each rank a different seed (seed + 1000·rank) and
# reads the weights before and after `DDP(model)`.
#
# **Predict**: after wrapping, whose weights does rank 3 hold? And the buffer `in_scale`, which no
# optimizer ever touches?

# %%
bcast = cu.run("workers.ch02_internals", world_size=4, **LIMITS, part="broadcast")
rank0_start = bcast[0]["before"]
for r, d in enumerate(bcast.ranks):
    print(f"rank {r}: started equal to rank 0: {torch.equal(d['before']['params'], rank0_start['params'])}; "
          f"after DDP(model): parameters == rank 0's start: {torch.equal(d['after']['params'], rank0_start['params'])}, "
          f"in_scale == rank 0's: {torch.equal(d['after']['in_scale'], rank0_start['in_scale'])}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_broadcast(bcast), "02_broadcast");

# %% [markdown]
# Left, the first eight weights of `fc1` on each rank before `DDP(model)`: four different initialisations.
# Right, after: every rank holds rank 0's values (the lines above check the `in_scale` buffer too).
# Constructing DDP is a broadcast from rank 0.

# %% [markdown]
# Buffers matter as much as parameters: a BatchNorm's running statistics are buffers, and ranks with
# different buffers compute different forwards. (With `broadcast_buffers=True`, the default, DDP also
# re-broadcasts buffers from rank 0 before every forward.)
#
# ### 3b. Gradients averaged during `backward()`, the optimizer unchanged
#
# DDP registers an autograd hook on every parameter. When a parameter's gradient has been accumulated,
# its hook fires; DDP copies that gradient into a flat bucket, and when a bucket is complete it launches
# an asynchronous all-reduce of it. At the end of `backward()` DDP waits for the all-reduces and writes the
# averaged result back into each `.grad`. (PyTorch's default hook divides by the world size *before* the
# sum, to keep fp16 gradients from overflowing.) So when `backward()` returns, `.grad` already holds the
# average, and the optimizer needs no change at all.
#
# The `average` part checks all three claims at world 4: the gradient DDP leaves equals the mean of what
# each rank computes alone (on a plain copy of the model), it is not what the rank computes alone, and
# the SGD step is exactly `w - lr * grad`.

# %%
avg = cu.run("workers.ch02_internals", world_size=4, **LIMITS, part="average")
local = torch.stack(avg.gather("local_grad"))  # [world, P]: each rank's gradient on its own rows
ddp_grad = avg.gather("ddp_grad")
mean_local = local.mean(dim=0)
print("DDP's .grad == mean over ranks of the local gradients (fp32 tol):",
      all(torch.allclose(g, mean_local, **FP32_TOL) for g in ddp_grad))
print("DDP's .grad is the same on every rank, bit for bit:", all(torch.equal(g, ddp_grad[0]) for g in ddp_grad))
print("DDP's .grad differs from rank 0's local gradient:", not torch.allclose(ddp_grad[0], local[0], **FP32_TOL))
step_ok = all(torch.allclose(d["weights_after"], d["weights_before"] - d["lr"] * d["ddp_grad"], atol=1e-7, rtol=0)
              for d in avg.ranks)
print("optimizer step is plain SGD on that .grad (w_after == w_before - lr * grad, atol 1e-7):", step_ok)

# %% [markdown]
# ### 3c. Buckets: how many all-reduces you pay for
#
# Why not all-reduce each gradient as soon as it is ready? Every collective costs a fixed latency
# (the $\alpha$ of chapter 01's $t = \alpha + S/\beta$) plus its bytes, and a model has hundreds of parameter
# tensors: paying $\alpha$ hundreds of times is slow. Why not one all-reduce for everything at the end?
# Then no communication overlaps the backward. DDP packs gradients into **buckets** of about
# `bucket_cap_mb` (default 25 MiB) in the order they become ready (last layer first), and all-reduces each
# bucket as soon as it is full, while the backward continues through earlier layers.
#
# The rule, from `compute_bucket_assignment_by_size` in PyTorch's `reducer.cpp`: walk the gradients in
# ready order, add each to the open bucket, and close the bucket **as soon as it holds at least the cap**.
# One more detail, the kind you only learn by measuring: on the *first* iteration DDP does not yet know the
# real order in which gradients become ready, so it puts everything into a single bucket, and rebuilds the
# buckets from the observed order before the second iteration.
#
# The model here is 6 square `Linear(256, 256)` layers: each holds 256·256 + 256 fp32 numbers, 263,168
# bytes (257 KiB). A comm hook (`ddp.register_comm_hook`) that counts and then calls PyTorch's default
# all-reduce hook sees every all-reduce DDP launches.
#
# **Predict** with `bucket_cap_mb=0.5` (524,288 bytes): how many all-reduces in step 1? In step 2? And
# with the default cap (25 MiB, but the first bucket capped at 1 MiB)?

# %%
caps = [0.1, 0.25, 0.5, 1.0, 2.0]
bucket_runs = {f"{cap:g}": cu.run("workers.ch02_internals", world_size=2, **LIMITS, part="buckets",
                                  bucket_cap_mb=cap) for cap in caps}
bucket_runs["default"] = cu.run("workers.ch02_internals", world_size=2, **LIMITS, part="buckets", default_cap=True)
print(ch02.bucket_table(bucket_runs))

# %%
for label, res in bucket_runs.items():
    d = res[0]
    measured_later = d["all_reduce_bytes"][1:]
    print(f"cap {label:>7}: step 1 is one bucket of all {d['all_reduce_bytes'][0][0]:,} bytes: "
          f"{d['all_reduce_bytes'][0] == d['predicted']['first_iteration']}; every later step matches the "
          f"rule: {all(m == d['predicted']['rebuilt'] for m in measured_later)}; DDP's own log agrees: "
          f"{d['ddp_logging']['rebuilt_bucket_sizes'] == ', '.join(map(str, d['predicted']['rebuilt']))}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_bucket_counts(bucket_runs), "02_bucket_counts");

# %% [markdown]
# At 0.1 and 0.25 MiB a single layer (bias, then weight: 263,168 bytes) already reaches the cap, so there
# is one bucket per layer. At 1 MiB the bucket closes after four layers (4 × 263,168 = 1,052,672 ≥
# 1,048,576), and the two layers left make a second one.
# The default is not "one bucket": its first bucket is capped at 1 MiB so that communication starts early.
#
# When does each all-reduce start? The worker also records the moment each gradient lands in `.grad`
# (`register_post_accumulate_grad_hook`). Here is the second step's backward at `bucket_cap_mb=0.5`:

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_bucket_timeline(bucket_runs["0.5"], step=1), "02_bucket_timeline");

# %%
events = [e for e in bucket_runs["0.5"][0]["events"] if e["step"] == 1]
print(" -> ".join(f"grad {e['param']}" if e["kind"] == "grad" else f"ALL-REDUCE bucket {e['bucket']}"
                  for e in events))

# %% [markdown]
# The all-reduce of bucket 0 (layers 5 and 4) is launched while the gradients of layers 3 to 0 are still
# to be computed: that is the overlap of communication with backward. Only the last bucket's all-reduce
# is exposed at the end. (On this CPU, gloo runs the all-reduce on its own thread; on a GPU, NCCL runs it
# on a separate CUDA stream.)
#
# Explore: change the cap and the depth, and watch the buckets and the timeline (world 2, real ranks,
# every change is a new run).

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider


def draw_live(res, params):
    d = res[0]
    fig = ch02.draw_bucket_timeline(res, step=1)
    fig.axes[0].set_title(f"cap {params['bucket_cap_mb']:g} MiB, {params['layers']} layers: "
                          f"{len(d['all_reduce_bytes'][1])} all-reduces per backward (predicted "
                          f"{len(d['predicted']['rebuilt'])}); {len(d['all_reduce_bytes'][0])} in the first step, "
                          "before DDP rebuilds its buckets")
    return fig


live = LiveRun("workers.ch02_internals",
               {"bucket_cap_mb": W.FloatSlider(value=0.5, min=0.05, max=2.0, step=0.05, description="bucket_cap_mb",
                                               continuous_update=False, style={"description_width": "initial"}),
                "layers": slider("layers", 6, 1, 12)},
               draw_live, params={"part": "buckets", "world_size": 2, "steps": 2}, timeout=60)
live.wait(60)
live

# %% [markdown]
# ### 3d. Overlap by hand: asynchronous all-reduces launched from inside backward
#
# Exercise 1's hooks all-reduce each gradient *synchronously*: backward stands still while every message
# travels. Exercise 2 buckets the gradients but averages them after backward: nothing travels while backward
# computes. DDP does neither. `workers/data_parallel/overlap.py: OverlappedDDP` is its mechanism in 150 lines:
# a post-accumulate-grad hook on every parameter counts each bucket's gradients in; when the last one lands the
# bucket is flattened, pre-scaled by 1/N and launched with `dist.all_reduce(buf, async_op=True)`, which returns
# at once with a handle; backward goes on with the earlier layers while the bucket travels;
# `finish_gradient_synchronization()` (Megatron's name) waits for every handle and copies the averages back,
# before the optimizer step. It equals torch's DDP bit for bit at world 1 and 2 and to fp32 rounding at 4
# (`tests/test_ch02_overlap.py`). With `overlap=False` the same buckets leave only after backward: the contrast.

# %%
overlap_runs = {"overlap: launched from the hooks": cu.run("workers.ch02_overlap", world_size=2, **LIMITS,
                                                           bucket_cap_bytes=256),
                "no overlap: launched after backward": cu.run("workers.ch02_overlap", world_size=2, **LIMITS,
                                                              bucket_cap_bytes=256, overlap=False)}
for label, res in overlap_runs.items():
    d = res[0]
    summary = d["overlap"][1]
    print(f"{label}: {summary['buckets']} buckets {d['bucket_names']}; launched before backward's last gradient: "
          f"{summary['launched_before_last_grad']}; .grad equal to torch's DDP: "
          f"{all(torch.allclose(r['grads'], r['torch']['grads'], **FP32_TOL) for r in res.ranks)}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_overlap(overlap_runs), "02_overlap_timeline");

# %% [markdown]
# On this model the whole backward takes a fraction of a millisecond of CPU time, so the overlap buys little
# here; what matters is the order. In the top row bucket 0 (the last layer, whose gradients come first) leaves
# before backward has computed the first layer's gradients; by the time `finish` waits, it has often already
# arrived. In the bottom row both buckets leave after the last gradient and the step waits for all of them. On a
# GPU the same launches go to NCCL's own stream, and a bucket of a large model hides behind milliseconds of
# backward compute: that is why DDP buckets at all.

# %% [markdown]
# ## 4. Three mistakes that raise no error
#
# ### 4a. `DistributedSampler` without `set_epoch`
#
# `DistributedSampler` shuffles the dataset with a generator seeded by `seed + epoch`, the **same**
# permutation on every rank, and gives rank $r$ every $n$-th index starting at $r$. The sampler cannot
# know which epoch you are in: you tell it with `sampler.set_epoch(epoch)`.
#
# **Predict**: a dataset of 12 samples, world 2, three epochs, and `set_epoch` never called. What does
# rank 0 read in epoch 2?

# %%
samp = cu.run("workers.ch02_pitfalls", world_size=2, **LIMITS, part="sampler", dataset_size=12, epochs=3)
for r, d in enumerate(samp.ranks):
    print(f"rank {r} without set_epoch: {d['without_set_epoch']}")
    print(f"rank {r} with set_epoch:    {d['with_set_epoch']}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_sampler(samp), "02_set_epoch");

# %% [markdown]
# Without `set_epoch` every epoch is epoch 0: the same samples, in the same order, on the same ranks.
# Nothing crashes and the loss still goes down, but you trained on one fixed ordering, and the ranks
# never see each other's samples. In both cases the shards of one epoch are disjoint and cover the
# dataset: the sampler gets the *partition* right by itself; only the *reshuffle* needs you.
#
# ### 4b. `reduction="sum"` instead of `"mean"`
#
# DDP always divides the summed gradient by the world size. That is the right thing for a mean loss
# (section 1). With a summed loss, each rank's gradient is a sum over its $B/n$ rows; DDP averages those,
# so the result is $\frac{1}{n}$ of the single-process summed gradient. The effective learning rate now
# shrinks as you add GPUs.
#
# **Predict**: at world 4, what is DDP's gradient with `reduction="sum"` divided by the single-process
# gradient with `reduction="sum"`?

# %%
red_ref = ch02.reduction_reference(setup)
red_runs = {w: cu.run("workers.ch02_pitfalls", world_size=w, **LIMITS, part="reduction") for w in (1, 2, 4)}
ratios = ch02.reduction_ratios(red_runs, red_ref)
for w, r in ratios.items():
    print(f"world {w}: mean-loss DDP / single = {r['mean']:.4f}   sum-loss DDP / single = {r['sum']:.4f}"
          f"   (1/{w} = {1 / w:.4f})")

# %% tags=["nbval-ignore-output"]
for w, r in ratios.items():
    print(f"world {w}: largest deviation from an exact rescaling: mean {r['mean_residual']:.1e}, sum {r['sum_residual']:.1e}")
plots.savefig(ch02.draw_reduction(ratios), "02_reduction");

# %% [markdown]
# With `"mean"` the ratio is 1 at every world size; with `"sum"` it is exactly $1/n$. A recipe tuned on one
# GPU with a summed loss trains with a 4× smaller step on 4 GPUs. (Token-level losses in language models
# raise the same question: average over tokens *per rank* or over the *global* batch; when ranks hold
# different numbers of tokens, DDP's plain average is not the global mean.)
#
# ### 4c. Gradient accumulation and `no_sync`
#
# To train with a batch larger than fits, accumulate gradients over $k$ micro-batches before stepping:
# divide each micro-batch's loss by $k$, call `backward()` $k$ times, then step. Under DDP every
# `backward()` all-reduces, so $k$ micro-batches cost $k$ rounds of all-reduces, of which $k-1$ are wasted:
# the sum of averages equals the average of sums. `with ddp.no_sync():` turns the hooks' communication off;
# the gradients accumulate locally, and the one backward outside the context all-reduces the total.
#
# **Predict**: with $k=4$ micro-batches, how many all-reduces does one optimizer step cost with and
# without `no_sync`? Are the two gradients equal, and equal to one big batch of $4B$ rows in one process?

# %%
from workers.data_parallel.model import accumulated_reference

rows = []
for k in (1, 2, 4, 8):
    res = cu.run("workers.ch02_pitfalls", world_size=2, **LIMITS, part="no_sync", accumulation=k)
    ref = accumulated_reference(setup, k)
    d = res[0]
    rows.append({"k": k, "with": d["with_no_sync"]["all_reduces"], "without": d["without_no_sync"]["all_reduces"],
                 "equal": all(torch.allclose(r[m]["grad"], ref, **FP32_TOL) for r in res.ranks
                              for m in ("with_no_sync", "without_no_sync"))})
for row in rows:
    print(f"k={row['k']}: all-reduces per optimizer step with no_sync {row['with']}, without {row['without']}; "
          f"both gradients equal the {row['k']}B-row single-process gradient: {row['equal']}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch02.draw_no_sync(rows), "02_no_sync");

# %% [markdown]
# Both are correct; one talks $k$ times as much. On a fast network the extra all-reduces may hide behind
# the backward; at scale they do not. (Forgetting the $1/k$ is the other classic: gradients $k$ times too
# large, the same trap as 4b.)

# %% [markdown]
# ## 5. Exercises: DDP by hand
#
# Each function below runs **on real ranks** (world 2, then 4) when you run its check cell. Write imports
# inside the function: it is shipped to the ranks as source.
#
# ### Exercise 1: broadcast and per-parameter hooks
#
# Write `ddp_by_hand(model)`. It is called once, on every rank, on a model whose weights differ from rank
# to rank. Afterwards, plain `loss.backward()` followed by a plain SGD step must train exactly like the
# single-process baseline (the check runs 3 steps and compares gradients and weights after each).
#
# 1. Broadcast every parameter **and buffer** from rank 0 (`dist.broadcast(t.data, src=0)`).
# 2. For every parameter, register a hook that runs once its gradient is ready and replaces `.grad` by its
#    average over ranks: all-reduce (a sum), then divide by `dist.get_world_size()`.
#    `param.register_post_accumulate_grad_hook(hook)` is the right place. Read its documentation
#    carefully: what is the hook's argument?
#
# You may return the hook handles.

# %% tags=["exercise"]
def ddp_by_hand(model):
    raise NotImplementedError


# %% tags=["check"]
from course_utils.exercises import check

check("ddp_by_hand", ddp_by_hand)

# %% [markdown]
# ### Exercise 2: buckets
#
# Write `bucketed_average(grads, bucket_bytes)`: average a list of gradient tensors over the ranks **in
# place**, with one `dist.all_reduce` per bucket. Pack the gradients with DDP's rule: walk `grads` in the
# given order, add each to the open bucket, and close the bucket as soon as it holds **at least**
# `bucket_bytes` bytes (`numel() * element_size()`); a last, partly filled bucket is all-reduced too.
# For each bucket: flatten its gradients into one tensor (`torch.cat`), all-reduce it, divide by the world
# size, and copy the slices back into the gradients. The check counts your `all_reduce` calls and their
# sizes for several `bucket_bytes`.

# %% tags=["exercise"]
def bucketed_average(grads, bucket_bytes):
    raise NotImplementedError


# %% tags=["check"]
check("bucketed_average", bucketed_average)

# %% [markdown]
# ### Exercise 3: a sampler by hand
#
# Write `shard_indices(dataset_size, rank, world_size, epoch, seed)`: the list of sample indices rank
# `rank` reads in `epoch`. Every rank must get `ceil(dataset_size / world_size)` indices (pad by repeating
# indices from the start of the permutation), the ranks together must cover every sample, each epoch must
# have a new order, and the same arguments must always give the same answer. Hint: one
# `torch.randperm` with a `torch.Generator` seeded from `seed` and `epoch`, the same on every rank; then
# every `world_size`-th index. (This is `DistributedSampler(shuffle=True)`; the check verifies the
# properties on real ranks, which is what matters.)

# %% tags=["exercise"]
def shard_indices(dataset_size, rank, world_size, epoch, seed):
    raise NotImplementedError


# %% tags=["check"]
check("shard_indices", shard_indices)

# %% [markdown]
# ### Exercise 4: overlap
#
# Write `overlapped_hooks(params, buckets)`: `buckets` lists, bucket by bucket, indices into `params` (DDP's rule,
# last layer first). Register a post-accumulate-grad hook on every parameter so that when the **last** gradient
# of a bucket lands, the bucket is flattened (`torch.cat`), divided by the world size and sent with
# `dist.all_reduce(flat, async_op=True)`, during backward; return a function `finish()` that waits for every
# handle and copies the averages back into each `.grad`. The check wraps `dist.all_reduce` on the ranks: it sees
# when you launch (each bucket as soon as its last gradient lands, before backward computes the next ones),
# whether you launch asynchronously, and whether you wait inside backward. It also tries a model with a
# LayerNorm, whose weight's gradient lands before its bias's (not in the bucket's listed order), where `.grad`
# already holds an earlier micro-batch's gradient that backward adds to.

# %% tags=["exercise"]
def overlapped_hooks(params, buckets):
    raise NotImplementedError


# %% tags=["check"]
check("overlapped_hooks", overlapped_hooks)

# %% [markdown]
# ## Summary
#
# - DDP = a broadcast at construction + an all-reduce-and-average of every gradient during `backward()`:
#   bucket by bucket, each launched asynchronously as soon as it fills and waited for before the step.
#   With a mean loss and equal shards this is the single-process step, to fp32 rounding, and all ranks
#   stay bit-identical.
# - Gradients travel in buckets, packed in backward order and launched as soon as full, so communication
#   overlaps the rest of the backward. `bucket_cap_mb` sets how many all-reduces you pay for; the first
#   iteration is a single bucket while DDP learns the order.
# - Three silent mistakes: no `set_epoch` (one ordering forever), a summed loss (gradient scale $1/n$), and
#   accumulation without `no_sync` ($k$ times the communication).
#
# Next, chapter 03 puts collectives *inside* autograd, the building block of tensor parallelism; chapter 11
# shards what DDP replicates (optimizer state, gradients, parameters: ZeRO).

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
