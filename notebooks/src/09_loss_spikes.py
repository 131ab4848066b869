# %% [markdown]
# # 09 · Loss spike debugging
#
# A large run's loss curve is the only thing most people look at, and one morning it has a spike in it.
# Maybe the run recovers by itself; maybe it diverges; maybe nothing shows at all and the model is quietly
# worse. The cause can sit in any of four layers, and each layer has its own first check:
#
# | layer | what goes wrong | the fault injected here |
# |---|---|---|
# | **data** | a bad batch: a corrupted shard, a broken tokenizer run | `garbage_batch` |
# | **numeric** | the arithmetic itself: logits that grow without bound, gradients that round to zero | `high_lr`, `fp16_underflow` |
# | **communication** | ranks that stop agreeing: a reduction that sums instead of averages | `sum_not_average` |
# | **hardware** | a flipped bit: silent data corruption in one GPU | `bit_flip` |
#
# You cannot debug what you did not measure. So the chapter trains a tiny GPT (the course's GPT,
# `workers/model/gpt.py`, with its attention written out so its logits can be watched; 106k parameters, a seeded
# Markov chain as data: it learns in a hundred steps on one CPU core; `workers/gpt/` is the training loop) on real
# ranks, and every step the ranks stream **telemetry**: the loss, the global and per-layer gradient norms, the
# update/parameter ratio, the largest attention logit, the output log Z, the loss scale and the sample ids of
# the batch. Then we break it, one layer at a time, and look at what each fault does to the telemetry:
# its *signature*. Detection and recovery are real code: a loss-spike detector with rewind-and-skip, a
# cross-rank checksum with a reduction check, and deterministic replay.
#
# Everything runs on this machine's CPU with gloo (world 1 and 2); the faults and their signatures are the
# same on GPUs, only the timings differ.

# %%
import math

import torch

import course_utils as cu
from course_utils import ch09, ch09_tables, plots, reference_data
from workers.gpt.config import MODEL, TrainConfig
from workers.gpt.data import MarkovDataset, entropy_rate
from workers.model import make_model

plots.style()
TRAIN = "workers.ch09_train"
LIMITS = {"timeout": 120}
cfg, run_cfg = MODEL, TrainConfig()
floor = entropy_rate(MarkovDataset(cfg.vocab, cfg.seq, 1, run_cfg.data_seed).table)
n_params = sum(p.numel() for p in make_model(cfg).parameters())
print(cfg)
print("parameters:", n_params)
print(f"loss at uniform guessing log V = {math.log(cfg.vocab):.3f}; the chain's entropy rate (the floor) = {floor:.3f}")

# %% [markdown]
# ## 1. A healthy run and its telemetry
#
# The defaults: AdamW at learning rate $3\cdot10^{-3}$ after 20 warm-up steps, 120 steps of 16 samples of
# 32 tokens. What the telemetry means:
#
# - **global grad norm** $\lVert g\rVert = \sqrt{\sum_i g_i^2}$ over every parameter: the number
#   `torch.nn.utils.clip_grad_norm_` returns and clips with (the tests check that they agree);
# - **update/param ratio** $\lVert\theta_{t+1}-\theta_t\rVert / \lVert\theta_t\rVert$: how far one step
#   moves the weights, relative to their size. Adam's update is at most about `lr` per element whatever the
#   gradient's size, so in a healthy run this changes slowly from step to step and jumps when a step is unusual;
# - **max attention logit** $\max q\cdot k/\sqrt{d}$, over layers, heads and positions;
# - **output log Z** $=\log\sum_v e^{z_v}$, the softmax normaliser of the output logits, averaged over positions;
# - **loss scale**: the factor an fp16 run multiplies its loss by before backward (1 here: this run is fp32).
#
# **Predict**: after warm-up, does the global grad norm fall with the loss, stay flat, or grow?

# %% tags=["nbval-ignore-output"]
clean = cu.run(TRAIN, world_size=1, **LIMITS)
print(clean.describe())
tel = ch09.telemetry(clean)
print(f"loss: {tel['loss'][0]:.2f} -> {sum(tel['loss'][-10:]) / 10:.2f} (mean of the last 10 steps)")

# %%
print("the loss falls below 1.2 x the floor within the run:", sum(tel["loss"][-10:]) / 10 < 1.2 * floor)
print("the detector sees no spike in the healthy run:", ch09.spike_steps(tel) == [])

# %% tags=["nbval-ignore-output"]
print("series drawn:", [title for _, title, _ in ch09.telemetry_panels(tel)])
fig = ch09.draw_telemetry(tel, f"A healthy run's telemetry (lr {run_cfg.lr:g}); {clean.world_size} rank(s), "
                        f"{clean.seconds:.1f} s; {reference_data.label(reference_data.run_record(clean))}", cfg.vocab)
plots.savefig(fig, "09_healthy");

# %% tags=["nbval-ignore-output"]
def median(values):
    return sorted(values)[len(values) // 2]


warm = run_cfg.warmup
for key in ("loss", "grad_norm", "update_ratio", "max_attn_logit", "log_z_mean"):
    v = tel[key]
    print(f"{key:>14}: median of steps {warm}-{warm + 19}: {median(v[warm:warm + 20]):7.4f}, "
          f"of the last 20 steps: {median(v[-20:]):7.4f}, largest step-to-step ratio after warm-up: "
          f"{max(b / a for a, b in zip(v[warm:], v[warm + 1:])):5.2f}")
print("grad norm per layer group, median after warm-up:",
      {name: round(median(v[warm:]), 3) for name, v in tel["layer_grad_norms"].items()})

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_layer_grad_norms(tel, title="healthy run: grad norm per layer group"), "09_layer_norms");

# %% [markdown]
# After warm-up the grad norm falls with the loss, but only by a fraction (the medians above), not towards
# zero, and it is noisy from step to step: near the floor, the gradient of a 16-sample batch is mostly
# sampling noise, and noise does not shrink as the model improves. So an
# absolute grad-norm threshold is a poor alarm and a *relative* one (against the recent median) a good one;
# the same goes for the loss. The update ratio peaks as warm-up ends and then drifts slowly down, with no
# jump; the max attention logit and log Z drift slowly up. Those slow drifts are what the faults below turn
# into jumps or runaways. The layer groups sit at different levels (block 1's gradient is about a third of
# block 0's and the embeddings'): compare each with its own history, and a spike confined to one group points
# at that layer.
#
# ## 2. Data: a garbage batch
#
# At step 65 the batch's 16 samples are random tokens (the dataset itself is corrupted at those sample ids,
# as a bad shard would be). **Predict**: how high does the loss jump, compared with $\log V = 3.47$? Does
# the run come back by itself, and how fast?

# %% tags=["nbval-ignore-output"]
garbage = cu.run(TRAIN, world_size=1, **LIMITS, fault="garbage_batch")
bad = ch09.telemetry(garbage)
at = run_cfg.at_step
print(f"loss at step {at}: {bad['loss'][at]:.2f} (clean run: {tel['loss'][at]:.2f}); grad norm {bad['grad_norm'][at]:.2f} "
      f"(clean {tel['grad_norm'][at]:.2f})")

# %%
print("spikes the detector finds:", ch09.spike_steps(bad))
print(f"sample ids of batch {at}: {bad['sample_ids'][at][0]}..{bad['sample_ids'][at][-1]}, "
      f"garbage among them: {bad['garbage_samples'][at]} of {len(bad['sample_ids'][at])}")
print("identical to the clean run before the bad batch:", bad["loss"][:at] == tel["loss"][:at])

# %% [markdown]
# The loss spike is larger than $\log V$: a trained model is *confidently* wrong about random tokens, which
# costs more than guessing. The batch pushes the weights far (grad norm and update ratio jump), and the run
# takes a few steps to forget it. Here the damage is small; at scale a bad batch at a high learning rate
# can start a divergence. Logging **sample ids per batch** is what turns "a spike at step 65" into "these
# 16 samples".
#
# **Rewind and skip.** The training loop keeps an in-memory snapshot (weights, optimizer state, loss scale,
# data cursor) every 10 steps. When a loss exceeds 1.5x the median of the last 10, it restores the last
# snapshot, adds the spiking batch's sample ids to a skip list, and trains on. The criterion for a correct
# recovery is strict: the recovered run must be **bit for bit** the run that never saw those samples.

# %% tags=["nbval-ignore-output"]
recovered = cu.run(TRAIN, world_size=1, **LIMITS, fault="garbage_batch", recover=True)
rewinds = recovered[0]["rewinds"]
never_saw = cu.run(TRAIN, world_size=1, **LIMITS, skip_ids=rewinds[0]["skipped_ids"])
print(recovered.describe())

# %%
rec = ch09.telemetry(recovered)
ref = ch09.telemetry(never_saw)
for rw in rewinds:
    print(f"spike at step {rw['spike_step']}: rewound to the snapshot of step {rw['rewound_to']}, "
          f"skipped sample ids {rw['skipped_ids'][0]}..{rw['skipped_ids'][-1]}")
print("steps executed:", len(recovered[0]["executed"]["step"]), "for", len(rec["step"]), "committed")
print("recovered == the run that never saw those samples, loss for loss:", rec["loss"] == ref["loss"])
print("... and final weights bit for bit:", rec["param_checksum"][-1] == ref["param_checksum"][-1])

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_garbage_batch(tel, bad, at, rec, recovered[0]["executed"], rewinds), "09_garbage_batch");

# %% [markdown]
# ## 3. Numeric: a learning rate too high, qk-layernorm and z-loss
#
# Now the learning rate is 0.2 (the `high_lr` fault). Wortsman et al. 2023, *Small-scale proxies for
# large-scale Transformer training instabilities* (sec. 3.1), reproduce in small models what
# Dehghani et al. 2023, *Scaling Vision Transformers to 22B parameters* (sec. 3.1), saw at scale: the
# attention logits $q\cdot k/\sqrt d$ grow without bound, the softmax collapses onto one position
# (attention entropy collapse), and the loss stops improving or diverges. Their fix is **qk-layernorm**: a
# LayerNorm on $q$ and $k$ per head before the dot product, which bounds the logits by the LayerNorm gains.
# The second instability is the output softmax: cross-entropy does not care where $\log Z$ sits, so it
# drifts. PaLM (Chowdhery et al. 2022, sec. 5) adds the **z-loss** $10^{-4}\cdot\log^2 Z$ to pull it to 0.
#
# Four runs at lr 0.2: plain, qk-layernorm, z-loss, both. Our z-loss coefficient is $10^{-2}$, not
# PaLM's $10^{-4}$: our $\log Z$ is about 5, not hundreds, and the run is 120 steps long, so the pull
# $2c\log Z$ must be stronger to act within it.
#
# **Predict**: which of the four runs' max attention logit passes 1,000? Which runs' loss ends lowest?

# %% tags=["nbval-ignore-output"]
HIGH = {"plain": {}, "qk-layernorm": {"qk_layernorm": True}, "z-loss 1e-2": {"z_loss": 1e-2},
        "qk-layernorm + z-loss": {"qk_layernorm": True, "z_loss": 1e-2}}
high = {label: ch09.telemetry(cu.run(TRAIN, world_size=1, **LIMITS, fault="high_lr", **kw)) for label, kw in HIGH.items()}
for label, t in high.items():
    print(f"{label:>22}: max attention logit {max(t['max_attn_logit']):>10.1f}, final loss "
          f"{sum(t['loss'][-10:]) / 10:.2f}, final mean log Z {t['log_z_mean'][-1]:.2f}")

# %%
final = {label: sum(t["loss"][-10:]) / 10 for label, t in high.items()}
print("plain: max attention logit above 1,000:", max(high["plain"]["max_attn_logit"]) > 1e3)
print("qk-layernorm: max attention logit stays below 100:",
      all(max(high[k]["max_attn_logit"]) < 100 for k in ("qk-layernorm", "qk-layernorm + z-loss")))
print("plain: final loss above 2.5 (it stopped learning; log V = 3.47):", final["plain"] > 2.5)
print("qk-layernorm: final loss at least 0.5 below plain's:", final["qk-layernorm"] < final["plain"] - 0.5)
print("z-loss: |mean log Z| ends below 1.5, plain above 3:",
      abs(high["z-loss 1e-2"]["log_z_mean"][-1]) < 1.5 and high["plain"]["log_z_mean"][-1] > 3)

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_high_lr(high, run_cfg.high_lr, cfg.vocab), "09_high_lr");

# %% [markdown]
# Without qk-layernorm the max attention logit climbs from 0.1 past $10^5$ and the loss stalls near 3,
# barely below $\log V$; with it the logits stay in the tens and the run trains at a learning rate about 70x
# the default. z-loss alone does nothing for the attention logits (it acts on the output softmax only), but
# it holds $\log Z$ near 0 where it otherwise drifts to about 4. In the runs stored here all four spike early,
# while warm-up is still raising the learning rate: a longer warm-up is the other classic mitigation.
#
# These are chaotic runs: on your CPU the numbers above will differ (other kernels round differently). Over
# the CPU kernels and seeds we measured (`python -m course_utils.cpu_spread ch09_high_lr`) the plain run's
# logits peaked between $1.9\cdot10^5$ and $4.7\cdot10^5$ and its loss ended between 2.8 and 3.2, the
# qk-layernorm run's logits stayed between 34 and 56 and its loss ended 0.7 to 1.4 below the plain run's, and
# $\log Z$ ended at 3.6 to 4.2 without z-loss and within 1.1 of 0 with it: the verdicts printed above hold
# on all of them.
#
# Explore: learning rate, qk-layernorm and z-loss (every change is a new run on a real rank). The widget's
# runs are half as long as the ones above, which is long enough for the logits to run away; a change answers in
# about 1 s on the warm rank of an idle 2-core machine (`make bench`), several times that on a busy one:

# %% tags=["nbval-ignore-output"]
WIDGET_STEPS = 60  # half the run, so that a change answers in a second or two
logit = high["plain"]["max_attn_logit"]
print(f"plain run at lr {run_cfg.high_lr:g}: max attention logit {logit[0]:.3f} at step 0, "
      f"{logit[WIDGET_STEPS - 1]:.3g} at step {WIDGET_STEPS - 1}: grown {logit[WIDGET_STEPS - 1] / logit[0]:.1e}x")

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun



def draw_lr(res, params):
    t = ch09.telemetry(res)
    label = f"qk-LN {'on' if params['qk_layernorm'] else 'off'}, z-loss {params['z_loss']:g}"
    return ch09.draw_high_lr({label: t}, params["high_lr"], cfg.vocab)


lr_live = LiveRun(TRAIN, {"high_lr": W.FloatLogSlider(value=0.2, base=10, min=-3, max=0, step=0.25,
                                                       description="lr", continuous_update=False),
                          "qk_layernorm": W.Checkbox(value=False, description="qk-layernorm"),
                          "z_loss": W.Dropdown(options=[0.0, 1e-4, 1e-2], value=0.0, description="z-loss")},
                  draw_lr, params={"world_size": 1, "fault": "high_lr", "steps": WIDGET_STEPS}, timeout=120,
                  progress_total=lambda p: WIDGET_STEPS)
lr_live.wait(120)
lr_live

# %% [markdown]
# ## 4. Numeric: fp16 underflow
#
# fp16 has 5 exponent bits: its smallest subnormal is $2^{-24}\approx 6\cdot10^{-8}$, and any gradient below
# it becomes exactly 0. Our tiny model's gradients (median about $6\cdot10^{-4}$) are far from that floor; a
# large model's, averaged over millions of tokens and wide layers, are not. So the `fp16_underflow` fault
# multiplies the loss by $2^{-14}$ before an fp16 backward (and divides the fp32 gradients by it after), which
# moves our gradients where a big model's sit. In fp32 that multiplier is exact and changes nothing. The
# mitigation is dynamic **loss scaling** (Micikevicius et al. 2018, *Mixed Precision Training*, sec. 3.2):
# multiply the loss by $S=2^{16}$, divide the gradients by $S$ in fp32, halve $S$ on an overflow, double it
# after 50 clean steps.
#
# **Predict**: what fraction of gradient elements is exactly zero without loss scaling? Does the loss still fall?
#
# (The run without loss scaling also takes the exact fp32 gradient of every batch, `fp32_grad_probe=True`,
# to grade the gradients it gets; that costs a second backward and changes nothing in the run.)

# %% tags=["nbval-ignore-output"]
FP16 = {"fp32, same multiplier": {"dtype": "float32"}, "fp16, no loss scaling": {"fp32_grad_probe": True},
        "fp16, dynamic loss scaling": {"loss_scaling": True}}
fp16 = {label: ch09.telemetry(cu.run(TRAIN, world_size=1, **LIMITS, fault="fp16_underflow", **FP16[label]))
        for label in cu.each(FP16, "run")}  # each() prints which run it is on: about 7 s each here, idle
for label, t in fp16.items():
    low = min(t["loss"])
    print(f"{label:>27}: zero gradient elements {100 * sum(t['zero_grad_frac']) / len(t['step']):5.1f}% on average, "
          f"loss at its lowest {low:.2f} (step {t['loss'].index(low)}), final {t['loss'][-1]:.2f}, "
          f"final loss scale {t['loss_scale'][-1]:g}")

# %%
zeros = {label: sum(t["zero_grad_frac"]) / len(t["step"]) for label, t in fp16.items()}
plain16 = fp16["fp16, no loss scaling"]
print("without loss scaling, more than 90% of gradient elements are exactly 0:", zeros["fp16, no loss scaling"] > 0.9)
print("with loss scaling, fewer than 1%:", zeros["fp16, dynamic loss scaling"] < 0.01)
print("the multiplier is exact in fp32: the fp32 run equals the healthy run, loss for loss:",
      fp16["fp32, same multiplier"]["loss"] == tel["loss"])
print("without loss scaling the loss turns: it ends more than 0.5 above its lowest point:",
      plain16["loss"][-1] > min(plain16["loss"]) + 0.5)
print("the spike detector flags no step of it:", ch09.spike_steps(plain16) == [])

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_fp16(fp16, cfg.vocab), "09_fp16_underflow");

# %% [markdown]
# The fp32 curve lies exactly under the loss-scaled fp16 one. Without loss scaling nearly every gradient
# element is 0, and the loss first falls, more slowly, then turns and climbs back by more than a nat (to
# about $\log V$) by the end of the run, with no step the spike detector would flag. Why does it learn at
# all, and why does it turn? The per-layer grad
# norms and the count of elements whose gradient is nonzero for the first time (`woken_elements`) say where
# the gradient goes.

# %% tags=["nbval-ignore-output"]
body = [s for s in plain16["step"] if any(plain16["layer_grad_norms"][g][s] > 0 for g in ("embed", "block0", "block1"))]
wake = body[0]
woken = plain16["woken_elements"][wake]
print(f"steps before any gradient reaches the embeddings or the blocks: {wake} (only the head has one until then)")
print(f"elements whose gradient is nonzero for the first time at step {wake}: {woken} "
      f"({100 * woken / n_params:.1f}% of the parameters)")
print(f"... the share of exactly-zero gradient elements at steps {wake - 1}, {wake}: "
      f"{plain16['zero_grad_frac'][wake - 1]:.3f}, {plain16['zero_grad_frac'][wake]:.3f}")
print(f"... update/param ratio at steps {wake - 1}, {wake}: "
      f"{plain16['update_ratio'][wake - 1]:.4f}, {plain16['update_ratio'][wake]:.4f}")
dlogit = run_cfg.loss_multiplier / (run_cfg.global_batch * cfg.seq)  # d(multiplier * mean CE)/d logit <= this
print(f"the largest possible gradient of one output logit: {dlogit:.2e} = {dlogit / 2 ** -24:g} x fp16's smallest "
      f"subnormal 2^-24")

# %% tags=["nbval-ignore-output"]
first = ch09.adam_steps_after_one_gradient(wake, 1)[0]
echo = ch09.adam_steps_after_one_gradient(wake, len(plain16["step"]) - wake)
print(f"step {wake}: their fp16 gradients have the sign of the exact fp32 gradient for "
      f"{100 * plain16['woken_sign_agreement'][wake]:.0f}% of them (50% is a coin toss)")
print(f"Adam's step on them: median {plain16['woken_update'][wake]:.3f} lr; "
      f"a weight's first gradient at step {wake} gets {first:.3f} lr from Adam, whatever its size")
print(f"with no gradient after it, momentum carries such a weight {sum(echo[:8]):.1f} lr in 8 steps, "
      f"{sum(echo):.1f} lr by the end of the run")

# %% [markdown]
# For its first 52 steps (50 to 55, whatever the CPU and the seed) the fp16 run trains only its output layer. A logit's gradient is at most two units
# of fp16's smallest subnormal; the head's weight gradient sums such units over 512 positions and survives,
# but one matrix product further back (times weights of size 0.02) everything rounds to 0. That is why the
# loss falls at first (a linear read-out of random features learns something) and why it falls slowly.
# Then, as the head learns, the backward signal starts to cross the floor inside the blocks, as a few
# rounding units per element, and these gradients carry no direction: their signs match the exact
# gradient's about as often as a coin would. Adam normalises every element by its own history, and a weight
# that had none (m = v = 0) gets a step of a fixed size on its first gradient, about half of `lr`, however
# small that gradient was; momentum then keeps moving it for many steps more. Thousands of weights take
# random steps as large as the real ones: that is the dip in the zero fraction and the jump in the update
# ratio at the same step, and the loss turns.
#
# **Test the explanation**: rerun, and from that step on give no update to the weights that had no gradient
# before it (`freeze_dormant_from`); everything else is the same run.

# %% tags=["nbval-ignore-output"]
frozen = ch09.telemetry(cu.run(TRAIN, world_size=1, **LIMITS, fault="fp16_underflow", freeze_dormant_from=wake))
for label, t in {"fp16, no loss scaling": plain16, f"... dormant weights frozen from step {wake}": frozen}.items():
    low = min(t["loss"])
    print(f"{label:>42}: loss at its lowest {low:.2f} (step {t['loss'].index(low)}), final {t['loss'][-1]:.2f}")

# %%
print("the same run up to that step, loss for loss:", frozen["loss"][:wake + 1] == plain16["loss"][:wake + 1])
print("frozen, the loss keeps falling: it ends below the unfrozen run's lowest point:",
      frozen["loss"][-1] < min(plain16["loss"]))

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_dormant({"fp16, no loss scaling": plain16, f"dormant weights frozen from step {wake}": frozen},
                                wake, cfg.vocab), "09_fp16_dormant");

# %% [markdown]
# With those weights frozen the loss keeps falling: the first gradients to get through did the damage. So
# this numeric fault shows first as a loss that is *too slow*, then as a loss that climbs with no spike, and
# the loss is the wrong place to look for it. The first check is the zero-gradient counter (and the
# per-layer grad norms: the body's are exactly 0). Loss scaling moves the gradients back above the floor,
# where they have a direction, and the problem is gone. (Freezing is a diagnosis, not a fix.)
#
# ## 5. Communication: a rank that sums instead of averages
#
# Two ranks, gradients averaged by hand (a flat buffer, `all_reduce`, divide by the world size). From
# step 65 on, rank 1 forgets the division: its gradient is twice everyone else's. Nothing raises. Every
# step, each rank computes a **bitwise checksum** of its parameters (every bit and every position counts,
# see the exercise) and the ranks all-gather them. And because averaging is linear, each rank also checks
# its reduction: projected on a fixed random vector (the same on every rank), its reduced gradient must
# give the mean of the ranks' local projections. (The plain sum of the gradient elements would be the
# simplest such projection, and a poor one: a gradient's elements nearly cancel, the softmax's over the
# vocabulary, LayerNorm's over its features, and twice almost nothing is almost nothing.)
#
# **Predict**: at which step do the checksums first differ, and can two ranks tell which of them is wrong?

# %% tags=["nbval-ignore-output"]
summed = cu.run(TRAIN, world_size=2, **LIMITS, fault="sum_not_average", fault_rank=1, steps=80, replay=True)
print(summed.describe())

# %%
alarm = summed[0]["checksum_alarm"]
print(f"first step whose checksums disagree: {alarm['step']}; culprit: rank {alarm['culprits']} "
      f"(found by the {alarm['by']})")
print("the ranks agree bit for bit before that step:",
      summed[0]["telemetry"]["param_checksum"][:alarm["step"]] == summed[1]["telemetry"]["param_checksum"][:alarm["step"]])

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_checksums(summed, "rank 1 sums instead of averaging from step 65 (world 2, CPU)"),
              "09_sum_not_average");

# %% [markdown]
# The checksum fires at the first step, exact to the step, long before the losses drift visibly apart.
# With two ranks a checksum alone cannot say who is wrong (one against one); the reduction check can,
# because the faulty rank's reduced gradient is not the mean of the local ones. With more ranks, the
# odd one out of the majority is the suspect. (The run also replayed itself from step 0, `replay=True`: that
# is for section 6.)
#
# ## 6. Hardware: a flipped bit
#
# Silent data corruption: at step 65 one bit of one element flips on rank 1 (bit 20, a mantissa bit:
# the value changes by 6 to 12.5%). First in rank 1's **gradient before the all-reduce**. **Predict**: does the
# cross-rank checksum catch it?

# %% tags=["nbval-ignore-output"]
flipped = cu.run(TRAIN, world_size=2, **LIMITS, fault="bit_flip", fault_rank=1, steps=80, replay=True)
print(flipped.describe())

# %%
print("cross-rank checksum alarm:", flipped[0]["checksum_alarm"])
rep = flipped[0]["replay"]
print(f"replay from step 0: first differing step {rep['first_step']}, on rank(s) {rep['ranks']}, in the {rep['where']}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_replay(flipped, "a bit flips in rank 1's gradient at step 65 (world 2, CPU)"), "09_bit_flip");

# %% [markdown]
# The checksum sees nothing: the all-reduce averaged the corrupted gradient into *every* rank, so the ranks
# agree perfectly, on the wrong weights. The loss does not show it either. What finds it is **deterministic
# replay**: restore a snapshot and run the same steps again, with the same data, comparing a per-step
# fingerprint (checksums of each rank's local gradient before the all-reduce and of its parameters after
# the step). On deterministic kernels a replay reproduces every bit, so the first fingerprint that differs is
# the corrupted step; the rank whose *local gradient* differs first is the faulty one. (Every bit on the same
# hardware and build: the replay must run where the run ran, or on an identical machine. On another CPU the
# kernels round differently, and every fingerprint differs from the first step.) A fault that a replay
# does **not** reproduce is hardware; one that it does is software or data. The summing rank of section 5
# replayed itself the same way: compare.

# %%
rep_sum = summed[0]["replay"]
print(f"bit flip (transient, hardware): the replay diverges: {rep['diverged']}, first at step {rep['first_step']}, "
      f"rank(s) {rep['ranks']}")
print(f"summing rank (in the code): the replay diverges: {rep_sum['diverged']}; first differing fingerprint, by rank: "
      f"{rep_sum['event_by_rank']}")
print(f"... although that run's ranks disagree from step {summed[0]['checksum_alarm']['step']}: the replay made the same "
      "mistake, bit for bit:", not rep_sum["diverged"])

# %% [markdown]
# The replay of the summing run reproduced every fingerprint, through the faulty steps too: the fault is
# in the code, so it happens again on the same inputs, and a replay that finds *nothing* is the finding
# (look at the code, the configuration, the data). A replay that parts from the original run points at
# the machine.
#
# The same flip in rank 1's **parameters after the step** is different: now the ranks disagree, and the
# checksum fires at once, but two ranks cannot vote. The replay says who.

# %%
flipped_param = cu.run(TRAIN, world_size=2, **LIMITS, fault="bit_flip", fault_rank=1, flip_target="param",
                       steps=80, replay=True)
alarm = flipped_param[0]["checksum_alarm"]
rep = flipped_param[0]["replay"]
print(f"checksum: ranks disagree from step {alarm['step']}; culprit by the checksum alone: {alarm['culprits']} "
      f"({alarm['by']})")
print(f"replay: first differing step {rep['first_step']}, rank(s) {rep['ranks']}, in the {rep['where']}")

# %% [markdown]
# ## 7. Triage: symptom, first check, tool, mitigation
#
# What the five experiments add up to, as data (`course_utils.ch09_tables.TRIAGE`):

# %%
print(ch09_tables.triage_table())

# %% [markdown]
# How often does each layer strike at scale? Meta published the root causes of the 419 unexpected
# interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (Dubey et al. 2024,
# *The Llama 3 Herd of Models*, arXiv:2407.21783, section 3.3.4, Table 5). The counts, as published:

# %%
print(ch09_tables.interruption_table())
rows = ch09_tables.LLAMA3_INTERRUPTIONS
print("counts add up to the published total of 419:", sum(r[2] for r in rows) == ch09_tables.LLAMA3_TOTAL_UNEXPECTED)
print("rows whose published % is not count/419:",
      [r[0] for r in rows if round(ch09_tables.percent_of_total(r[2]), 1) != r[3]])

# %% tags=["nbval-ignore-output"]
plots.savefig(ch09.draw_interruptions(), "09_llama3_interruptions");

# %% [markdown]
# Check a table before you use it: the counts add up, the printed percentages do not (94.9%), because the
# first row says 30.1% where 148/419 is 35.3%. GPUs and their memory are 64% of the interruptions by count;
# "Silent Data Corruption" is only 6 of them, but those are the six that no error message reports, and
# the ones that replay exists for. Every row of this table stopped the job (a restart from the last
# checkpoint); the loss spikes of this chapter are the failures that do *not* stop it, and silent data
# corruption is where the two meet.
#
# ## 8. Exercises
#
# ### Exercise 1: a cross-rank checksum
#
# Write `cross_rank_checksum(params)`: return a list, on **every** rank, with every rank's checksum of its
# list of parameter tensors, in rank order. It is graded on real ranks (world 2, then 4) where one rank has
# the lowest mantissa bit of one element flipped (of an ordinary weight, then of a weight near 1e-12), or
# -0.0 where the others hold 0.0, and another has two elements swapped: each must change that rank's
# checksum. Hints: `t.view(torch.int32)` reinterprets the bits; weight each element by its
# position; keep the arithmetic in Python ints or split words into 16-bit halves so int64 cannot
# overflow; `dist.all_gather_object(out, value)` gathers one Python object per rank.

# %% tags=["exercise"]
def cross_rank_checksum(params):
    raise NotImplementedError


# %% tags=["check"]
from course_utils.exercises import check

check("cross_rank_checksum", cross_rank_checksum)

# %% [markdown]
# ### Exercise 2: where did two runs part?
#
# Write `first_divergence(trace_a, trace_b, rtol)`: the first index at which two per-step traces (losses,
# say) differ by more than `rtol` relative to the larger of the two values, or `None` if they never do.
# A trace that ends early (either one) diverges where it ends; a NaN is never close to anything, not even to
# another NaN, and a step where either trace overflowed to infinity has diverged too (careful: `inf <= rtol * inf`
# holds).

# %% tags=["exercise"]
def first_divergence(trace_a, trace_b, rtol):
    raise NotImplementedError


# %% tags=["check"]
check("first_divergence", first_divergence)

# %% [markdown]
# ### Exercise 3: the z-loss
#
# Write `z_loss(logits, coeff)`: for logits of shape `[..., V]`, return the scalar tensor
# `coeff * mean over positions of (log Z)^2`, with `log Z = logsumexp` over the last dimension
# (PaLM, sec. 5), computed in float32 (the logits may come in bfloat16). It is added to the cross-entropy
# before `backward()`, so it must carry a gradient; the check includes logits around +100 and -120.

# %% tags=["exercise"]
def z_loss(logits, coeff):
    raise NotImplementedError


# %% tags=["check"]
check("z_loss", z_loss)

# %% [markdown]
# ## Summary
#
# - Measure before you need it: loss, grad norms (global and per layer), update/param ratio, max attention
#   logit, log Z, loss scale, sample ids; every step.
# - **Data**: a spike tied to a batch. Rewind to a snapshot and skip the sample ids; done right, the run is
#   bit for bit the run that never saw them.
# - **Numeric**: at a high learning rate the attention logits grow without bound (qk-layernorm bounds
#   them) and log Z drifts (z-loss pins it); in fp16 small gradients become 0 (loss scaling), and the
#   first ones to get through are rounding noise on which Adam takes full-size steps: a slow climb, no spike.
# - **Communication**: a cross-rank bitwise checksum finds the first step at which ranks disagree; a
#   linear invariant (a random projection of the reduced gradient = the mean of the local gradients'
#   projections) names the rank.
# - **Hardware**: corruption before an all-reduce leaves the ranks in agreement; only deterministic
#   replay finds the step and the rank, and tells hardware (the bit flip: not reproduced) from software (the
#   summing rank: reproduced bit for bit).

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
