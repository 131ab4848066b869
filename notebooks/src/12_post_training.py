# %% [markdown]
# # 12 · Post-training ledger: SFT, LoRA and RL
#
# Pretraining makes a model that continues text; post-training makes one that answers. The recipe has a
# few standard parts, and each has a cost you can write down before you start:
#
# | step | what it learns from | what it holds in memory |
# |---|---|---|
# | **SFT** (supervised fine-tuning) | prompts with written answers | the model + its optimizer state |
# | **LoRA / QLoRA** | the same data, through a small adapter | a frozen base + a small trained adapter |
# | **DPO** | pairs of answers, one preferred | the policy + a frozen reference |
# | **GRPO** (or PPO) | rewards of sampled answers | the policy + a reference (+ value and reward models for PPO) |
#
# The chapter does all of it for real, on a tiny GPT (`workers/gpt/`, reused from chapter 09) and a task
# whose reward a program can check: **"a+b=" followed by the two digits of the sum** (`workers/posttrain/task.py`).
# Each run takes a few seconds on one CPU core, on real ranks (world 1 and 2). The memory ledger for 7B
# and 70B models is computed from the same formulas as chapter 00's. At the end, three **evaluation gates**
# decide whether a run may ship.

# %%
import torch

import course_utils as cu
from course_utils import ch12, plots
from course_utils import posttrain_gates as gates
from course_utils import posttrain_ledger as ledger
from course_utils.posttrain_methods import render_methods
from workers.posttrain import task
from workers.posttrain.lora import LORA_TARGETS, LoRALinear, apply_lora, lora_param_count, trainable_params
from workers.posttrain.train import TOY, make_policy

plots.style()
LIMITS = {"timeout": 120}
print(TOY)
print("tiny GPT parameters:", sum(p.numel() for p in make_policy(0).parameters()))
train_pairs, held_out = task.split_pairs()
print("vocabulary:", task.CHARS, "| a sample:", task.decode(task.sequences([(7, 5)])[0]))
print("train prompts:", len(train_pairs), "| held-out prompts:", len(held_out))
print("every digit is a first and a second operand in training:",
      {a for a, _ in train_pairs} == {b for _, b in train_pairs} == set(range(10)))

# %% [markdown]
# The 20 held-out sums are the pairs with $(a + 2b) \bmod 5 = 0$: two per value of $a$, two per value of $b$.
# They test whether a model learned to add, not whether it can guess a digit it never read in that place
# (holding out $b = 0$ and $b = 5$, say, would ask exactly that).
#
# These runs are tiny and chaotic: on another CPU, whose kernels round differently, a seeded run follows
# another trajectory. The lines this notebook prints as verdicts hold on every CPU kernel measured (AVX-512,
# AVX2, plain) and seed, with a margin (`python -m course_utils.cpu_spread ch12_sft ch12_lora_dpo ch12_grpo`);
# the exact losses and accuracies are printed in cells whose numbers will differ on your machine.
#
# ## 1. LoRA: a rank-r update to a frozen matrix
#
# Full fine-tuning updates every weight $W_0$ ($d\times k$). LoRA (Hu et al. 2021, sec. 4.1) freezes $W_0$
# and learns $\Delta W = \tfrac{\alpha}{r} B A$ with $B$ ($d\times r$) and $A$ ($r\times k$): $r(d+k)$
# numbers instead of $dk$. $B$ starts at **zero**, so at step 0 the adapted layer *is* the base layer.
# After training, $W_0 + \tfrac{\alpha}{r}BA$ is one $d\times k$ matrix again: the **merge** costs nothing
# at inference.
#
# **Predict**: for a $4096\times4096$ projection at $r=16$, what fraction of its weights does LoRA train?

# %%
d = k = 4096
print(f"r=16 on a {d}x{k} matrix: {lora_param_count(d, k, 16):,} trainable of {d * k:,} "
      f"({100 * lora_param_count(d, k, 16) / (d * k):.2f}%)")
torch.manual_seed(0)
layer = LoRALinear(torch.nn.Linear(5, 6), r=2, alpha=4.0)
x = torch.randn(3, 5)
print("at init, adapted layer == base layer, bit for bit:", torch.equal(layer(x), layer.base(x)))
with torch.no_grad():
    layer.lora_B.normal_()  # pretend it trained
print("after training, merged nn.Linear == adapted layer (fp32, atol 1e-6):",
      torch.allclose(layer.merge()(x), layer(x), atol=1e-6))

# %% [markdown]
# On the tiny GPT: adapters on every Linear inside the blocks (attention `qkv`, `proj`; MLP `fc1`, `fc2`).
# The count from the real module must equal $\sum r(d+k)$.

# %%
model = make_policy(0)
wrapped = apply_lora(model, ("qkv", "proj", "fc1", "fc2"), r=4)
D = TOY.hidden
by_formula = TOY.layers * sum(lora_param_count(dd, kk, 4) for dd, kk in ((3 * D, D), (D, D), (4 * D, D), (D, 4 * D)))
print("wrapped:", wrapped)
print("trainable from the module:", trainable_params(model), "| from r(d+k):", by_formula,
      "| equal:", trainable_params(model) == by_formula)

# %% [markdown]
# The LoRA paper's own example (sec. 7.1, Table 5): on GPT-3 175B, a budget of "18M" trainable
# parameters is $r=8$ on one attention matrix type, $r=4$ on two, or $r=2$ on all four, in all 96 layers.

# %%
for r, targets in ((8, ("q",)), (4, ("q", "v")), (2, ("q", "k", "v", "o"))):
    print(f"GPT-3 175B, r={r} on {'+'.join(targets)}: {ledger.lora_params('175B', r, targets):,}")

# %% [markdown]
# ## 2. The memory ledger: full fine-tuning vs LoRA vs QLoRA
#
# Per GPU, model states only (no sharding; activations depend on batch and sequence):
#
# - **full**: 16 bytes per parameter, mixed-precision Adam (ZeRO, sec. 3.1);
# - **LoRA**: the frozen base in bf16 (2 bytes, no gradient, no optimizer state) + adapters at 16 bytes each;
# - **QLoRA** (Dettmers et al. 2023, sec. 3): the base in 4-bit NF4, plus one quantisation constant per
#   block of 64 weights, itself quantised to 8 bits ("double quantization").
#
# **Predict**: which of the six fits on one 80 GB GPU?

# %%
print(f"NF4 bits per weight, constants included: {ledger.nf4_bits_per_param(double_quant=False):.3f} "
      f"plain, {ledger.nf4_bits_per_param():.3f} with double quantization")
rows = ledger.ledger_table(("7B", "70B"), r=16)
print("LoRA r=16 on every linear layer (q, k, v, o, gate, up, down):")
print(ledger.render_ledger(rows))

# %%
GPU_GB = 80
print(f"fits one {GPU_GB} GB GPU (model states):",
      [f"{r['model']} {r['method']}" for r in rows if r["total"] < GPU_GB])

# %% tags=["nbval-ignore-output"]
plots.savefig(ch12.draw_ledger(rows, limit_gb=GPU_GB), "12_ledger");

# %% [markdown]
# Full fine-tuning of 70B needs more than a terabyte
# of model states: that is chapter 00's ZeRO/FSDP territory. Adam's 12 bytes per trained parameter are
# what LoRA removes; the base's 2 bytes per parameter are what QLoRA cuts to about half a byte.
#
# The QLoRA paper's headline: 65B finetuning "from >780GB of GPU memory to <48GB". Our ledger, with the
# Guanaco setting (r = 64 on every linear layer of LLaMA 65B):

# %%
for method in ledger.METHODS:
    m = ledger.finetune_memory(ledger.LLAMA_65B, method, r=64)
    print(f"LLaMA 65B, {method:>5}: {m.total / 1e9:7.1f} GB of model states")

# %% [markdown]
# Explore: LoRA rank and model size (pure arithmetic, no ranks).

# %% tags=["nbval-ignore-output"]
import ipywidgets as W
from IPython.display import display

from course_utils.widgets import figure_png, slider

rank_slider = slider("LoRA rank r", 16, 1, 256)
model_pick = W.Dropdown(options=["7B", "8B", "70B", "405B"], value="70B", description="model")
ledger_out = W.Image()


def _draw_ledger(change=None):
    rows_now = ledger.ledger_table((model_pick.value,), r=rank_slider.value)
    ledger_out.value = figure_png(ch12.draw_ledger(rows_now))


rank_slider.observe(_draw_ledger, "value")
model_pick.observe(_draw_ledger, "value")
_draw_ledger()
display(W.VBox([W.HBox([rank_slider, model_pick]), ledger_out]))

# %% [markdown]
# ## 3. SFT: mask the prompt
#
# An SFT example is a prompt and an answer. The prompt is *given*; the model should learn to produce the
# answer. With the loss on every token, half of each example here is the prompt's random digits, which no
# model can predict: the loss pays for them and the gradient chases them. **Prompt masking** averages the
# cross-entropy over answer tokens only.
#
# **Predict**: which run reaches a lower loss *on the answer tokens*?

# %% tags=["nbval-ignore-output"]
masked = cu.run("workers.ch12_sft", world_size=1, **LIMITS, mask_prompt=True)
unmasked = cu.run("workers.ch12_sft", world_size=1, **LIMITS, mask_prompt=False)
print(masked.describe())

# %%
import math

# how fast each run learns the answers: its answer-token loss averaged over all 150 steps (the last steps
# alone are a noisy read: which run is lower there depends on the seed and on the CPU's kernels)
answer_mean = {name: sum(h["answer_loss"] for h in r[0]["history"]) / len(r[0]["history"])
               for name, r in (("masked", masked), ("unmasked", unmasked))}
# of the 5 predicted tokens, one (b, after "a+") is a uniform digit no model can predict: log 10 nats
print(f"floor of the every-token loss from the digit b alone: log(10) / {task.SEQ_LEN - 1} = "
      f"{math.log(10) / (task.SEQ_LEN - 1):.3f}")
print("masked run learns the answers faster (lower answer-token loss over the run):",
      answer_mean["masked"] < answer_mean["unmasked"])
print("masked run: held-out accuracy rose from 0:", masked[0]["before"]["accuracy"] == 0 < masked[0]["after"]["accuracy"])

# %% tags=["nbval-ignore-output"]
print({name: round(v, 3) for name, v in answer_mean.items()}, "| masked run's held-out accuracy:",
      masked[0]["before"]["accuracy"], "->", masked[0]["after"]["accuracy"])

# %% tags=["nbval-ignore-output"]
plots.savefig(ch12.draw_sft_masking(masked[0]["history"], unmasked[0]["history"]), "12_sft_masking");

# %% [markdown]
# The every-token run's loss has a floor set by a prompt digit it can never predict, and part of its
# gradient chases that digit: its answer-token loss lags. (By how much varies: over seeds and CPUs the
# every-token run's mean answer-token loss is 0.08 to 0.21 nats higher; by the last steps the two are
# within noise of each other, either one ahead.)
#
# ## 4. Full fine-tuning vs LoRA on the toy, measured
#
# Sections 1 and 2 counted and priced LoRA; now train with it. Two SFT runs on the same data, for the
# same 150 steps, from the same random init: **full fine-tuning** (all 58,176 weights train) and **LoRA**
# with $r=4$, $\alpha=8$ on every `nn.Linear` of the model: `qkv`, `proj`, `fc1`, `fc2` in both blocks, and
# the LM `head` (why the head: the end of this section). Everything else is frozen.
#
# The learning rate first, measured rather than guessed: each method at four rates, scored by its mean
# answer-token loss over the 150 steps (how fast it learns; less noisy than the last step alone).

# %% tags=["nbval-ignore-output"]
LORA_RANK = 4
SWEEP_LRS = (1e-3, 3e-3, 1e-2, 3e-2)
METHOD_RANKS = {"full": 0, "LoRA": LORA_RANK}
sweep_runs = {(method, lr): cu.run("workers.ch12_sft", world_size=1, **LIMITS, lr=lr, lora_rank=rank)
              for method, rank in METHOD_RANKS.items() for lr in SWEEP_LRS}
sweep = {key: sum(h["answer_loss"] for h in res[0]["history"]) / len(res[0]["history"])
         for key, res in sweep_runs.items()}
print("mean answer-token loss over 150 steps:")
for method in METHOD_RANKS:
    print(f"{method:>5}: " + "  ".join(f"lr {lr:g}: {sweep[method, lr]:.3f}" for lr in SWEEP_LRS))

# %%
best_lr = {method: min(SWEEP_LRS, key=lambda lr: sweep[method, lr]) for method in METHOD_RANKS}
print("best learning rate on this grid:", best_lr)
print("LoRA's best rate is larger than full fine-tuning's:", best_lr["LoRA"] > best_lr["full"])

# %% [markdown]
# LoRA wants a larger step here, and full fine-tuning at LoRA's best rate does worse than at its own (the
# table): one learning rate for both would handicap one of them. Below, each method at its own best rate
# (those runs of the sweep: same data, same 150 steps).
#
# **Predict**: after the last step, how many times more bytes of AdamW state does full fine-tuning hold
# than LoRA? And how many gradient tensors does LoRA hold for its frozen base?

# %% tags=["nbval-ignore-output"]
ft_runs = {method: sweep_runs[method, best_lr[method]] for method in METHOD_RANKS}
for method, res in ft_runs.items():
    r, hist = res[0], res[0]["history"]
    print(f"{method:>5} (lr {best_lr[method]:g}): answer-token loss {hist[0]['answer_loss']:.2f} -> "
          f"{sum(h['answer_loss'] for h in hist[-10:]) / 10:.2f} (last 10 steps) | held-out accuracy "
          f"{r['before']['accuracy']:.2f} -> {r['after']['accuracy']:.2f} | held-out loss "
          f"{r['before']['heldout_loss']:.2f} -> {r['after']['heldout_loss']:.2f}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch12.draw_full_vs_lora({f"full FT (lr {best_lr['full']:g})": ft_runs["full"][0],
                                      f"LoRA r={LORA_RANK} (lr {best_lr['LoRA']:g})": ft_runs["LoRA"][0]}),
              "12_full_vs_lora");

# %%
full_r, lora_r = ft_runs["full"][0], ft_runs["LoRA"][0]
print("B = 0 at init, so both runs start from the same model:", full_r["before"] == lora_r["before"])
for method, r in ((m, ft_runs[m][0]) for m in METHOD_RANKS):
    hist = r["history"]
    print(f"{method}: answer-token loss more than halved:",
          sum(h["answer_loss"] for h in hist[-10:]) / 10 < hist[0]["answer_loss"] / 2,
          "| held-out accuracy rose:", r["after"]["accuracy"] > r["before"]["accuracy"])

# %% [markdown]
# The held-out set is only 20 prompts (accuracy moves in steps of 0.05): read its numbers, printed above
# for each method, as a sanity check, not a ranking of the methods. The memory below is different: arithmetic
# that holds at any size.
#
# **What the rank held.** After its last step each worker counted its own tensors
# (`workers/posttrain/state.py`): the weights, every `.grad` that exists, and every tensor in AdamW's
# `state`. The ledger of section 2 assumes mixed precision: bf16 weights and gradients (2 + 2 bytes) and
# 12 bytes of fp32 Adam state (master copy, m, v). The toy trains in plain fp32, which maps to **4** bytes
# per weight, **4** per gradient and **8** of Adam state (m and v: the fp32 weight is its own master copy);
# a frozen weight is 4 bytes (the ledger's bf16 base: 2) with no gradient and no state. The same
# `memory_from_counts` that prices 7B and 70B, given those bytes (`ledger.FP32_ADAM`) and counts from the
# toy's shapes, must give exactly what the rank counted.

# %%
n_base = ledger.toy_params(TOY.hidden, TOY.layers, TOY.vocab, TOY.seq)
n_lora = ledger.toy_lora_params(TOY.hidden, TOY.layers, TOY.vocab, LORA_RANK, LORA_TARGETS)
print(f"from the shapes: {n_base:,} base parameters; LoRA r={LORA_RANK} on {', '.join(LORA_TARGETS)}: {n_lora:,}")
predicted = {"full": ledger.memory_from_counts("full", n_base, per=ledger.FP32_ADAM),
             "LoRA": ledger.memory_from_counts("lora", n_lora, n_base, per=ledger.FP32_ADAM)}
checks = {m: ledger.against_measured(predicted[m], ft_runs[m][0]["state_bytes"]) for m in METHOD_RANKS}
print(ledger.render_against_measured(checks))
print("every count on the rank equals the ledger's:",
      all(rank == led for rows in checks.values() for _, rank, led in rows))
print("gradients held for frozen weights:", {m: ft_runs[m][0]["state_bytes"]["frozen_with_grad"] for m in METHOD_RANKS})
full_s, lora_s = full_r["state_bytes"], lora_r["state_bytes"]
print(f"full / LoRA AdamW m + v: {full_s['optimizer_moment_bytes'] / lora_s['optimizer_moment_bytes']:.2f} "
      f"= {n_base:,} / {n_lora:,} trainable parameters")
for method, s in (("full", full_s), ("LoRA", lora_s)):
    print(f"{method}: AdamW also holds {s['optimizer_step_bytes']} bytes of `step` counters "
          f"= 4 bytes x {s['trainable_tensors']} parameter tensors (the ledger's per-parameter bytes omit them)")

# %% [markdown]
# Adam's state is proportional to what trains, so the ratio is the parameter ratio: 9.1 here, because a
# $48\times48$ matrix at $r=4$ saves only $dk/r(d+k) = 6\times$. At $4096\times4096$ and $r=16$ it is
# $128\times$, which is why the 7B LoRA row of section 2 is almost all frozen base. Here too the frozen
# base is the largest part of LoRA's bill (233 kB of its 335 kB).
#
# **Merge the trained adapter.** After training, the worker merged a copy of the LoRA model (`merge_lora`:
# each `LoRALinear` becomes one `nn.Linear` with $W_0 + \tfrac{\alpha}{r}BA$, what exercise 1 writes for
# one matrix) and compared the two models' logits on all 100 prompts. Up to fp32 rounding they are the
# same function: $(W_0 + sBA)x$ and $W_0x + sB(Ax)$ differ only in the order of the sums.

# %%
merge = lora_r["merge"]
print("LoRA modules left in the merged model:", merge["lora_modules_left"])
print("parameters: merged", merge["merged_params"], "| base before LoRA", lora_r["base_params"],
      "| adapter model", lora_r["total_params"])
print("max |logits(merged) - logits(adapter)| <= 1e-5 x max |logit| (fp32):",
      merge["max_abs_logit_diff"] <= 1e-5 * merge["max_abs_logit"])

# %% tags=["nbval-ignore-output"]
print(f"max |logit difference| = {merge['max_abs_logit_diff']:.2e} with max |logit| = {merge['max_abs_logit']:.1f}")

# %% [markdown]
# **Why the head too.** This base is a random init, not a pretrained model. The last two layers turn the
# residual stream $x$ into logits: the final LayerNorm (gain 1 and bias 0 as initialised; `apply_lora`
# freezes it with the rest of the base) gives
# $z = (x - \bar x)/\sqrt{\mathrm{var}(x) + \epsilon}$, and the head gives $Wz$. Whatever the blocks compute,
# $z$ has **mean 0** over its $d$ features and **norm** $\sqrt{d\,\mathrm{var}/(\mathrm{var}+\epsilon)} < \sqrt d$.
# With both layers frozen, the lowest loss on a target digit $t$ is therefore
# $\min_z -\log\mathrm{softmax}(Wz)_t$ over that zero-mean ball: a convex problem (a logsumexp minus a
# linear function, over a convex set), which `course_utils/ch12_floor.py` solves to its global minimum,
# with a certificate that the number it returns is a true lower bound.
# **Predict**: LoRA on the blocks only, at the same rate: how low does the answer-token loss get?

# %%
from course_utils.ch12_floor import frozen_head_floor

base_model = make_policy(0)  # blocks-only LoRA freezes its head and final LayerNorm as they are here
head_floor = frozen_head_floor(base_model.head.weight, range(10), base_model.ln_f.weight, base_model.ln_f.bias)
train_answers = task.sequences(train_pairs)[:, task.PROMPT_LEN:].reshape(-1).tolist()  # both digits of every sum
answer_floor = head_floor.mean_over(train_answers)
print("frozen-head floor per digit, nats:", " ".join(f"{t}: {f:.2f}" for t, f in zip(head_floor.targets,
                                                                                    head_floor.floor.tolist())))
print(f"floor of the answer-token loss on the training prompts: {answer_floor:.2f} nats")
print("certified: the solver's loss is within 1e-9 nats of the lower bound:", head_floor.gap.max().item() < 1e-9)

# %% tags=["nbval-ignore-output"]
blocks_only = cu.run("workers.ch12_sft", world_size=1, **LIMITS, lr=best_lr["LoRA"], lora_rank=LORA_RANK,
                     lora_targets=[t for t in LORA_TARGETS if t != "head"])
blocks_loss = [h["answer_loss"] for h in blocks_only[0]["history"]]
blocks_end = sum(blocks_loss[-10:]) / 10
print(f"blocks-only LoRA: lowest answer-token loss {min(blocks_loss):.2f}, last 10 steps {blocks_end:.2f}; "
      f"floor {answer_floor:.2f}: {blocks_end - answer_floor:.2f} nats above it")

# %%
with_head_end = sum(h["answer_loss"] for h in lora_r["history"][-10:]) / 10
print("no step of blocks-only LoRA goes below the lowest per-digit floor:",
      min(blocks_loss) >= head_floor.floor.min().item())
print("blocks-only LoRA ends within 0.5 nats of the frozen-head floor:", blocks_end - answer_floor < 0.5)
print("the floor alone is more than 0.5 nats above LoRA with the head:", answer_floor > with_head_end + 0.5)

# %% [markdown]
# The frozen head, not the adapters, is what stops blocks-only LoRA: its loss ends a few tenths of a nat
# above the floor (no training of the blocks can take it below), while LoRA with the head ends about a nat
# below the floor itself (1.0 to 1.2 nats over seeds and CPUs). On a pretrained model the head already reads the
# right tokens out and LoRA on the blocks is the usual choice; on a new vocabulary or a random base, whatever is frozen must already be
# able to say the answer.
#
# ## 5. DPO: preferences without a reward model
#
# DPO (Rafailov et al. 2023, eq. 7) trains on pairs (prompt, chosen, rejected). Here chosen is the right
# sum and rejected a near miss (off by 1 or 2). With $\pi_\text{ref}$ the SFT model, frozen:
#
# $$\mathcal L = -\log\sigma\Big(\beta\log\tfrac{\pi(y_w|x)}{\pi_\text{ref}(y_w|x)} - \beta\log\tfrac{\pi(y_l|x)}{\pi_\text{ref}(y_l|x)}\Big)$$
#
# $\beta\log(\pi/\pi_\text{ref})$ is the **implicit reward**. At step 0 policy = reference: margin 0, loss $\log 2$.
# **Predict**: does the chosen answer's implicit reward rise, or does the rejected one's mostly fall?

# %% tags=["nbval-ignore-output"]
dpo_run = cu.run("workers.ch12_dpo", world_size=1, **LIMITS)
dpo_hist = dpo_run[0]["history"]
print(dpo_run.describe())

# %%
last10 = {key: sum(h[key] for h in dpo_hist[-10:]) / 10 for key in ("margin", "chosen_reward", "rejected_reward")}
print("step 0 margin is 0 (policy = reference):", abs(dpo_hist[0]["margin"]) < 1e-6)
print("margin over the last 10 steps > 0.05:", last10["margin"] > 0.05)
print("rejected implicit reward ends below 0 (last 10 steps):", last10["rejected_reward"] < 0)

# %% tags=["nbval-ignore-output"]
print("last 10 steps, implicit reward: chosen", f"{last10['chosen_reward']:+.3f}", "| rejected",
      f"{last10['rejected_reward']:+.3f}", "| margin", f"{last10['margin']:.3f}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch12.draw_dpo(dpo_hist, beta=0.1), "12_dpo");

# %% [markdown]
# DPO only sees the *margin*: it is free to push both log-probabilities down as long as the rejected one
# falls faster, a known failure mode on small pair sets. Here the rejected answer's implicit reward always
# falls (by 0.26 to 0.35 over seeds and CPUs); the chosen one's ends between -0.13 and +0.03: whether this
# run's chosen answer rose or fell a little is the line above.
# Watch both curves, not just the margin.
#
# ## 6. GRPO: reinforcement learning with a verifiable reward
#
# GRPO (Shao et al. 2024, DeepSeekMath, sec. 4.1) samples $G$ answers per prompt, scores them (here by
# program: right or wrong), and uses the **group** as the baseline: advantage
# $= (r - \text{mean}_\text{group})/\text{std}_\text{group}$. No value model. The policy gradient is PPO's
# clipped surrogate, plus a KL penalty to the SFT reference. The worker first runs SFT (so some sampled
# answers are right: RL needs signal), then GRPO. At world 2 each rank samples its own prompts; gradients
# are averaged and rewards all-gathered.
#
# **Predict**: at world 2 with half the prompts per rank, are the reward curves the same as at world 1?

# %% tags=["nbval-ignore-output"]
grpo_1 = cu.run("workers.ch12_grpo", world_size=1, **LIMITS)
grpo_2 = cu.run("workers.ch12_grpo", world_size=2, **LIMITS, prompts_per_rank=8)
print(grpo_1.describe())
print(grpo_2.describe())

# %%
expected = grpo_1[0]["expected_reward"]
print("world 1: expected reward on the training prompts rose by more than 0.02:",
      expected["after"] > expected["before"] + 0.02)
print("world 2: both ranks log the same global rewards:",
      [h["reward"] for h in grpo_2[0]["history"]] == [h["reward"] for h in grpo_2[1]["history"]])
print("world 2: samples per step:", grpo_2[0]["history"][0]["samples"])

# %% tags=["nbval-ignore-output"]
print(f"expected reward (exact, no sampling): {expected['before']:.3f} -> {expected['after']:.3f}")
plots.savefig(ch12.draw_grpo({"world 1, 16 prompts x 8": grpo_1[0]["history"],
                              "world 2, 2 x 8 prompts x 8": grpo_2[0]["history"]}), "12_grpo");

# %% [markdown]
# The two curves differ (different samples) but have the same global batch and the same trend. The sampled
# reward is a noisy read of progress (128 right-or-wrong samples a step: about +-0.04); the **expected**
# reward, the probability of the right answer averaged over the training prompts, is computed exactly from
# the policy's log-probabilities and moves without that noise. The KL to the reference grows as the policy
# moves: the KL coefficient is the leash.
#
# ## 7. PPO, DPO and GRPO side by side

# %%
print(render_methods())

# %% [markdown]
# ## 8. Three evaluation gates
#
# Before a post-trained model ships: **(1) training health** (finite loss, no grad-norm spike, the typical
# KL to the reference below a limit), **(2) regression** (the held-out loss of what it could already do, here
# the SFT answers, may not rise by more than a margin), **(3) target and safety** (accuracy above a floor,
# forbidden outputs, non-digit answers, below a ceiling). The thresholds are data, and they are set from
# measurements, not from one run: the same healthy run, on another CPU, follows another trajectory (its
# largest grad norm was 9 on one machine and 112 on another), so a gate compares a step's grad norm with
# the run's own median (a spike detector, as in chapter 09) and reads the KL's median over steps. Over 30
# healthy runs and 30 at the broken learning rate below (seeds x CPU kernels), every threshold sits well
# inside the gap between the two (the ranges are in `course_utils/posttrain_gates.py`).

# %%
print(gates.Thresholds())
for g in gates.run_gates(grpo_1[0]):
    print(g)
print("verdict:", gates.verdict(gates.run_gates(grpo_1[0])))

# %% [markdown]
# **Predict**: the same GRPO run at a learning rate 30x the default. Which gates fail?

# %% tags=["nbval-ignore-output"]
BROKEN_LR = 3e-2
broken = cu.run("workers.ch12_grpo", world_size=1, **LIMITS, lr=BROKEN_LR)

# %%
broken_gates = gates.run_gates(broken[0])
print(f"lr {BROKEN_LR:g}, failed gates:", [g.name for g in broken_gates if not g.passed])
for g in broken_gates:
    print(" ", g.name, "PASS" if g.passed else "FAIL")

# %% [markdown]
# ## Exercises
#
# ### Exercise 1: merge a LoRA adapter
#
# Write `lora_merge(W, A, B, alpha, r)`: `W` is the frozen $d\times k$ weight, `B` is $d\times r$, `A` is
# $r\times k$. Return the merged weight (a new tensor; leave `W` unchanged).

# %% tags=["exercise"]
def lora_merge(W, A, B, alpha, r):
    raise NotImplementedError


# %% tags=["check"]
from course_utils.exercises import check

check("lora_merge", lora_merge)

# %% [markdown]
# ### Exercise 2: the DPO loss
#
# Write `dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)`: each argument but
# `beta` is a tensor `[n]` of sequence log-probs (sums over tokens: they can be hundreds below 0). Return the
# mean DPO loss (eq. 7), a scalar with a gradient with respect to both policy log-probs.

# %% tags=["exercise"]
def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta):
    raise NotImplementedError


# %% tags=["check"]
check("dpo_loss", dpo_loss)

# %% [markdown]
# ### Exercise 3: group-relative advantages
#
# Write `grpo_advantages(rewards, group_size)`: `rewards` is `[n_prompts * group_size]`, each prompt's
# answers consecutive. Return `(r - group mean) / (group std + 1e-4)`, one per reward, in a new tensor
# (leave `rewards` unchanged).

# %% tags=["exercise"]
def grpo_advantages(rewards, group_size):
    raise NotImplementedError


# %% tags=["check"]
check("grpo_advantages", grpo_advantages)

# %% [markdown]
# ## Summary
#
# - LoRA trains $r(d+k)$ numbers per matrix, starts exactly at the base model ($B=0$), and merges back into
#   one matrix. QLoRA keeps the frozen base in 4-bit NF4: with both, 70B fits on one GPU, full FT does not.
# - SFT: mask the prompt, so the loss and its gradient are about the answer.
# - Measured on the rank: fp32 AdamW holds 8 bytes (m, v) per *trainable* parameter, plus a 4-byte `step`
#   per tensor; frozen weights hold no gradient and no state; full / LoRA Adam state is the parameter ratio.
#   The ledger's per-parameter bytes, mapped to fp32, predict every count exactly. LoRA wanted its own,
#   larger learning rate; the merged model is the adapter model to fp32 rounding, at the base's size.
# - What stays frozen bounds what LoRA can learn: a frozen random head and final LayerNorm put a floor
#   under the answer loss that no adapter on the blocks can cross, computed exactly as a convex problem.
# - DPO: a classification loss on the implicit-reward margin against a frozen reference; no sampling.
# - GRPO: the group of sampled answers is the baseline; no value model; KL to the reference is the leash.
# - Gates turn "the loss went down" into a decision: health, regression, target and safety.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
