# %% [markdown]
# # 11 · ZeRO and FP8: the memory ledger
#
# A GPU training a transformer holds four things: **parameters**, **gradients**, **optimizer states** and
# **activations**. The first three (the *model states*) do not depend on the batch; plain data parallelism
# copies all three onto every GPU, which is pure redundancy. ZeRO (Rajbhandari et al. 2020) removes it one state
# at a time. FP8 attacks from the other side: fewer bytes per number, for the matmuls and what they save.
#
# In this chapter we keep the ledger honest: every prediction comes from `course_utils.ledger` (formulas from
# the papers, tested against the papers' own numbers), and every measurement comes from real ranks, counted from
# the tensors themselves. GPU-only numbers (`torch.cuda.memory_allocated`, FP8 tensor-core GEMMs) come from a
# GPU when there is one, and otherwise from data committed with the course, labelled with device and date; if
# neither exists, the notebook says so rather than invent them.

# %%
import matplotlib.pyplot as plt
import torch
from IPython.display import display

import course_utils as cu
from course_utils import ch11, plots, reference_data
from course_utils.exercises import check
from course_utils.fp8 import E4M3, E5M2
from course_utils.ledger import (GB, LINEAR_INPUT_TERMS, activation_bytes_per_layer, activation_terms_per_layer,
                                 fp8_linear_inputs_activation_bytes_per_layer, model_state_bytes)
from course_utils.tables import Table

plots.style()
torch.set_num_threads(1)  # the notebook's own tensors are small; one thread leaves the cores to the ranks

# %% [markdown]
# ## 1. The four states, and what ZeRO shards
#
# Mixed-precision Adam keeps 2 bytes of bf16 weight, 2 bytes of gradient and K = 12 bytes of optimizer state
# (fp32 master weight, momentum, variance) per parameter (ZeRO, section 3.1). With N_d data-parallel GPUs,
# stage 1 shards the optimizer states, stage 2 also the gradients, stage 3 also the parameters (section 5.1).
# The paper's Figure 1 example, 7.5B parameters on 64 GPUs:

# %%
rows = []
for stage in range(4):
    s = model_state_bytes(7.5e9, dp=64, zero_stage=stage)
    rows.append([["DDP", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)", "ZeRO-3 (P_os+g+p)"][stage],
                 f"{s.params / GB:.2f}", f"{s.grads / GB:.2f}", f"{s.optimizer / GB:.2f}", f"{s.total / GB:.1f}"])
display(Table(["stage", "params GB", "grads GB", "optimizer GB", "total GB"], rows,
              "7.5e9 parameters, N_d = 64 (Figure 1 prints 120, 31.4, 16.6, 1.9 GB)"))

# %% [markdown]
# Activations are the fourth state and ZeRO does not touch them: they depend on sequence length and micro-batch
# (Korthikanti et al. 2022, Table 2). The planner adds them. Llama 2 7B at sequence 4096 across data-parallel
# sizes: ZeRO-1 and 2 cut the 12-byte and 2-byte terms, ZeRO-3 the rest of the model states; the activations
# stay.

# %% tags=["nbval-ignore-output"]
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7.2))  # one above the other: side by side is shown at 60%
ch11.ledger_figure(ch11.ledger_plans("7B", (8, 64, 512)), "Llama 2 7B, seq 4096, micro-batch 1", ax=ax1)
ch11.ledger_figure(ch11.ledger_plans("70B", (1, 8, 32), tp=8, pp=4), "Llama 3 70B with tp=8, pp=4 (32 GPUs per replica)",
                   ax=ax2)
fig.tight_layout(h_pad=2.5)  # room between the upper panel's dp labels and the lower one's title
plots.savefig(fig, "11_ledger_states");

# %% [markdown]
# With TP and PP the ledger composes: each GPU first holds Ψ/(tp·pp) of the parameters, and ZeRO shards that
# slice over the DP ranks holding the same slice. For 70B with tp=8, pp=4, DDP already fits; ZeRO-1 then turns
# the first stage's 27 GB of optimizer state into 3.4 GB at dp=8 and 0.9 GB at dp=32. (In Megatron the
# distributed optimizer shards over DP x CP.)
#
# ### Exercise 1: the ZeRO ledger
# Write `zero_state_bytes(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12)`: a dict with the bytes per GPU
# of `"params"`, `"grads"` and `"optimizer"` (2-byte weights and gradients, `optimizer_bytes` per parameter of
# optimizer state), when TP and PP split the model before ZeRO shards it over `dp` ranks.

# %% tags=["exercise"]
def zero_state_bytes(n_params, dp, stage, tp=1, pp=1, optimizer_bytes=12):
    """Bytes per GPU of parameters, gradients and optimizer states: dict(params=..., grads=..., optimizer=...)."""
    raise NotImplementedError


# %% tags=["check"]
check("zero_state_bytes", zero_state_bytes)

# %% [markdown]
# ## 2. ZeRO-1 by hand, on real ranks
#
# `workers/zero/zero1.py` wraps any torch optimizer (`Zero1Optimizer(model.parameters(), torch.optim.AdamW,
# lr=...)`). One step on N data-parallel ranks:
#
# 1. backward as usual: each rank has the gradient of its own B/N rows;
# 2. **reduce-scatter** the gradients: rank r receives the sum over ranks of *its shard only*, and divides by N;
# 3. the wrapped optimizer steps **only rank r's shard**, so only that shard has Adam moments;
# 4. **all-gather** the updated shards: every rank holds the full, updated model again.
#
# Steps 2 and 4 move exactly the bytes of DDP's all-reduce (a ring all-reduce *is* a reduce-scatter followed by
# an all-gather): the optimizer memory drops N times for free (ZeRO, section 7.2.1).
#
# **How to partition.** Laying all parameters end to end in one flat buffer and giving rank r elements
# [rS, (r+1)S) makes every shard the same size, S = ⌈Ψ/N⌉, so the bytes match the ledger's KΨ/N exactly; the
# price is that a shard may cut a tensor in two, which is exact only for *elementwise* optimizers (SGD, Adam,
# AdamW). Giving each rank whole tensors (largest first to the least-loaded rank, like torch's
# `ZeroRedundancyOptimizer`) works for any optimizer, including those that look at a whole matrix (LAMB,
# Adafactor, Muon), but the shards are only as even as the tensor sizes allow. `partition="flat"` is the
# default; `partition="params"` is the other choice. Either way the model's parameters become views of one flat
# buffer and their `.grad` views of a flat gradient buffer, so backward accumulates straight into it and a tied
# weight (here the embedding and the LM head share one `Parameter`) is one tensor, stepped once.
#
# The test bed is the course's GPT with a tied embedding and no QKV bias (`workers/zero/model.py` sets it up from
# `workers/model/gpt.py`). Every rank starts from its
# own random weights (the optimizer's broadcast must equalise them), trains on its B/N rows, and alongside
# trains the **single-process reference**: the whole batch, a plain unsharded `torch.optim.AdamW`. The first
# run at each world size starts its ranks (seconds); later runs reuse them.

# %%
adamw = {w: cu.run("workers.ch11_zero1", w, optimizer="adamw", timeout=240) for w in (1, 2, 4)}

# %% tags=["nbval-ignore-output"]
for w, res in adamw.items():
    r0 = res[0]
    print(f"world {w}: max |w - reference| after construction and each step: "
          + ", ".join(f"{e:.1e}" for e in r0["max_abs_error"])
          + f" | identical on every rank: {all(res.gather('equal_to_rank0'))}")

# %% [markdown]
# At world 1 the sharded optimizer *is* the unsharded one, bit for bit. At worlds 2 and 4 the weights differ
# from the single process by up to a few 1e-5, a few 1e-3 x the learning rate (how much depends on the CPU's
# kernels: 1e-7 to 3.5e-5 over those we measured): the n ranks add the gradient in a different order than one
# process does, and **Adam divides each update by the size of that element's own gradient**, so
# a rounding difference of 1e-7 on a gradient of 1e-4 becomes a relative difference of 1e-3 in the update. (SGD,
# below, stays at 1e-7.) The check that isolates the sharding: feed a plain unsharded AdamW the *same averaged
# gradient* (`grad_sync="all_reduce"` leaves it in every `.grad`) and compare.

# %%
# = 0.02 x lr: fp32 reordering of small gradients, amplified by Adam's normalisation. The largest difference
# is an extreme value that depends on this CPU's kernels: 1e-7 to 3.5e-5 over the CPUs and seeds we measured.
TOL_ADAM = 2e-4
same = cu.run("workers.ch11_zero1", 4, optimizer="adamw", grad_sync="all_reduce", timeout=120)
sgd = {w: cu.run("workers.ch11_zero1", w, optimizer="sgd", timeout=120) for w in (1, 2, 4)}
for w, res in adamw.items():
    print(f"AdamW, world {w}: within {TOL_ADAM:g} of the single process: "
          f"{max(res[0]['max_abs_error']) <= TOL_ADAM}; ranks identical: {all(res.gather('equal_to_rank0'))}; "
          f"tied weight still one Parameter: {all(res.gather('tied'))}")
same_diff = max(max(e) for e in same.gather("same_grad_max_abs_error"))
print(f"AdamW, world 4, same gradients as an unsharded AdamW: max difference {same_diff} "
      f"({'bitwise equal' if same_diff == 0 else 'NOT bitwise equal'})")
for w, res in sgd.items():
    print(f"SGD + momentum, world {w}: within 1e-6 of the single process: {max(res[0]['max_abs_error']) <= 1e-6}")

# %% [markdown]
# **Predict, then measure.** The model has 27,840 parameters (fp32 here) and AdamW keeps two fp32 tensors per
# parameter (`exp_avg`, `exp_avg_sq`): K = 8 bytes. How many bytes of optimizer state does each rank hold at
# world 4? Write your number down, then run the cell: it sums `nbytes` over every tensor in each rank's
# `optimizer.state` (the 4-byte `step` counter Adam keeps per tensor is reported apart: the ledger leaves it out).

# %%
params_part = {w: cu.run("workers.ch11_zero1", w, optimizer="adamw", partition="params", timeout=120) for w in (1, 2, 4)}
mixed = cu.run("workers.ch11_zero1", 4, optimizer="adamw", dtype="bfloat16", master_weights=True, timeout=120)
measured = {f"AdamW flat, N={w}": r for w, r in adamw.items()}
measured |= {f"SGD flat, N={w}": r for w, r in sgd.items()}
measured |= {f"AdamW whole tensors, N={w}": r for w, r in params_part.items()}
measured["bf16 + fp32 master, AdamW, N=4"] = mixed
display(Table(["run", "N", "parameters", "K", "measured bytes per rank", "ledger K·Ψ/N", "verdict"],
              ch11.bytes_rows(measured), "optimizer-state bytes per rank, measured on real ranks vs the ledger"))
print("scalar bookkeeping per rank (Adam's step counters):", adamw[4].gather("state_bytes")[0]["scalars"], "bytes")

# %% [markdown]
# The flat partition matches the ledger to the byte at every N, for AdamW (K = 8), SGD with momentum (K = 4),
# and mixed precision, where the fp32 master shard joins the moments to make the paper's K = 12. Whole-tensor
# shards are balanced only to within the largest tensor (here the 128 x 32 MLP weights): the sum is exact,
# the split is not.

# %% tags=["nbval-ignore-output"]
ax = ch11.bytes_figure(adamw, params_part)
plots.savefig(ax.figure, "11_zero1_bytes");

# %% [markdown]
# ## 3. Memory at the four moments of a step
#
# `workers/ch11_memory.py` trains a GPT in bf16 with fp32 master weights and AdamW, as DDP (`zero=0`)
# or ZeRO-1, and records memory after init, after the forward pass, after the backward pass and after the
# optimizer step. On any machine it *accounts* bytes from the tensors themselves: the flat weight and gradient
# buffers, the optimizer's state tensors, and the activations: every tensor autograd saves for backward
# (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded, is watched through a weak reference, and at
# each moment the worker adds up the bytes of those *still alive* (each tensor's own elements; memory two saved
# tensors share, such as SDPA's output and the output projection's input, counted once). On a GPU it also
# records `torch.cuda.memory_allocated`. Here, on the CPU, a small shape (h = 128, 2 layers), every moment of
# both steps:

# %%
SMALL = dict(hidden=128, heads=4, layers=2, vocab=512, seq=128, micro_batch=2, steps=2)
memory_runs = {
    "DDP, N=1": cu.run("workers.ch11_memory", 1, zero=0, timeout=240, **SMALL)[0],
    "DDP, N=2": cu.run("workers.ch11_memory", 2, zero=0, timeout=240, **SMALL)[0],
    "ZeRO-1, N=2": cu.run("workers.ch11_memory", 2, zero=1, timeout=240, **SMALL)[0],
    "ZeRO-1, N=4": cu.run("workers.ch11_memory", 4, zero=1, timeout=240, **SMALL)[0],
}
display(Table(["run", "moment", "params", "grads", "optimizer", "activations", "saved tensors alive",
               "ledger: model states"], ch11.moment_rows(memory_runs),
              f"rank 0, bytes accounted from tensors (CPU), {memory_runs['DDP, N=1']['n_params']:,} parameters"))

# %% [markdown]
# Model states match the ledger to the byte at every moment (the optimizer column adds Adam's 4-byte step
# counter), including the jump at the first step: until step 1's optimizer step the optimizer column holds only
# the fp32 master weights (4 bytes per parameter, over N with ZeRO-1), and from then on also Adam's two moments
# (12 bytes per parameter). The saved tensors are alive after the forward pass and none is left after backward,
# and the activation bytes are the same at N = 1, 2 and 4: ZeRO-1 does not touch them.
#
# Is that zero after backward measured, or merely assumed? The same run with two classic mistakes:
# `loss.backward(retain_graph=True)`, and a forward hook that keeps every block's output "for logging":

# %%
for leak in ("retain_graph", "stash"):
    r = cu.run("workers.ch11_memory", 1, zero=0, leak=leak, timeout=240, **SMALL)[0]
    after = {m["moment"]: m for m in ch11.moments_of(r)}
    print(f"leak={leak}: activations after backward {after['backward']['accounted']['activations']:,} bytes "
          f"({after['backward']['saved_tensors_alive']} saved tensors alive), after the step "
          f"{after['step']['accounted']['activations']:,} bytes")

# %% [markdown]
# With `retain_graph=True` the whole graph, and every tensor it saved, stays alive as long as `loss` does; the
# hook keeps two block outputs (2sbh each), which autograd had saved for the next LayerNorm.
#
# **Against Korthikanti's formula.** The ledger's activation line is Korthikanti et al. (2022), Table 2 with
# selective recomputation: 34 sbh bytes per layer. Section 4.1 derives it term by term, and two of its terms,
# the attention and MLP dropout masks (1 sbh each), do not exist in this block, which has no dropout; the other
# 32 sbh do. What the worker accounts also holds things the formula leaves out. Term by term, for the run above:

# %%
r = memory_runs["DDP, N=1"]
cfg = r["config"]
measured_act = next(m for m in ch11.moments_of(r) if m["moment"] == "forward")["accounted"]["activations"]
terms = ch11.activation_terms(cfg)
predicted = sum(t["bytes"] for t in terms)
display(Table(["saved for backward", "where it comes from", "bytes"],
              [[t["term"], t["source"], f"{t['bytes']:,}"] for t in terms]
              + [["sum", "", f"{predicted:,}"], ["measured after the forward pass (all four runs)", "",
                                                 ", ".join(f"{ch11.moments_of(m)[1]['accounted']['activations']:,}"
                                                           for m in memory_runs.values())]],
              f"activations of the {cfg['layers']}-layer GPT, b = {cfg['micro_batch']}, s = {cfg['seq']}, "
              f"h = {cfg['hidden']}, V = {cfg['vocab']}, bf16, rank 0"))
formula = ch11.ledger_moments(cfg, r["n_params"])["forward"]["activations"]
korthikanti = activation_terms_per_layer(cfg["seq"], cfg["micro_batch"], cfg["hidden"], cfg["heads"],
                                         recompute="selective")
masks = cfg["layers"] * sum(v for term, v in korthikanti.items() if "dropout" in term)
print(f"measured {measured_act:,} bytes; term by term {predicted:,}: "
      f"{'equal' if measured_act == predicted else f'differ by {measured_act - predicted:+,}'}")
print(f"the ledger's formula, 34 sbh x {cfg['layers']} layers = {formula:,.0f} bytes: {masks:,.0f} of it dropout "
      f"masks this block does not have, and {measured_act - terms[0]['bytes']:,} measured bytes outside its terms")

# %% [markdown]
# The sum of the terms is the measurement to the byte, at every N. So the formula is right about what it counts,
# and we can say exactly where it differs for this model: it counts 2 sbh per layer of dropout masks that do not
# exist here, and it leaves out the LayerNorm statistics and SDPA's log-sum-exp (tens of bytes per token and
# layer, against 32h: nothing at h = 2048) and everything outside the layers, above all the loss's fp32
# log-probabilities, b·s·V·4 bytes: with a 512-token vocabulary and h = 128 they are about a fifth of the total.
# That is why the measurement exceeds the formula although the formula holds masks the block lacks.

# %% tags=["nbval-ignore-output"]
fig = ch11.moments_figure(memory_runs, title="accounted tensor bytes per rank, CPU (gloo): not allocator measurements; "
                                              "black: the ledger")
plots.savefig(fig, "11_memory_moments_cpu");

# %% [markdown]
# ### The same on a GPU, for a model of about 1B parameters
# `tools/gpu/ch11_memory.sh` runs the worker's default shape (l = 20, h = 2048, V = 32000, s = 2048: 1.08e9
# parameters) on a GPU, records `torch.cuda.memory_allocated` at the four moments for DDP and ZeRO-1 at world 1
# (NCCL) and 2 (two ranks on one GPU, gloo on CUDA tensors), and commits the result as
# `data/gpu/ch11_memory_h200.json`, with device, versions and date.

# %% tags=["nbval-ignore-output"]
gpu = ch11.gpu_data("memory")
if torch.cuda.is_available():
    print("A GPU is visible: measuring live, DDP and ZeRO-1 at world 1 and 2 (this takes a few minutes).")
    live = ch11.live_memory_record(worlds=(1, 2), zero_stages=(0, 1))
    fig, text = ch11.gpu_memory_report(live)
    print(text)
    plots.savefig(fig, "11_memory_moments_gpu")
elif gpu is not None:
    fig, text = ch11.gpu_memory_report(gpu)
    print(text)
    if fig is not None:
        plots.savefig(fig, "11_memory_moments_gpu")
else:
    print("The GPU measurement has not been run yet: no GPU here, and no data/gpu/ch11_memory_*.json committed.\n"
          "Run `bash tools/gpu/ch11_memory.sh` on a machine with a GPU and commit the JSON it writes.\n"
          "Until then, the ledger's prediction for that run (GiB per rank, steady state after a step):")
    cfg = dict(layers=20, hidden=2048, heads=16, vocab=32000, seq=2048, micro_batch=2, dtype="bfloat16",
               optimizer="adamw")
    n_1b = 12 * 20 * 2048**2 + 10 * 20 * 2048 + (32000 + 2048) * 2048 + 2 * 2048
    for z, w in ((0, 1), (0, 2), (1, 2)):
        pred = ch11.ledger_moments({**cfg, "zero": z, "world_size": w}, n_1b)
        print(f"  {'DDP' if z == 0 else 'ZeRO-1'}, N={w}: " + ", ".join(
            f"{moment} {sum(v.values()) / 2**30:.1f}" for moment, v in pred.items()))

# %% [markdown]
# ### Exercise 2: the sharded optimizer step
# Write `zero1_step(params, state, make_optimizer)`, called on every rank after backward:
#
# - `params`: the model's parameters (each tensor once, the tied one included); each `.grad` holds *this
#   rank's* local gradient;
# - `state`: a dict kept between calls (empty at the first call): keep your shard and your optimizer in it;
# - `make_optimizer(tensors)`: returns a torch optimizer over the tensors you give it (SGD with momentum).
#
# Average the gradients over the ranks, step only this rank's 1/N of the elements with an optimizer that holds
# state for that shard alone, then leave the full updated parameters on every rank. The check runs your function
# on 2 and 4 real ranks for three steps against the unsharded single-process SGD, and measures the state your
# optimizers hold. (Why SGD? Adam normalises away a gradient that is N times too large, so a missing average
# would go unnoticed.)

# %% tags=["exercise"]
def zero1_step(params, state, make_optimizer):
    """One ZeRO-1 step: average the gradients, step only this rank's shard, re-synchronise the parameters."""
    import torch
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("zero1_step", zero1_step)

# %% [markdown]
# ## 4. ZeRO-2 and ZeRO-3 by hand, and PyTorch's FSDP2
#
# ZeRO-1 still holds a whole gradient on every rank until the step. **ZeRO-2** (`workers/zero/zero2.py`) does
# not: it packs the parameters into buckets with DDP's rule (chapter 02), and a post-accumulate-grad hook on every
# parameter launches an asynchronous **reduce-scatter** of a bucket as soon as its last gradient lands, *during*
# backward, then drops that bucket's `.grad`. A rank keeps only its 1/N shard of each reduced gradient; the
# optimizer steps its shards and an all-gather after the step hands every rank the whole updated model. Same
# bytes on the wire as DDP, 2Ψ(N-1)/N (ZeRO, section 7.2.1).

# %%
z2 = cu.run("workers.ch11_zero2", 4, timeout=240)
for rank, r in enumerate(z2.ranks):
    print(f"rank {rank}: within {TOL_ADAM:g} of one process: {max(r['max_abs_error']) <= TOL_ADAM}; "
          f"whole gradients in .grad at most {max(r['peak_grad_bytes']):,} bytes of {r['param_bytes']:,}; "
          f"gradient shard {r['grad_shard_bytes']:,} bytes, AdamW state {r['state_bytes']:,} bytes")
r = z2[0]
padded = 4 * sum(s * 4 for s in r["shard_size"])
print(f"{r['buckets']} buckets; reduce-scatters launched before backward ended, per step: {r['launches_in_backward']}; "
      f"sent per step {sum(r['comm_bytes'].values()) / r['steps']:,.0f} bytes = 2Ψ(n-1)/n = {2 * 3 / 4 * padded:,.0f}")

# %% [markdown]
# ### Exercise 3: ZeRO-2's gradient hook
# Write `zero2_grad_hooks(params, grad_shard)`: register hooks on `params` (the model's parameters, the tied
# weight once) so that when the **last** of them receives its gradient during backward, the gradients are laid
# end to end in the order of `params`, padded with zeros to N x S elements (S = `grad_shard.numel()`), and this
# rank's slice of their **mean over the ranks** lands in `grad_shard`, and no parameter keeps a whole `.grad`.
# Return the hook handles. (One bucket here, the whole model; `Zero2Optimizer` does the same per bucket.) The
# check runs a backward on 2 and 4 ranks and compares your shard with one process's gradient, for a model whose
# parameter count needs padding and one whose count splits evenly (its parameters listed in reverse, so the last
# gradient to land is not the last in the list); it also notes which collectives your hook ran, and how many bytes.

# %% tags=["exercise"]
def zero2_grad_hooks(params, grad_shard):
    """Post-accumulate-grad hooks: reduce-scatter the mean gradient into grad_shard when the last one lands."""
    import torch
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("zero2_grad_hooks", zero2_grad_hooks)

# %% [markdown]
# **ZeRO-3** shards the parameters too (`workers/zero/zero3.py`, FSDP's algorithm: Zhao et al. 2023). The model is
# cut into *units*, one per block plus a root (the tied embedding and head, positions, final LayerNorm). A unit's
# parameters live in one flat buffer, padded to N equal shards; a rank keeps its shard and frees the buffer's
# storage. Just before a unit's forward (a forward-pre hook) the shards are **all-gathered**; after it the buffer
# is freed again (`reshard_after_forward`); when the gradient of the unit's output arrives (a hook on that
# tensor) it is gathered once more for backward; when the unit's last gradient lands, its gradients are
# **reduce-scattered** and the buffer freed. With **prefetch** the next unit's all-gather leaves while this one
# computes. Every unit is gathered twice and reduced once: 3Ψ(N-1)/N per step, 1.5x DDP (ZeRO, section 7.2.2).
#
# **Predict** before running: with 4 blocks on 2 ranks, how many blocks are whole at once at the peak in each
# setting below, and how many bytes does a rank send per step?

# %%
z3 = {setting: cu.run("workers.ch11_zero3", 2, layers=4, steps=1, prefetch=setting[0], reshard_after_forward=setting[1],
                      timeout=240)[0] for setting in ch11.ZERO3_SETTINGS}
display(Table(["setting", "peak whole params (bytes)", "root + blocks, from the units", "all-gathers + reduce-scatters",
               "sent per step (bytes)", "ZeRO paper", "verdict"], ch11.zero3_rows(z3),
              "ZeRO-3 by hand on 2 ranks, 4 blocks: measured on rank 0 vs the units' sizes and the paper's traffic"))
for setting, r in z3.items():
    print(f"{ch11.zero3_setting(*setting)}: within {TOL_ADAM:g} of one process: {max(r['max_abs_error']) <= TOL_ADAM}; "
          f"whole parameters kept between steps: {r['params_after_step']} bytes")

# %% tags=["nbval-ignore-output"]
axes = ch11.zero3_timeline_figure(z3)
plots.savefig(axes[0].figure, "11_zero3_timeline");

# %% [markdown]
# In reading order (top left, top right, then the bottom row): FSDP's default holds the root and one block (every
# gather is matched by a free); prefetch holds two blocks, the price of hiding the next all-gather behind this
# block's compute; without resharding after
# forward every unit stays whole from its forward to its backward, which is ZeRO-2's parameter memory in exchange
# for one all-gather less (2Ψ(N-1)/N). The whole gradients (orange) never add up to the model's: each unit's are
# reduce-scattered and dropped as soon as they are complete. Between steps a rank holds nothing whole, only its
# shards: the ledger's stage 3, (2 + 2 + K)Ψ/N, to the byte plus padding (`tests/test_zero3.py`).
#
# ### Exercise 4: gather, then free, around one unit
# Write `zero3_unit_hooks(unit, flat, shard)`. `unit` is a Transformer block whose parameters are views of `flat`
# (N x S elements, its storage freed: 0 bytes) and `shard` is this rank's S elements. Register hooks so that the
# unit's parameters are whole exactly while they are needed: all-gathered into `flat` just before its forward
# (`flat.untyped_storage().resize_(flat.numel() * flat.element_size())`, then `all_gather_into_tensor`), freed
# right after it (`resize_(0)`), gathered again just before its backward (a hook on the gradient of its output),
# and freed once every parameter has its gradient. The check runs the block forward and backward under your
# hooks and compares with the block computed whole, for a pre-norm block and for a post-norm one (whose
# gradients land in another order); "freed" means the parameters' own storage too, not only `flat`'s. It stops a
# read of freed memory, or of a gather not yet waited for, before it happens (such a read would crash the rank)
# and tells you where.

# %% tags=["exercise"]
def zero3_unit_hooks(unit, flat, shard):
    """Forward-pre, forward, output-gradient and post-accumulate-grad hooks: whole only during forward and backward."""
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("zero3_unit_hooks", zero3_unit_hooks)

# %% [markdown]
# The same at world 1, 2 and 4, against one process:

# %%
for w in (1, 2, 4):
    res = cu.run("workers.ch11_zero3", w, timeout=240)
    print(f"ZeRO-3, world {w}: within {TOL_ADAM:g} of one process: {max(max(e) for e in res.gather('max_abs_error')) <= TOL_ADAM}; "
          f"ranks identical: {all(res.gather('equal_to_rank0'))}; bytes kept per rank (params + grads + AdamW): "
          f"{res[0]['shard_bytes'] + res[0]['grad_shard_bytes'] + res[0]['state_bytes']:,}")

# %% [markdown]
# ### PyTorch's FSDP2, side by side
#
# `torch.distributed.fsdp.fully_shard` on every block, then on the root (torchtitan's `apply_fsdp`), trained on the
# same model, data and AdamW as the hand-written version (`workers/ch11_fsdp2.py`). Every all-gather and
# reduce-scatter FSDP2 makes is caught by wrapping the two `torch.distributed` functions it calls.

# %%
f2 = cu.run("workers.ch11_fsdp2", 4, timeout=240)
r = f2[0]
print(f"FSDP2 within {TOL_ADAM:g} of one process: {max(r['fsdp2_error']) <= TOL_ADAM}; of the hand-written stage 3: "
      f"{max(r['between']) <= TOL_ADAM}; bytes kept on rank 0, FSDP2 {r['fsdp2_kept']} vs by hand {r['hand_kept']}")
display(Table(["collective", "by hand: bytes in -> out", "FSDP2: bytes in -> out", ""], ch11.fsdp2_rows(r),
              "one step's collectives on rank 0, in order (4 ranks, fp32)"))

# %% [markdown]
# The same messages in the same order, but one: FSDP2 keeps its *root* whole from forward to backward by default
# (its parameters would be gathered again at once), so it sends one all-gather fewer than the paper's 3Ψ. The
# gradients' mean is rounded differently (FSDP2 sums then divides by N; the hand version pre-scales by 1/N), so the
# weights agree to rounding, not bit for bit. On a model whose first dimensions do not divide by N, FSDP2 pads
# every parameter rather than each unit, and its messages grow (`tests/test_fsdp2_vs_zero3.py`).

# %% [markdown]
# ### Mixed precision, sharded: FSDP2's policy
#
# Every large run shards a model that computes in bf16. FSDP2 says how with four settings
# (`MixedPrecisionPolicy`): `param_dtype`, the dtype parameters are all-gathered and computed in (bf16);
# `reduce_dtype`, the dtype gradients are reduce-scattered in (fp32, so the mean over ranks is not rounded to
# bf16); `output_dtype`, the model's output; and the fp32 shard that each rank keeps *is* the master copy the
# optimizer steps. `Zero3Model(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
# reduce_dtype=torch.float32))` does the same by hand: each all-gather sends the shard cast to bf16 into a bf16
# buffer, and backward's bf16 gradients are cast to fp32 before the reduce-scatter. It is a cast of the
# *parameters*, not `torch.autocast` (which casts each operation's inputs and keeps some, LayerNorm among them, in
# fp32), so the reference is one process that computes with a bf16 copy of its fp32 weights and steps the fp32
# copy (`workers/zero/model.py: train_reference_mixed`).
#
# **Predict** before running: at 4 ranks, what share of fp32 ZeRO-3's bytes on the wire does this policy send?

# %%
mixed = {f"{dt}, N=4": cu.run("workers.ch11_zero3_mixed", 4, param_dtype=dt, fsdp2=dt == "bfloat16", timeout=300)[0]
         for dt in ("float32", "bfloat16")}
display(Table(["param dtype", "all-gathers (bytes)", "reduce-scatter (bytes)", "sent per step", "2Ψ'·param + Ψ'·reduce"],
              ch11.mixed_wire_rows(mixed), "one step's bytes sent by rank 0 of 4, ring accounting; reduce dtype fp32"))
bf16_run, fp32_run = mixed["bfloat16, N=4"], mixed["float32, N=4"]
units = len(bf16_run["units"])  # FSDP2 sends one all-gather fewer: the root's second, at index `units`
sent = {k: sum(r["hand_comm_bytes"].values()) for k, r in mixed.items()}
print(f"bf16 all-gathers send {bf16_run['hand_comm_bytes']['all_gather'] / fp32_run['hand_comm_bytes']['all_gather']:g} "
      f"of fp32's; the whole step {sent['bfloat16, N=4'] / sent['float32, N=4']:.4g} (the reduce-scatter stays fp32)")
print(f"bf16 ZeRO-3 within {ch11.BF16_TOL:g} of one process (SGD, 3 steps): "
      f"{max(bf16_run['hand_error']) <= ch11.BF16_TOL}; FSDP2 on the same policy within {ch11.BF16_TOL:g} of it: "
      f"{max(bf16_run['between']) <= ch11.BF16_TOL}; the same messages but the root's second all-gather: "
      f"{bf16_run['hand_calls'][:units] + bf16_run['hand_calls'][units + 1:] == bf16_run['fsdp2_calls']}")

# %% tags=["nbval-ignore-output"]
print("largest weight difference from one process after each step (bf16 rounding: varies by CPU):",
      ", ".join(f"{e:.2e}" for e in bf16_run["hand_error"]), "| FSDP2:",
      ", ".join(f"{e:.2e}" for e in bf16_run["fsdp2_error"]))

# %% [markdown]
# The all-gathers carry bf16 (half the bytes) and the reduce-scatter fp32, so a step sends 2·2 + 4 = 8 bytes per
# parameter instead of 12: two thirds. The weights agree with one process to bf16 rounding, not fp32's: the ranks
# round partial sums of their own rows inside the matmuls (tests/test_zero3_mixed.py measures the spread over seeds
# and CPU kernels; with AdamW the gap would be ~lr, since Adam turns a gradient that is rounding noise into a full
# step either way).
#
# Where does the memory go? The ledger's mixed-precision row (ZeRO, section 3.1) counts 2 bytes of bf16 weight,
# 2 of gradient and K = 12 of fp32 master and Adam moments per parameter, over N at stage 3. Sharded with this
# policy, the bf16 weights exist only whole and briefly, a unit at a time; what a rank *keeps* is the fp32 shard
# (the master, 4 bytes), the fp32 gradient shard (4 bytes) and the optimizer's state: the same 16 bytes over N,
# split otherwise. Rank 0 of 2, AdamW, at the four moments of the first two steps:

# %%
mixed_adam = cu.run("workers.ch11_zero3_mixed", 2, optimizer="adamw", fsdp2=False, timeout=300)[0]
display(Table(["moment", "fp32 shards", "whole bf16 units", "grads", "optimizer", "held", "ledger (2 + 2 + K)/N",
               "verdict"], ch11.mixed_moment_rows(mixed_adam, state_bytes=8),
              f"mixed-precision ZeRO-3, rank 0 of 2, Ψ' = {mixed_adam['padded_numel']:,}: bytes from the tensors"))

# %% [markdown]
# Equal at every moment but one: after backward every unit's fp32 gradient bucket (N x S) is still on its way
# through the reduce-scatter, waited for at the step. Whole bf16 units: zero at each of these moments, since FSDP's
# default frees each unit after its forward and its backward.
#
# ### Where the gradients live, and clipping them
#
# The reduced gradient lands in one flat fp32 buffer per unit, but an optimizer, a gradient clip and your own code
# think in parameters. So each parameter also has a *sharded parameter* (`Zero3Model.parameters()`), a view of
# its elements in the unit's fp32 shard, whose `.grad` after `sync_grads()` is a view of the same elements of the
# gradient shard: no copy, and any `torch.optim` optimizer can step them (FSDP2 makes each `.grad` a sharded
# DTensor). A parameter may be split between two ranks, or lie wholly in another rank's shard: then this rank's
# view of it is empty. Small parameters can also be *replicated* (`replicate=`: kept whole on every rank, their
# gradient all-reduced), as the LayerNorms often are (`tests/test_zero3_grads.py` runs the whole sequence with a
# standard optimizer, in fp32, bf16 and fp16).
#
# ### Exercise 5: clip the gradient's norm over the shards
# Write `clip_grad_norm_sharded(grads, max_norm)`: `grads` are this rank's sharded `.grad` tensors (every element of
# the model's gradient is in exactly one rank's shard; some of your tensors may be empty). Compute the norm of the
# **whole** gradient, the same on every rank, scale your shards in place by min(1, max_norm / (norm + 1e-6)) and
# return the norm before clipping, as `torch.nn.utils.clip_grad_norm_` does. The check runs on 2 and 4 ranks with a
# norm above and below `max_norm`, logs your collectives, and puts a NaN in one rank's shard.

# %% tags=["exercise"]
def clip_grad_norm_sharded(grads, max_norm):
    """Clip ZeRO-3's sharded gradients by the whole gradient's norm; return the norm before clipping."""
    import torch
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("clip_grad_norm_sharded", clip_grad_norm_sharded)

# %% [markdown]
# ### All four stages, measured against the ledger and the paper
#
# `workers/ch11_stages.py` trains the same model with each stage by hand (stage 0: a full AdamW on every rank
# after one all-reduce) and, at init and after every forward, backward and step, adds up the bytes of the tensors
# each rank holds. Every collective of the last step is caught where torch dispatches it
# (`workers/zero/recorder.py`, a `TorchDispatchMode`): the stages do not report their own traffic. The ledger is
# `model_state_bytes` at the padded count Ψ' the flat buffers hold (each rounded up to N equal shards).

# %%
stages = {stage: cu.run("workers.ch11_stages", 4, stage=stage, timeout=240)[0] for stage in range(4)}
display(Table(["stage", "params", "grads", "AdamW", "ledger total", "collectives per step", "sent (bytes)",
               "ZeRO paper", "verdict (every moment)"], ch11.stage_rows(stages),
              f"bytes on rank 0 of 4 after backward, fp32, Ψ = {stages[0]['n_params']:,}, "
              f"Ψ' = {stages[3]['padded_numel']:,}"))

# %% [markdown]
# Read down the columns: stage 1 shards AdamW's moments, stage 2 the gradients too, stage 3 the parameters too;
# stages 0-2 send the bytes of one all-reduce, stage 3 half as much again. (A stage-2 or stage-3 rank also holds
# its gradient buckets while their reduce-scatters are in flight, freed when they complete; the worker reports
# them apart, as `in_flight`, because when that happens is the machine's business, not the ledger's.)

# %% [markdown]
# **Explore.** Pick the ranks, the stage and, for stage 3, prefetch and resharding: every change is a new run on
# real (warm) ranks. Left: what each rank holds at every moment of two steps, against the ledger's line; middle
# (stage 3): whole parameters through the last step's hooks; right: what rank 0 sent in one step, against the
# paper.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun

stages_live = LiveRun("workers.ch11_stages",
                      {"world_size": W.ToggleButtons(options=[1, 2, 4], value=4, description="ranks"),
                       "stage": W.ToggleButtons(options=[0, 1, 2, 3], value=3, description="ZeRO stage"),
                       "prefetch": W.Checkbox(value=False, description="prefetch (stage 3)"),
                       "reshard_after_forward": W.Checkbox(value=True, description="reshard_after_forward (stage 3)")},
                      ch11.stages_live_draw, params={"layers": 4, "steps": 2}, timeout=120,
                      progress_total=lambda p: p["steps"])
stages_live.wait(120)
stages_live

# %% [markdown]
# ## 5. FP8
#
# FP8 halves bf16 again, for the operands of the matmuls (Micikevicius et al. 2022): **E4M3** (4 exponent bits,
# 3 mantissa bits) for weights and activations, **E5M2** (more range, less precision) for gradients. Eight bits
# cannot hold a tensor's range on their own, so every group of values carries an fp32 **scale** that maps its
# largest magnitude (amax) onto the format's largest value.

# %%
for f in (E4M3, E5M2):
    print(f"{f.name.upper()}: max {f.max:g}, smallest normal 2^{int(torch.tensor(f.min_normal).log2())}, "
          f"smallest subnormal 2^{int(torch.tensor(f.min_subnormal).log2())}, {f.mantissa_bits} mantissa bits "
          f"(relative step 2^-{f.mantissa_bits})")

# %% [markdown]
# ### Outlier channels and scaling granularity
# Large transformers have a few activation channels far larger than the rest (Dettmers et al. 2022). One scale
# for the whole tensor is set by those outliers, which pushes every ordinary value down the exponent range. FP8
# is floating point, so that costs nothing until the ordinary values fall below the smallest normal number;
# then they lose their mantissa and finally flush to zero. DeepSeek-V3 (2024, section 3.3.2) scales
# activations per 1 x 128 tile and weights per 128 x 128 block, so an outlier only spoils its own group.
#
# **Predict**: at what outlier magnitude does per-tensor E4M3 start to hurt the ordinary channels? (E4M3's
# normal range spans 448 / 2^-6, about 2^15.)

# %% tags=["nbval-ignore-output"]
fig = ch11.granularity_figure()
plots.savefig(fig, "11_fp8_granularity");

# %%
errors = ch11.granularity_errors((1e2, 1e4, 1e6))
for g, values in errors.items():
    print(f"E4M3 per {g:<6}: error on ordinary channels with outliers 1e2 / 1e4 / 1e6 x: "
          + " / ".join(f"{v:.2f}" for v in values))

# %% [markdown]
# Up to about 1e3 the granularity makes no difference: the relative error is E4M3's rounding (steps of 2^-3
# of the leading bit, so at most 2^-4 off; about 2.6% rms). Beyond 1e4 the per-tensor scale pushes the ordinary channels into subnormals and then to
# zero; tiles and blocks keep the damage to the groups that contain an outlier. E5M2's 32 binades of range
# never reach that point here, at twice the rounding error.
#
# ### Delayed versus current scaling
# *Current* scaling reads the tensor's amax just before casting (an extra pass over the tensor); *delayed*
# scaling (Transformer Engine's `DelayedScaling`) uses the largest amax of the previous steps, which saves that
# pass but cannot see a sudden jump: the values beyond the stale range saturate at ±448. (At step 0 the history
# is empty and the scale is 1, as in Transformer Engine; a window of 16 steps keeps the demonstration short,
# where TE's default is 1024.)

# %% tags=["nbval-ignore-output"]
fig, history = ch11.scaling_figure()
plots.savefig(fig, "11_fp8_delayed_vs_current");

# %%
spike = 25
print(f"step {spike}: amax jumps {history['amax'][spike] / history['amax'][spike - 1]:.0f}x; delayed scaling "
      f"saturates {history['saturated'][spike]:.1%} of the values (error {history['delayed_error'][spike]:.2f}); "
      f"current scaling: error {history['current_error'][spike]:.3f}")
print(f"the next step, the history holds the spike: delayed error {history['delayed_error'][spike + 1]:.3f} "
      "(a smaller scale only shifts exponents, until values become subnormal)")

# %% [markdown]
# ### FP8 GEMM versus bf16
# The payoff is speed: FP8 tensor cores do twice the bf16 FLOPs on Hopper. The cost is error. On the CPU we can
# only emulate the numbers (quantise, dequantise, multiply in fp32, as tensor cores accumulate):

# %%
emulated = ch11.emulated_gemm_errors()
print("C = A B (512 x 1024 x 512), A with 4 outlier channels (100x), relative error vs fp32 "
      "(emulated on the CPU, not timed):")
for name, err in emulated.items():
    print(f"  {name:<18} {err:.4f}")

# %% tags=["nbval-ignore-output"]
gemm = ch11.gpu_data("fp8_gemm")
if torch.cuda.is_available():
    print("measured now:", ch11.gemm_report(cu.run("workers.ch11_fp8_gemm", 1, timeout=300)[0]))
elif gemm is not None and gemm.get("available"):
    print("Committed GPU measurement:", reference_data.label(gemm))
    print(ch11.gemm_report(gemm))
else:
    print("No GPU here and no committed data/gpu/ch11_fp8_gemm_*.json: the FP8 GEMM has not been timed yet "
          "(tools/gpu/ch11_memory.sh does it).")
    ref = reference_data.load("h200_block_fp8_baseline")
    print(f"For scale, a previous run on {reference_data.label(ref)}: "
          + reference_data.fp8_gemm_summary(ref) + ".")

# %% [markdown]
# ### What FP8 changes in the ledger, and what it does not
# FP8 training recipes (Transformer Engine; DeepSeek-V3, section 3.3) cast the *inputs of the matmuls* to FP8.
# The master weights and Adam's moments stay fp32, gradients are reduced in bf16 or fp32, and the model keeps
# its bf16 weights (some recipes cache an extra FP8 copy). So the 16 bytes per parameter of model states do not
# shrink; what shrinks is the activations saved for the linear layers' backward (1 byte instead of 2), and the
# matmul time. The attention output is the one linear input that another kernel also keeps: a fused attention
# saves it in bf16 for its own backward, so an FP8 copy for the projection adds to it rather than replacing it.

# %%
bf16 = model_state_bytes(1, weight_bytes=2, grad_bytes=2, optimizer_bytes_per_param=12).total
fp8_cache = model_state_bytes(1, weight_bytes=2 + 1, grad_bytes=2, optimizer_bytes_per_param=12).total
print(f"model states per parameter: {bf16:g} bytes in bf16; {fp8_cache:g} with a cached FP8 weight copy")
# Korthikanti et al. 2022, sec 4.1, term by term (course_utils.ledger.activation_terms_per_layer); the four linear
# layers' saved inputs (QKV, projection, fc1, fc2) are the terms FP8 halves.
SBH = dict(seq=2048, micro_batch=1, hidden=4096, heads=32)  # any shape: the terms are multiples of sbh
sbh = SBH["seq"] * SBH["micro_batch"] * SBH["hidden"]
bf16_act = activation_bytes_per_layer(**SBH, recompute="selective")
linear_inputs = sum(activation_terms_per_layer(**SBH, recompute="selective")[t] for t in LINEAR_INPUT_TERMS)
fp8_act = fp8_linear_inputs_activation_bytes_per_layer(**SBH)
fp8_flash = fp8_linear_inputs_activation_bytes_per_layer(**SBH, attention_keeps_output=True)
print(f"activations per layer (selective recomputation): {bf16_act / sbh:g} sbh in bf16, of which the linear "
      f"layers' inputs are {linear_inputs / sbh:g} sbh; with those in FP8: {fp8_act / sbh:g} sbh "
      f"({1 - fp8_act / bf16_act:.0%} less)")
print(f"with a fused attention that keeps its bf16 output for its own backward (SDPA, FlashAttention): "
      f"{fp8_flash / sbh:g} sbh ({1 - fp8_flash / bf16_act:.0%} less)")

# %% [markdown]
# ## Summary
# - The ledger: 2 + 2 + K bytes per parameter of model states, divided by tp·pp, then by N_d one state per ZeRO
#   stage; activations on top, untouched by ZeRO.
# - A hand-written ZeRO-1 (reduce-scatter, step a shard, all-gather) gives the unsharded optimizer's weights at
#   N = 1, 2, 4 (bitwise when fed the same gradients), and its measured optimizer bytes are the ledger's KΨ/N.
# - ZeRO-2 reduce-scatters each bucket from inside backward and never holds a whole gradient; ZeRO-3 gathers each
#   unit before its forward and backward and frees it after: 3Ψ(N-1)/N on the wire, root + one block whole at a
#   time (two with prefetch, all without resharding), equal to one process and to PyTorch's FSDP2.
# - FP8 is floating point: one scale per tensor survives moderate outliers, per-tile and per-block scales survive
#   extreme ones; delayed scaling clips a sudden spike that current scaling absorbs.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
