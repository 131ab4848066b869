"""How many bytes attention moves through HBM, and how much memory it holds: naive vs tiled (chapter 07).

Pure Python (no torch), so the notebook can draw it anywhere. All counts are for ``batch * heads``
independent (N x d) attention problems, with N queries and N keys.

Naive attention (Dao et al. 2022, "FlashAttention", Algorithm 0, the "standard attention implementation"):

    1. read Q, K (2Nd); S = Q K^T; write S (N^2)
    2. read S (N^2); P = softmax(S); write P (N^2)
    3. read P (N^2), V (Nd); O = P V; write O (Nd)

    total = 4Nd + 4N^2 elements: Theta(Nd + N^2), Theorem 2's count for standard attention. For N >> d the
    N^2 terms dominate, and they are pure traffic: S and P exist only to be read back. A causal mask does not
    help here; the square matrix is still written and read (the math backend does exactly this).

Tiled attention, FlashAttention-2 order (our kernels and ``workers/attention/tiled.py``): one program per query
tile of ``block_q`` rows keeps its Q tile, running max, running sum and output accumulator on chip and streams
K and V past it:

    read Q once (Nd), write O once (Nd), write LSE (N fp32 values),
    read K and V once per query tile: 2d * (keys the tile can see), summed over the ceil(N / block_q) tiles
    = 2Nd * ceil(N / block_q) without a mask, about half with a causal mask (tiles above the diagonal skipped).

    total = Theta(N^2 d / block_q). block_q is bounded by on-chip memory M (it holds a block_q x d tile of Q
    and of the accumulator), so this is Theorem 2's Theta(N^2 d^2 / M). For large N the ratio naive / tiled
    is 4N^2 / (2N^2 d / block_q) = 2 block_q / d: 2x for d = block_q = 128, 4x for d = 64. That is an upper
    bound on the tiled traffic: the K/V re-reads of programs running at the same time mostly hit the L2 cache
    (50 MB on an H100/H200, while K and V of one head at N = 16k, d = 128, bf16 are 8 MB), so what reaches
    HBM approaches the compulsory 4Nd (``compulsory_attention_hbm_bytes``): linear in N, against naive's N^2.

``fa1_theorem2_hbm_bytes`` counts Algorithm 1 of the FlashAttention paper itself (outer loop over K/V blocks,
inner over Q blocks, O and the statistics read and written once per K/V block), with the paper's block sizes
B_c = ceil(M / 4d), B_r = min(B_c, d) from an SRAM of M elements, to show the theorem's formula directly.

Memory: naive holds the N x N scores (and the probabilities: both exist while softmax runs), O(N^2) per head;
tiled holds the output and one LSE per row, O(N). That is a lower bound on what a real kernel allocates: on one
H200 (see ``shared/reference``) SDPA's flash backend peaked at 32.5 MiB for B=2, H=16, N=4096, d=128 in bf16,
O (32 MiB) + LSE (0.5 MiB), but its peaks at other lengths do not follow O + LSE (chapter 07 shows them).
"""
from __future__ import annotations

import math

LSE_BYTES = 4  # the log-sum-exp (and the running statistics) are kept in fp32 whatever the input dtype


def _check(n: int, d: int, batch: int, heads: int, bytes_per_element: int) -> None:
    for name, value in (("n", n), ("d", d), ("batch", batch), ("heads", heads),
                        ("bytes_per_element", bytes_per_element)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def keys_read_per_query_tile(n: int, block_q: int, causal: bool) -> list[int]:
    """How many keys each query tile streams: all n, or with a causal mask up to the tile's last query."""
    tiles = math.ceil(n / block_q)
    if not causal:
        return [n] * tiles
    return [min(n, (i + 1) * block_q) for i in range(tiles)]


def compulsory_attention_hbm_bytes(n: int, d: int, batch: int = 1, heads: int = 1, bytes_per_element: int = 2) -> int:
    """The least any forward can move: read Q, K, V once, write O once, and one fp32 LSE per row."""
    _check(n, d, batch, heads, bytes_per_element)
    return batch * heads * (4 * n * d * bytes_per_element + n * LSE_BYTES)


def naive_attention_hbm_bytes(n: int, d: int, batch: int = 1, heads: int = 1, bytes_per_element: int = 2,
                              score_bytes: int | None = None) -> int:
    """HBM bytes of Algorithm 0 forward: 4Nd element reads/writes of Q, K, V, O and 4N^2 of S and P.

    ``score_bytes`` is the element size of S and P (default: the input's; an implementation that upcasts the
    softmax to fp32 uses 4).
    """
    _check(n, d, batch, heads, bytes_per_element)
    score_bytes = bytes_per_element if score_bytes is None else score_bytes
    per_head = 4 * n * d * bytes_per_element + 4 * n * n * score_bytes
    return batch * heads * per_head


def tiled_attention_hbm_bytes(n: int, d: int, block_q: int = 128, batch: int = 1, heads: int = 1,
                              bytes_per_element: int = 2, causal: bool = False) -> int:
    """HBM bytes of the tiled forward (FlashAttention-2 order): Q, O once, K and V once per query tile, LSE."""
    _check(n, d, batch, heads, bytes_per_element)
    q_and_o = 2 * n * d * bytes_per_element
    k_and_v = sum(2 * keys * d * bytes_per_element for keys in keys_read_per_query_tile(n, block_q, causal))
    lse = n * LSE_BYTES
    return batch * heads * (q_and_o + k_and_v + lse)


def naive_attention_backward_hbm_bytes(n: int, d: int, batch: int = 1, heads: int = 1, bytes_per_element: int = 2,
                                       score_bytes: int | None = None) -> int:
    """HBM bytes of the standard backward (Dao et al. 2022, Algorithm 3) from the saved P:

    dV = P^T dO (read P, dO; write dV); dP = dO V^T (read dO, V; write dP); dS = P * (dP - rowsum(dP * P))
    (read P, dP; write dS); dQ = dS K and dK = dS^T Q (read dS twice, K, Q; write dQ, dK):
    7N^2 score-sized elements and 8Nd input-sized ones.
    """
    _check(n, d, batch, heads, bytes_per_element)
    score_bytes = bytes_per_element if score_bytes is None else score_bytes
    return batch * heads * (7 * n * n * score_bytes + 8 * n * d * bytes_per_element)


def tiled_attention_backward_hbm_bytes(n: int, d: int, block_q: int = 64, block_k: int = 128, batch: int = 1,
                                       heads: int = 1, bytes_per_element: int = 2, causal: bool = False) -> int:
    """HBM bytes of our three backward kernels (recomputation: no N x N matrix is read or written).

    preprocess: read O, dO; write delta.  dK/dV (one program per key tile of ``block_k``): read K, V once,
    stream Q, dO, LSE, delta of every query that sees the tile, write dK, dV.  dQ (one program per query tile
    of ``block_q``): read Q, dO, LSE, delta once, stream K and V, write dQ.
    """
    _check(n, d, batch, heads, bytes_per_element)
    e = bytes_per_element
    preprocess = 2 * n * d * e + n * LSE_BYTES
    # Queries that see key tile j: all n, or (causal) those from the tile's first key on.
    key_tiles = math.ceil(n / block_k)
    queries = [n - (j * block_k if causal else 0) for j in range(key_tiles)]
    dkdv = 2 * n * d * e + sum(q * (2 * d * e + 2 * LSE_BYTES) for q in queries) + 2 * n * d * e
    dq = 2 * n * d * e + 2 * n * LSE_BYTES + sum(
        2 * keys * d * e for keys in keys_read_per_query_tile(n, block_q, causal)) + n * d * e
    return batch * heads * (preprocess + dkdv + dq)


def fa1_block_sizes(d: int, sram_bytes: int, bytes_per_element: int = 2) -> tuple[int, int]:
    """(B_r, B_c) of FlashAttention Algorithm 1: B_c = ceil(M / 4d), B_r = min(B_c, d), M in elements."""
    m = sram_bytes // bytes_per_element
    block_c = math.ceil(m / (4 * d))
    return min(block_c, d), block_c


def fa1_theorem2_hbm_bytes(n: int, d: int, sram_bytes: int = 228 * 1024, batch: int = 1, heads: int = 1,
                           bytes_per_element: int = 2) -> int:
    """HBM bytes of FlashAttention Algorithm 1 (Dao et al. 2022, proof of Theorem 2).

    K and V are read once (2Nd). For each of the T_c = ceil(N / B_c) key/value blocks, every Q block is read
    (Nd), every O block read and written (2Nd), and the statistics l and m read and written (4N, fp32):
    2Nd + T_c (3Nd + 4N) = Theta(N^2 d^2 / M) since T_c ~ 4Nd / M.
    """
    _check(n, d, batch, heads, bytes_per_element)
    _, block_c = fa1_block_sizes(d, sram_bytes, bytes_per_element)
    t_c = math.ceil(n / block_c)
    per_head = 2 * n * d * bytes_per_element + t_c * (3 * n * d * bytes_per_element + 4 * n * LSE_BYTES)
    return batch * heads * per_head


def tiled_sram_bytes(block_q: int, block_k: int, d: int, bytes_per_element: int = 2, num_stages: int = 2) -> int:
    """On-chip bytes one forward program needs: its Q tile, ``num_stages`` buffered K and V tiles, and the fp32
    accumulator and statistics (registers on a GPU, counted here as on-chip memory all the same)."""
    q_tile = block_q * d * bytes_per_element
    kv_tiles = num_stages * 2 * block_k * d * bytes_per_element
    accumulators = block_q * d * 4 + 2 * block_q * 4 + block_q * block_k * 4  # acc, (m, l), one score tile
    return q_tile + kv_tiles + accumulators


def attention_peak_extra_bytes(n: int, d: int, batch: int = 1, heads: int = 1, bytes_per_element: int = 2,
                               impl: str = "tiled", score_copies: int = 2, score_bytes: int | None = None) -> int:
    """Bytes a forward allocates beyond q, k, v: the output plus what the algorithm must hold.

    impl="naive": the output and ``score_copies`` N x N matrices of ``score_bytes`` each (S and P by default).
    Measured PyTorch math backends may hold more (one H200 run held about 3.6 fp32 N x N copies for bf16
    inputs: it upcasts); pass ``score_copies``/``score_bytes`` to match a given implementation.
    impl="tiled": the output and one fp32 LSE per row. That is all FlashAttention saves for backward.
    """
    _check(n, d, batch, heads, bytes_per_element)
    out = n * d * bytes_per_element
    if impl == "naive":
        score_bytes = bytes_per_element if score_bytes is None else score_bytes
        per_head = out + score_copies * n * n * score_bytes
    elif impl == "tiled":
        per_head = out + n * LSE_BYTES
    else:
        raise ValueError(f"impl must be 'naive' or 'tiled', got {impl!r}")
    return batch * heads * per_head


def attention_flops(n: int, d: int, batch: int = 1, heads: int = 1, causal: bool = False,
                    backward: bool = False) -> float:
    """The benchmark convention: 4 B H N^2 d for forward (two matmuls), halved when causal, x3.5 for
    forward+backward (backward = 2.5x forward: five matmuls, one of them the recomputation of S)."""
    flops = 4.0 * batch * heads * n * n * d
    if causal:
        flops /= 2
    return flops * 3.5 if backward else flops
