# %% [markdown]
# # 05 · Attention tensor parallelism by head
#
# Chapter 04 split an MLP so that the nonlinearity stayed local. Attention has an even better seam: its
# **heads**. Each head computes $\mathrm{softmax}(Q_iK_i^\top/\sqrt d)V_i$ from its own slice of the
# projections and never looks at another head until the output projection mixes them. So Megatron
# (Shoeybi et al. 2019, [arXiv:1909.08053](https://arxiv.org/abs/1909.08053), section 3, Figure 3b) gives
# each rank $n_{heads}/t$ whole heads:
#
# * the QKV projection is **column-parallel by heads**: rank r computes the queries, keys and values of
#   its own heads (input through `f`);
# * attention runs locally on those heads, with no communication at all;
# * the output projection is **row-parallel**: its input rows are exactly those heads' outputs, and one
#   all-reduce (`g`) sums the ranks' contributions. Bias once, after.
#
# Two complications make this chapter worth its own notebook. Modern models use **grouped-query
# attention** (GQA: Ainslie et al. 2023, [arXiv:2305.13245](https://arxiv.org/abs/2305.13245)), with fewer
# key/value heads than query heads, and at large TP there are fewer KV heads than ranks. And the QKV
# weight is usually stored **fused**, which sets a trap for anyone who splits it with `chunk`.

# %%
import torch

import course_utils as cu
from course_utils import plots, tp_check, tp_figures, tp_viz

plots.style()
LIMITS = {"timeout": 60}  # per run; the ranks stay warm between runs (and the exercise checks reuse them)
SEQ, BATCH = 8, 2
ATTENTION = "workers.ch05_attention_tp"


WORLD = 4  # one set of 4 warm ranks; TP 1, 2 and 4 run as tensor-parallel groups inside it


def run_attention(tp, **params):
    """One forward + backward of attention split over ``tp`` ranks, and the comparison with dense attention.

    The 4 ranks form 4/tp independent tensor-parallel groups, each running the whole attention; ``compare``
    rebuilds and checks every group.
    """
    res = cu.run(ATTENTION, world_size=WORLD, tp=tp, seq=SEQ, batch=BATCH, **LIMITS, **params)
    cfg = tp_check.config_of(res[0]["config"])
    return res, tp_check.compare(res, "attention", cfg, seq=SEQ, batch=BATCH)


# %% [markdown]
# ## 1. Heads on ranks
#
# Our dense reference (`workers/model/dense.py: DenseAttention`) has one fused projection `qkv` of
# shape `[(heads + 2 kv_heads) d, h]` laid out `[Q; K; V]`, causal scaled-dot-product attention, and
# an output projection `proj`. The parallel version (`workers/parallel/attention.py: ParallelAttention`)
# is built from it with `from_dense`. **Predict**: for 4 heads at TP 2, how many all-reduces in forward,
# how many in backward, and in which layer?

# %%
mha = {t: run_attention(t, hidden=32, heads=4) for t in (1, 2, 4)}
for t, (res, rep) in mha.items():
    heads = [d["query_heads"] for d in res.ranks[:t]]  # the first group; the others hold the same heads
    print(f"TP {t}: query heads per rank {heads}; {rep.verdict()}")
    print("      communication of rank 0:",
          [(r["scope"], r["collective"], r["pass"]) for r in tp_check.comm_rows(res)] or "none")

# %% [markdown]
# The same pattern as the MLP: `g` after `proj` in forward, `f` before `qkv` in backward. At TP 4 each
# rank runs one head. A block (chapter 06) is attention plus MLP: 2 all-reduces forward, 2 backward.
#
# ## 2. Grouped-query attention: split or replicate the KV heads
#
# In GQA, $n_{kv}$ key/value heads serve $n_{heads}$ query heads, each KV head shared by $g = n_{heads} /
# n_{kv}$ consecutive query heads: query head $j$ reads KV head $\lfloor j/g \rfloor$. Rank r holds
# query heads $[r\,n_{heads}/t, (r+1)\,n_{heads}/t)$ and needs the KV heads those read.
#
# * If t divides $n_{kv}$, each rank holds $n_{kv}/t$ KV heads, exactly the ones it needs.
# * If $n_{kv}$ divides t (t > $n_{kv}$), a KV head cannot be cut (a head is the unit of attention), so
#   each KV head is **replicated** on the $t/n_{kv}$ ranks whose queries read it.
#
# Replication has a consequence for training. Each copy of a replicated KV weight only sees its own
# query heads' part of the gradient; the true gradient is the sum over copies. So the replicated K and V
# rows enter through `f` over the group of copies: identity forward, all-reduce of the gradient backward,
# and the copies stay identical after every step. (Inference engines replicate KV heads the same way
# but need no gradient.)
#
# A real case: Llama 3 405B has hidden 16384, 128 query heads and 8 KV heads (Dubey et al. 2024,
# *The Llama 3 Herd of Models*, [arXiv:2407.21783](https://arxiv.org/abs/2407.21783), Table 3), trained with
# TP 8 inside a node (section 3.3.2). One layer's attention, bf16, s = 8192:

# %%
for row in tp_viz.head_table(16384, 128, 8, tps=(1, 2, 4, 8, 16), seq=8192, batch=1):
    print(row)

# %% [markdown]
# At TP 8 every rank holds exactly one KV head; at TP 16 each KV head lives on two ranks. The activation
# all-reduce volume does not shrink with t (chapter 04): it is $b\,s\,h$, whatever the heads. Replication
# adds the last column: at TP 16 each rank's K and V rows ($2 \times 128 \times 16384$ weights, 8 MiB in bf16)
# get their gradient summed over the two copies, one more all-reduce per layer in backward. It is small next
# to the activation's (480 MiB sent per all-reduce at s = 8192) and does not grow with s or b. (Llama has no
# biases; a model with QKV biases adds a second, tiny all-reduce for their K and V entries.)
#
# **Predict**: 8 query heads and 2 KV heads at TP 4. Which KV head does rank 3 hold? Which ranks share
# KV head 0?

# %%
gqa = {"GQA 8q/2kv, TP 2 (split)": run_attention(2, hidden=32, heads=8, kv_heads=2),
       "GQA 8q/2kv, TP 4 (replicated x2)": run_attention(4, hidden=32, heads=8, kv_heads=2),
       "MQA 4q/1kv, TP 4 (replicated x4)": run_attention(4, hidden=32, heads=4, kv_heads=1)}
for label, (res, rep) in gqa.items():
    tp, cfg = res[0]["tp"], tp_check.config_of(res[0]["config"])
    print(f"{label}: KV heads per rank {[d['kv_head_ids'] for d in res.ranks[:tp]]}; {rep.verdict()}")
    syncs = [r for r in tp_check.comm_rows(res, kind="parameter") if r["scope"].endswith("kv_copies")]
    print("      gradient sums over KV copies (rank 0):",
          [(r["collective"], r["pass"], r["calls"], f"{r['message_bytes']} B") for r in syncs] or "none")
    model = tp_viz.kv_copy_grad_sync(cfg.hidden, cfg.heads, cfg.kv_heads, tp, bytes_per_element=4, bias=True)
    print("      the table's model (tp_viz.kv_copy_grad_sync):",
          f"{model['all_reduces']} all-reduces, {' + '.join(map(str, model['message_bytes']))} B (K and V weight "
          "rows, then their biases)" if model["all_reduces"] else "none")

# %% [markdown]
# The replicated copies hold the same gradient on every rank that shares them, bit for bit:

# %%
res4, _ = gqa["GQA 8q/2kv, TP 4 (replicated x2)"]
kv_grads = [d["grads"]["qkv.weight"]["value"][2 * 4:] for d in res4.ranks]  # after this rank's 2 query heads (d=4)
print("ranks 0 and 1 (KV head 0) identical:", torch.equal(kv_grads[0], kv_grads[1]),
      "| ranks 2 and 3 (KV head 1) identical:", torch.equal(kv_grads[2], kv_grads[3]))
res_nosync, rep_nosync = run_attention(4, hidden=32, heads=8, kv_heads=2, fault="skip_parameter_grad_sync")
print("without the sum over copies:", rep_nosync.verdict())

# %% tags=["nbval-ignore-output"]
reports = {"MHA TP 4": mha[4][1], **{k.split(",")[1].strip() + " " + k.split(",")[0][:3]: v[1]
                                     for k, v in gqa.items()}}
plots.savefig(tp_figures.equivalence_figure(reports, "attention by head vs dense attention (MHA, GQA split, GQA replicated)"),
              "05_gqa_equivalence");

# %% [markdown]
# One bar per tensor (outputs, input gradient, every weight and bias gradient), for each layout: the
# largest error against the dense float64 reference, below the float32 tolerance line. Splitting the
# KV heads and replicating them give the same function; only the bookkeeping of the gradients differs.

# %% [markdown]
# ## 3. The fused-QKV trap
#
# The fused weight stacks all query heads, then all key heads, then all value heads. Rank r needs *its
# heads from each of the three parts*. `w.chunk(t)[r]` hands it a contiguous block instead: at TP 2 with
# 4 heads, rank 0 gets all four query heads and key heads 0 and 1, and no value head. The shapes still fit
# (each rank still gets $(n_{heads} + 2n_{kv})d/t$ rows), so nothing crashes: the local code takes query
# heads 0 and 1 as its queries, query heads 2 and 3 as its keys, and key heads 0 and 1 as its values.

# %% tags=["nbval-ignore-output"]
plots.savefig(tp_figures.qkv_split_figure(heads=4, kv_heads=4, head_dim=2, tp=2), "05_qkv_split");

# %% [markdown]
# **Predict**: does the naive split give a slightly wrong output, or a completely different function?

# %%
res_naive, rep_naive = run_attention(2, hidden=32, heads=4, split="naive")
print("naive chunking:", rep_naive.verdict())
print(f"largest output error: {'above 0.1' if rep_naive.errors['output'] > 0.1 else 'small'}")

# %% tags=["nbval-ignore-output"]
print(rep_naive)

# %% [markdown]
# A completely different function. Megatron-LM avoids the trap by storing the fused weight
# **interleaved by query group**, `[q_g; k_g; v_g]` for each KV group g, a layout in which a contiguous
# chunk *is* a whole set of heads. Checkpoint converters between layouts are where this bug lives in
# practice: always compare against the dense model after converting.
#
# ## 4. Explore: heads and world size
#
# Choose the number of heads, KV heads and the world size; the widget reruns the equivalence on real
# ranks. A combination that cannot be split (6 heads on 4 ranks; 6 KV heads on 4 ranks) is refused
# before launching, with one sentence.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider

HEAD_DIM = 6  # the head size stays fixed and hidden follows the heads (8 heads: hidden 48), so any count is a model


def draw_heads(res, params):
    cfg = tp_check.config_of(res[0]["config"])
    rep = tp_check.compare(res, "attention", cfg, seq=SEQ, batch=BATCH)
    kv = [d["kv_head_ids"] for d in res.ranks[:params["tp"]]]
    return tp_figures.equivalence_figure({f"TP {params['tp']}": rep},
                                         f"{cfg.heads} heads of {cfg.head_dim}, {cfg.kv_heads} KV heads, "
                                         f"KV per rank {kv}: "
                                         f"{'equal' if rep.ok else 'DIFFERENT'}")


heads_live = LiveRun(ATTENTION, {"tp": slider("TP", 4, 1, 4), "heads": slider("heads", 8, 1, 16),
                                 "kv_heads": slider("KV heads", 2, 1, 16),
                                 "split": W.Dropdown(options=["right", "naive"], value="right", description="split")},
                     draw_heads, params={"world_size": WORLD, "seq": SEQ, "batch": BATCH},
                     derive=lambda s: {"hidden": HEAD_DIM * s["heads"]}, timeout=60)
heads_live.wait(60)
heads_live

# %% [markdown]
# And the pure sharding view from chapter 04 (no ranks), where you can push TP to 16:

# %% tags=["nbval-ignore-output"]
tp_viz.sharding_widget(hidden=64, ffn=256, heads=8, kv_heads=2, tp=4)

# %% [markdown]
# ## 5. Exercises
#
# **Exercise 1: split a fused QKV weight by heads.** `w` is the fused `[Q; K; V]` weight
# `[(heads + 2 kv_heads) * head_dim, h]` (or its bias, 1-D: index the first dimension). Return the
# rows rank `rank` of `tp` holds, laid out `[its Q heads; its K heads; its V heads]`. The check
# runs attention with your shard on real ranks, for MHA, GQA with the KV heads split, and GQA with them
# replicated.

# %% tags=["exercise"]
def split_fused_qkv(w, heads, kv_heads, head_dim, rank, tp):
    raise NotImplementedError

# %% tags=["check"]
cu.check("split_fused_qkv", split_fused_qkv)

# %% [markdown]
# **Exercise 2: KV heads per rank.** Return the list of KV heads rank `rank` of `tp` must hold,
# in increasing order, whether they are split or replicated.

# %% tags=["exercise"]
def kv_heads_for_rank(heads, kv_heads, tp, rank):
    raise NotImplementedError

# %% tags=["check"]
cu.check("kv_heads_for_rank", kv_heads_for_rank)

# %% [markdown]
# ## Summary
#
# * Attention splits by **whole heads**: QKV column-parallel by heads, local attention, output projection
#   row-parallel. One all-reduce forward, one backward, like the MLP.
# * GQA: KV heads are split when t divides $n_{kv}$, replicated when $n_{kv}$ divides t; replicated KV
#   weights need their gradients summed over the copies (one more small all-reduce in backward).
#   Anything else cannot be split, and is refused in a sentence.
# * A fused `[Q; K; V]` weight must be split head by head. `chunk` gives a model that runs and is wrong;
#   only a comparison with the dense module catches it.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
