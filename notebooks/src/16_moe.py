# %% [markdown]
# # 16 · Mixture of experts and expert parallelism: from the router to all-to-all on real ranks
#
# A dense transformer spends every parameter on every token. A **mixture of experts** (MoE) replaces each FFN by
# E FFNs, the *experts*, and a small *router* that sends each token to k of them. The model holds E times the FFN
# parameters but a token pays for k: Mixtral 8x7B holds 46.7B parameters and uses 12.9B per token (Jiang et al.
# 2024, *Mixtral of Experts*; Mistral AI's release post), DeepSeek-V3 671B and 37B (DeepSeek-AI 2024, *DeepSeek-V3
# Technical Report*, sec. 4.2). The experts do not fit on one GPU, so they are split over ranks: **expert
# parallelism** (EP, Lepikhin et al. 2020, *GShard*). Each rank routes its own tokens, then an **all-to-all** sends
# every token to the rank that holds its expert, and a second one brings the results back. DeepSeek-V3 trained with
# 64-way EP over 8 nodes (report, sec. 3.2).
#
# MoE is also where some of the most persistent silent bugs live, each a model that trains and is wrong:
#
# * a **router whose gradient is never all-reduced** across data-parallel ranks, so every replica's router drifts
#   its own way (torchtitan PR #2416);
# * **expert gradients exactly `ep` times too large**: an expert's gradient already sums the tokens that every EP
#   rank sent it, and averaging it over its expert-data-parallel group alone divides by too little
#   (pytorch/pytorch issue #160285; Megatron-LM PR #5956 "Divide expert gradients by the expert-parallel size");
# * tokens **combined back in the wrong order**: the rows come back sorted by expert, not by token;
# * a **load-balancing loss on each rank's statistics** instead of the batch's: another loss, with another optimum
#   (Qiu et al. 2025, *Demons in the Detail: On Implementing Load Balancing Loss for Training Specialized
#   Mixture-of-Expert Models*).
#
# This chapter builds the layer (router, capacity, the two auxiliary losses, SwiGLU experts, a shared expert), runs it
# on real ranks with two all-to-alls, and holds every output and every gradient to a one-process reference that
# loops over tokens one by one. Then it injects each of the four bugs and shows the check naming it, measures the
# all-to-all's bytes against the model, the cost of an imbalanced router, and trains chapter 09's tiny GPT with an
# MoE FFN with and without the load-balancing loss.
#
# Built here: `workers/moe/` (`config.py`, `router.py`, `dispatch.py`: the all-to-all dispatcher, `layer.py`: the
# layer, the groups and the reference, `equivalence.py`: the check, `train.py`: the MoE GPT) and the workers
# `workers/ch16_moe.py` and `workers/ch16_moe_train.py`.

# %%
import textwrap

import torch

import course_utils as cu
from course_utils import ch16, plots
from course_utils.exercises import check
from course_utils.planner import all_to_all_bytes, ep_rank_parameters, moe_parameter_counts
from course_utils.published_configs import PUBLISHED_MOE
from course_utils.tables import Table
from workers.moe.config import MoEConfig
from workers.moe.layer import MoELayer

plots.style()
torch.set_num_threads(1)  # the notebook's own tensors are small; one thread leaves the cores to the ranks
print(f"layer checks: hidden {MoEConfig().hidden}, expert ffn {MoEConfig().ffn} (SwiGLU), float64; "
      f"training: chapter 09's GPT, {ch16.TRAIN_STEPS} steps on {ch16.TRAIN_WORLD} ranks")

# %% [markdown]
# ## What an MoE costs: two published configurations
#
# Chapter 00 prices expert parallelism in full (`course_utils/planner.py`: `moe_parameter_counts`,
# `ep_rank_parameters`, `all_to_all_bytes`). The counts reproduce what the sources print: Mixtral counts the embedding
# table in its 12.9B active parameters; DeepSeek-V3's 37B fits either without the input embedding (36.6B) or truncated
# (37.55B).

# %%
rows = []
for cfg in PUBLISHED_MOE:
    n = moe_parameter_counts(cfg)
    rows.append({"model": cfg.name, "experts": cfg.experts, "top-k": cfg.top_k, "total": f"{n['total'] / 1e9:.2f}B",
                 "active": f"{n['active'] / 1e9:.2f}B", "routed experts": f"{n['experts'] / n['total']:.0%}",
                 "per rank at EP 8": f"{ep_rank_parameters(cfg, 8) / 1e9:.1f}B"})
print(Table.of(rows))

# %% [markdown]
# Nearly all of the parameters are routed experts, which is why they are what EP splits: at EP 8, a Mixtral rank
# holds one expert per layer plus everything dense.
#
# ## The router, in one process
#
# The router is one linear layer, `[E, h]`, with no bias. For each token: logits, softmax, the k largest
# probabilities, renormalised to sum to 1 when k > 1 (Mixtral's rule; with k = 1 the raw probability is the gate, as
# in Switch, so the router still gets a gradient). **Capacity** (Switch Transformer, Fedus et al. 2021, sec. 2.2):
# an expert takes at most `ceil(capacity_factor x tokens x k / E)` token choices; the rest are dropped (the token's
# output from that expert is 0, the residual stream carries it on). Who is dropped is decided by the queue order:
# GShard's, every token's first choice before any token's second choice. With capacity factor 0 nothing is dropped
# (the *dropless* MoE of Megablocks and DeepSeek-V3).
#
# Twelve tokens, four experts, top-2, capacity factor 1.0: each expert takes at most `ceil(12 x 2 / 4) = 6`.

# %%
demo_cfg = MoEConfig(experts=4, top_k=2, capacity_factor=1.0, aux_coeff=0.1, z_coeff=0.01)
demo = MoELayer(demo_cfg, seed=0)  # one process: every expert here
x_demo = torch.randn(12, demo_cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
y_demo = demo(x_demo)
rec = demo.last
print(Table.of([{"token": t, "experts": rec.experts[t].tolist(), "weights": [f"{w:.3f}" for w in rec.weights[t].tolist()],
                 "kept": ["yes" if k else "DROPPED" for k in rec.keep[t].tolist()]} for t in range(12)]))
print(f"choices per expert {rec.counts.tolist()} (capacity {demo_cfg.capacity(12)}): "
      f"{int((~rec.keep).sum())} of {rec.keep.numel()} dropped")

# %% [markdown]
# The experts that asked for more than 6 lose their latest requests: second choices first, then the first choices
# of the last tokens.
#
# Two auxiliary losses keep the router healthy. The **load-balancing loss** (Switch eq. 4) is
# `E x sum_i f_i x P_i`: `f_i` the fraction of the batch's token choices routed to expert i (a count: no gradient),
# `P_i` the mean probability the router gave expert i (the gradient goes through it). It is 1 when the load is even
# and E when one expert takes everything, so minimising it pushes probability away from crowded experts. Both `f`
# and `P` are statistics of the **whole batch**: on ranks, `f` comes from counts all-reduced over every rank
# (`workers/moe/router.py: load_balancing_loss`). The **router z-loss** (ST-MoE, Zoph et al. 2022, eq. 5),
# `mean_t logsumexp(logits_t)^2`, keeps the logits small, where rounding cannot decide the top-k.

# %%
print(f"load-balancing loss {rec.aux:.4f} (1 = even), z-loss {rec.z:.4f}; "
      f"total auxiliary term {demo_cfg.aux_coeff} x aux + {demo_cfg.z_coeff} x z = {demo.aux_loss.item():.5f}")

# %% [markdown]
# ## Expert parallelism: two all-to-alls
#
# With EP the ranks split the experts: EP rank r holds experts `[r E/ep, (r+1) E/ep)`. Every rank keeps the router
# (and any shared expert) and routes **its own** tokens. Then, as Megatron-LM's `MoEAlltoAllTokenDispatcher`
# (`workers/moe/dispatch.py`) does:
#
# 1. **permute**: list the kept (token, choice) pairs, sort them by expert (stably), gather their rows `[A, h]`.
#    Sorted by expert is sorted by destination rank.
# 2. **the split sizes**: count rows per expert, and exchange the counts with one small all-to-all, so every rank
#    knows how many rows it will receive from each source for each of its experts. `all_to_all_single` needs both
#    lists (`input_split_sizes`, `output_split_sizes`) to size its output.
# 3. **dispatch**: `all_to_all_single` of the rows. They arrive source by source; a second sort groups them by local
#    expert, and each expert reads one contiguous block.
# 4. **combine**: the same backwards (undo the local sort, all-to-all with the splits swapped), then **unpermute**:
#    add each row, times its routing weight, into its token's place (`index_add`: a top-2 token receives two rows).
#
# Autograd needs nothing more: the backward of an all-to-all is the all-to-all with the splits swapped.
# Four ranks, eight experts, top-2, capacity 1.0, 32 tokens (8 per rank):

# %%
split_run = cu.run(ch16.WORKER, 4, timeout=180, ep=4, experts=8, top_k=2, capacity_factor=1.0)
print(Table.of(ch16.split_rows(split_run), formats=ch16.SPLIT_FORMATS,
               caption="float64 activations, hidden 16: 128 bytes a row; bytes out: the dispatch's rows to other "
                       "ranks, bytes back: the combine's"))

# %% [markdown]
# Row by row: what rank r sends to rank j (`send splits[j]`) is what j receives from r (`recv splits[r]`); the rows a
# rank keeps for itself never touch the network, so the bytes that leave are the rest, times 16 x 8 bytes. The
# combine sends back exactly what the dispatch received (`rows per expert` are the rows each of the rank's experts
# computes, from every source).
#
# ## Equal to one process
#
# The reference (`workers/moe/layer.py: reference_forward`) is the layer written without any of this: for each token
# in turn, softmax, top-k, the capacity queue (counted per group of tokens, one group per rank, GShard's groups, so the
# same choices are dropped), each chosen expert applied to that token alone, the weighted sum. Loss: the mean over
# tokens of `y . g` (g a fixed random direction per token) plus both auxiliary losses. The ranks backpropagate their
# own share and average gradients: the router and shared expert over every rank, each expert over the ranks that
# hold a copy of it, **divided by the world size** in both cases (`layer.reduce_gradients`).
#
# Four layouts: EP 1 (one rank holds everything), EP 2, EP 4, and EP 2 x DP 2 on four ranks (two EP groups of two
# ranks, each holding all experts once: an expert has two copies whose gradients are averaged). In each, eight cases:
# 4 and 8 experts (8 with a shared expert too), top-1 and top-2, dropless and capacity factor 1.

# %%
sweep = {(world, ep): cu.run(ch16.WORKER, world, timeout=300, ep=ep, sweep=True) for world, ep in ch16.LAYOUTS}
equal_rows = [row for (world, ep), res in sweep.items() for row in ch16.equivalence_rows(res, world, ep)]
print(ch16.equivalence_table(equal_rows))

# %% [markdown]
# Every output, the routing and the dropped choices of every token, the load-balancing loss, and the gradients of
# every expert, the router, the shared expert and the input agree with the token-by-token loop within float64
# rounding. The largest differences (they vary by CPU):

# %% tags=["nbval-ignore-output"]
print(ch16.equivalence_table(equal_rows, errors=True))

# %% [markdown]
# ## The faults: four silent bugs, each caught and named
#
# Each fault injects one bug into the rank code (`workers/moe/faults.py`: it replaces one function of the layer for
# the run) on EP 2 x DP 2, eight experts, top-2, capacity 1; the same check (`workers/moe/equivalence.py: compare`)
# then says what differs:
#
# * `router_not_reduced`: the router's gradient skips the all-reduce;
# * `expert_grads_averaged_over_edp`: expert gradients averaged over the expert-data-parallel group (2 ranks) instead
#   of divided by the world (4);
# * `combine_order_not_restored`: the combine adds the returned rows in the order the choices were listed, forgetting
#   that they come back sorted by expert;
# * `aux_loss_local_statistics`: `f_i` from each rank's own counts.

# %%
faults = ch16.fault_rows()
print(Table.of([{k: r[k] for k in ("fault", "caught")} for r in faults]))

# %% [markdown]
# What the check says first, in each case (the numbers vary a little by CPU):

# %% tags=["nbval-ignore-output"]
for r in faults:
    print(f"{r['fault']}:\n{textwrap.fill(r['what the check says first'], 110, initial_indent='    ', subsequent_indent='    ')}")

# %% [markdown]
# None of these crashes or even looks wrong on a loss curve at first: the unreduced router is each replica's own
# router, the doubled expert gradient is a larger learning rate for the experts, the mixed-up combine is a noisier
# model, and the local aux loss balances each rank's micro-batch instead of the batch. The equivalence check sees each
# one at step 0 and names the tensor, the ranks, and (for the scale bug) the exact factor: `ep`.
#
# ## Bytes on the wire
#
# The all-to-all's cost model: a rank with T tokens sends `T x k` rows of `h` elements, and under **even routing**
# a fraction `(n-1)/n` of them go to the n-1 other EP ranks: `T h b k (n-1)/n` bytes per dispatch, as much per
# combine, and twice both in backward (`planner.all_to_all_bytes`). On a batch routed perfectly evenly (a router that
# reads expert i's score off coordinate i, `workers/moe/batch.py: balance`) the measurement is the model, to the byte;
# on a random batch the router is uneven, and each rank sends what its own tokens chose.

# %%
bytes_runs = {"even (by construction)": cu.run(ch16.WORKER, 4, timeout=180, ep=4, experts=8, top_k=2, tokens=256,
                                               balanced=True),
              "random": cu.run(ch16.WORKER, 4, timeout=180, ep=4, experts=8, top_k=2, tokens=256)}
print(Table.of(ch16.bytes_rows(bytes_runs, hidden=16, top_k=2, element_bytes=8), formats=ch16.BYTES_FORMATS,
               caption="bytes of one dispatch, 64 tokens per rank, top-2, EP 4, float64: model = 64 x 16 x 8 x 2 x 3/4"))

# %% [markdown]
# ## Imbalance: the slowest rank sets the pace
#
# Skew the batch towards expert 0 (every token leans towards its router row) and the rank holding it computes most
# of the rows. The others finish their experts early and reach the combine's all-to-all, where they wait: no rank
# gets its rows back before the busiest rank has computed them and sent them. To see it on a CPU, the experts must be
# most of the forward, so here they are wide and the tokens few: 2,048 tokens of hidden 128, experts 2,048 wide
# (float32; a row costs 6 x 128 x 2,048 flops in its expert), on four ranks, EP 4, an even batch and a skewed one.
# Each rank times four forwards (and backwards), each started at a barrier, and reports the median of the last three:
# the wall time of routing and the dispatch, of its experts, and of the wait in the combine, and the CPU time its
# experts took (the rank's own: another process on the same cores does not inflate it). The rows each rank computed
# are exact; the verdicts compare ranks of one run, with margins measured over seeds and CPU kernels
# (`course_utils/ch16.py: IMBALANCE_SPREAD`). The waits are wall times: they are printed with the timings below, not
# judged, because with four ranks on two cores the scheduler also decides who waits.

# %%
imbalance = ch16.imbalance_rows(ch16.imbalance_runs())
print(Table.of([{k: r[k] for k in ("batch", "rank", "experts", "rows computed")} for r in imbalance],
               formats={"rows computed": "{:,}"}))
print(ch16.imbalance_verdict(imbalance))

# %% [markdown]
# Where each rank's forward went, on this machine (the times vary with the CPU, its cores and its load):

# %% tags=["nbval-ignore-output"]
print(Table.of(imbalance, ["batch", "rank", "rows computed", *ch16.TIMINGS], caption=plots.CPU_NOTE,
               formats={"rows computed": "{:,}", **{k: "{:.1f}" for k in ch16.TIMINGS}}))
print(ch16.imbalance_sentence(imbalance))
print(ch16.imbalance_waits(imbalance))
plots.savefig(ch16.draw_imbalance(imbalance), "16_moe_imbalance")

# %% [markdown]
# In the skewed batch every bar ends at about the same time: each rank leaves the combine when the busiest one
# arrives, so the busiest rank's experts set the length of everyone's forward, and the other ranks spend the
# difference waiting (the hatched part). In the even batch the waits are scattered: they go to whichever ranks the
# machine happened to run a little later. The backward repeats the pattern (the experts' backward, then an all-to-all that waits for it).
#
# How much longer the whole step takes depends on what the ranks run on. With a device per rank (GPUs, or a CPU
# core each) the experts' part of the step grows by the busiest rank's share, about 2x here. When ranks outnumber
# cores, as with four ranks on a 2-core machine, the ranks that wait give their cores to the busy one and the wall
# time grows by less; on a machine busy with other work the difference between two runs can vanish in the noise (the
# last lines above give this machine's ratios). The comparison between the ranks of one run does not depend on
# either. Capacity bounds the damage (the busiest expert computes at most its capacity) at the price of dropped
# tokens; the load-balancing loss attacks the cause.
#
# ## Training an MoE GPT, with and without the load-balancing loss
#
# Chapter 09's tiny GPT (2 layers, hidden 32, its Markov-chain data) with each FFN replaced by an MoE layer: 8
# experts, top-2, dropless, on 2 ranks (EP 2). First, the same model on 1 and 2 ranks follows the same trajectory:
# `workers/moe/train.py` on EP ranks is the one-process model, step after step (float32: the losses agree to ~1e-7
# over 30 steps here; `tests/test_ch16_train.py` bounds it at 1e-4 on every CPU).

# %% tags=["nbval-ignore-output"]
short = {world: ch16.train(ch16.AUX, world=world, steps=30)[0]["loss"] for world in (1, 2)}
print(f"loss after 30 steps: 1 rank {short[1][-1]:.6f}, EP 2 {short[2][-1]:.6f}; "
      f"largest difference over the 30 steps {max(abs(a - b) for a, b in zip(short[1], short[2])):.1e}")

# %% [markdown]
# Now 150 steps with the Switch coefficient 0.01 and with none:

# %%
train_runs = {f"aux {ch16.AUX}": ch16.train(ch16.AUX), "no aux loss": ch16.train(0.0)}
summary = ch16.training_summary(train_runs)
print(ch16.aux_verdict(summary, f"aux {ch16.AUX}", "no aux loss"))

# %% [markdown]
# This run's numbers, and the figure (they vary by machine; the verdicts above hold on every CPU's kernels,
# `course_utils/cpu_spread.py: ch16_moe_train`):

# %% tags=["nbval-ignore-output"]
print(Table.of(summary, formats=ch16.SUMMARY_FORMATS))
print(ch16.load_sentence(summary, f"aux {ch16.AUX}", "no aux loss"))
plots.savefig(ch16.draw_training(train_runs), "16_moe_training")

# %% [markdown]
# The two loss curves lie almost on top of each other; the middle panel, their difference, is noise around zero, a
# small fraction of the loss: the aux loss costs nothing visible in the loss here. The load differs. Without the aux
# loss the router concentrates tokens on a few experts (the dashed line on the right, the bright bands of the right
# heat map). With it the busiest expert's load is lower, but not even: it stays well above an even share (the line
# marked "even"; the mean and the highest value are printed above). A coefficient of 0.01 pulls the router towards
# balance without forcing it there. The heat maps are the load histogram of every step: a bright band is an expert
# taking several even shares, a dark one an expert the router has all but abandoned. That load is what capacity
# must absorb. The same routing, cut at other capacity factors (GShard's queue, per rank):

# %% tags=["nbval-ignore-output"]
plots.savefig(ch16.draw_drops(train_runs), "16_moe_drops")

# %% [markdown]
# At capacity 1.0 the router without the aux loss would drop more of its choices (the verdict above; this run's
# percentages are printed with the table); raising the capacity factor buys the drops back with padding compute and
# memory (every expert is sized for its capacity). This is why Switch
# trains with capacity 1.0-1.25 *and* an aux loss, and why dropless MoEs (Megablocks, DeepSeek-V3) need the balance
# even more: there the busiest expert sets the step time directly. DeepSeek-V3 replaces most of the aux loss by a
# per-expert bias added to the routing scores (report, sec. 2.1.2, "auxiliary-loss-free load balancing"), counted in
# the planner's parameter count.

# %% [markdown]
# ## Exercises
#
# **Exercise 1: the dispatch's permutation and split sizes.** `experts` is an int64 tensor `[T, k]`, each token's k
# chosen experts; `keep` a bool tensor `[T, k]`, which of those choices fit in their expert's capacity. The rows this
# rank sends are the kept choices, listed as `experts[keep]` (`[A]`, A = `keep.sum()`, in (token, choice) order).
# Return `(order, send_splits)`: `order` an int64 tensor `[A]` of positions into that list such that
# `experts[keep][order]` is sorted by expert (ascending; the order of the tokens within one expert is yours to
# choose), and `send_splits` a list of `ep` ints, the rows that go to each EP rank, where EP rank r holds experts
# `[r * n_experts / ep, (r + 1) * n_experts / ep)`. The check runs in this notebook on six cases: top-1 and top-2,
# with and without dropped choices, ep 1, 2 and 4, 4 and 8 experts, an expert no token chose.

# %% tags=["exercise"]
def dispatch_plan(experts, keep, n_experts, ep):
    """experts [T, k] int64, keep [T, k] bool -> (order [A] int64, send_splits: list of ep ints)."""
    raise NotImplementedError

# %% tags=["check"]
check("dispatch_plan", dispatch_plan)

# %% [markdown]
# **Exercise 2: the load-balancing loss on the whole batch.** `probs` `[T, E]` are the router's softmax
# probabilities for this rank's T tokens (they require grad), `experts` `[T, k]` this rank's chosen experts
# (`k = top_k`, `E = n_experts`). Return this rank's term, a 0-dim tensor: `E * sum_i f_i * P_i`, where `f_i` is the
# fraction of the token choices of **every rank of `group`** routed to expert i (choices for i over the group,
# divided by the group's tokens times `top_k`: one `torch.distributed.all_reduce` of the counts, which carry no
# gradient) and `P_i = probs.mean(0)[i]` over **this rank's** tokens. With equal tokens per rank the ranks' terms
# average to the loss of the whole batch (with unequal ones, their average weighted by tokens does). `group` is a
# process group (`None`: the whole world). The check runs on 2 and 4 real ranks, each with its own batch leaning
# towards another expert (in one case the ranks hold different numbers of tokens, one only 2), compares your term
# and its gradient with respect to `probs` with the chapter's `load_balancing_loss`, and at 4 ranks runs it again
# inside two groups of 2.

# %% tags=["exercise"]
def load_balancing_loss(probs, experts, n_experts, top_k, group):
    """probs [T, E] (requires grad), experts [T, k] int64 -> this rank's term, a 0-dim tensor."""
    raise NotImplementedError

# %% tags=["check"]
check("load_balancing_loss", load_balancing_loss)

# %% [markdown]
# **Exercise 3: the combine.** After the return all-to-all, `rows` `[A, h]` are the expert outputs for this rank's A
# kept choices, in the same order as `token_index` `[A]` (the token each row belongs to, int64) and `weight` `[A]`
# (its routing weight). Return `y` `[tokens, h]` with `y[t]` the sum, over the rows r with `token_index[r] == t`, of
# `weight[r] * rows[r]`; a token whose choices were all dropped gets zeros. Keep it differentiable in `rows` and
# `weight`: the experts and the router learn through it, and leave them unchanged; `y` has the device and dtype of
# `rows`. The check puts your function in the last step of the
# chapter's expert-parallel layer (8 experts, top-2, capacity factor 1.0, float64) on 2 and 4 real ranks, runs a
# forward and a backward, and compares the output and every gradient with the one-process layer.

# %% tags=["exercise"]
def combine(rows, token_index, weight, tokens):
    """rows [A, h], token_index [A] int64, weight [A] -> y [tokens, h]."""
    raise NotImplementedError

# %% tags=["check"]
check("combine", combine)

# %% [markdown]
# ## Explore on real ranks
#
# Choose the experts, top-k, the capacity factor (0: dropless), the aux coefficient and the EP size (the number of
# ranks). Each change trains the MoE GPT for 40 steps on real ranks and draws the last step's tokens per expert (EP
# ranks' boundaries marked), the drops and the busiest expert's load over training, and the bytes each rank's dispatch
# sent against the model. Combinations the layer cannot take are refused in one sentence, in the status line, before
# a rank starts: try 6 experts on EP 4 (each EP rank must hold the same number of experts), or top-k 8 with fewer
# than 8 experts. A change of EP size starts new ranks (about 7 s on an idle 2-core machine, `make bench`; the status
# line says so); the same size reuses the warm ones (about 2 s for 40 steps).

# %% tags=["nbval-ignore-output"]
import ipywidgets as W


def choice(name, options, value, width="150px"):
    return W.Dropdown(options=options, value=value, description=name, layout=W.Layout(width=width),
                      style={"description_width": "initial"})


# ch16.EXPLORER_CONTROLS: name -> (label, options, first value); experts 6 and top-k 8 reach the refusals
explorer = ch16.MoEExplorer({name: choice(label, options, value)
                             for name, (label, options, value) in ch16.EXPLORER_CONTROLS.items()})
explorer.wait(120)
explorer

# %% [markdown]
# ## What maps to Megatron-LM and torchtitan
#
# | here (`workers/moe/`) | Megatron-LM (`megatron/core/transformer/moe/`) | torchtitan (`torchtitan/models/moe/`) |
# |---|---|---|
# | `TopKRouter` | `router.py: TopKRouter` | `moe.py: TokenChoiceTopKRouter` |
# | `keep_mask` (capacity, GShard's queue order) | `moe_utils.py: topk_softmax_with_capacity` (`drop_policy="position"`; its default `"probs"` drops the lowest-scored choices instead) | dropless only |
# | `load_balancing_loss`, `z_loss` | `moe_utils.py: switch_load_balancing_loss_func`, `z_loss_func` | `load_balance_coeff` (bias-based) |
# | `MoEAlltoAllTokenDispatcher` | `token_dispatcher.py: MoEAlltoAllTokenDispatcher` | `expert_parallel.py: ExpertParallel` |
# | `all_to_all` (autograd) | `tensor_parallel/mappings.py: all_to_all` | `all_to_all_single_autograd` |
# | experts as `DenseMLP` (SwiGLU) | `experts.py: SequentialMLP`, `GroupedMLP` | `GroupedExperts` |
# | `expert_mesh`: the `ep` and `edp` groups of the rank grid (ep folded out of dp) | `parallel_state`: expert model / expert data parallel groups | `ep` / `dp_shard_mod_ep` mesh dims |
# | `reduce_gradients` (experts / world) | `expert_gradient_scaling_factor` in DDP | FSDP2 on the `edp` mesh |
#
# **On GPUs** the worker runs unchanged under torchrun (NCCL when every rank has a GPU; with one GPU, gloo stages the
# all-to-all through the host, `runtime.host_staged`):
#
# ```bash
# torchrun --nproc-per-node 8 workers/ch16_moe.py --ep 8 --experts 8 --top-k 2 --dtype float32
# torchrun --nproc-per-node 8 workers/ch16_moe_train.py --ep 4 --experts 8 --capacity-factor 1.25
# ```
#
# Real MoE kernels replace the loop over local experts by one grouped GEMM and the two sorts by fused permute kernels;
# DeepSeek-V3 also limits each token to experts on at most 4 nodes so the all-to-all's cross-node bytes stay bounded
# (node-limited routing, report sec. 2.1.2). None of it changes what is computed, which is what the checks here hold.
#
# ## Summary
#
# * An MoE layer is a router (softmax, top-k, renormalised), experts, and optionally capacity (GShard's queue decides
#   who is dropped) and shared experts; two auxiliary losses keep the router balanced (Switch) and its logits small
#   (ST-MoE). Its load-balancing loss is a statistic of the whole batch.
# * Expert parallelism is two all-to-alls around the experts, each preceded by an exchange of split sizes, with a sort
#   by expert before and its inverse after. Expert gradients are averaged over their copies but divided by the world.
# * On EP 1, 2, 4 and EP 2 x DP 2, every output and gradient equals the token-by-token reference in float64, dropping
#   the same choices; four silent bugs are each caught and named.
# * All-to-all bytes are `T h b k (n-1)/n` per direction under even routing, exactly. A skewed router gives one rank
#   most of the rows; the others wait for it at the combine, so the busiest rank sets the pace of the EP group.
# * The load-balancing loss lowers the busiest expert's load without making it even, at no visible cost to the loss
#   here; without it a capacity factor of 1 would drop more of the choices.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell.
