# %% [markdown]
# # 13 · Pipeline parallelism: GPipe, 1F1B and zero bubble on real send/recv
#
# Tensor parallelism (chapters 04-06) splits every layer across ranks and pays two all-reduces per layer in
# each direction. **Pipeline parallelism** splits the model the other way: by *depth*. Rank s holds a
# contiguous block of layers (a *stage*); a micro-batch's activation goes from stage to stage forward, and
# its gradient comes back the same way. Nothing else crosses a stage boundary: no weights, no all-reduce.
#
# The price is the **bubble**. Stage 3 cannot start before stages 0-2 have each run the first micro-batch,
# and stage 0 waits at the end for the last gradient to come back. With p stages and m micro-batches per
# step, each rank idles $(p-1)(t_F + t_B)$ of a step that lasts $(m + p - 1)(t_F + t_B)$ (Narayanan et
# al. 2021, *Efficient Large-Scale Language Model Training on GPU Clusters*,
# [arXiv:2104.04473](https://arxiv.org/abs/2104.04473), section 2.2.1). Two ways to write that down:
#
# * **idle / total** $= \frac{p-1}{m+p-1}$: the share of the step a rank is idle (what a timeline shows);
# * **bubble / ideal** $= \frac{p-1}{m}$: the paper's "bubble time fraction", the bubble over the bubble-free
#   time; it can exceed 1.
#
# Both shrink only with more micro-batches. **GPipe** (Huang et al. 2019) runs all m forwards, then all m
# backwards, so every stage holds m micro-batches' activations at the turn. **1F1B** (PipeDream-Flush,
# Narayanan et al. 2021 section 2.2.1, Figure 4) starts each stage's backwards as early as possible: p - s - 1
# warm-up forwards, then one forward and one backward in turn, then the remaining backwards. Same bubble,
# but at most p - s micro-batches in flight. **1F1B saves memory, not time.**
#
# The **interleaved** schedule (section 2.2.2) shrinks the bubble without more micro-batches: each rank
# holds v smaller model chunks, and the bubble falls by v, for v times the messages. **Zero-bubble** schedules
# (Qi et al. 2023, [arXiv:2401.10241](https://arxiv.org/abs/2401.10241); DeepSeek-V3's DualPipe) fill it another
# way: they split each backward into its input-gradient and weight-gradient halves and move the latter into the
# gaps (section 8).
#
# We build them all as data (`workers/pipeline/schedules.py`, `zero_bubble.py`), run them on 4 real ranks with
# `isend`/`irecv` (`workers/pipeline/p2p.py`, `executor.py`), prove the pipeline computes the unsplit model's
# gradients exactly, then measure the bubble, the stash and the saved activation bytes from the ranks' own
# timelines and autograd's own bookkeeping.

# %%
import course_utils as cu
from course_utils import ch13
from course_utils import plots
from course_utils.ledger import pipeline_bubble_fraction, tp_comm_bytes_per_layer
from workers.pipeline.model import PipelineConfig, partition_table
from workers.pipeline.schedules import all_stages, ideal_bubble, peak_stash, with_p2p

plots.style()
LIMITS = {"timeout": 60}  # per run; 4 warm ranks serve every run (p = 1 and 2 run as copies inside them)
WORKER, WORLD = "workers.ch13_pipeline", 4
CFG = PipelineConfig()
TIMED = {"forward_ms": 20.0, "backward_ms": 40.0}  # calibrated waits: t_B = 2 t_F, as for a transformer layer


def run(**params):
    return cu.run(WORKER, world_size=WORLD, **LIMITS, **params)


# %% [markdown]
# ## 1. The split, and what crosses it
#
# The model is a stack of Linear + tanh layers; the partition table gives each stage a contiguous range.

# %%
print(f"{CFG.layers} layers, hidden {CFG.hidden}, micro-batch {CFG.micro_batch_size} rows, m = {CFG.micro_batches}")
for p in (1, 2, 4):
    print(f"p = {p}: stages own layers", partition_table(CFG.layers, p))

# %% [markdown]
# **Predict** for a GPT-3-sized layer (h = 12288, s = 2048, micro-batch 1, bf16): how many bytes does one
# stage boundary carry per micro-batch, and how does that compare with what tensor parallelism over 8 GPUs
# sends for *one* layer?

# %%
h, s, b, bytes_bf16, layers_per_stage = 12288, 2048, 1, 2, 12
boundary = b * s * h * bytes_bf16  # one [b, s, h] activation forward, its gradient backward
tp = tp_comm_bytes_per_layer(b, s, h, 8, bytes_per_element=bytes_bf16)
print(f"pipeline: {boundary / 2**20:.0f} MiB forward + {boundary / 2**20:.0f} MiB backward per micro-batch per boundary")
print(f"tensor parallel (t=8): {tp.all_reduces} all-reduces, {tp.total_wire_bytes / 2**20:.0f} MiB sent per GPU per layer, "
      f"{layers_per_stage * tp.total_wire_bytes / 2**20:.0f} MiB for {layers_per_stage} layers")

# %% [markdown]
# A stage boundary carries two activations per micro-batch, point to point, between two neighbours; TP
# all-reduces several per layer among all t ranks. That is why PP is what crosses *nodes* (slow links,
# small volume) while TP stays inside an NVLink domain: PP beats TP when the link is slow and the model
# is deep, as long as m is large enough to hide the bubble.
#
# ## 2. The schedules, as data
#
# Each rank's step is a list of actions. Printed for p = 4, m = 8 (`F3` is the forward of micro-batch 3):

# %%
P, M = 4, 8
for name in ("gpipe", "1f1b"):
    print(f"{name}:\n{ch13.schedule_text(all_stages(name, P, M))}\n")

# %% [markdown]
# **Predict**: the most micro-batches each stage holds at once under each schedule; and the idle share
# of each in ideal time ($t_B = 2 t_F$, free messages). `schedules.simulate` replays the lists with the
# cross-stage dependencies (F(i) on s after F(i) on s - 1; B(i) on s after B(i) on s + 1):

# %%
for name in ("gpipe", "1f1b"):
    sched = all_stages(name, P, M)
    print(f"{name}: peak stash per stage {[peak_stash(a) for a in sched]}, ideal idle/total {ideal_bubble(sched):.4f}")
print(f"formula (p-1)/(m+p-1) = {pipeline_bubble_fraction(P, M, denominator='total'):.4f}")

# %% [markdown]
# ## 3. The pipeline is the unsplit model
#
# Each micro-batch's loss is divided by m (as Megatron does), so the gradients accumulated over the m
# micro-batches are those of the mean loss over the whole global batch. The reference
# (`workers/pipeline/reference.py`) trains the same model unsplit in this process. Three SGD steps at
# p = 1, 2 and 4 (p = 1 and 2 run as 4 and 2 identical pipelines on the 4 ranks; every copy is checked).
# A run takes its degrees in the words of the course's one layout (`workers/layout/rules.py`, the one chapter 15
# and chapter 00's planner use, whose rules refuse what cannot run): p stages is `pp=p`, and the v chunks per
# stage of section 7 are `virtual_stages=v`.

# %%
STEPS = 3
for name in ("gpipe", "1f1b"):
    for p in (1, 2, 4):
        c = ch13.compare_to_reference(run(schedule=name, pp=p, steps=STEPS), steps=STEPS)
        print(f"{name:>5}, p = {p}: losses, all {c['parameters']} gradients and weights within 1e-6 of one "
              f"process after {STEPS} steps: {c['within_tol']}")

# %% [markdown]
# ## 4. The schedule on a timeline
#
# The math of this small MLP takes microseconds, far below the scheduling noise of a shared CPU. So each
# action is **padded to a fixed wall time with a calibrated wait** (`time.sleep` after the real math, to
# the `TIMED` durations printed below, B twice F), standing in for a stage large enough to pipeline. The messages are real: every
# `recv` blocks until the neighbour's `isend` arrives, and that waiting is the white space. Each rank
# times its actions from a barrier. **Predict** where the white is, for each schedule.

# %%
print("each action padded to", TIMED, "(a calibrated wait, not compute)")
timed = {name: run(schedule=name, micro_batches=M, **TIMED) for name in ("gpipe", "1f1b")}
for name, res in timed.items():
    print(f"{name}: peak stashed micro-batches per stage, measured {[d['peak_stash'] for d in ch13.pipeline_ranks(res)]}; "
          f"actions per stage {[len(d['timeline']) for d in ch13.pipeline_ranks(res)]}")

# %% tags=["nbval-ignore-output"]
for name, res in timed.items():
    plots.savefig(ch13.gantt_figure(res), f"13_gantt_{name}")

# %% [markdown]
# The same white triangles at the start and the end: the same bubble. What differs is the middle: GPipe
# runs every forward before any backward (m activations stored on every stage), 1F1B interleaves them as
# soon as the last stage can start (p - s stored on stage s).
#
# ## 5. The bubble against m
#
# **Predict** the idle share at p = 4 for m = 1, 2, 4, 8, 16, in both conventions.

# %% tags=["nbval-ignore-output"]
sweep = {}
for name in ("gpipe", "1f1b"):
    sweep[name] = [(m, ch13.measured_bubble(run(schedule=name, micro_batches=m, **TIMED))) for m in (1, 2, 4, 8, 16)]
print("measured idle / total on this CPU (gloo), against the formulas:")
print(f"{'m':>3} {'gpipe':>7} {'1f1b':>7} {'(p-1)/(m+p-1)':>14} {'(p-1)/m':>8}")
for (m, g), (_, o) in zip(sweep["gpipe"], sweep["1f1b"]):
    f = ch13.bubble_formulas(P, m)
    print(f"{m:>3} {g:>7.3f} {o:>7.3f} {f['idle/total (p-1)/(m+p-1)']:>14.3f} {f['bubble/ideal (p-1)/m']:>8.3f}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch13.bubble_figure(sweep, P), "13_bubble_vs_m");

# %% [markdown]
# The measured idle share is idle / total, and follows $(p-1)/(m+p-1)$; $(p-1)/m$ is the same bubble
# measured against the bubble-free time, so it lies above and passes 1 for m < p - 1. The measurement sits
# a little above the formula: each real message's latency (gloo over the loopback, on a busy CPU) delays
# every action that waits for it. On NVLink that latency is microseconds against milliseconds of compute.
#
# ## 6. Memory, not time
#
# **Predict** each stage's peak stash at m = 4, 8, 16 for both schedules. Measured by the executor:

# %%
for m in (4, 8, 16):
    for name in ("gpipe", "1f1b"):
        peaks = [d["peak_stash"] for d in ch13.pipeline_ranks(run(schedule=name, micro_batches=m))]
        print(f"m = {m:>2}, {name:>5}: peak stashed micro-batches per stage {peaks}")

# %% [markdown]
# GPipe's stash grows with m: the very thing that shrinks the bubble costs activation memory linearly.
# 1F1B's is capped at p - s whatever m is, so m can grow until the bubble is small.
#
# ## 7. Interleaving: v model chunks per rank
#
# More micro-batches shrink the bubble, but m is bounded by the global batch (m x micro-batch rows) that
# the optimizer wants. The **interleaved 1F1B** schedule (Narayanan et al. 2021, section 2.2.2, Figure 4
# bottom; Megatron's `forward_backward_pipelining_with_interleaving`) shrinks it another way. Cut the model
# into p x v chunks instead of p stages and give rank s the chunks s, s + p, s + 2p, ...: chunk c of
# rank s is **virtual stage** c p + s, so a micro-batch goes round the ranks v times. Each action is now
# 1/v of a stage's work, so the fill and drain triangles are v times thinner: the bubble becomes
# $\frac{1}{v}\frac{p-1}{m}$ of the ideal time ($\frac{p-1}{vm+p-1}$ of the step).
#
# The price: every micro-batch crosses v times as many boundaries, so **v times the messages**, and the
# warm-up runs $2(p-s-1) + (v-1)p$ chunk-forwards before the first backward (Megatron's warm-up; when
# m = p there is one group and Megatron runs every forward first), so more is in flight. Micro-batches go
# round in groups of p, so m must be a multiple of p (Megatron required it).
# For p = 4, m = 8, v = 2 (`F3c1` is micro-batch 3 through the rank's chunk 1, its layers 4 + s apart):

# %%
print(ch13.schedule_text(all_stages("interleaved", P, M, 2)))

# %% [markdown]
# **Predict**: in ideal time (free messages), the idle share for v = 1, 2, 4 at p = 4, m = 8; the messages
# rank 1 sends per step; and the most activations rank 0 holds, counted in *micro-batches' worth of a
# stage* (a stashed chunk holds 1/v of the rank's layers, so v stashed chunks are one micro-batch's worth).

# %%
for v in (1, 2, 4):
    sched = all_stages("1f1b" if v == 1 else "interleaved", P, M, v)
    sends = sum(1 for a in with_p2p(sched[1], P, 1, v) if a[0].startswith("send"))
    print(f"v = {v}: ideal idle/total {ideal_bubble(sched):.4f} (formula "
          f"{pipeline_bubble_fraction(P, M, v, denominator='total'):.4f}), rank 1 sends {sends} messages, "
          f"rank 0 holds at most {peak_stash(sched[0])} chunk activations = {peak_stash(sched[0]) / v:g} "
          "micro-batches' worth")

# %% [markdown]
# The bubble falls as $(p-1)/(vm+p-1)$, exactly; the messages grow as v; and rank 0 holds more: its peak,
# $2(p-1) + (v-1)p + 1$ chunks of 1/v of a stage each, is $p + (p-1)/v$ micro-batches' worth against
# 1F1B's p (5.5 and 4.75 against 4 here). Interleaving buys time with messages and some memory.
#
# The schedule on real ranks computes the same gradients as one process (three SGD steps, every copy checked):

# %%
for p, v in ((2, 2), (4, 2), (2, 4)):
    c = ch13.compare_to_reference(run(schedule="interleaved", pp=p, virtual_stages=v, steps=STEPS), steps=STEPS)
    print(f"interleaved, p = {p}, v = {v}: all {c['parameters']} gradients and weights within 1e-6 of one "
          f"process after {STEPS} steps: {c['within_tol']}")

# %% [markdown]
# Now timed, with the same calibrated waits per *stage* (a chunk's action is padded to 1/v of them), on a
# 16-layer model so v = 4 still has a layer per chunk. Autograd's saved tensors are counted in bytes by
# the executor (`saved_tensors_hooks`), so the memory is measured, not inferred:

# %%
INTERLEAVED = {v: run(schedule="1f1b" if v == 1 else "interleaved", virtual_stages=v, micro_batches=M, layers=16,
                      **TIMED)
               for v in (1, 2, 4)}
for v, res in INTERLEAVED.items():
    rows = ch13.pipeline_ranks(res)
    print(f"v = {v}: messages sent per rank {[sum(d['messages'].values()) for d in rows]}, peak bytes saved for "
          f"backward per rank {[d['peak_saved_bytes'] for d in rows]}")

# %% [markdown]
# Each stashed chunk also keeps its own input (the tensor that arrived), so in this toy, whose layers
# save one tensor each, the bytes grow faster than the layers' worth; in a transformer a layer saves
# tens of activations of that size (chapter 06) and the boundary input is noise.
#
# **Predict** whether the measured bubbles land on the formula, and which v wins on this machine.

# %% tags=["nbval-ignore-output"]
fit = ch13.fit_message_time(list(INTERLEAVED.values()))
print("idle / total at p = 4, m = 8, measured on this CPU (gloo):")
print(f"{'v':>2} {'measured':>9} {'formula':>8} {'replayed at ' + format(fit['message_ms'], 'g') + ' ms/message':>28}")
for v, got, want, sim in zip(INTERLEAVED, fit["measured"], fit["formula"], fit["simulated"]):
    print(f"{v:>2} {got:>9.3f} {want:>8.3f} {sim:>28.3f}")
plots.savefig(ch13.gantt_figure(INTERLEAVED[2]), "13_gantt_interleaved")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch13.interleave_figure(INTERLEAVED, fit["message_ms"], P, M, TIMED["forward_ms"], TIMED["backward_ms"]),
              "13_bubble_vs_chunks");

# %% [markdown]
# The measurements sit above the formula, and more so the more chunks: every message's latency delays the
# action waiting for it, and v = 4 sends four times as many. Replaying the ranks' own action lists with a
# single per-message latency (fitted to these runs: milliseconds through gloo on a loaded 2-core CPU,
# printed above) explains the gap. That latency is the knob: where it is small against a chunk's
# compute (NVLink, microseconds against milliseconds), interleaving wins nearly its full factor v; where
# it is not, more chunks stop paying. Where, in the replay (t_B = 2 t_F, p = 4, m = 8)?

# %%
for low, high in ((1, 2), (2, 4)):
    a = ch13.chunks_crossover(P, M, low, high)
    print(f"v = {high} idles more than v = {low} once a message costs {a:.3f} of a stage's forward "
          f"({a * TIMED['forward_ms']:.1f} ms at the padded {TIMED['forward_ms']:g} ms)")

# %% [markdown]
# Megatron posts the next receive before the current chunk's work, so that a message lands while its rank
# computes; our executor posts every receive of a step before the step begins. (On gloo this matters beyond
# overlap: a message sent before its receive is posted cannot land until it is, and meanwhile gloo's transport
# threads poll without sleeping, a core's worth of CPU; with four ranks on two cores, round trips took 4 ms instead
# of 0.15.) Gloo has a second trap, and the executor sidesteps it by sending each direction of a link on a process
# group of its own. Gloo's transport thread only *tries* the lock of a pair of ranks when a message arrives; while
# its own rank holds that lock to send, it polls until the lock is free. GPipe's messages cross a link one way at a
# time, but 1F1B's and interleaving's cross it both ways at once. On one group, with two pipelines of two ranks on
# two cores (m = 8), the transport threads polled 20,000 (1F1B) and 32,000 (interleaved) times a step, against
# GPipe's 3,400. With the two groups the steps took 15 and 23 ms instead of 17 and 31 ms (CPU timings, median of
# four launches each).
# What no posting hides is a message the next stage sits idle waiting for: that latency, once per hop on the
# critical path, is what the replay charges, and what pushes the crossover.
#
# ## 8. Zero bubble: the backward in two halves
#
# A stage's backward does two different jobs. For a linear layer $y = xW^\top + b$ it computes the **input
# gradient** $dx = dy\,W$, which the previous stage is waiting for, and the **weight gradient**
# $dW = dy^\top x$, $db = \sum dy$, which nobody waits for: it is needed only at the optimizer step. Qi et al.
# 2023 (*Zero Bubble Pipeline Parallelism*, [arXiv:2401.10241](https://arxiv.org/abs/2401.10241)) call them **B**
# and **W**, send B's result on as soon as it exists, and move the W's into the gaps where a stage would idle.
# With equal times $T_F = T_B = T_W$ (each is one GEMM per linear layer):
#
# * **ZB-H1** keeps 1F1B's order of forwards and input gradients and holds each W back by p - 1 - s steps: stage s
#   idles $(p-1)(T_F + T_B - T_W)$ instead of 1F1B's $(p-1)(T_F + T_B + T_W)$, a third, with 1F1B's activations;
# * **ZB-H2** warms up twice as long, so every stage is busy from its first F to its last W: no idle inside a
#   stage's own span, for about twice the activations;
# * **ZB-V** cuts the model into 2p chunks and gives rank s chunks s and 2p - 1 - s: down the ranks and back up
#   in a V, so the last chunk, and the loss, sit on rank 0 next to the first, and rank p - 1 hands chunk p - 1's
#   output to chunk p in memory. Zero bubble at equal times, with 1F1B's peak activations;
# * **DualPipeV** (DeepSeek-V3, [arXiv:2412.19437](https://arxiv.org/abs/2412.19437) section 3.2.1, cut into the
#   V by Sea AI Lab; `deepseek-ai/DualPipe`) runs the same V in eight phases, pairing a forward of one micro-batch
#   with a backward of another so that on GPUs one's compute hides the other's all-to-all. Here the pair runs one
#   action after the other; it needs m >= 2p.
#
# B and W by hand (`workers/pipeline/split_backward.py`): B computes each layer's $dz$ (through tanh's derivative)
# and $dx$, and keeps each layer's input $x$ and $dz$ for W, which later forms $dW$ and $db$. Together they are
# autograd's backward, bit for bit, in float64:

# %%
import torch

from workers.pipeline import split_backward
from workers.pipeline.model import make_batch, stage_module
from workers.pipeline.validity import check_schedule, peak_stashes
from workers.pipeline.zero_bubble import split_stages

stage = stage_module(CFG, 1, 4).double()  # stage 1 of 4: two Linear + tanh layers
x = make_batch(CFG)[0][:CFG.micro_batch_size].double().requires_grad_()  # [micro_batch, hidden]
dy = torch.randn(CFG.micro_batch_size, CFG.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
stage(x).backward(dy)  # autograd's whole backward
want = [x.grad.clone()] + [q.grad.clone() for q in stage.parameters()]
stage.zero_grad(set_to_none=True)
layers = split_backward.stage_layers(stage)
y, saved = split_backward.forward(layers, x.detach())
dx, for_w = split_backward.backward_input(layers, saved, dy)  # B: what the previous stage waits for
grads_after_b = [q.grad for q in stage.parameters()]
split_backward.backward_weight(layers, for_w)  # W: any time later
got = [dx] + [q.grad for q in stage.parameters()]
print("after B alone, the weights' gradients are still", set(map(type, grads_after_b)))
print("B then W equal to autograd's backward, bit for bit:", all(torch.equal(a, b) for a, b in zip(got, want)))
print(f"W waits on {len(for_w)} layers' (x, dz): {split_backward.stash_bytes(for_w)} bytes per micro-batch here")

# %% [markdown]
# What W keeps alive between B and W is the cost: for this stack each layer's input and its $dz$. In a
# transformer layer that is the inputs of its four or so GEMMs and their output gradients, a fraction of the
# activations 1F1B already holds (the attention scores, the MLP's wide activation and the norms' statistics are
# B's business and are freed by it).
#
# The schedules as data, with W actions (`workers/pipeline/zero_bubble.py`): ZB-H1 and ZB-V for p = 4, m = 8
# (`W3` is micro-batch 3's weight gradient; in the V, `F3c1` is micro-batch 3 through the rank's second chunk):

# %%
for name in ("zb-h1", "zb-v"):
    print(f"{name}:\n{ch13.schedule_text(split_stages(name, P, M))}\n")

# %% [markdown]
# A table is only runnable if every W comes after its B, every B after the next stage's B (or the loss), every F
# after the previous stage's F, and the blocking receives cannot wait on each other in a circle. The executor
# checks the whole table before it posts a single message (`validity.check_schedule`), so a broken one is refused
# with the dependency it breaks instead of hanging four ranks. Stage 0 running micro-batch 2's W before its B:

# %%
broken = [list(row) for row in split_stages("zb-h1", P, M)]
b2, w2 = broken[0].index(("B", 2)), broken[0].index(("W", 2))
broken[0][b2], broken[0][w2] = broken[0][w2], broken[0][b2]
try:
    check_schedule(broken, M)
except ValueError as refused:
    print("refused:", refused)

# %% [markdown]
# On the ranks, each schedule at p = 2 and 4 computes exactly what one process computes: float64 this time, so the
# only difference is the order of the additions (three SGD steps, every copy of the pipeline checked):

# %%
for p in (2, 4):
    for name, m in (("zb-h1", 5), ("zb-h2", 6), ("zb-v", 4), ("dualpipev", 2 * p)):
        res = run(schedule=name, pp=p, micro_batches=m, virtual_stages=2 if name in ("zb-v", "dualpipev") else 1,
                  steps=STEPS, dtype="float64")
        c = ch13.compare_to_reference(res, steps=STEPS)
        print(f"{name:>9}, p = {p}, m = {m}: losses, all {c['parameters']} gradients and weights within 1e-12 of one "
              f"process: {c['within_tol']}")

# %% [markdown]
# PyTorch ships the same schedules in `torch.distributed.pipelining` (`ScheduleInterleavedZeroBubble`,
# `ScheduleZBVZeroBubble`, `ScheduleDualPipeV`; torchtitan trains with them). The same model, cut the same way into
# `PipelineStage`s and run by PyTorch's schedules on the same ranks (`workers/ch13_native.py`), computes the same
# step, and its own action table (`pipeline_order`, `3I0` is virtual stage 3's input gradient of micro-batch 0, `-`
# an idle slot) is the course's, action for action:

# %%
NATIVE = "workers.ch13_native"
for name, p, m in (("zb-h1", 4, 8), ("zb-v", 2, 4), ("zb-v", 4, 8), ("dualpipev", 4, 8)):
    res = cu.run(NATIVE, world_size=WORLD, schedule=name, pp=p, micro_batches=m, steps=STEPS, dtype="float64",
                 virtual_stages=2 if name in ("zb-v", "dualpipev") else 1, **LIMITS)
    c = ch13.compare_to_reference(res, steps=STEPS)
    same = all(row["equal"] for row in res[0]["comparison"])
    print(f"PyTorch's {name}, p = {p}, m = {m}: within 1e-12 of one process: {c['within_tol']}; its table is the "
          f"course's on every rank: {same}")
print()
print(ch13.side_by_side(cu.run(NATIVE, world_size=WORLD, schedule="zb-v", pp=2, micro_batches=4, virtual_stages=2,
                               **LIMITS)[0]))

# %% [markdown]
# **Predict** the idle share of 1F1B, ZB-H1, ZB-H2, ZB-V and DualPipeV at p = 4, m = 8 with F, B and W each padded
# to 20 ms (the backward's 40 ms split in two), and what each stage holds at most.

# %%
ZB = {name: run(schedule=name, micro_batches=M, virtual_stages=2 if name in ("zb-v", "dualpipev") else 1, **TIMED)
      for name in ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev")}
for name, res in ZB.items():
    rows = ch13.pipeline_ranks(res)
    print(f"{name:>9}: the same tables replayed with free messages idle {ch13.replayed(res)['step_idle']:.3f} of the "
          f"step; each stage holds at most {[peak_stashes(d['actions'])['held'] for d in rows]} chunks "
          f"between a forward and its last backward action")

# %% tags=["nbval-ignore-output"]
display(ch13.zero_bubble_table(ZB))
plots.savefig(ch13.zero_bubble_figure(ZB), "13_zero_bubble")
plots.savefig(ch13.gantt_figure(ZB["zb-h1"]), "13_gantt_zb_h1")
plots.savefig(ch13.gantt_figure(ZB["zb-v"]), "13_gantt_zb_v")

# %% [markdown]
# Two counts of the same bubble. The paper's ("paper's count") is the idle inside each stage's own span: a stage
# that starts the next step's forwards as soon as it is free pays only that, and there ZB-H2 and ZB-V reach zero.
# Our step ends in a synchronised optimizer step, as Megatron's does, so every stage also waits for the last one:
# the start skew of $(p-1)T_F$ stays, and ZB-H1 and ZB-H2 both idle $\frac{p-1}{3m+p-1}$ of the step, ZB-V and
# DualPipeV about half that. Either way W fills most of 1F1B's $\frac{p-1}{m+p-1}$. The measured bars sit above
# the replay by what the messages cost, more for the V schedules, which send twice as many.
#
# The memory panel is the price list: ZB-H1 holds 1F1B's activations from F to B, but its held-back W's keep
# their (x, dz) longer, so every stage ends up holding as much as stage 0; ZB-H2 holds about twice that; ZB-V and
# DualPipeV hold as much on every stage as 1F1B's stage 0, a little more for DualPipeV.
#
# **When zero bubble does not pay.** W fills the gaps only if there is W to move: with W a tenth of the backward
# (a layer whose backward is mostly attention, or a recomputed one), ZB-H1 has little to put in the bubble.
# Predict, then run it:

# %%
SMALL_W = {name: run(schedule=name, micro_batches=M, w_share=0.1, **TIMED) for name in ("1f1b", "zb-h1")}
for name, res in SMALL_W.items():
    print(f"W = 10% of the backward, {name:>5}: the table replayed with free messages idles "
          f"{ch13.replayed(res)['step_idle']:.3f} of the step")

# %% tags=["nbval-ignore-output"]
for name, res in SMALL_W.items():
    print(f"{name:>5}: measured idle / total {ch13.measured_bubble(res):.3f} on this CPU (gloo)")

# %% [markdown]
# The other two limits are in the same replay. Few micro-batches: at m = 1 there is no steady state for W to fill
# (ZB-H1 still saves its W's idle share, 0.67 of the step against 1F1B's 0.75). And messages: every F and B waits
# for one, and the V schedules send twice as many, so once a message costs a sizeable part of a forward the V's
# advantage is gone (p = 4, m = 8, idle / total with a message latency in units of $T_F$):

# %%
TABLES = {"1f1b": (all_stages("1f1b", P, M), "loop"), "zb-h1": (split_stages("zb-h1", P, M), "loop"),
          "zb-v": (split_stages("zb-v", P, M), "v"), "dualpipev": (split_stages("dualpipev", P, M), "v")}
print(f"{'latency':>8}" + "".join(f" {name:>9}" for name in TABLES))
for latency in (0.0, 0.25, 0.5, 1.0):
    print(f"{latency:>8}" + "".join(f" {ch13.replay(table, message=latency, placement=where)['step_idle']:>9.3f}"
                                    for table, where in TABLES.values()))

# %% [markdown]
# Chapter 00's planner prices these schedules from the same tables (`step_time` replays them with each stage's
# own times and W half of each backward), so the bubble it charges a run on ZB-V is the one these ranks execute.
#
# ## 9. Exercises
#
# **Exercise 1: the 1F1B schedule.** Return stage `stage`'s action list, `[("F", 0), ("F", 1), ..., ("B", 0), ...]`,
# for p stages and m micro-batches: warm-up forwards, steady one-forward-one-backward, cool-down backwards.
# The check replays all stages together: every micro-batch once, no deadlock, at most p - stage stashed,
# and no bigger bubble than GPipe's.

# %% tags=["exercise"]
def one_f_one_b_schedule(p, m, stage):
    raise NotImplementedError

# %% tags=["check"]
cu.check("one_f_one_b_schedule", one_f_one_b_schedule)

# %% [markdown]
# **Exercise 2: one stage, one micro-batch, real messages.** `stage` is this rank's `nn.Module`; `comm`
# has `is_first`, `is_last`, `input()` (the micro-batch, first stage), `loss(output)` (last stage; already
# divided by m), `recv_forward()`, `send_forward(t)`, `recv_backward()`, `send_backward(t)`. A received
# tensor is plain data: autograd knows nothing of the stage it came from. Run the forward, and the
# backward so that every stage's weights get their gradients. The check runs it on 2 and 4 real ranks
# for 3 micro-batches and compares every gradient with one process.

# %% tags=["exercise"]
def stage_step(stage, comm):
    raise NotImplementedError

# %% tags=["check"]
cu.check("stage_step", stage_step)

# %% [markdown]
# **Exercise 3: B now, W later.** A Linear layer computes $y = x W^T + b$. Its backward has two halves that a
# zero-bubble schedule runs at different times: **B**, the input gradient $dx = dy\,W$, which the previous stage is
# waiting for, and **W**, the weight gradients $dW = dy^T x$ and $db$ (the rows of $dy$ summed), which nobody waits
# for. Given `x` `[n, in]`, `weight` `[out, in]` and `dy` `[n, out]`, return `(dx, w)`: `dx` computed now, and `w`,
# a function of no arguments that computes and returns `(dW, db)` when the schedule calls it, later. B computes
# nothing for W: it only keeps what W will need. The check compares with autograd in float64 at five shapes (one
# with n = 1, some with in != out), watches which tensors your B computes, runs the next micro-batch's B before this
# one's W (as ZB-H1 does), and checks that the caller's tensors are left as they were.

# %% tags=["exercise"]
def split_linear_backward(x, weight, dy):
    raise NotImplementedError

# %% tags=["check"]
cu.check("split_linear_backward", split_linear_backward)

# %% [markdown]
# **Exercise 4: repair a schedule.** `broken` is a ZB-H1 table for p = 4 stages and m = 6 micro-batches, written by
# hand: per rank a list of `("F", i)`, `("B", i)` and `("W", i)`. Two of its actions are out of place, and the table
# cannot run. `check_schedule(table, 6)` (`workers/pipeline/validity.py`) raises a `ValueError` that names the first
# dependency a table breaks; start with `return broken`, and the check tells you the same. Return the repaired table:
# move the two actions that break a dependency, and nothing else, so that every action runs exactly once, no rank
# waits for ever, and the bubble is no worse than ZB-H1's (`simulate_split(table)` at $t_F = t_B = t_W = 1$, the
# largest `span_idle`). Where a moved action lands matters: some places that satisfy every dependency still make a
# rank wait.

# %%
broken = ch13.broken_schedule()
print(ch13.schedule_text(broken))

# %% tags=["exercise"]
def fix_schedule(broken):
    raise NotImplementedError

# %% tags=["check"]
cu.check("fix_schedule", fix_schedule)

# %% [markdown]
# **Exercise 5: predict the bubble.** Count the bubble as the zero-bubble paper does: for each rank, the idle time
# between the start of its own first action and the end of its own last, in ideal time (messages cost nothing,
# every action of a kind takes the same time); the bubble is the largest over the ranks. `t_f`, `t_b` and `t_w` are
# the times of one F, B and W action of the table (in ZB-V an action is one chunk, half of a rank's layers); 1F1B's
# table has no W actions, so its B is the whole backward and takes $t_B + t_W$. Return the bubble of `schedule`
# (`"1f1b"`, `"zb-h1"` or `"zb-v"`: the tables `all_stages("1f1b", p, m)` and `split_stages(schedule, p, m)`) from
# how its table is built, as a formula in p, m and the times: your function may not replay the table. Draw a few
# timelines first (rank 0's, then the last rank's). The check compares your formula with the replay in 18 cases:
# 1F1B at any m, ZB-H1 at m >= p with $t_W$ below, at and above $t_F$, and ZB-V at $t_F = t_B = t_W$ (the times it
# was built for) with fewer micro-batches than the $2p - 1$ that fill its V, and more.

# %% tags=["exercise"]
def predict_bubble(schedule, p, m, t_f, t_b, t_w):
    raise NotImplementedError

# %% tags=["check"]
cu.check("predict_bubble", predict_bubble)

# %% [markdown]
# ## 10. Explore on real ranks
#
# Schedule, micro-batches, stages (`pp`), chunks per stage (`virtual_stages`, the interleaved schedule's; ZB-V and
# DualPipeV always hold two in a V) and W's share of the backward (the zero-bubble schedules'): each change reruns
# the step on the warm ranks and redraws the Gantt chart from their timelines (padded actions as above; fewer stages
# run as copies; a 16-layer model, so every p x v up to 16 splits). A combination a schedule cannot run (DualPipeV
# with fewer than 2p micro-batches, the interleaved schedule with m not a multiple of p) is refused before
# launching, in the layout's words, with what to change.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider


def draw_gantt(res, params):
    return ch13.gantt_figure(res)


V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank in a V, always
gantt_live = LiveRun(WORKER, {"schedule": W.ToggleButtons(options=["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v",
                                                                   "dualpipev"], value="1f1b"),
                              "micro_batches": slider("micro-batches m", 8, 1, 16),
                              "pp": W.Dropdown(options=[1, 2, 4], value=4, description="stages pp"),
                              # model chunks per stage: an interleaved schedule's setting (greyed for the others)
                              "virtual_stages": W.Dropdown(options=[2, 4], value=2, description="chunks v",
                                                           style={"description_width": "initial"}),
                              # the weight gradient's share of a backward: what a zero-bubble schedule can move
                              "w_share": W.FloatSlider(value=0.5, min=0.0, max=0.9, step=0.1, description="W share",
                                                       style={"description_width": "initial"})},
                     draw_gantt, params={"world_size": WORLD, "layers": 16, **TIMED}, timeout=60,
                     derive=lambda s: {"virtual_stages": s["virtual_stages"] if s["schedule"] == "interleaved"
                                       else 2 if s["schedule"] in V_SHAPED else 1},
                     applies={"virtual_stages": lambda s: s["schedule"] == "interleaved",
                              "w_share": lambda s: s["schedule"].startswith("zb") or s["schedule"] == "dualpipev"})
gantt_live.wait(60)
gantt_live

# %% [markdown]
# ## Summary
#
# * A pipeline stage sends one activation forward and receives one gradient back per micro-batch, point to
#   point: little volume, one neighbour. That is why it spans nodes.
# * Split correctly (received activations as leaves that require grad, each micro-batch's loss over m), the
#   pipeline computes exactly the unsplit model's gradients.
# * Both GPipe and 1F1B idle $(p-1)/(m+p-1)$ of the step ($(p-1)/m$ of the ideal time): only more
#   micro-batches shrink the bubble.
# * 1F1B keeps at most p - s micro-batches' activations on stage s, GPipe m: 1F1B saves memory, not time.
# * Interleaving v chunks per rank cuts the bubble to $(p-1)/(vm+p-1)$ for v times the messages and a
#   little more memory; it pays while a message's latency is small against a chunk's compute.
# * Splitting the backward into B (the input gradient, which the previous stage waits for) and W (the weight
#   gradient, which nobody waits for) lets a schedule fill the bubble with W: ZB-H1 idles $(p-1)(T_F+T_B-T_W)$ per
#   stage, a third of 1F1B's, at 1F1B's activations plus W's stash; ZB-H2, ZB-V and DualPipeV reach zero inside a
#   stage's own span, for more memory (ZB-H2) or twice the messages (the V). It pays while there is W to move,
#   enough micro-batches, and messages cheap against a forward.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
