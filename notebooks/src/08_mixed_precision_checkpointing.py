# %% [markdown]
# # 08 · Mixed precision and checkpointing
#
# Two things decide whether a long training run finishes with the model you meant to train: the **numbers**
# it computes with, and the **state** it can come back to after a failure. Both are about what a run keeps
# and how exactly it keeps it.
#
# - Low-precision formats (fp16, bf16, FP8) double or quadruple the arithmetic a GPU does per second and
#   halve the bytes moved, but they overflow, underflow and round in ways that silently change training.
#   Loss scaling and fp32 master weights are the two repairs every mixed-precision recipe uses
#   (Micikevicius et al. 2018, *Mixed Precision Training*, ICLR).
# - A large job fails every few hours (Part C has Llama 3's numbers), so it restarts from checkpoints
#   hundreds of times. A checkpoint that forgets one piece of state (an RNG, the sampler's position, the
#   scheduler, the loss scale) does not crash: it resumes a *different* run.
#
# This chapter
#
# - **Part A** measures the formats (range, spacing, overflow, underflow, rounding) on real tensors, then
#   trains with fp16 autocast and a real `GradScaler` on real ranks, injects an inf, and shows why fp32
#   master weights are needed when parameters are bf16;
# - **Part B** proves a resume **bit for bit** across new processes, then drops one piece of state at a time
#   (the loss scaler of an fp16 run included) and watches the runs split; saves a sharded checkpoint with
#   `torch.distributed.checkpoint` at world 2 and loads it at world 1; kills a save midway and shows which
#   writers survive that;
# - **Part C** derives how often to checkpoint (Young, Daly) with the failure rate Llama 3 published.
#
# Everything runs on this machine's CPU with gloo; timings are CPU timings and say so.

# %%
import numpy as np
import torch

import course_utils as cu
from course_utils import plots
from course_utils import ch08_precision as P
from course_utils.exercises import check

plots.style()
LIMITS = {"timeout": 60}  # seconds per run

# %% [markdown]
# ## Part A · Mixed precision
#
# A training step in "mixed precision" keeps three kinds of numbers in three formats: the matmuls run in a
# 16-bit (or 8-bit) format because tensor cores are several times faster there and the tensors take half the
# memory; the weights the optimizer updates stay in fp32; and the loss may be multiplied by a large constant
# so that small gradients survive the 16-bit backward. Each of those choices answers one failure of a
# narrow format: **overflow**, **underflow** and **rounding**. We measure each one here, then on real ranks.
#
# Sources: IEEE 754-2008 (binary32, binary16); the OCP *8-bit Floating Point Specification (OFP8)* v1.0 and
# Micikevicius et al. 2022, *FP8 Formats for Deep Learning* (arXiv:2209.05433), Table 1, for E4M3 and E5M2;
# Micikevicius et al. 2018, *Mixed Precision Training*, ICLR (arXiv:1710.03740), sections 3.1 (fp32 master
# weights) and 3.2 (loss scaling).

# %% [markdown]
# ### A1. Five formats, read from `torch.finfo`
#
# A floating-point number is a sign, an exponent (which binade, i.e. which power of two) and a mantissa
# (where inside the binade). Exponent bits buy **range**, mantissa bits buy **precision**. Every number in
# the table is read from `torch.finfo` or decoded from the bit patterns themselves (for 8- and 16-bit formats
# the table decodes all 256 or 65536 patterns and counts the infinities and NaNs).
#
# **Predict first.** bf16 and fp16 both have 16 bits. Which one reaches 1e38? Which one can tell 1000 from
# 1001? And E4M3, with no infinity at all: what does it do with the bit pattern IEEE would spend on inf?

# %%
P.show_formats()

# %%
for name, pub in P.PUBLISHED.items():  # the published constants, checked against torch.finfo by the tests
    f = P.format_info(name)
    print(f"{name:<9} max {f.max:>7g} (published {pub['max']:g}); smallest subnormal {f.smallest_subnormal:.4g} "
          f"(published {pub['smallest_subnormal']:.4g})  [{pub['source']}]")

# %% tags=["nbval-ignore-output"]
plots.savefig(P.draw_format_ranges(), "08_format_ranges");

# %% [markdown]
# bf16 keeps fp32's 8 exponent bits, so it has fp32's range and only 7 mantissa bits: about 2.4 decimal
# digits. fp16 spends 5 bits on the exponent: 3.3 digits, but nothing above 65504. FP8 halves again; its two
# variants split the byte differently, E4M3 for weights and activations (precision), E5M2 for gradients
# (range). Every positive E4M3 and E5M2 value fits on one line:

# %% tags=["nbval-ignore-output"]
plots.savefig(P.draw_fp8_grid(), "08_fp8_values");

# %% [markdown]
# ### A2. Overflow
#
# **Predict.** fp16's largest value is 65504 and the step below it is 32. What is `fp16(65504 + 15)`?
# `fp16(65504 + 16)`? And E4M3, which has no inf: what is `e4m3(1000.0)`, and `e4m3(inf)`?

# %%
P.overflow_demo()

# %% [markdown]
# Round to nearest, ties to even: 65504 + 16 is exactly halfway to 65536, whose mantissa is even, and 65536
# is not representable: inf. E5M2 behaves the same way at its own max. E4M3 has no inf pattern, so a cast
# can only saturate to ±448 or give NaN (OCP OFP8 allows both conversions); the table shows what *this*
# torch does, measured. Do not rely on it: `course_utils.fp8` (chapter 11) clamps before every cast.
#
# ### A3. Underflow
#
# Below the smallest normal number the exponent is stuck at its minimum and the leading 1 is gone: these
# **subnormal** numbers are evenly spaced by the smallest subnormal (2^-24 in fp16), so small values keep
# their magnitude but lose significant bits, down to a single bit. Half of the smallest subnormal is a
# tie between 0 and 2^-24 and rounds to the even one: 0.

# %%
P.underflow_demo("fp16")

# %% tags=["nbval-ignore-output"]
plots.savefig(P.draw_subnormal_error("fp16"), "08_fp16_subnormals");

# %% [markdown]
# ### A4. Rounding: the update that vanishes
#
# The gap between neighbouring numbers (one *ulp*, unit in the last place) grows with the magnitude:
# 2^-7 = 0.0078 at 1.0 in bf16, 4 at 1000.

# %%
P.spacing_table()

# %% [markdown]
# **Predict.** `bf16(1 + 2^-8)`? (2^-8 is half an ulp at 1.) And `bf16(1 + 3 * 2^-8)`?

# %%
P.rounding_demo()

# %% [markdown]
# So a weight w = 1 stored in bf16 ignores any update smaller than half an ulp, 2^-8 = 0.0039: with a learning
# rate of 1e-3 and gradients of order 1, every SGD step is below that. **Predict** what a thousand updates of
# +1e-3 do to w = 1 in bf16, fp16 and fp32.

# %%
print(P.vanishing_update(1.0, 2.0**-9, "bf16"))
print(P.vanishing_update(1.0, 2.0**-9, "fp32"))
for fmt in ("bf16", "fp16", "fp32"):
    print(f"{fmt}: 1.0 + 1000 x 1e-3 = {P.accumulate(1.0, 1e-3, 1000, fmt):.6f}")

# %% [markdown]
# bf16 never moves, fp16 (ulp 2^-10 ≈ 0.001 at 1) moves by the wrong amount, fp32 gets 2.0.
#
# ### Exercise 1: fp32 -> bf16 by hand
#
# bf16 is the top half of an fp32 number. Write `round_to_bf16(x)` for a float32 tensor `x`: read the bit
# pattern with `x.view(torch.int32)`, keep the top 16 bits **rounded to nearest, ties to even**, and return
# the rounded values as float32 (the low 16 bits zero). It must agree bit for bit with
# `x.to(torch.bfloat16).float()` on every input, including ±0, subnormals, exact ties, values that round up
# to inf, and NaN (which stays NaN). Do not modify `x` (a view shares its memory), and do not call
# `.to(torch.bfloat16)`. Hint: what do you add to the pattern before cutting, so that a dropped part above
# 0x8000 rounds up, below rounds down, and exactly 0x8000 goes to the even side?

# %% tags=["exercise"]
def round_to_bf16(x):
    """fp32 -> bf16 (round to nearest, ties to even) from the bit pattern; returns float32 values."""
    import torch  # noqa: F401

    raise NotImplementedError


# %% tags=["check"]
check("round_to_bf16", round_to_bf16)

# %% [markdown]
# ### A5. Gradients underflow in fp16: loss scaling
#
# In LLM training the loss is a mean over every token of the global step (Llama 3 used 4M to 16M tokens per
# step), so each token's share of the gradient is tiny. The worker builds a one-block language model (vocabulary
# 512) and runs the same weights and tokens three ways: an fp32 backward (the reference), an fp16 autocast
# backward, and the same with the loss multiplied by S = 2^16 before `backward()` (GradScaler's default
# initial scale), dividing the fp32 weight gradients by S afterwards. The loss is normalised by a step of
# 2^20 tokens, of which this rank computes 512.
#
# **Predict.** The logits' gradients are (p - onehot) / 2^20 with p ≈ 1/512. Where is that on fp16's range?
# What fraction of them survives the unscaled fp16 backward?

# %%
uf = cu.run("workers.ch08_precision", world_size=1, part="underflow", **LIMITS)[0]
P.underflow_table(uf)

# %% tags=["nbval-ignore-output"]
plots.savefig(P.draw_underflow(uf), "08_gradient_underflow");

# %% [markdown]
# This is the argument of Micikevicius et al. 2018, Fig. 3: most activation gradients sit below 2^-24 and
# flush to zero, while most of fp16's range above them goes unused. Multiplying by S moves the histogram up by
# log2(S) = 16 binades (drawn here as fp16's zones moving left) without touching fp32's precision: S is a
# power of two, so scaling and unscaling are exact.
#
# ### A6. GradScaler on real ranks, with an injected inf
#
# A fixed S can be too small (underflow) or too large (the backward overflows to inf). `torch.amp.GradScaler`
# adapts it: after `growth_interval` steps in a row without inf/NaN it multiplies the scale by
# `growth_factor` (2); when `unscale_` finds an inf or NaN in any gradient, `step()` **skips** the optimizer
# step and `update()` multiplies the scale by `backoff_factor` (0.5).
#
# The worker trains a small MLP with fp16 autocast and a real GradScaler under DDP at world 2, with
# `growth_interval=4` so that things happen within 48 steps. At step 10 one gradient element of **rank 1
# only** is set to inf, before DDP all-reduces the gradients.
#
# **Predict.** What does rank 0 do at step 10: step, or skip? What happens to the ranks' weights if one
# steps and the other skips?

# %%
ls = cu.run("workers.ch08_precision", world_size=2, part="loss_scaling", inf_steps=[10], inf_rank=1, **LIMITS)
r0, r1 = ls.ranks
print("step 10, own gradient finite (before the all-reduce): rank 0", r0["local_finite"][10], "rank 1", r1["local_finite"][10])
print("step 10 skipped: rank 0", r0["skipped"][10], "rank 1", r1["skipped"][10])
natural = [k for k, s in enumerate(r0["skipped"]) if s and k not in r0["inf_steps"]]
print("the same steps skipped on both ranks:", r0["skipped"] == r1["skipped"])
print("steps skipped without an injected inf (the scaler overflowed on its own):", len(natural) > 0)
print("weights bit-identical on the two ranks after every step:", torch.equal(r0["weights"], r1["weights"]))
print("weights unchanged across step 10:", torch.equal(r0["weights"][11], r0["weights"][10]))

# %% tags=["nbval-ignore-output"]
# which steps overflow on their own depends on the fp16 rounding of this CPU's kernels
print("skipped steps:", [k for k, s in enumerate(r0["skipped"]) if s])
plots.savefig(P.draw_loss_scaling(ls), "08_loss_scaling");

# %% [markdown]
# The all-reduce sums rank 1's inf into everyone's gradient, so every rank's `unscale_` finds it, every rank
# skips the same step and halves its scale the same way: the ranks stay identical without any extra
# communication. The other skips were not injected: the scale grew until the fp16 backward overflowed on its
# own (sometimes on one rank only, the all-reduce again makes it everyone's), backed off, and grew again.
# That sawtooth is the scaler finding the largest scale the gradients allow.
#
# ### Exercise 2: GradScaler's update rule
#
# Write `update_scale(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)`
# returning `(new_scale, new_good_steps)`: what `GradScaler.update()` does after one step. `good_steps` counts
# the steps without inf since the scale last changed. The check replays sequences of `found_inf` flags through
# your function and through a real `torch.amp.GradScaler("cpu")`, and compares after every update.

# %% tags=["exercise"]
def update_scale(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    """GradScaler.update's rule: returns (new_scale, new_good_steps)."""
    raise NotImplementedError


# %% tags=["check"]
check("update_scale", update_scale)

# %% [markdown]
# With your rule, replay the skip flags the ranks measured: your scales should be the ranks' scales.

# %%
try:
    mine = P.replay_scale(update_scale, r0["skipped"], **r0["scaler_args"])
    print("your update_scale reproduces the ranks' scale at every step:", mine == r0["scale"])
except NotImplementedError:
    print("(solve exercise 2 first: then this cell replays your rule on the ranks' skip flags)")

# %% [markdown]
# Explore: the growth interval, which rank gets the inf (-1: every rank), and inf or NaN.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider

live_scaler = LiveRun("workers.ch08_precision",
                      {"growth_interval": slider("growth_interval", 4, 1, 12),
                       "inf_rank": slider("inf_rank", 1, -1, 1),
                       "inject": W.Dropdown(options=["inf", "nan"], value="inf", description="inject")},
                      lambda res, params: P.draw_loss_scaling(res),
                      params={"part": "loss_scaling", "world_size": 2, "inf_steps": [10]}, timeout=60)
live_scaler.wait(60)
live_scaler

# %% [markdown]
# ### A7. fp32 master weights
#
# bf16 has fp32's range, so it needs no loss scaling; what it lacks is precision (A4). The worker trains the
# same linear regression three ways, for the same 150 SGD steps at the same learning rate: **fp32**;
# **bf16 compute with fp32 master weights** (autocast: the matmuls see a bf16 copy of the weights, the
# optimizer updates the fp32 ones); **pure bf16** (the weights, their gradients and the update
# `w - lr * g` all in bf16). Each step it counts the weights whose update was asked for (g != 0) but lost
# (`bf16(w - lr*g) == w`).
#
# **Predict.** Which run stalls? In the master-weights run, what fraction of the *bf16 copy* changes per
# step, late in training?

# %% tags=["nbval-ignore-output"]
mw = cu.run("workers.ch08_precision", world_size=1, part="master_weights", **LIMITS)[0]
P.master_weights_table(mw)

# %% [markdown]
# The digits in that table depend on how this CPU rounds bf16 matmuls (they move in the third digit between
# AVX-512, AVX2 and plain kernels); the claims below hold on every one of them, with a margin (measured with
# `python -m course_utils.cpu_spread ch08_precision`):

# %%
for claim, holds in P.master_weights_claims(mw).items():
    print(f"{claim}: {holds}")

# %% tags=["nbval-ignore-output"]
plots.savefig(P.draw_master_weights(mw), "08_master_weights");

# %% [markdown]
# As the loss falls the gradients shrink, `lr * g` drops below half an ulp of `w`, and pure bf16 stops
# learning: by the end most of its updates are rounded away (the table's last columns) and its loss is an
# order of magnitude above fp32's. The
# master-weights run tracks fp32 step for step, although its bf16 copy is *also* unchanged in most steps:
# the fp32 master accumulates the small updates until they cross a bf16 rounding boundary (Micikevicius et
# al. 2018, sec 3.1). That is why mixed-precision Adam keeps 4 bytes of fp32 weight per parameter next to the
# 2-byte bf16 copy, the "16 bytes per parameter" of chapter 00.
#
# Explore: a larger learning rate makes each update bigger, so pure bf16 stalls later and lower.

# %% tags=["nbval-ignore-output"]
live_master = LiveRun("workers.ch08_precision",
                      {"lr": W.FloatLogSlider(value=0.1, base=10, min=-2, max=0, step=0.1, description="lr",
                                              continuous_update=False)},
                      lambda res, params: P.draw_master_weights(res[0]),
                      params={"part": "master_weights", "world_size": 1}, timeout=60)
live_master.wait(60)
live_master

# %% [markdown]
# ## Part B · Checkpointing: resume as if nothing happened
#
# A large run fails every few hours (Llama 3's pre-training, about once every three hours: Part C). Each
# time, the job restarts in **new processes**
# from the last checkpoint. A good checkpoint makes that restart invisible: the resumed run computes exactly
# what the uninterrupted run would have, bit for bit. Anything less and you cannot tell a restart from a bug,
# and every comparison you make ("did my change help?") carries noise from the restarts. Bit for bit means on
# the same kind of machine and the same build: a resume on another CPU or another PyTorch runs other kernels,
# which round differently, and the run drifts from there (as every run in this course would: its printed
# losses are this machine's).
#
# What must a checkpoint hold? More than the weights:
#
# | part | what it is | without it, after a restart |
# |---|---|---|
# | model | the weights (`model.state_dict()`) | training starts again from the initialisation |
# | optimizer | AdamW's `exp_avg`, `exp_avg_sq`, `step`, and each group's `lr` | moments restart at zero, bias correction restarts |
# | scheduler | `last_epoch`: where in warmup + cosine we are | the warmup runs again |
# | data / sampler | epoch and position in the shuffled order | the first batches are read twice, others never |
# | every RNG | python `random`, numpy, torch CPU, each GPU's; **per rank** | other dropout masks, other augmentation noise |
# | loss scaler | fp16's scale and its count of good steps | the scale restarts at 65536: other steps overflow and are skipped |
# | step, config | the step count, every hyperparameter | a resumed run with other settings is another run |
#
# The run we checkpoint (`workers/checkpointing/training.py`) has one of each: a two-layer MLP with dropout,
# AdamW, a warmup + cosine `LambdaLR`, a seeded shuffled data order with a position
# (`workers/checkpointing/sampler.py`), augmentation that draws from numpy (input noise) and from python's
# `random` (one feature zeroed per step), as real data pipelines do, and, with `precision="fp16"`, fp16
# autocast with a `torch.amp.GradScaler` (B3). Under DDP each rank seeds its streams with
# `seed + 1000 * rank`: ranks must draw *different* masks, so every rank's RNG state is its own.
#
# The checkpoints go to `build/scratch/08_checkpoints/`, emptied each time the next cell runs, so reruns
# replace them instead of piling up (the async-save experiment below writes about 100 MB):

# %%
from course_utils import ch08_checkpoint as ch08
from course_utils.scratch import scratch_dir

CKPT_ROOT = scratch_dir("08_checkpoints")


def ckpt_dir(name: str) -> str:
    """A fresh directory for one experiment's checkpoints."""
    path = CKPT_ROOT / name
    path.mkdir(exist_ok=True)
    return str(path)


RESUME = {"steps": 12, "save_at": 5, "timeout": 90}  # 8 steps per epoch: the resumed part crosses an epoch

# %% [markdown]
# ### B1. The bitwise-resume proof
#
# Three runs of `workers/ch08_resume.py` at world 2:
#
# 1. `mode="straight"`: 12 steps without interruption;
# 2. `mode="save"`: the first 5 steps, then a checkpoint of everything (`checkpointing/state.py`):
#    rank 0 writes the replicated part (`model_optim.pt`), every rank its own `rng_rank_R.pt`;
# 3. `mode="resume"`, with `warm=False`: **new processes** (new pids) that load the newest complete
#    checkpoint into freshly built objects and run steps 6 to 12.
#
# **Predict**: will the losses of steps 6-12 equal the straight run's to fp32 rounding (~1e-7), or to the
# last bit? And the weights?

# %%
straight = cu.run("workers.ch08_resume", world_size=2, mode="straight", **RESUME)
saved = cu.run("workers.ch08_resume", world_size=2, mode="save", ckpt_dir=ckpt_dir("full"), **RESUME)
resumed = cu.run("workers.ch08_resume", world_size=2, mode="resume", ckpt_dir=ckpt_dir("full"), warm=False, **RESUME)
print("saved:", saved[0]["saved_parts"], "->", saved[0]["checkpoint"], saved[0]["files"])
print("restored in new processes:", resumed[0]["restored"], "from", resumed[0]["checkpoint"])

# %% tags=["nbval-ignore-output"]
print(f"pids: save run {saved.gather('pid')}, resume run {resumed.gather('pid')} ({resumed.launch} start)")

# %%
cmp_full = ch08.ckpt_compare(straight, saved, resumed)
for rank, r in enumerate(cmp_full["ranks"]):
    print(f"rank {rank}: losses torch.equal: {r['losses_equal']}, weights after every step torch.equal: "
          f"{r['weights_equal']}, max |loss diff| = {r['max_loss_diff']:.1e}")

# %% [markdown]
# Zero, not "small". The resumed processes ran the same fp32 operations on the same bits in the same order
# (same weights, same Adam moments, same lr, same rows, same dropout masks, same noise), so they produced the
# same bits. This is the test to put in CI for your own training code: `torch.equal`, never `allclose`,
# because `allclose` would also pass a resume that lost the RNG state.
#
# ### B2. Leave one part out, watch the curves split
#
# `omit=` leaves a part out of what is saved; the resumed run then has what a fresh process has: seeds from
# the start (so step 6 replays step 1's dropout masks), position 0 in the data order, a scheduler at step 0,
# zero Adam moments.
#
# **Predict** for each part: from which step does the loss differ from the straight run? (The loss of step
# $s$ is computed from the weights after step $s-1$.)

# %%
runs = {"everything": (saved, resumed)}
for part in ("rng", "sampler", "scheduler", "optimizer"):
    s = cu.run("workers.ch08_resume", world_size=2, mode="save", ckpt_dir=ckpt_dir(f"no_{part}"), omit=part, **RESUME)
    r = cu.run("workers.ch08_resume", world_size=2, mode="resume", ckpt_dir=ckpt_dir(f"no_{part}"), **RESUME)
    runs[f"without {part}"] = (s, r)
for label, (s, r) in runs.items():
    c = ch08.ckpt_compare(straight, s, r)["ranks"][0]
    if c["first_loss_diff_step"] is None and c["first_weight_diff_step"] is None:
        print(f"{label:>18}: bit-identical to the straight run")
        continue
    print(f"{label:>18}: weights differ from step {c['first_weight_diff_step']}, loss from step "
          f"{c['first_loss_diff_step']} (max |loss diff| {c['max_loss_diff']:.1e})")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch08.ckpt_draw_resume(straight, runs, save_at=RESUME["save_at"]), "08_resume_split");

# %% [markdown]
# Without the RNG or the sampler the very first resumed loss is already different: other dropout masks,
# other rows. Without the optimizer the weights move apart at step 6 (zero moments, a fresh bias correction,
# and the lr a freshly built scheduler put into the fresh optimizer) and the loss follows at step 7.
#
# The scheduler is the subtle one: the optimizer's `state_dict` also stores each group's current `lr`, so
# step 6 still uses the right learning rate. Then the fresh scheduler's first `step()` sets the lr to the
# warmup's second value, step 7's update is wrong, and the loss of step 8 shows it. A bug that waits two
# steps, and in a real run would show up as a little bump after every restart.
#
# The differences are small here (a tiny model, 12 steps), but they are not rounding: they are another
# training run. On a real model they compound; "the loss curve has a kink at every restart" is this.
#
# ### B3. The loss scaler of an fp16 run
#
# The runs above are fp32: there is no loss scale to lose. With `precision="fp16"` the same run trains under
# fp16 autocast with a real `torch.amp.GradScaler` (A6), here with `growth_interval=2` (the default is 2000)
# so that within 12 steps the scale grows until the fp16 backward really overflows, and those steps are
# skipped on both ranks. The checkpoint now also holds `scaler.state_dict()`: the scale and the count of good
# steps since it last changed (in `model_optim.pt`: every rank has the same scaler, since the inf is
# all-reduced). Same three runs, then once more with `omit="scaler"`.
#
# **Predict**: without the scaler, the resumed run's first step uses a fresh scaler's 65536. Does a different
# scale alone change the weights? (Multiplying by a power of two and dividing back again is exact in floating
# point, unless something overflows or underflows.) From which step do the runs split?

# %%
FP16 = {**RESUME, "precision": "fp16"}  # fp16 autocast + GradScaler(growth_interval=2)
straight16 = cu.run("workers.ch08_resume", world_size=2, mode="straight", **FP16)
runs16 = {}
for label, omit, warm in (("everything", "", False), ("without scaler", "scaler", True)):
    where = ckpt_dir("fp16_" + (omit or "full"))
    s = cu.run("workers.ch08_resume", world_size=2, mode="save", ckpt_dir=where, omit=omit, **FP16)
    r = cu.run("workers.ch08_resume", world_size=2, mode="resume", ckpt_dir=where, warm=warm, **FP16)
    runs16[label] = (s, r)
print("saved:", runs16["everything"][0][0]["saved_parts"], "| restored:", runs16["everything"][1][0]["restored"])
compared16 = {label: ch08.ckpt_compare(straight16, s, r) for label, (s, r) in runs16.items()}
print("with the scaler: bit-identical to the straight run on every rank:", compared16["everything"]["bitwise"])
# without it: the first resumed step whose skip differs from the straight run's
save_at, tail = RESUME["save_at"], list(zip(straight16[0]["skipped"][RESUME["save_at"]:],
                                            runs16["without scaler"][1][0]["skipped"]))
split = next((save_at + 1 + i for i, (a, b) in enumerate(tail) if a != b), None)
print("without it: the runs skip other steps:", split is not None)
print("... and the weights split exactly at the first of those, the loss one step later, on every rank:",
      all((r["first_weight_diff_step"], r["first_loss_diff_step"]) == (split, split + 1)
          for r in compared16["without scaler"]["ranks"]))

# %% tags=["nbval-ignore-output"]
# which steps overflow depends on the fp16 rounding of this CPU's kernels: the table is this machine's
print(ch08.ckpt_scale_table(straight16, runs16, save_at=RESUME["save_at"]))
first = compared16["without scaler"]["ranks"][0]
print(f"without scaler: weights differ from step {first['first_weight_diff_step']}, loss from step "
      f"{first['first_loss_diff_step']} (max |loss diff| {first['max_loss_diff']:.1e})")
plots.savefig(ch08.ckpt_draw_scaler(straight16, runs16, save_at=RESUME["save_at"]), "08_resume_scaler");

# %% [markdown]
# With the scaler in the checkpoint the fp16 run resumes bit for bit too, new processes and all, skipped
# steps included. Without it the scale starts again at 65536 (and its count of good steps at 0). In the run
# stored here the straight run's step 6, at 131072, overflowed and was skipped; the resumed run's step 6, at
# 65536, did not overflow, so it took an optimizer step the straight run never took, and the weights differ
# from that step on. (Which steps overflow depends on how your CPU rounds fp16; the rule does not.) A
# different scale alone would have changed nothing: the skips are what the lost scaler changes.
# (`tests/test_ch08_checkpoint.py` checks this at world 1, where the first resumed step runs at 65536
# instead of 262144 with bit-identical weights, and the runs split at the first step only one of them skips.)
# With the default `growth_interval=2000` the same holds on a longer clock: a restart that forgets the scaler
# puts the scale back at 65536 and its count at 0, so it grows, overflows and skips on another schedule than
# the run it claims to continue.
#
# ### B4. Sharded checkpoints: torch.distributed.checkpoint (DCP)
#
# With FSDP or ZeRO-3 no rank holds the full model, and gathering it on rank 0 to `torch.save` it costs the
# whole model in one rank's memory and one rank's write bandwidth. DCP has each rank write **only its shard**,
# plus a `.metadata` file recording which slice of which tensor is in which file. Loading is planned from the
# metadata: each rank of the *new* world reads the slices it needs, so a checkpoint written at one world size
# loads at any other (resharding), with no conversion step.
#
# `workers/ch08_dcp.py`: a 2-layer MLP of 7-row layers sharded with FSDP2 (`fully_shard`), so each parameter and
# its AdamW moments are DTensors placed `Shard(0)` on a CPU `DeviceMesh`: rank 0 holds rows 0-3, rank 1 rows 4-6.
# Two AdamW steps, `dcp.save` at world 2; then a plain unsharded model at **world 1** loads it.
#
# **Predict**: how many `.distcp` files, and will the world-1 model be equal to the full tensors gathered before
# the save, bit for bit, optimizer state included?

# %%
saved_dcp = cu.run("workers.ch08_dcp", world_size=2, part="save", ckpt_dir=ckpt_dir("dcp"), timeout=90)
loaded_dcp = cu.run("workers.ch08_dcp", world_size=1, part="load", ckpt_dir=ckpt_dir("dcp"), timeout=90)
print("files written at world 2:", sorted(saved_dcp[0]["files"]))
print(ch08.ckpt_shard_table(saved_dcp, loaded_dcp))

# %% tags=["nbval-ignore-output"]
print("bytes per file:", saved_dcp[0]["files"])  # .metadata records the checkpoint's path, so its size varies

# %%
dcp_cmp = ch08.ckpt_dcp_compare(saved_dcp, loaded_dcp)
print(f"{len(dcp_cmp['equal'])} tensors (weights, biases, exp_avg, exp_avg_sq, step); all torch.equal after the "
      f"world-2 -> world-1 load: {dcp_cmp['all_equal']}")

# %% [markdown]
# ### B5. Async save: how long does training wait?
#
# `dcp.save` blocks until every byte is written. `dcp.async_save` first **stages** the state (copies it to
# host memory; on a GPU this is the device-to-host copy), returns a `Future`, and writes from a background
# thread while training goes on. The worker changes every weight right after `async_save` returns, then
# checks that the checkpoint holds the values from before: staging is a snapshot. The background save uses a
# process group of its own (two threads issuing collectives on one group could interleave them differently
# on different ranks).
#
# **Predict**: for ~8 MiB of weights (and twice that of AdamW state) per rank, what fraction of the blocking
# save's time does training wait with `async_save`?

# %% tags=["nbval-ignore-output"]
timing = cu.run("workers.ch08_dcp", world_size=2, part="async", ckpt_dir=ckpt_dir("dcp_async"), width=1024,
                layers=4, repeats=3, timeout=180)
print("per save, the slowest of the 2 ranks (as in the figure):")
for k, v in ch08.ckpt_async_times(timing).items():
    print(f"{k:>14}: " + ", ".join(f"{t * 1e3:.0f} ms" for t in v))
print(plots.CPU_NOTE)
plots.savefig(ch08.ckpt_draw_async(timing), "08_async_save");

# %%
pending = [all(p) and not any(m) for p, m in zip(timing.gather("pending_at_return"), timing.gather("metadata_at_return"))]
print("every async_save returned before its checkpoint was durable (Future pending, no .metadata yet):", all(pending))
print("async checkpoint holds the staged (pre-change) weights on every rank:", all(timing.gather("snapshot_ok")))

# %% [markdown]
# After the first save (which allocates the staging buffers), training waits for the copy only; the write
# itself overlaps the next steps. The price: host memory for a second copy of the state, and a checkpoint
# that is not durable until the `Future` completes; never start the next save (or exit) before it has.
#
# ### B6. A save killed midway
#
# Saves die: the node is preempted, the OOM killer fires, the disk fills. The naive save,
# `torch.save(state, "ckpt/model.pt")`, opens the final name with `O_TRUNC`: from that moment the old
# checkpoint is gone and the new one is incomplete. `workers/ch08_atomic.py` writes a checkpoint shaped like a
# real one (`model.pt`, `optimizer.pt` twice its size, `meta.pt`) and can kill its own process with SIGKILL
# after N bytes (`checkpointing/faults.py`): no `finally`, no `atexit`, as in a real kill.
#
# First the naive writer: step 1 saved, step 2 killed 500,000 bytes in (inside `optimizer.pt`). Then a
# new process looks at the directory. **Predict**: what does a loader that takes the newest directory do?

# %%
naive = ckpt_dir("naive")
cu.run("workers.ch08_atomic", world_size=1, part="save", writer="naive", step=1, ckpt_dir=naive, timeout=60)
print(ch08.ckpt_crash(writer="naive", step=2, ckpt_dir=naive, kill_at_bytes=500_000))
scan_naive = cu.run("workers.ch08_atomic", world_size=1, part="scan", ckpt_dir=naive, timeout=60)[0]
print(ch08.ckpt_scan_table(scan_naive))

# %% [markdown]
# The newest directory holds a whole `model.pt` and a truncated `optimizer.pt` that does not even load:
# "failed finding central directory" (a `torch.save` file is a zip archive whose index is written last). The
# atomic loader trusts neither directory: the naive writer never commits with a manifest, so even the complete
# `step_00000001/` cannot be told from a torn one. That failure is at least loud. Worse is the
# common "save over `latest/` in place": killed right after `model.pt` is complete,

# %%
inplace = ckpt_dir("inplace")
cu.run("workers.ch08_atomic", world_size=1, part="save", writer="naive", step=1, name="latest", ckpt_dir=inplace,
       timeout=60)
print(ch08.ckpt_crash(writer="naive", step=2, name="latest", ckpt_dir=inplace, kill_after_file="model.pt"))
print(ch08.ckpt_scan_table(cu.run("workers.ch08_atomic", world_size=1, part="scan", ckpt_dir=inplace, timeout=60)[0]))

# %% [markdown]
# Every file loads. The directory looks complete. The model is from step 2, the optimizer and the step counter
# from step 1: a resume continues silently from a state that never existed.
#
# The atomic writer (`checkpointing/atomic.py`) follows four rules:
#
# 1. write every file under a **temporary name in the same directory** (same file system, so the rename
#    below is one `rename(2)`; across file systems `os.replace` fails and `shutil.move` copies);
# 2. `flush` and **`os.fsync`** each file before renaming it (else after a power cut the rename can be on
#    disk before the data: an empty file under the final name);
# 3. build a multi-file checkpoint in a **staging directory**, write a **manifest last** (each file's size and
#    sha256), then **rename** the directory to `step_XXXXXXXX` and fsync its parent: that rename is the commit;
# 4. the loader takes the **newest directory whose manifest matches** its files, and ignores everything else.
#
# Same crash, atomic writer:

# %%
careful = ckpt_dir("atomic")
cu.run("workers.ch08_atomic", world_size=1, part="save", writer="atomic", step=1, ckpt_dir=careful, timeout=60)
print(ch08.ckpt_crash(writer="atomic", step=2, ckpt_dir=careful, kill_at_bytes=500_000))
scan_atomic = cu.run("workers.ch08_atomic", world_size=1, part="scan", ckpt_dir=careful, timeout=60)[0]

# %% tags=["nbval-ignore-output"]
print(ch08.ckpt_scan_table(scan_atomic))  # the .tmp file's name is random

# %%
pick = scan_atomic["atomic_pick"]
print(f"atomic loader picks {pick['name']}: every file loads, all from step {pick['steps'][0]}; "
      f"newer entries skipped: {[e['name'] for e in scan_atomic['entries'] if not e['valid']]}")

# %% [markdown]
# The killed save never got past its staging directory, so nothing under a final name is incomplete: the
# previous checkpoint is still there, still complete, and chosen. (The manifest also catches what a rename
# cannot: a checkpoint copied file by file to other storage, or damaged later; the `resume` worker above
# used this same writer at world 2, every rank writing into the staging directory before rank 0 committed.)
#
# ### Exercise 3: the training state
#
# Write `training_state(model, optimizer, scheduler, sampler, scaler)` returning a dict with everything needed
# to resume bit for bit, as `{"model": ..., "optimizer": ..., "scheduler": ..., "sampler": ..., "scaler": ...,
# "rng": {...}}` where `rng` holds `"torch"`, `"numpy"`, `"python"` (and `"cuda"` on a GPU). The checker, on 1
# and 2 ranks under DDP, trains an fp16 run like B3's (autocast and a `GradScaler`) for 3 steps, calls your
# function, `torch.save`s the result, throws every object away, builds new ones from another seed, re-seeds
# every RNG elsewhere, loads your state with the course's own restore (`model.load_state_dict(state["model"])`
# and so on), trains on, and compares every batch, dropout mask, noise draw, learning rate, loss scale and
# weight with an uninterrupted run. Imports go inside the function.

# %% tags=["exercise"]
def training_state(model, optimizer, scheduler, sampler, scaler):
    raise NotImplementedError


# %% tags=["check"]
check("training_state", training_state)

# %% [markdown]
# ### Exercise 4: an atomic save
#
# Write `atomic_save(obj, path)`: after it returns, `path` holds `obj`; if it fails at any point, `path` still
# holds whatever it held before, whole. The checker makes a save fail halfway through its writes (a full disk)
# and loads `path`; then it watches a normal save: `path` must be replaced (a new inode), not rewritten in
# place; never deleted first; renamed from a file in the same directory whose own data was fsync-ed before the
# rename; the directory fsync-ed after it (the rename is a change to the directory: open it with
# `os.open(directory, os.O_RDONLY)` and fsync that); nothing left beside it.

# %% tags=["exercise"]
def atomic_save(obj, path):
    raise NotImplementedError


# %% tags=["check"]
check("atomic_save", atomic_save)

# %% [markdown]
# ## Part C · How often to checkpoint
#
# A checkpoint costs time to write, $\delta$; a failure costs the work done since the last one plus a
# restart, $R$. Checkpoint too rarely and every failure throws away hours; too often and the job spends
# its life writing. With failures arriving at random (a Poisson process, mean time between failures $M$),
# Young (1974, *A first order approximation to the optimum checkpoint interval*, CACM 17(9)) found the
# compute time between checkpoints that minimises the loss to first order,
#
# $$ \tau_\text{Young} = \sqrt{2\,\delta\,M}, $$
#
# and Daly (2006, *A higher order estimate of the optimum checkpoint interval for restart dumps*, FGCS
# 22(3)) wrote the complete expected wall time for $T_s$ seconds of work,
#
# $$ T_w(\tau) = M\,e^{R/M}\left(e^{(\tau+\delta)/M}-1\right)\frac{T_s}{\tau}, $$
#
# whose minimum his perturbation series gives as
# $\tau_\text{Daly} = \sqrt{2\delta M}\,\big(1 + \tfrac13\sqrt{\delta/2M} + \tfrac19\,\delta/2M\big) - \delta$.
# `course_utils/checkpoint_interval.py` implements both; its tests reproduce Daly's own examples
# (117, 57 and 9.1 minutes for $M$ = 24 h, 6 h and 15 min with $\delta$ = 5 min) and check the closed form
# against a Monte-Carlo simulation of failures.
#
# Where does $M$ come from? A job stops when *any* of its GPUs fails, so failure rates add:
# $M_\text{job} = M_\text{GPU} / N$. Llama 3's 405B pre-training saw **419 unexpected interruptions in a
# 54-day snapshot** on up to 16,384 H100s (Dubey et al. 2024, *The Llama 3 Herd of Models*, section 3.3.4,
# Table 5). That count is every cause: GPUs and their memory account for 58.7% of it, the rest is software,
# network and hosts. Spread over the GPUs it gives a failure rate *per GPU, any cause*, which is what
# $M_\text{GPU}$ means below. *Predict:* what is the job's MTBF, and how often should a 2-minute checkpoint
# be written?

# %%
from course_utils import checkpoint_interval as ci

M = ci.llama3_job_mtbf()
print(f"Llama 3: a failure every {M / 3600:.2f} h of the job "
      f"= one per GPU, any cause, every {M * ci.LLAMA3_GPUS / (365 * 86400):.1f} years")
for delta in (30.0, 120.0, 600.0):
    print(f"checkpoint {delta / 60:4.1f} min: Young every {ci.young_interval(delta, M) / 60:5.1f} min, "
          f"Daly every {ci.daly_interval(delta, M) / 60:5.1f} min, "
          f"time lost at the optimum {100 * ci.waste_fraction(ci.daly_interval(delta, M), delta, M, 600.0):.1f}%")

# %% [markdown]
# The optimum is flat: the left panel shows the fraction of the machine lost (writing checkpoints, redoing
# lost work, restarting) against the interval, for three write costs at Llama 3's MTBF and a 10-minute
# restart; the black squares are simulated jobs (200 runs of 50 segments each, Poisson failures), not the
# formula. The right panel asks what a wrong guess of the MTBF costs: choosing the interval for an MTBF off
# by 2x loses about a percentage point more. What does matter is the write time $\delta$: to first order the
# checkpoints and the work they fail to protect cost $\sqrt{2\delta/M}$ of the machine, so a 4x faster write
# halves that part (the printed table above: 30 s, 2 min and 10 min writes). That is why sharded checkpoints,
# every rank writing its own part in parallel, and asynchronous saves (Part B) matter at scale. The restarts
# add $R/M$ on top whatever the interval. Values here are the published interruption rate with illustrative
# write and restart times, not measurements of any cluster.

# %% tags=["nbval-ignore-output"]
delta, restart = 120.0, 600.0
simulated = {tau: ci.simulate_wall_time(tau, delta, M, restart, 50 * tau, runs=200, seed=i) / (50 * tau)
             for i, tau in enumerate(ci.daly_interval(delta, M) * np.array([0.2, 1.0, 5.0]))}
fig = ci.sensitivity_figure(delta, M, restart, simulated=simulated)
plots.savefig(fig, "08_checkpoint_interval");

# %% [markdown]
# ### Exercise 5: how often, for a job on many GPUs
#
# Write `checkpoint_every(checkpoint_s, gpu_mtbf_s, n_gpus)`: Young's interval in seconds for a job on
# `n_gpus` GPUs that each fail, independently, once every `gpu_mtbf_s` seconds on average.

# %% tags=["exercise"]
def checkpoint_every(checkpoint_s, gpu_mtbf_s, n_gpus):
    raise NotImplementedError


# %% tags=["check"]
check("checkpoint_every", checkpoint_every)

# %% [markdown]
# ## Summary
#
# - fp16 has bits for precision but little range (max 65504, gradients below $2^{-24}$ vanish); bf16 has
#   fp32's range but only 8 bits of significand, so small updates to bf16 weights round away. Loss scaling
#   fixes the first (a `GradScaler` that backs off on inf and skips that step on every rank together), fp32
#   master weights the second.
# - A checkpoint is the *whole* state: model, optimizer, scheduler, step, the data order and position,
#   every RNG, the loss scale, the config. With all of it a resumed run is the same run, bit for bit;
#   without any one piece it is a different run that does not say so.
# - Sharded checkpoints (DCP) are written by every rank in parallel and can be loaded at another world
#   size; a write must be atomic (temporary name, fsync, rename, a manifest last) so that a crash midway
#   leaves the previous checkpoint as the newest valid one.
# - Checkpoint every $\approx\sqrt{2\,\delta\,M_\text{job}}$ with $M_\text{job} = M_\text{GPU}/N$; the
#   optimum is flat in $M$ but the loss grows with $\sqrt\delta$.
#
# Chapter 09 turns to runs that do not crash but go wrong: loss spikes, and how telemetry, checksums and
# deterministic replay (which needs exactly the bitwise resume of Part B) find their cause. Chapter 11 shows
# how sharding the optimizer state (ZeRO) shrinks what each rank must hold, and so what each rank must save.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
