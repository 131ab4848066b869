# %% [markdown]
# # 07 · Why FlashAttention is fast
#
# Attention is two matrix multiplications with a softmax in between:
# $O = \mathrm{softmax}(QK^\top/\sqrt d)\,V$. Written the obvious way, it materialises the $N \times N$
# score matrix $S$ and the probabilities $P$ in GPU memory (HBM), writes them, and reads them back. For a
# sequence of 16k tokens that is 268 million numbers *per head*, produced only to be consumed a moment
# later. The GPU can multiply far faster than it can move those numbers, so naive attention spends its time
# waiting for memory, and holds $O(N^2)$ of it.
#
# FlashAttention (Dao et al. 2022, [arXiv:2205.14135](https://arxiv.org/abs/2205.14135); FlashAttention-2,
# Dao 2023, [arXiv:2307.08691](https://arxiv.org/abs/2307.08691)) computes exactly the same function
# without ever writing $S$ or $P$ to HBM. Three ideas make that possible, and this chapter builds each one:
#
# 1. **The online softmax** (Milakov & Gimelshein 2018, [arXiv:1805.02867](https://arxiv.org/abs/1805.02867)):
#    a softmax can be computed one tile of keys at a time, keeping a running max and a running sum, and
#    *rescaling* what was accumulated whenever the max grows.
# 2. **Tiling**: a query tile stays on chip while key and value tiles stream past it; the output is written
#    once. HBM traffic drops from $\Theta(N^2)$ extra bytes to reading the inputs a few times.
# 3. **Recomputation in backward**: forward saves only the output and one log-sum-exp (LSE) per row, $O(N)$;
#    backward rebuilds each tile of $P$ exactly from the LSE instead of storing it.
#
# The course's implementations live in `workers/attention/`: a float64 reference (`reference.py`), the
# readable tiled PyTorch version (`tiled.py`), and Triton kernels (`triton_kernels.py`), all behind
# `flash_attention(q, k, v, causal, impl=...)`. Nothing here needs ranks: attention on one device is a
# single-process story. Distributed attention (context parallelism) reuses the merge you write below.

# %%
import os

import torch

if not torch.cuda.is_available():
    # No GPU: run the Triton kernels in Triton's interpreter, on CPU tensors. This must happen before
    # triton is imported (``@triton.jit`` decides at import time); on a GPU the kernels compile instead.
    os.environ["TRITON_INTERPRET"] = "1"

import inspect

import course_utils as cu
from course_utils import ch07, plots, reference_data
from workers.attention import (attention_reference, attention_reference_grads, flash_attention,
                               online_softmax_merge, online_softmax_update)
from workers.attention.reference import relative_error

plots.style()
# The CPU work here is many small tensor ops. On a shared 2-core machine a second OpenMP thread costs more in
# synchronisation than it gains (measured: 10x slower under load), so this notebook's CPU runs one thread.
torch.set_num_threads(1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REFERENCE = ch07.load_reference()  # the committed H200 run: data/reference/h200_attention_baseline.json
print("device for the kernels:", DEVICE, "| Triton interpreter:", os.environ.get("TRITON_INTERPRET") == "1")

# %% [markdown]
# ## 1. The online softmax, one tile at a time
#
# Take one query and its scores $s_1, \dots, s_N$ against $N$ keys. The softmax needs two reductions over
# the whole row, the max $m$ (for numerical safety: $e^{s}$ overflows fp32 once $s > 88.7$) and the sum
# $\ell = \sum_j e^{s_j - m}$, before it can weight a single value. That seems to force us to see the whole
# row first. It does not. Walk the keys in tiles and keep three running quantities:
#
# $$m \leftarrow \max(m, \max_{j \in \text{tile}} s_j), \qquad
#   \ell \leftarrow e^{m_\text{old} - m}\,\ell + \sum_{j \in \text{tile}} e^{s_j - m}, \qquad
#   \text{acc} \leftarrow e^{m_\text{old} - m}\,\text{acc} + \sum_{j \in \text{tile}} e^{s_j - m}\, v_j .$$
#
# Everything accumulated so far was measured in units of $e^{m_\text{old}}$; when a tile raises the max,
# the factor $\alpha = e^{m_\text{old} - m} \le 1$ converts it to the new unit. At the end,
# $O = \text{acc}/\ell$ and $\text{LSE} = m + \log \ell$. Here is the walk for 24 keys in tiles of 4,
# computed by the course's own `online_softmax_update` (the function `tiled.py` calls for every tile).
#
# **Predict** before you run: at which tiles will $\alpha$ be below 1? And after the last tile, will
# $\ell$ equal $\sum_j e^{s_j - \max_j s_j}$ exactly, or only approximately?

# %%
scores, values = ch07.demo_scores(n_keys=24, seed=0)
walk = ch07.online_softmax_trace(scores, values, block=4)
print(ch07.trace_table(walk))
exact = ch07.exact_softmax_stats(scores, values)
print(f"\nexact, all keys at once: max {exact['max']:.3f}, sum {exact['sum']:.3f}, output {exact['out']:.4f}")
print(f"walk ends equal to it (to 1e-12): max {abs(walk[-1]['m_new'] - exact['max']) < 1e-12}, "
      f"sum {abs(walk[-1]['l_new'] - exact['sum']) < 1e-12}, output {abs(walk[-1]['out'] - exact['out']) < 1e-12}")

# %% [markdown]
# $\alpha < 1$ exactly at the tiles that contain a new maximum (2, 4 and 5 here, counting from 0), and the
# result is exact, not an approximation: rescaling is multiplication by the right power of $e$. Notice
# also the last column: after each tile, acc / $\ell$ is the exact attention output *over the keys seen so
# far*. That is what makes partial results mergeable (section 3). The same walk as a figure:

# %% tags=["nbval-ignore-output"]
plots.savefig(ch07.tile_walk_figure(scores, values, block=4), "07_online_softmax")

# %% [markdown]
# Explore it: move through the tiles, change the block size (1 key per tile is the classic streaming
# softmax; 24 is the ordinary softmax in one go) and the scores. The left panel shows the keys seen and the
# running max; the middle one the running sum split into what was carried over (grey, rescaled by the red
# factor) and what the tile added; the right one the output so far. Pure drawing, no ranks.

# %% tags=["nbval-ignore-output"]
ch07.tile_walk_widget(n_keys=24, block=4, seed=0)

# %% [markdown]
# ## 2. Tiled attention equals naive attention
#
# Now whole matrices: a tile of queries against a tile of keys gives a tile of scores, and every row of it
# runs the walk above. `tiled.py` loops over query tiles (outer) and key tiles (inner), the
# FlashAttention-2 order: each output tile is finished in one pass and written once. Tiles need not divide
# the sequence, and with a causal mask the tiles above the diagonal are skipped entirely.
#
# **Predict**: the tiled result in fp32 against a float64 naive reference, with tiles of 64 x 64, 16 x 48
# and 100 x 7 on 100 tokens: equal to about 1e-7, or visibly different for the odd tile shapes?

# %%
gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(2, 3, 100, 32, generator=gen) for _ in range(4))  # [B, H, N, D], fp32
rows = []
for causal in (False, True):
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = attention_reference_grads(q, k, v, dout, causal)
    for block_q, block_k in ((64, 64), (16, 48), (100, 7)):
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, lse = flash_attention(qg, kg, vg, causal=causal, impl="torch", return_lse=True,
                                   block_q=block_q, block_k=block_k)
        out.backward(dout)
        errs = {name: relative_error(a, b) for name, a, b in
                (("out", out, ref_out), ("dq", qg.grad, ref_dq), ("dk", kg.grad, ref_dk), ("dv", vg.grad, ref_dv))}
        errs["lse"] = (lse.double() - ref_lse).abs().max().item()
        rows.append((causal, block_q, block_k, errs))
        print(f"causal={causal!s:5} tiles {block_q:3} x {block_k:2}: out, lse, dq, dk, dv all within 1e-5 of "
              f"float64 naive: {max(errs.values()) < 1e-5}")

# %% tags=["nbval-ignore-output"]
for causal, block_q, block_k, errs in rows:
    print(f"causal={causal!s:5} tiles {block_q:3} x {block_k:2}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
naive32 = ch07.naive_attention(q, k, v)
print("naive fp32 vs float64:", f"{relative_error(naive32, attention_reference(q, k, v)[0]):.1e}",
      "| tiled fp32 bit-identical to naive fp32:", torch.equal(flash_attention(q, k, v, impl="torch"), naive32))

# %% [markdown]
# Both fp32 versions sit a few times 1e-7 from the float64 truth: tiling loses nothing. They are not bit-identical
# to each other, because the sums run in a different order; that is rounding, and it is why every
# comparison in this course states a tolerance instead of asking for `torch.equal`.
#
# ### Exercise 1: the forward tile loop
#
# Write the FlashAttention forward for **one head**: `q` is `[Nq, D]`, `k` and `v` are `[Nk, D]` (fp32);
# return `(out [Nq, D], lse [Nq])` with scale $1/\sqrt{D}$. Keep all queries together and walk the keys in
# tiles of `block` rows, carrying `m`, `l` and `acc` as above; never build a `[Nq, Nk]` tensor (the check
# watches the size of every tensor your code creates). With `causal=True`, query $i$ sees key $j$ iff
# $j \le i$: mind the positions inside a tile. The check climbs a ladder (one tile, several tiles, causal,
# scores large enough to overflow `exp`, scores so negative that `exp` underflows), and the first rung that
# fails names the missing idea.

# %% tags=["exercise"]
def forward_tile_loop(q, k, v, causal=False, block=16):
    import math

    import torch

    raise NotImplementedError

# %% tags=["check"]
cu.check("forward_tile_loop", forward_tile_loop)

# %% [markdown]
# ## 3. Merging partial results
#
# The output after a tile is exact attention over the keys seen so far, and the LSE says how much softmax
# mass those keys carry. So two attentions over **disjoint** key sets, each normalised on its own, combine
# into attention over the union: $\text{LSE} = \log(e^{\text{LSE}_a} + e^{\text{LSE}_b})$, and each part is
# weighted by its share $e^{\text{LSE}_x - \text{LSE}}$. This is the step that lets a ring of GPUs each hold
# a slice of the keys (context parallelism, "ring attention"), or a kernel split one long row across several
# programs ("split-K" decoding).
#
# **Predict**: split 100 keys into 37 and 63, attend to each part separately, merge. Equal to attention over
# all 100, to rounding?

# %%
out_a, lse_a = flash_attention(q, k[:, :, :37], v[:, :, :37], impl="torch", return_lse=True)
out_b, lse_b = flash_attention(q, k[:, :, 37:], v[:, :, 37:], impl="torch", return_lse=True)
merged, merged_lse = online_softmax_merge(out_a, lse_a, out_b, lse_b)
full, full_lse = attention_reference(q, k, v)
print("merged == attention over all keys (1e-5):", relative_error(merged, full) < 1e-5,
      "| LSE (1e-5):", (merged_lse.double() - full_lse).abs().max().item() < 1e-5)
print("plain average of the two parts instead:", f"relative error {relative_error((out_a + out_b) / 2, full):.2f}")

# %% [markdown]
# ### Exercise 2: merge two partial attentions
#
# `out_a [N, D]`, `lse_a [N]` is attention over one set of keys, `out_b`, `lse_b` over another (fp32).
# Return `(out, lse)` over their union, without changing the inputs. Three traps the check sets: a part that
# saw **no** keys (a causal row before its keys start) has `lse = -inf` and `out = 0`, and must not turn into
# `nan`; when both parts are empty the union is empty too (`out = 0`, `lse = -inf`); and LSEs around 200, or
# two LSEs 100 apart, where `exp` overflows fp32. (`workers/attention/api.py: online_softmax_merge` is the course's version;
# write your own.)

# %% tags=["exercise"]
def merge_attention(out_a, lse_a, out_b, lse_b):
    import torch

    raise NotImplementedError

# %% tags=["check"]
cu.check("merge_attention", merge_attention)

# %% [markdown]
# ## 4. Backward without the N x N matrix
#
# Backward needs $P$ again: $dV = P^\top dO$, $dP = dO\,V^\top$, $dS = P \circ (dP - \delta)$ with
# $\delta_i = \sum_j P_{ij}\, dP_{ij}$ (the softmax Jacobian), then $dQ = dS\,K \cdot$ scale and
# $dK = dS^\top Q \cdot$ scale. Storing $P$ would undo everything. Instead forward saved the LSE, and
# $P_{ij} = e^{s_{ij} - \text{LSE}_i}$ is rebuilt exactly, tile by tile, with no max and no sum needed. The
# one row-wide quantity, $\delta$, has a shortcut that needs no row of $P$ at all:
# $\delta_i = \sum_j P_{ij} (dO_i \cdot v_j) = dO_i \cdot \sum_j P_{ij} v_j = dO_i \cdot O_i$.
# Recomputing costs one extra matmul per tile; it is cheaper than reading $P$ back from HBM.
#
# **Predict**: is `rowsum(dO * O)` equal to `rowsum(P * dP)` computed the naive way?

# %%
scale = 1 / 32 ** 0.5
p_full = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1)  # [B, H, N, N]: naive only
dp_full = dout.double() @ v.double().transpose(-1, -2)
delta_naive = (p_full * dp_full).sum(-1)
delta_short = (dout.double() * full).sum(-1)  # O from the float64 reference
print("rowsum(dO * O) == rowsum(P * dP):", torch.allclose(delta_naive, delta_short, atol=1e-12))
print("P rebuilt from the LSE == softmax:", torch.allclose(torch.exp(q.double() @ k.double().transpose(-1, -2)
                                                                     * scale - full_lse[..., None]), p_full, atol=1e-12))

# %% [markdown]
# ### Exercise 3: one tile of the backward
#
# Given a query tile (`q`, `out`, `dout`: `[Bq, D]`, `lse`: `[Bq]`), a key tile (`k`, `v`: `[Bk, D]`) and
# the `scale`, return `(dv, ds)`: this tile's contribution to dV, `[Bk, D]`, and its $dS$, `[Bq, Bk]`.
# No mask (non-causal). The check runs your function over every tile pair of a 40-token head (ragged tiles
# both ways), assembles dq, dk and dv from your answers, and compares them with autograd through naive
# float64 attention.

# %% tags=["exercise"]
def backward_tile(q, k, v, out, dout, lse, scale):
    raise NotImplementedError

# %% tags=["check"]
cu.check("backward_tile", backward_tile)

# %% [markdown]
# ## 5. The IO argument, with numbers
#
# Count bytes through HBM for one forward at the size of the H200 measurements (bf16, batch 2, 16 heads,
# head dim 128). `course_utils/attention_io.py` holds the models:
#
# * **naive** (Dao et al. 2022, Algorithm 0): write $S$, read it, write $P$, read it: $4N^2$ score-sized
#   elements (fp32 here, as PyTorch's math backend upcasts) plus $4Nd$ for Q, K, V, O;
# * **tiled**, with no help from the cache: Q and O once, K and V re-read once per 128-row query tile,
#   $2Nd \cdot N/128$; that is FlashAttention's Theorem 2, $\Theta(N^2 d^2/M)$ for on-chip memory $M$;
# * **compulsory**: read Q, K, V once and write O once, the least any implementation can move.
#
# Then turn bytes into time with the H200's own measured numbers from the reference run (a device copy at
# 4.27 TB/s, an 8192³ bf16 matmul at 796 TFLOP/s), and put the measured forwards next to them.
#
# **Predict**: at N = 16k, how many GB does naive attention move, and is it memory-bound (FLOP per byte below
# the ridge 796 / 4.27 ≈ 187) or compute-bound?

# %%
io_rows = ch07.io_rows([512, 1024, 2048, 4096, 8192, 16384], REFERENCE)
ridge = REFERENCE["matmul_bf16_tflops"] / REFERENCE["copy_TBps"]
print(f"ridge point of the H200 run: {ridge:.0f} FLOP/byte")
print(f"{'N':>6} {'naive GB':>9} {'tiled GB':>9} {'min GB':>7} {'naive/tiled':>11} {'FLOP/B naive':>12} "
      f"{'FLOP/B tiled':>12} {'naive ms':>9} {'tiled ms':>9} {'compute ms':>10}")
for r in io_rows:
    print(f"{r['n']:>6} {r['naive_GB']:>9.2f} {r['tiled_GB']:>9.2f} {r['compulsory_GB']:>7.3f} "
          f"{r['naive_GB'] / r['tiled_GB']:>11.1f} {r['naive_flop_per_byte']:>12.0f} {r['tiled_flop_per_byte']:>12.0f} "
          f"{r['naive_ms']:>9.3f} {r['tiled_ms']:>9.3f} {r['compute_ms']:>10.3f}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch07.io_figure(io_rows, REFERENCE), "07_io_bytes")

# %% [markdown]
# Naive attention moves 138 GB at N = 16k and does 32 FLOP per byte whatever N is: deeply memory-bound,
# 32 ms of pure traffic against 5.5 ms of arithmetic. The measured math backend is slower still (it runs
# several kernels and copies). Tiling cuts the traffic 4x here (naive's $4N^2$ fp32 elements are $16N^2$
# bytes; tiled re-reads K and V, $2 \cdot 2Nd$ bytes, once per 128-row tile: $4N^2 d/128 = 4N^2$ bytes at
# d = 128) and lifts the intensity to 127 FLOP/byte.
#
# Now look at the measured cuDNN forward: 0.415 ms at 4k and 7.0 ms at 16k, *below* the tiled line
# (0.52 and 8.1 ms). It could not be if every K/V re-read came from HBM. Programs that run at the same time
# stream the same K and V tiles, and K and V of one head at 16k are only 8 MB: the re-reads mostly hit the
# 50 MB L2 cache (the Hopper figure in NVIDIA's H100 architecture whitepaper), so real HBM traffic sits
# between the tiled and the compulsory lines (larger query tiles would also help). What is left is
# arithmetic: cuDNN runs at about 80% of the matmul rate. The IO argument is the first half of the story;
# the second half is keeping the tensor cores busy, which is what separates the fused kernels below.
#
# ## 6. The kernel
#
# The Triton forward is the same loop as `tiled.py`, one program per (query tile, batch x head). Here is the
# PyTorch update every tile goes through, and then its Triton twin:

# %% tags=["nbval-ignore-output"]
print(inspect.getsource(online_softmax_update))

# %% tags=["nbval-ignore-output"]
print(ch07.function_source("_attn_fwd_inner"))

# %% [markdown]
# What changed on the way to the GPU, and why:
#
# * **base 2**: `qk_scale` has $\log_2 e$ folded in, so every exponential is `exp2`, the hardware
#   instruction (`exp` would cost an extra multiply per element); the LSE is converted back to natural log
#   at the end.
# * **the mask is a compile-time mode**: the loop over fully visible tiles carries no mask arithmetic;
#   only the diagonal tile (causal) and the ragged last tile pay for it. Causal programs stop at the
#   diagonal, so causal attention costs about half.
# * **P is cast to bf16/fp16 before its matmul** (`p.to(v.dtype)`) so that it runs on tensor cores, with
#   fp32 accumulation: that rounding is most of the kernel's bf16 error, as in FlashAttention itself.
#
# Backward is three kernels with no atomics: $\delta$ = rowsum(dO * O); one program per key tile that
# streams query tiles and accumulates dK and dV in registers; one per query tile for dQ. The dK/dV loop:

# %% tags=["nbval-ignore-output"]
print(ch07.function_source("_attn_bwd_dkdv_inner"))

# %% [markdown]
# It runs here too. Without a GPU, `TRITON_INTERPRET=1` (set in the first cell) executes every program
# instance on CPU tensors with numpy: slow, so the shapes are tiny, but it is the same kernel source that
# compiles for the GPU, with the interpreter's own small tile config (32 x 16 forward). 40 tokens make
# several tiles, a ragged tail and a causal diagonal.
#
# **Predict**: forward and backward, causal and not, fp32: within the 1e-5 fp32 tolerance of the float64
# reference?

# %%
from workers.attention import triton_kernels  # noqa: E402  (imported here, after TRITON_INTERPRET is set)
from workers.attention.reference import LSE_TOLERANCE, RELATIVE_TOLERANCE  # noqa: E402

print("kernels interpreted on CPU:", triton_kernels.is_interpreter())
gen = torch.Generator().manual_seed(1)
tq, tk, tv, tdo = (torch.randn(1, 1, 40, 16, generator=gen).to(DEVICE) for _ in range(4))
for causal in (False, True):
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (tq, tk, tv))
    out, lse = flash_attention(qg, kg, vg, causal=causal, impl="triton", return_lse=True)
    out.backward(tdo)
    ref = attention_reference_grads(tq, tk, tv, tdo, causal)
    ok = all(relative_error(a, b) <= RELATIVE_TOLERANCE[torch.float32]
             for a, b in zip((out, qg.grad, kg.grad, vg.grad), (ref[0], ref[2], ref[3], ref[4])))
    ok &= (lse.double() - ref[1]).abs().max().item() <= LSE_TOLERANCE[torch.float32]
    print(f"Triton kernel, causal={causal!s:5}: out, lse, dq, dk, dv within the fp32 tolerance: {ok}")

# %% [markdown]
# `tests/test_attention_triton.py` runs far more of this (every dtype, head dims 16 to 128, ragged
# lengths, several tile configs) and also *mutates* the kernel source (drops the rescale, shifts the
# causal mask) to prove that those tests would catch each bug.
#
# ## 7. The measured comparison
#
# On a GPU, speed is the point. The committed reference run measured every SDPA backend on one H200 (bf16,
# B = 2, H = 16, d = 128, forward and forward + backward; `data/reference/h200_attention_baseline.json`,
# copied from the course's shared reference with its provenance). FLOPs are counted as $4BHN^2d$ forward,
# halved when causal, and 3.5x that for forward + backward. Its orange line is **not** the course's kernel:
# it is a plain, untuned 30-line Triton forward, which shows how far a simple fused kernel already gets.
#
# **Predict**: which backend is fastest, and by how much does SDPA flash trail it at 16k?

# %%
print(reference_data.label(REFERENCE))
ref_rows = ch07.reference_rows(REFERENCE)
print(f"{'implementation':>52} {'N':>6} {'causal':>6} {'fwd TFLOP/s':>11} {'fwd+bwd TFLOP/s':>15}")
for r in sorted(ref_rows, key=lambda r: (r["causal"], r["n"], -(r["fwd_tflops"] or 0))):
    if r["n"] in (4096, 16384):
        fb = f"{r['fwdbwd_tflops']:.0f}" if r["fwdbwd_tflops"] else "-"
        print(f"{ch07.IMPLS[r['impl']][0]:>52} {r['n']:>6} {r['causal']!s:>6} {r['fwd_tflops']:>11.0f} {fb:>15}")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch07.comparison_figure(REFERENCE), "07_h200_comparison")

# %% [markdown]
# cuDNN leads from 4k on (540-660 TFLOP/s forward; 625-660 non-causal, about 80% of the matmul rate), SDPA's
# flash backend holds about 355 non-causal, and the memory-efficient backend about half of that. The plain
# 30-line Triton forward beats SDPA flash by about 1.3x non-causal. The reference did not run math at 16k:
# one fp32 copy of its N x N matrix alone would take 32 GiB there. At 1k every kernel is short and fixed
# costs weigh: cuDNN's forward + backward is then the slowest fused one.
#
# And the course's own kernels? `workers/attention/bench.py` measures them side by side with every backend
# and writes `data/attention/h200_<date>.json`; this cell draws whatever has been committed.

# %%
latest = ch07.latest_bench(head_dim=128)
BENCH = latest[1] if latest else None
if latest:
    print(f"course benchmark: {latest[0].name}, {reference_data.label(BENCH)}")
else:
    print("The course's kernels have not been measured on a GPU yet: there is no data/attention/h200_*.json. "
          "Every GPU number in this chapter is the reference run above.")

# %% tags=["nbval-ignore-output"]
if BENCH is not None:
    display(plots.savefig(ch07.comparison_figure(REFERENCE, BENCH, bench_label="dashed: course benchmark"),
                          "07_course_vs_sdpa"))
    for r in BENCH["rows"]:
        if r["impl"] in ("course_triton", "sdpa_flash", "sdpa_cudnn") and r.get("head_dim") == 128 and "fwd_tflops" in r:
            print(f"{r['impl']:>14} N={r['n']:>6} causal={r['causal']!s:5} fwd {r['fwd_tflops']:.0f} TFLOP/s, "
                  f"fwd+bwd {r.get('fwdbwd_tflops') or float('nan'):.0f} TFLOP/s, peak {r.get('fwd_peak_mib', 0):.0f} MiB")

# %% [markdown]
# With a GPU, measure here and now (a short sweep, untuned Triton configs so it compiles only once per
# kernel; `python -m workers.attention.bench --out ...` runs the full one). The dashed lines are this run:
# compare within a run first, then with the reference.

# %% tags=["nbval-ignore-output"]
if torch.cuda.is_available():
    from workers.attention import bench as bench_attention

    live_args = bench_attention.parse_args(["--out", "unused.json", "--seqlens", "1024,4096", "--head-dims", "128",
                                            "--impls", "sdpa_efficient,sdpa_flash,sdpa_cudnn,course_triton",
                                            "--no-autotune", "--target-ms", "50"])
    LIVE = bench_attention.run_benchmark(live_args)
    display(ch07.comparison_figure(REFERENCE, LIVE, bench_label="dashed: live run on this GPU"))
else:
    print("No GPU here: nothing to rerun live. The figures above are the committed H200 measurements.")

# %% [markdown]
# ## 8. Memory: linear vs quadratic
#
# The other half of the story. Naive attention keeps $P$ for backward, $N^2$ numbers per head; the tiled
# `torch.autograd.Function` keeps only $O$ and the LSE. We can count this exactly on a CPU, without timing
# anything: `saved_tensors_hooks` sees every tensor autograd saves, and we add up their storages (the
# inputs excluded).
#
# **Predict**: at N = 1024, B = 1, H = 4, d = 64 in fp32, how many MiB does each keep?

# %%
saved = ch07.saved_bytes_rows([128, 256, 512, 1024, 2048])
print(f"{'N':>5} {'naive saves (MiB)':>17} {'tiled saves (MiB)':>17} {'ratio':>6}   exact formulas hold")
for r in saved:
    n = r["n"]
    formula_naive = 1 * 4 * n * n * 4  # P: B * H * N^2 fp32
    formula_tiled = 1 * 4 * (n * 64 * 4 + n * 4)  # O: B * H * N * d fp32, plus the fp32 LSE per row
    print(f"{n:>5} {r['naive_bytes'] / 2**20:>17.3f} {r['tiled_bytes'] / 2**20:>17.3f} "
          f"{r['naive_bytes'] / r['tiled_bytes']:>6.1f}   {r['naive_bytes'] == formula_naive and r['tiled_bytes'] == formula_tiled}")

# %% [markdown]
# Exact: the naive graph saves $4N^2$ bytes per head, the tiled one $4N(d + 1)$, and the ratio $N/(d+1)$ grows
# without bound. On the GPU the reference run measured forward peak memory (left panel below): the math
# backend's grows with N² (7.3 GiB at 4k, about 3.6 fp32 copies of the N x N matrix for bf16 inputs), the
# fused ones stay in the hundreds of MiB. Their values do not follow O + LSE exactly (SDPA flash measured
# 104 MiB at 1k, 33 at 4k and 866 at 16k; workspaces and allocator caching count too, and the reference does
# not record how the peak was taken), so read the left panel for its slopes, the right one for exact bytes.

# %% tags=["nbval-ignore-output"]
plots.savefig(ch07.memory_figure(REFERENCE, saved), "07_memory")

# %% [markdown]
# ## 9. The layout pitfall: (B, S, H, D) vs (B, H, S, D)
#
# A projection produces `[B, S, H * D]`, and `.view(B, S, H, D)` is free. SDPA and the course's kernels
# take `[B, H, S, D]`; flash_attn's own `flash_attn_func` takes `[B, S, H, D]`. Two things go wrong here.
#
# The silent one first: pass a `[B, S, H, D]` tensor to a function that expects `[B, H, S, D]` and the
# shapes still fit. Attention then runs over the **heads** axis, for every token separately.
#
# **Predict**: does it raise an error?

# %%
gen = torch.Generator().manual_seed(2)
x_q, x_k, x_v = (torch.randn(2, 64, 4, 16, generator=gen) for _ in range(3))  # [B, S, H, D]
right = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (x_q, x_k, x_v))).transpose(1, 2)
wrong = torch.nn.functional.scaled_dot_product_attention(x_q, x_k, x_v)  # [B, S, H, D] read as [B, H, S, D]
print("wrong layout ran without error, output shape", tuple(wrong.shape), "| same result:",
      torch.allclose(wrong, right, atol=1e-5))

# %% [markdown]
# No error, a different function, and a model that still trains, only worse. The second pitfall is cost.
# `.transpose(1, 2)` is a view (it swaps two strides); `.contiguous()` then copies the whole tensor. Kernels
# that read through strides need no copy: the course's Triton kernel does (it only needs the head dim
# contiguous), as this check on the interpreter shows.

# %%
t_view = x_q.transpose(1, 2)  # [B, H, S, D], a view
print("transpose is a view:", t_view.data_ptr() == x_q.data_ptr(), "| contiguous:", t_view.is_contiguous(),
      "| .contiguous() copies:", t_view.contiguous().data_ptr() != x_q.data_ptr())
small = [t[:1, :40, :1].to(DEVICE) for t in (x_q, x_k, x_v)]  # [1, 40, 1, 16], tiny for the interpreter
strided = flash_attention(*(t.transpose(1, 2) for t in small), impl="triton")
copied = flash_attention(*(t.transpose(1, 2).contiguous() for t in small), impl="triton")
print("Triton kernel on the strided view == on the contiguous copy:", torch.equal(strided, copied))

# %% [markdown]
# What does the copy cost? On this CPU (one thread), measured: three copies in and one out, against the SDPA
# forward.
# On the H200, modelled from its measured numbers: four tensors read and written at the measured 4.27 TB/s
# (bytes read plus bytes written, counted the way the H200's 4.8 TB/s peak is), against the measured
# SDPA flash forward.
#
# **Predict**: on which machine does the copy matter more, and at short or long sequences?

# %% tags=["nbval-ignore-output"]
layout_cpu = ch07.layout_timings([256, 512, 1024], reps=5)
for r in layout_cpu:
    print(f"CPU, S={r['seq']:>5}: copies {r['copy_s'] * 1e3:7.2f} ms, SDPA forward {r['attention_s'] * 1e3:7.2f} ms "
          f"({100 * r['copy_s'] / r['attention_s']:.0f}%)  [CPU wall time, this machine]")

# %%
layout_gpu = ch07.layout_copy_model(REFERENCE)
for r in layout_gpu:
    print(f"H200 model, N={r['n']:>6}: copies {r['copy_ms'] * 1e3:6.0f} us vs SDPA flash forward "
          f"{r['flash_fwd_ms'] * 1e3:6.0f} us: {100 * r['copy_share']:.0f}%")

# %% tags=["nbval-ignore-output"]
plots.savefig(ch07.layout_figure(layout_cpu, layout_gpu, REFERENCE), "07_layout_copy")

# %% [markdown]
# On a CPU attention is slow arithmetic and the copies are about a percent (noisy: other work shares this
# machine). On the H200 the attention kernel is so fast that at N = 1k the copies would add about a quarter
# to the forward, and still 8% at 4k; only at 16k does the N² work bury them. On the GPU the fix is free: keep
# the `[B, S, H, D]` view and hand the kernel strides, or choose the kernel whose layout your model already
# has, instead of paying for `.contiguous()` twice per layer, forward and backward.
#
# ## Summary
#
# * The online softmax computes softmax one tile at a time: a running max, a running sum, and a rescale by
#   $e^{m_\text{old} - m_\text{new}}$ whenever the max grows. Exact, not approximate; after every tile the
#   output is exact attention over the keys seen, so partial results merge through their LSEs.
# * Tiling keeps S and P on chip: naive moves $\Theta(N^2)$ bytes at 32 FLOP/byte, tiled reads the inputs a
#   few times, and with L2 reuse the fastest kernels run near the matmul rate (cuDNN about 80% on the H200).
# * Forward saves O and the LSE, $O(N)$; backward rebuilds P from the LSE, with
#   $\delta = \mathrm{rowsum}(dO \circ O)$ standing in for the row-wide softmax Jacobian term.
# * Layouts: a wrong layout is silently a different function, and a `.contiguous()` copy costs most, relative
#   to the kernel, exactly where attention is fastest.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
