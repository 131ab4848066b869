# %% [markdown]
# # 14 · Context parallelism: ring attention
#
# Every parallelism so far splits the *model* (tensor, pipeline) or the *batch* (data). None of them helps
# when one sequence is too long: a transformer layer's activations grow with the sequence length $s$, so at
# 128k tokens one sequence's activations no longer fit on a GPU, whatever the model split. FlashAttention
# (chapter 07) already removed the $s \times s$ score matrix; what remains is linear in $s$, and still too much.
#
# **Context parallelism (CP)** splits the sequence. Each of cp ranks holds $s/\mathrm{cp}$ tokens: their
# queries, keys, values and every activation. Everything in a transformer layer except attention works token
# by token, so it needs nothing from the other ranks. Attention does: each query must see the keys of the
# whole sequence (or, causal, all earlier ones).
#
# **Ring attention** (Liu, Zaharia and Abbeel 2023, [arXiv:2310.01889](https://arxiv.org/abs/2310.01889);
# Megatron-Core's context parallelism) keeps each rank's queries at home and passes the K/V chunks around a
# ring: at each of cp steps every rank computes attention of its queries against the chunk it holds, sends
# that chunk to rank + 1 and receives the next from rank - 1. Each step's result is normalised on its own;
# chapter 07's **online-softmax merge** combines them exactly, using one log-sum-exp per row. After cp steps
# every query has met every key chunk: full attention, with no rank ever holding more than two K/V chunks.
#
# Two complications make up the rest of the chapter. With a **causal** mask, the last rank's queries see the
# whole sequence and the first rank's only their own chunk, so a plain split leaves the ranks idle in turn;
# the **zigzag** split fixes that. And the ring **sends** the whole sequence's K/V through every rank at every
# layer; it pays off because the transfer of one chunk overlaps the compute on another.
#
# The ring is one of two ways to split attention's sequence. The other, **DeepSpeed-Ulysses**, moves the
# *heads* instead of the keys: two all-to-alls turn sequence shards into head shards and back (section 6).
#
# Built here: `workers/context_parallel/` (the split, the block rule, the ring's `isend`/`irecv` links, the
# forward and a hand-written ring backward, Ulysses' all-to-alls), the workers `workers/ch14_ring_attention.py`
# and `workers/ch14_ulysses.py`, and checks against the float64 single-process attention of
# `workers/attention/reference.py`.

# %%
import torch

import course_utils as cu
from course_utils import ch14 as cpx
from course_utils import ch14_ulysses as uly
from course_utils import plots
from workers.attention import attention_reference, online_softmax_merge
from workers.attention.reference import RELATIVE_TOLERANCE, relative_error
from workers.context_parallel.blocks import work_per_rank
from workers.context_parallel.inputs import make_inputs
from workers.context_parallel.simulate import MISTAKES, one_process_ring
from workers.context_parallel.split import chunk_ids, chunk_ranges

plots.style()
WORKER, WORLD = "workers.ch14_ring_attention", 4
LIMITS = {"timeout": 60}  # per run; 4 warm ranks serve every run (cp = 1 and 2 run as 4 and 2 copies inside them)
SEQ = 32


def run(**params):
    return cu.run(WORKER, world_size=WORLD, seq=SEQ, **LIMITS, **params)


# %% [markdown]
# ## 1. What each rank holds
#
# **Contiguous**: cut the sequence into cp chunks, rank r holds chunk r. **Zigzag**: cut it into 2cp chunks,
# rank r holds chunk r *and* chunk 2cp-1-r, an early chunk and its mirror from the end. This is the split of
# Megatron-LM (`get_batch_on_this_cp_rank`: "Assuming CP=2, we then get 4 chunks, chunk_0 and chunk_3 are
# assigned to GPU0, chunk_1 and chunk_2 are assigned to GPU1"). `cp` and `split` are fields of the course's one
# layout (`workers/layout/rules.py`, the one chapter 15 composes), whose rules refuse a `seq` they do not cut into
# equal chunks before any rank starts. The token ranges at cp = 4:

# %%
CP = 4
for split in ("contiguous", "zigzag"):
    print(f"{split}, seq = {SEQ}, cp = {CP}:")
    for rank in range(CP):
        print(f"  rank {rank}: chunks {chunk_ids(CP, rank, split)}, tokens {chunk_ranges(SEQ, CP, rank, split)}")

# %% [markdown]
# ## 2. Why a merge of pieces is full attention
#
# A query's attention over keys split into parts a and b: each part gives its own normalised output
# $o_x = \sum_{j \in x} e^{s_j - \ell_x} v_j$ and log-sum-exp $\ell_x = \log \sum_{j\in x} e^{s_j}$. Over the
# union, $\ell = \log(e^{\ell_a} + e^{\ell_b})$ and $o = e^{\ell_a - \ell} o_a + e^{\ell_b - \ell} o_b$: each
# part reweighted by its share of the softmax mass (`online_softmax_merge`, chapter 07). The merge is
# associative and commutative, so the order in which the ring delivers the chunks does not matter.
# **Predict** the error of merging four key chunks, one at a time, against attention over all of them:

# %% tags=["nbval-ignore-output"]
q, k, v, _ = make_inputs(1, 2, SEQ, 16, seed=1)
out, lse = torch.zeros(q.shape, dtype=torch.float64), torch.full(q.shape[:-1], float("-inf"), dtype=torch.float64)
for part in torch.arange(SEQ).chunk(4):
    o_part, l_part = attention_reference(q, k[:, :, part], v[:, :, part])  # [b, h, s, d], [b, h, s]
    out, lse = online_softmax_merge(out, lse, o_part, l_part)
full, full_lse = attention_reference(q, k, v)
print(f"merge of 4 key chunks vs full attention: relative error {relative_error(out, full):.1e}, "
      f"lse error {(lse - full_lse).abs().max().item():.1e}")
naive = sum(attention_reference(q, k[:, :, p], v[:, :, p])[0] for p in torch.arange(SEQ).chunk(4)) / 4
print(f"averaging the 4 outputs instead (no rescale): relative error {relative_error(naive, full):.2f}")

# %% [markdown]
# The digits of a float64 rounding error (the first line) depend on the CPU's exp and matmul kernels; what
# holds on every machine is the order of magnitude:

# %%
print("the merge equals full attention to float64 rounding (relative error and lse error below 1e-13):",
      relative_error(out, full) < 1e-13 and (lse - full_lse).abs().max().item() < 1e-13)
print("averaging without the rescale is wrong by more than 10%:", relative_error(naive, full) > 0.1)

# %% [markdown]
# ## 3. The ring on real ranks
#
# At step t rank r holds the K/V chunk of rank r - t. It posts the `isend` of that chunk to rank + 1 and the
# `irecv` of the next from rank - 1 *before* computing on it (`workers/context_parallel/ring.py`), merges
# the block into its running (out, lse), then waits for the transfer. Backward is written by hand
# (`attention.py`): each block's gradients come from FlashAttention-2's backward with the *final* out and lse,
# dQ stays home, and each chunk's dK/dV accumulator travels the ring with its K/V, collecting every rank's
# contribution, then takes one last hop home.
#
# **Predict**: which of the 12 settings below (cp, split, causal) is furthest from one-process attention?
# The ranks run in float64, like the reference, so the bound is the float64 one:

# %%
TOL = RELATIVE_TOLERANCE[torch.float64]
print(f"tolerance (relative, float64): {TOL:g}")
ring_checks = {}
for cp in (1, 2, 4):
    for split in ("contiguous", "zigzag"):
        for causal in (True, False):
            c = ring_checks[cp, split, causal] = cpx.compare_to_reference(run(cp=cp, split=split, causal=causal))
            print(f"cp = {cp}, {split:>10}, causal = {causal!s:>5}: out, lse, dq, dk, dv equal to one process within "
                  f"tolerance: {c['within_tol']} (max error below 1e-13: {c['max_error'] < 1e-13})")

# %% [markdown]
# The errors themselves (their last bits of float64 depend on this CPU's kernels: another machine prints other
# digits, all as small):

# %% tags=["nbval-ignore-output"]
for (cp, split, causal), c in ring_checks.items():
    worst = max(c["errors"], key=c["errors"].get)
    print(f"cp = {cp}, {split:>10}, causal = {causal!s:>5}: max relative error {c['max_error']:.1e} (in {worst})")
furthest = max(ring_checks, key=lambda key: ring_checks[key]["max_error"])
print("furthest from one process:", furthest)

# %% [markdown]
# All equal, to float64 rounding: every block is computed once, by the rank that owns its queries, and
# merged with the exact rescale. What would the classic mistakes cost? The same ring in one process
# (`workers/context_parallel/simulate.py`, the ranks' block rule and merge without the messages), causal,
# cp = 4, with each mistake injected (`MISTAKES`; `tests/test_ch14_split.py` checks each is caught):

# %%
q4, k4, v4, _ = make_inputs(1, 2, SEQ, 16, seed=3)
truth, _ = attention_reference(q4, k4, v4, causal=True)
for split in ("contiguous", "zigzag"):
    right, _ = one_process_ring(q4, k4, v4, CP, split)
    print(f"{split}: the right ring, relative error below 1e-13: {relative_error(right, truth) < 1e-13}")
    for name, mistake in MISTAKES.items():
        wrong, _ = one_process_ring(q4, k4, v4, CP, split, **mistake)
        print(f"  {name:>32}: relative error {relative_error(wrong, truth):.2f}")

# %% [markdown]
# Every mistake is off by order one, thirteen orders of magnitude above the right ring's error: a test
# with a float64 tolerance cannot miss them. (A wrong-way ring is harmless *without* a mask: every rank
# still meets every K/V chunk once, and a sum does not care about order. The mask is what makes the
# ring's direction matter.)
#
# ## 4. Causal attention: which blocks, on which rank
#
# Cut queries and keys at the same chunk boundaries. A block (query chunk i, key chunk j) is **full** when
# i > j (every key earlier than every query), **diagonal** when i = j (the causal mask inside it), and
# **skipped** when i < j (every key in the future: no work, nothing to merge). **Predict** how many blocks
# each rank computes at cp = 4 under each split. The ranks count what their loops did:

# %%
causal_runs = {split: run(cp=CP, split=split, causal=True, backward=False) for split in ("contiguous", "zigzag")}
for split, res in causal_runs.items():
    for row in cpx.work_table(res):
        print(f"{split:>10} rank {row['rank']}: chunks {row['chunks']}, blocks computed {row['blocks']} "
              f"({row['diagonal']} diagonal), score entries {row['score_entries']}")

# %% [markdown]
# Each computed block in the grid is coloured by its rank and labelled with the ring step (hatched: the
# diagonal, masked inside); blank blocks were skipped.

# %% tags=["nbval-ignore-output"]
for split, res in causal_runs.items():
    plots.savefig(cpx.block_grid_figure(res), f"14_blocks_{split}")

# %% [markdown]
# Contiguous: rank r computes r full blocks and its diagonal, so the last rank works cp times as long as
# the first, and a step of the ring lasts as long as its slowest rank. Zigzag: the early chunk r sees r + 1
# chunks and its mirror 2cp-1-r sees 2cp - r, the same sum on every rank.

# %%
for split in ("contiguous", "zigzag"):
    entries = [w["score_entries"] for w in work_per_rank(SEQ, CP, split, True)]
    print(f"{split:>10}: score entries per rank {entries}, slowest / fastest rank = {max(entries) / min(entries):g}")

# %% tags=["nbval-ignore-output"]
plots.savefig(cpx.work_bars_figure(causal_runs), "14_work_per_rank");

# %% [markdown]
# ## 5. What crosses the wire, and why it is hidden
#
# **Predict** the bytes each rank sends in forward at cp = 1, 2, 4 (K and V of seq/cp tokens, float64 here):

# %%
for cp in (1, 2, 4):
    d = run(cp=cp)[0]
    chunks_fwd = d["sent_bytes"]["forward"] / d["kv_chunk_bytes"]
    chunks_bwd = d["sent_bytes"]["backward"] / d["kv_chunk_bytes"]
    print(f"cp = {cp}: one K (or V) chunk = {d['kv_chunk_bytes']} bytes; sent per rank: forward {chunks_fwd:g} chunks "
          f"(2*(cp-1) = {2 * (cp - 1)}), backward {chunks_bwd:g} chunks (K/V again, plus dK/dV at every step)")

# %% [markdown]
# The activations a rank keeps shrink as seq/cp; what it sends per layer does not shrink (the whole
# sequence's K/V, less its own chunk). It is hidden because a ring step *computes* on a chunk while the next
# one travels, and the compute of a step grows with the square of the chunk, the transfer only linearly.
# A small model for one attention layer of Llama 3 405B at its long-context length (Llama Team 2024,
# *The Llama 3 Herd of Models*, Table 3: 128 query heads and 8 KV heads of 128; Table 4: 131,072 tokens
# at cp = 16), bf16, no causal skipping:

# %%
from course_utils.planner import GPUS, MODEL_SHAPES, NETWORK_TIERS

L405 = MODEL_SHAPES["llama-3.1-405b"]
LONG_SEQ, HEAD_DIM = 131072, L405.hidden // L405.heads
print(f"{L405.name}: {L405.heads} query heads, {L405.kv_heads} KV heads of {HEAD_DIM}; seq = {LONG_SEQ}, bf16, "
      "per rank and layer:")
for cp in (1, 2, 4, 8, 16, 32):
    m = cpx.memory_vs_communication(LONG_SEQ, cp, L405.heads, L405.kv_heads, HEAD_DIM)
    ratio = "nothing sent" if m["flops_per_byte"] is None else f"FLOPs per byte received {m['flops_per_byte']:>7.0f}"
    print(f"  cp = {cp:>2}: {m['tokens_per_rank']:>6} tokens, K/V held {m['kv_held_bytes'] / 2**20:>4.0f} MiB, "
          f"sent {m['kv_sent_bytes'] / 2**20:>4.0f} MiB ({m['kv_chunks_sent']:>2} chunks), {ratio}")

# %% [markdown]
# A step does $4 (s/\mathrm{cp})^2 H d$ FLOPs (every *query* head) on $2 (s/\mathrm{cp}) H_{kv} d$ elements
# it receives (only the *KV* heads travel), so its FLOPs per byte fall as $s/\mathrm{cp}$. The ring hides the
# transfer while a step's compute outlasts it: $s/\mathrm{cp} \ge F\,H_{kv}\,b / (2 H B)$ for peak FLOP/s
# $F$ and link bandwidth $B$ (`min_tokens_to_hide`), with H100 numbers (989.5 TFLOP/s dense bf16, datasheet;
# NVLink 450 GB/s each way, datasheet; 400 Gb/s per GPU across nodes, as Llama 3's RoCE fabric, sec 3.3.1;
# all from `course_utils/planner.py`; published, not measured here). At *peak* FLOP/s, the hardest case: a real kernel is slower, which helps; causal skipping halves a
# step's average work, which doubles the length needed:

# %%
H100 = GPUS["h100"]
for tier in ("nvlink4", "roce400"):
    link, shape = NETWORK_TIERS[tier], (L405.heads, L405.kv_heads, HEAD_DIM)
    t_min = cpx.min_tokens_to_hide(*shape, H100.peak_flops, link.bandwidth)
    t_causal = cpx.min_tokens_to_hide(*shape, H100.peak_flops, link.bandwidth, causal=True)
    cp_max = cpx.largest_hidden_cp(LONG_SEQ, *shape, H100.peak_flops, link.bandwidth, causal=True)
    print(f"{link.name}: a chunk of at least {t_min:.0f} tokens ({t_causal:.0f} causal) hides the transfer; "
          f"at seq {LONG_SEQ}, causal, up to cp = {cp_max}")

# %% [markdown]
# Llama 3 405B trained at cp = 16 across nodes (TP = 8 fills each node's NVLink domain; groups are ordered
# TP, CP, PP, DP from the inside, Figure 5): 8192 tokens per rank, well above the ~2500 needed. Note that
# Llama 3 did *not* use a ring (sec 3.3.2): with 8 KV heads against 128 query heads, K/V are small, so it
# all-gathers them once and computes each rank's queries against the whole sequence, which also
# balances causal work with the zigzag-like split this chapter uses. The ring's advantage is memory
# (one chunk of K/V in flight instead of all of it) and overlap; the all-gather's is simplicity.
#
# ## 6. The other way: DeepSpeed-Ulysses
#
# The ring keeps every head on every rank and moves the keys. **DeepSpeed-Ulysses** (Jacobs et al. 2023,
# [arXiv:2309.14509](https://arxiv.org/abs/2309.14509)) moves the heads instead. Each rank still starts with
# seq/cp positions of every head. One **all-to-all** of q, k and v gives each rank *every* position of heads/cp
# heads (it scatters the heads and gathers the sequence); attention then runs locally, with no merge, because a
# head's attention needs no other head; a second all-to-all sends the output back to seq/cp positions of every
# head. The two all-to-alls are a conjugate pair, like Megatron's `all_to_all_sp2hp` and `all_to_all_hp2sp`: the
# backward of each is the other, so autograd runs the reverse all-to-all on the gradients
# (`workers/context_parallel/ulysses.py`). The worker `workers/ch14_ulysses.py` runs it on the same 4 ranks
# (smaller cp as copies side by side), float64 like the reference, and reports every rank's rows of out, dq, dk
# and dv.
#
# **Predict**: is Ulysses at cp = 4 closer to full attention than the ring was?

# %%
ULY_LIMITS = {"timeout": 60}


def run_ulysses(**params):
    return cu.run(uly.WORKER, world_size=WORLD, **ULY_LIMITS, **{"seq": SEQ, "heads": 8, **params})


for cp in (2, 4):
    print(uly.verdict(run_ulysses(cp=cp)))
print(uly.verdict(run_ulysses(cp=4, causal=False)))

# %% [markdown]
# The errors themselves (they can differ by machine in their last float64 digits; here each head's attention is
# the reference's own arithmetic on whole heads, so they are often exactly 0):

# %% tags=["nbval-ignore-output"]
for cp in (2, 4):
    c = uly.check(run_ulysses(cp=cp))
    print(f"cp = {cp}: " + ", ".join(f"{name} {err:.1e}" for name, err in c["errors"].items()))

# %% [markdown]
# Where each (position, head) of q, k, v and out lives before and after each all-to-all, drawn from a run with 8
# query heads and 2 KV heads at cp = 4 (the ranks' own rows and the shapes of their tensors):

# %%
gqa_run = run_ulysses(cp=4, kv_heads=2)
print(uly.verdict(gqa_run))

# %% tags=["nbval-ignore-output"]
plots.savefig(uly.all_to_all_figure(gqa_run), "14_ulysses_all_to_all")

# %% [markdown]
# Two limits show in it. **Each rank holds whole heads**, so cp must divide the heads: the worker refuses any
# other layout before a rank starts, naming what works. **KV heads** cannot be cut either: with 2 KV heads at
# cp = 4, each is copied onto the 2 ranks whose query heads read it (`repeat_interleave`; autograd sums the
# copies' gradients back into the one head), and the copies travel.

# %%
try:
    run_ulysses(cp=4, heads=6)
except cu.InvalidParameter as refusal:
    print("refused:", refusal)

# %%
for kv_heads in (8, 4, 2, 1):
    extra = uly.kv_copy_bytes(SEQ, 8, kv_heads, 4)
    print(f"kv_heads {kv_heads}: K and V travel as {extra['kv_sent']} heads; forward bytes per rank "
          f"{extra['forward']}, of which {extra['extra']} are copies")

# %% [markdown]
# With 2 KV heads or with 1, K and V cost what 4 would: a model with fewer KV heads than the degree pays for the
# copies (grouped-query attention saves nothing in Ulysses' traffic below cp KV heads).
#
# Ulysses and the ring compose: **USP** (Fang and Zhao 2024, [arXiv:2405.07719](https://arxiv.org/abs/2405.07719))
# makes cp = ulysses x ring, all-to-alls inside groups of consecutive ranks (the closest links) and a ring across
# the groups, which lifts Ulysses' bound of cp at most the heads. At cp = 4 = 2 x 2, zigzag, on the same 4 ranks:

# %%
print(uly.verdict(run_ulysses(cp=4, ring=2, split="zigzag")))
print(uly.verdict(run_ulysses(cp=4, ring=2, split="zigzag", kv_heads=2)))

# %% [markdown]
# ### What crosses the wire: Ulysses against the ring
#
# Per attention layer each rank sends, in elements, with one head's rows on one rank $H = b\,(s/\mathrm{cp})\,d$
# (`workers/context_parallel/ulysses.py`):
#
# * **Ulysses**: $\frac{\mathrm{cp}-1}{\mathrm{cp}}(2 h + 2 h_{kv}') H$ in forward (q, k, v, out; each
#   all-to-all keeps 1/cp at home), and the same in backward (their gradients, the other way), with
#   $h_{kv}' = \max(h_{kv}, \mathrm{cp})$ the KV heads that travel;
# * **the ring**: $2(\mathrm{cp}-1)\,h_{kv} H$ in forward (K and V passed on cp - 1 times), and
#   $(2(\mathrm{cp}-1) + 2\mathrm{cp})\,h_{kv} H$ in backward (K and V again, and the dK/dV accumulators).
#
# **Predict** which sends fewer bytes at cp = 4 with 8 heads, and whether the sequence length changes the answer.
# Every rank counts what it sends; each run below is compared with the formula (the ring measured where the
# ring worker runs it, with as many KV heads as heads):

# %%
points = [uly.bytes_point(setting, run_ulysses(**uly.run_params(setting))) for setting in uly.measured_settings()]
print(f"{len(points)} runs; every rank sent exactly the formula's bytes: {all(p['equal'] for p in points)}")

# %% tags=["nbval-ignore-output"]
plots.savefig(uly.bytes_figure(points), "14_ulysses_vs_ring_bytes")

# %% [markdown]
# Ulysses' backward moves the same tensors' gradients, so its two lines coincide. The sequence length scales
# both methods alike (left): it never decides. The degree does (right): the ring's bytes per rank grow towards
# the whole sequence's K and V, Ulysses' fall as 1/cp (the paper's point: grow seq and cp together and its bytes
# per link stay constant). The KV heads decide too (middle): the ring carries only K and V, Ulysses carries q
# and out as well. The crossover, from the formulas:

# %%
rows = uly.crossover_rows(heads=8, cp=4, seq=SEQ, head_dim=16, kv_options=(1, 2, 4, 8))
for r in rows:
    print(f"kv_heads {r['kv_heads']}: Ulysses {r['ulysses']['forward']:>6} + {r['ulysses']['backward']:>6} bytes, "
          f"ring {r['ring']['forward']:>6} + {r['ring']['backward']:>6} (forward + backward); fewer in forward: "
          f"{r['fewer_forward']}, over the step: {r['fewer_step']}")
print(uly.crossover_sentence(rows, heads=8, cp=4))

# %% [markdown]
# And for Llama 3 405B's attention (128 query heads, 8 KV heads of 128, section 5) at 131,072 tokens, bf16:

# %%
for cp in (8, 16):
    rows = uly.crossover_rows(L405.heads, cp, LONG_SEQ, HEAD_DIM, kv_options=(L405.kv_heads,), element_size=2)
    r = rows[0]
    print(f"cp = {cp:>2}: Ulysses sends {r['ulysses']['forward'] / 2**20:>4.0f} MiB forward and "
          f"{r['ulysses']['backward'] / 2**20:>4.0f} MiB backward per rank and layer, the ring "
          f"{r['ring']['forward'] / 2**20:>4.0f} and {r['ring']['backward'] / 2**20:>4.0f} MiB "
          f"(fewer in forward: {r['fewer_forward']}, over the step: {r['fewer_step']})")

# %% [markdown]
# With many KV heads Ulysses sends less, and less the larger cp. With grouped-query attention and few KV heads the
# ring carries less, in forward at least: at 8 KV heads against 128 query heads it sends about half of Ulysses'
# forward bytes at cp = 8; at cp = 16 the ring's heavier backward (K and V again, and the dK/dV accumulators) tips
# the whole step to Ulysses, though its KV heads are now copied. And bytes are not time. The ring's transfers **overlap** its compute (a step computes on
# one chunk while the next travels, section 5); Ulysses **cannot**: attention needs the whole all-to-all's
# result before it starts, and the output's all-to-all waits for attention to finish, so every byte is on the
# critical path. What Ulysses buys is simplicity: any attention kernel runs unchanged on whole heads, with no
# merge and no causal balancing (every rank sees every position of its heads). Its price: cp at most the heads,
# and KV heads copied below cp. Hence USP's mix: Ulysses inside a node, where the all-to-all is fast, the ring
# across nodes, where overlap pays.
#
# ## 7. Exercises
#
# **Exercise 1: the zigzag split.** Return rank `rank`'s two token ranges `[(start, stop), (start, stop)]`:
# the sequence is cut into 2cp equal chunks, and the rank holds chunk `rank` and its mirror from the end.

# %% tags=["exercise"]
def zigzag_chunks(seq, cp, rank):
    raise NotImplementedError

# %% tags=["check"]
cu.check("zigzag_chunks", zigzag_chunks)

# %% [markdown]
# **Exercise 2: the causal block rule.** Queries and keys are cut at the same chunk boundaries. Return
# `"full"`, `"diagonal"` or `"skip"` for the block of query chunk `q_chunk` against key chunk `k_chunk` under
# a causal mask. The check also runs ring attention in one process with your rule and reports its error.

# %% tags=["exercise"]
def block_kind(q_chunk, k_chunk):
    raise NotImplementedError

# %% tags=["check"]
cu.check("block_kind", block_kind)

# %% [markdown]
# **Exercise 3: Ulysses' first all-to-all.** One rank holds `x`, its rows of every head, `[seq/cp, heads, d]`;
# the ranks' rows, in rank order, make the whole sequence. Return this rank's `[seq, heads/cp, d]`: every
# position of its heads (rank j's heads are j·heads/cp to (j+1)·heads/cp - 1), rank i's rows i-th. You may call
# `all_to_all(pieces)` once: `pieces` is a list of cp tensors, piece j goes to rank j, and it returns the list of
# cp tensors this rank received, rank i's piece i-th. If cp does not divide the heads, raise `ValueError` before
# sending anything. The check runs your function on cp simulated ranks (threads that share one all-to-all), at
# several shapes and dtypes.

# %% tags=["exercise"]
def seq_to_heads(x, cp, all_to_all):
    raise NotImplementedError

# %% tags=["check"]
cu.check("seq_to_heads", seq_to_heads)

# %% [markdown]
# ## 8. Explore on real ranks
#
# Ring size, split and mask: each change reruns forward and backward on the warm ranks and redraws the
# block grid from what they computed (smaller rings run as copies on the 4 ranks).

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun


def draw_blocks(res, params):
    c = cpx.compare_to_reference(res)
    return cpx.block_grid_figure(res, title=f"cp = {params['cp']}, {params['split']}, causal = {params['causal']}: "
                                            f"equal to one process: {c['within_tol']}")


blocks_live = LiveRun(WORKER, {"cp": W.Dropdown(options=[1, 2, 4], value=4, description="cp"),
                               "split": W.ToggleButtons(options=["zigzag", "contiguous"], value="zigzag"),
                               "causal": W.Checkbox(value=True, description="causal")},
                      draw_blocks, params={"world_size": WORLD, "seq": SEQ}, timeout=60)
blocks_live.wait(60)
blocks_live

# %% [markdown]
# Ulysses against the ring: the degree, the heads, the KV heads and the sequence. Each change reruns Ulysses'
# forward and backward on the warm ranks: the bars are what each rank sent (Ulysses) against the ring's formula
# at the same shape (which the ring's ranks send, section 5), and the title says whether the run equals full
# attention. A layout Ulysses cannot run is refused with the reason.

# %% tags=["nbval-ignore-output"]
ulysses_live = uly.ulysses_widget(WORLD)
ulysses_live.wait(60)
ulysses_live

# %% [markdown]
# ## Summary
#
# * Context parallelism splits the sequence: each rank holds seq/cp tokens' activations, and only attention
#   needs the other ranks.
# * Ring attention keeps the queries home and passes K/V chunks to rank + 1; the online-softmax merge makes
#   the pieces exactly full attention, forward and (with dK/dV travelling with their K/V) backward.
# * With a causal mask, future blocks are skipped and diagonal blocks masked: a contiguous split gives the
#   last rank cp times the first rank's work; the zigzag split (chunk r and 2cp-1-r) equalises it.
# * Each rank sends 2(cp-1) chunks (K and V, seq/cp tokens each) per layer in forward: (cp-1)/cp of the
#   whole sequence's K and V, nearly all of it whatever cp. It is hidden behind a step's compute while seq/cp stays
#   above $F H_{kv} b / (2 H B)$ tokens (about 2500 for Llama 3 405B across 400 Gb/s, causal).
# * DeepSpeed-Ulysses splits the same sequence by heads instead: one all-to-all turns seq/cp positions of every
#   head into every position of heads/cp heads, attention runs locally on whole heads, a second all-to-all turns
#   the output back; exactly full attention, forward and backward. cp must divide the heads, and KV heads fewer
#   than cp are copied (and their copies sent).
# * Ulysses sends $\frac{\mathrm{cp}-1}{\mathrm{cp}}(2h + 2h_{kv}')$ heads' rows per rank and phase, falling as
#   1/cp; the ring $2(\mathrm{cp}-1) h_{kv}$ in forward, growing with cp. With few KV heads the ring carries less;
#   and only the ring overlaps its traffic with compute. USP composes the two: cp = ulysses x ring.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
