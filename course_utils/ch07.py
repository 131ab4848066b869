"""Notebook-side helpers for chapter 07 (FlashAttention): drawing, reference data, exact memory counts.

- the online softmax, one key tile at a time: ``online_softmax_trace`` (computed with the course's own
  ``workers.attention.online_softmax_update``), ``tile_walk_figure`` and the ``tile_walk_widget`` (pure drawing);
- the H200 measurements: ``load_reference`` (``data/reference/h200_attention_baseline.json``), the benchmark
  files ``data/attention/h200_*.json`` written by ``workers/attention/bench.py``, ``comparison_figure``,
  ``io_figure``, ``memory_figure``;
- exact, timing-free memory on CPU: ``saved_for_backward_bytes``;
- the layout pitfall: ``layout_timings`` (CPU) and ``layout_copy_model`` (H200, from its measured numbers).
"""
from __future__ import annotations

import ast
import glob
import json
import math
import statistics
import time
from pathlib import Path

from course_utils import reference_data
from course_utils.paths import DATA, ROOT

BENCH_GLOB = str(DATA / "attention" / "h200_*.json")

# One name, label and colour per implementation, whichever file it comes from.
IMPLS = {
    "sdpa_math": ("SDPA math (materialises N x N)", "#8c8c8c"),
    "sdpa_efficient": ("SDPA efficient (xFormers)", "#9467bd"),
    "sdpa_flash": ("SDPA flash (FlashAttention-2)", "#1f77b4"),
    "sdpa_cudnn": ("SDPA cuDNN", "#2ca02c"),
    "flash_attn": ("flash_attn package", "#17becf"),
    "triton_plain": ("plain 30-line Triton fwd (not the course's kernel)", "#ff7f0e"),
    "course_triton": ("course Triton kernel", "#d62728"),
    "course_torch": ("course tiled PyTorch", "#e377c2"),
}
_REFERENCE_BACKENDS = {"math": "sdpa_math", "efficient": "sdpa_efficient", "flash": "sdpa_flash",
                       "cudnn": "sdpa_cudnn", "triton_course": "triton_plain"}


# ----------------------------------------------------------------------------------------------------------
# 1. The online softmax, tile by tile
# ----------------------------------------------------------------------------------------------------------

def demo_scores(n_keys: int = 24, seed: int = 0):
    """(scores, values) of one query against ``n_keys`` keys, float64. A gentle upward drift makes the running
    max rise a few times along the walk, so the rescaling is visible."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    drift = torch.linspace(0.0, 2.0, n_keys, dtype=torch.float64)
    scores = 1.2 * torch.randn(n_keys, generator=gen, dtype=torch.float64) + drift
    values = torch.randn(n_keys, generator=gen, dtype=torch.float64)
    return scores, values


def online_softmax_trace(scores, values, block: int) -> list[dict]:
    """The state after each key tile of the online softmax for one query row (scalar values, head dim 1).

    Each step holds the tile's key range, the running max before/after (``m_old``, ``m_new``), the rescale
    factor ``alpha = exp(m_old - m_new)``, the running sum before and after (``l_old``, ``l_new``), the part
    carried over (``alpha * l_old``) and the tile's own sum, and the output so far ``out = acc / l``, which
    is exact attention over the keys seen so far. The arithmetic is ``workers.attention.online_softmax_update``.
    """
    import torch

    from workers.attention import online_softmax_update

    if block < 1:
        raise ValueError(f"block must be a positive number of keys, got {block}")
    scores = torch.as_tensor(scores, dtype=torch.float64).reshape(-1)
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    m = torch.full((1, 1, 1), float("-inf"), dtype=torch.float64)  # [B, H, Bq]
    l = torch.zeros(1, 1, 1, dtype=torch.float64)
    acc = torch.zeros(1, 1, 1, 1, dtype=torch.float64)  # [B, H, Bq, D]
    steps = []
    for i, start in enumerate(range(0, len(scores), block)):
        tile = scores[start:start + block]
        m_old, l_old = m.item(), l.item()
        m, l, acc = online_softmax_update(m, l, acc, tile.view(1, 1, 1, -1), values[start:start + block].view(1, 1, -1, 1))
        alpha = math.exp(m_old - m.item()) if m_old != float("-inf") else 0.0
        steps.append({"tile": i, "start": start, "stop": start + len(tile), "m_old": m_old, "m_new": m.item(),
                      "alpha": alpha, "l_old": l_old, "carried": alpha * l_old,
                      "tile_sum": torch.exp(tile - m.item()).sum().item(), "l_new": l.item(),
                      "out": (acc / l[..., None]).item()})
    return steps


def exact_softmax_stats(scores, values) -> dict:
    """What the walk must end at: max, sum exp(s - max), the LSE and softmax(s) . v, computed in one go."""
    import torch

    scores = torch.as_tensor(scores, dtype=torch.float64)
    values = torch.as_tensor(values, dtype=torch.float64)
    m = scores.max().item()
    return {"max": m, "sum": torch.exp(scores - m).sum().item(), "lse": torch.logsumexp(scores, 0).item(),
            "out": (torch.softmax(scores, 0) @ values).item()}


def trace_table(steps: list[dict]) -> str:
    """The walk as a fixed-width table (rounded, so that it prints the same everywhere)."""
    lines = [f"{'tile':>4} {'keys':>7} {'m_old':>7} {'m_new':>7} {'alpha':>7} {'alpha*l_old':>11} "
             f"{'tile sum':>9} {'l_new':>7} {'out so far':>10}"]
    for s in steps:
        m_old = "-inf" if s["m_old"] == float("-inf") else f"{s['m_old']:.3f}"
        lines.append(f"{s['tile']:>4} {s['start']:>3}:{s['stop']:<3} {m_old:>7} {s['m_new']:>7.3f} {s['alpha']:>7.3f} "
                     f"{s['carried']:>11.3f} {s['tile_sum']:>9.3f} {s['l_new']:>7.3f} {s['out']:>10.4f}")
    return "\n".join(lines)


def tile_walk_figure(scores, values, block: int, step: int | None = None):
    """Three panels after tile ``step`` (1-based; None: all tiles): the scores with the running max, the running
    sum split into what was carried over (rescaled) and what the tile added, and the output so far."""
    import matplotlib.pyplot as plt
    import numpy as np

    steps = online_softmax_trace(scores, values, block)
    step = len(steps) if step is None else max(0, min(int(step), len(steps)))
    exact = exact_softmax_stats(scores, values)
    s = np.asarray(scores, dtype=float)
    cmap = plt.get_cmap("tab10")
    fig, (ax_s, ax_l, ax_o) = plt.subplots(1, 3, figsize=(12.5, 4.2), gridspec_kw={"width_ratios": [2.2, 1.2, 1.2]})
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.2), "fontsize": 9, "frameon": False}

    for t in steps:
        seen = t["tile"] < step
        current = t["tile"] == step - 1
        xs = np.arange(t["start"], t["stop"])
        ax_s.bar(xs, s[t["start"]:t["stop"]], color=cmap(t["tile"] % 10) if seen else "#dddddd",
                 edgecolor="black" if current else "none", linewidth=1.2)
        if seen:
            ax_s.hlines(t["m_new"], t["start"] - 0.45, t["stop"] - 0.55, colors="black", linewidth=2)
        ax_s.axvline(t["start"] - 0.5, color="#999999", linewidth=0.6, linestyle=":")
    ax_s.plot([], [], color="black", linewidth=2, label="running max m after each tile")
    ax_s.set_xlabel("key j (tiles of %d)" % block)
    ax_s.set_ylabel("score s_j")
    ax_s.set_title(f"after tile {step} of {len(steps)}: the keys seen so far" if step else "before the first tile")
    ax_s.legend(**below)

    done = steps[:step]
    idx = np.arange(1, len(done) + 1)
    ax_l.bar(idx, [t["carried"] for t in done], color="#bbbbbb", label="carried: alpha * l_old")
    ax_l.bar(idx, [t["tile_sum"] for t in done], bottom=[t["carried"] for t in done],
             color=[cmap(t["tile"] % 10) for t in done], label="this tile: sum exp(s - m_new)")
    for t in done:
        if 0 < t["alpha"] < 1:  # the max rose: everything summed so far shrinks
            ax_l.annotate(f"x{t['alpha']:.2f}", (t["tile"] + 1, t["l_new"]), ha="center", va="bottom", fontsize=9,
                          color="#cf222e")
    if step == len(steps) and steps:
        ax_l.axhline(exact["sum"], color="black", linestyle="--", linewidth=1,
                     label=f"exact sum exp(s - max) = {exact['sum']:.3f}")
    ax_l.set_xlim(0.4, len(steps) + 0.6)
    ax_l.set_ylim(0, 1.15 * max([t["l_new"] for t in steps] + [exact["sum"]]))  # fixed: steps do not rescale the axis
    ax_l.set_xlabel("tile")
    ax_l.set_ylabel("l (in units of exp(m))")
    ax_l.set_title("running sum l (red: rescale factor)")
    ax_l.legend(**below)

    ax_o.plot(idx, [t["out"] for t in done], "o-", color="#1f77b4",
              label="acc / l: exact attention over the keys seen")
    ax_o.axhline(exact["out"], color="black", linestyle="--", linewidth=1,
                 label=f"softmax(s) . v over all keys = {exact['out']:.3f}")
    outs = [t["out"] for t in steps] + [exact["out"]]
    pad = 0.1 * (max(outs) - min(outs) or 1.0)
    ax_o.set_xlim(0.4, len(steps) + 0.6)
    ax_o.set_ylim(min(outs) - pad, max(outs) + pad)
    ax_o.set_xlabel("tile")
    ax_o.set_title("output so far")
    ax_o.legend(**below)
    fig.tight_layout()
    return fig


def tile_walk_widget(n_keys: int = 24, block: int = 4, seed: int = 0):
    """Sliders for the tile, the block size and the random scores; redraws ``tile_walk_figure`` (no ranks)."""
    import ipywidgets as W

    from course_utils.widgets import figure_png, slider

    tile = slider("after tile", math.ceil(n_keys / block), 0, math.ceil(n_keys / block))
    block_w = slider("block (keys per tile)", block, 1, n_keys)
    seed_w = slider("scores (seed)", seed, 0, 20)
    out = W.Output()
    status = W.HTML()

    def redraw(_change=None):
        tile.max = math.ceil(n_keys / block_w.value)  # clamps tile.value too
        scores, values = demo_scores(n_keys, seed_w.value)
        fig = tile_walk_figure(scores, values, block_w.value, tile.value)
        steps = online_softmax_trace(scores, values, block_w.value)[:tile.value]
        if steps:
            last = steps[-1]
            status.value = (f"tile {last['tile'] + 1}: m {last['m_old']:.3f} &rarr; {last['m_new']:.3f}, "
                            f"alpha = {last['alpha']:.3f}, l = {last['carried']:.3f} + {last['tile_sum']:.3f} = "
                            f"{last['l_new']:.3f}, out = {last['out']:.4f}")
        else:
            status.value = "m = -inf, l = 0, acc = 0: nothing seen yet"
        import base64

        out.outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(figure_png(fig)).decode("ascii"),
                                 "text/plain": "<figure>"}},)

    for w in (tile, block_w, seed_w):
        w.observe(redraw, names="value")
    redraw()
    box = W.VBox([W.HBox([tile, block_w, seed_w]), status, out])
    box.controls = {"tile": tile, "block": block_w, "seed": seed_w}  # for tests and for driving it from code
    box.output, box.status = out, status
    return box


# ----------------------------------------------------------------------------------------------------------
# 2. Measured data: the committed H200 reference, and the course's benchmark files
# ----------------------------------------------------------------------------------------------------------

def load_reference() -> dict:
    """The committed H200 attention run, with its provenance (``course_utils.reference_data``)."""
    return reference_data.load("h200_attention_baseline")


def reference_rows(ref: dict) -> list[dict]:
    """The reference's rows in the benchmark's vocabulary: impl, n, causal, head_dim, fwd/fwdbwd ms and TFLOP/s."""
    rows = []
    for r in ref["sdpa"]:
        rows.append({"impl": _REFERENCE_BACKENDS.get(r["backend"], r["backend"]), "n": r["N"], "causal": r["causal"],
                     "head_dim": 128, "fwd_ms": r.get("fwd_ms"), "fwd_tflops": r.get("fwd_tflops"),
                     "fwdbwd_ms": r.get("fwdbwd_ms"), "fwdbwd_tflops": r.get("fwdbwd_tflops"),
                     "fwd_peak_mib": r.get("fwd_peak_mib")})
    return rows


def bench_files(pattern: str = BENCH_GLOB) -> list[Path]:
    """The course's own GPU results (``workers/attention/bench.py`` output committed under data/attention/)."""
    return [Path(p) for p in sorted(glob.glob(pattern))]


def load_bench(path: str | Path) -> dict:
    with open(path) as f:
        return json.load(f)


def latest_bench(head_dim: int = 128, pattern: str = BENCH_GLOB):
    """(path, results) of the newest benchmark file (by name: they carry the date) with rows at ``head_dim``,
    or None when no such file has been committed."""
    for path in reversed(bench_files(pattern)):
        results = load_bench(path)
        if any(r.get("head_dim") == head_dim for r in results.get("rows", [])):
            return path, results
    return None


def _n_axis(ax, ns) -> None:
    """Log2 x axis labelled with the sequence lengths themselves (1k, 4k, ...)."""
    from course_utils.plots import log2_axis

    log2_axis(ax, ns)
    ax.minorticks_off()


def _lookup(rows, impl, causal, head_dim, key):
    pts = sorted((r["n"], r[key]) for r in rows if r["impl"] == impl and r["causal"] == causal
                 and r.get("head_dim", 128) == head_dim and r.get(key) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def comparison_figure(reference: dict, bench: dict | None = None, head_dim: int = 128, title: str | None = None,
                      bench_label: str = "dashed: course benchmark"):
    """TFLOP/s vs N: forward (top) and forward+backward (bottom), non-causal (left) and causal (right).

    Solid lines: the committed reference run. ``bench`` (a ``workers/attention/bench.py`` result, or a live run):
    its rows are drawn dashed with square markers, side by side with the reference in each panel; the dashed
    runs are a different run (and possibly a different machine): compare within a run before across runs.
    """
    import matplotlib.pyplot as plt

    ref_rows = reference_rows(reference)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.2), sharex=True)
    for col, causal in enumerate((False, True)):
        for row, mode in enumerate(("fwd", "fwdbwd")):
            ax = axes[row][col]
            for impl, (label, colour) in IMPLS.items():
                xs, ys = _lookup(ref_rows, impl, causal, head_dim, f"{mode}_tflops")
                if xs:
                    ax.plot(xs, ys, "o-", color=colour, label=label)
                if bench is not None:
                    xs, ys = _lookup(bench["rows"], impl, causal, head_dim, f"{mode}_tflops")
                    if xs:
                        ax.plot(xs, ys, "s--", color=colour, label=f"{label} ({bench_label})")
            peak = reference.get("matmul_bf16_tflops")
            if peak:
                ax.axhline(peak, color="black", linestyle=":", linewidth=1)
                ax.text(0.01, peak * 0.97, f"8192^3 bf16 matmul, same GPU: {peak:.0f}", fontsize=8.5, va="top",
                        transform=ax.get_yaxis_transform())
            _n_axis(ax, [r["n"] for r in ref_rows] + [r["n"] for r in (bench or {}).get("rows", [])])
            ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'}, "
                         f"{'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(0, (peak or 800) * 1.08)
            if row == 1:
                ax.set_xlabel("sequence length N")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=3, fontsize=9, bbox_to_anchor=(0.5, 0.0))
    caption = reference_data.label(reference)
    if bench is not None:
        caption += f"\ndashed: {reference_data.label(bench)}"
    fig.suptitle(title or f"attention, bf16, B=2, H=16, d={head_dim}: {caption}", fontsize=9.5)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------
# 3. The IO argument, with the H200's measured bandwidth and matmul rate
# ----------------------------------------------------------------------------------------------------------

def io_rows(ns, reference: dict, d: int = 128, block_q: int = 128, batch: int = 2, heads: int = 16,
            bytes_per_element: int = 2) -> list[dict]:
    """Per N: HBM bytes of naive (fp32 scores, like SDPA math), tiled (no L2 reuse) and the compulsory minimum,
    FLOP per byte, and the time each byte count would take at the measured copy bandwidth next to the
    time the FLOPs take at the measured matmul rate."""
    from course_utils import attention_io as io

    bw = reference["copy_TBps"] * 1e12
    peak = reference["matmul_bf16_tflops"] * 1e12
    rows = []
    for n in ns:
        naive = io.naive_attention_hbm_bytes(n, d, batch, heads, bytes_per_element, score_bytes=4)
        tiled = io.tiled_attention_hbm_bytes(n, d, block_q, batch, heads, bytes_per_element)
        compulsory = io.compulsory_attention_hbm_bytes(n, d, batch, heads, bytes_per_element)
        flops = io.attention_flops(n, d, batch, heads)
        rows.append({"n": n, "naive_GB": naive / 1e9, "tiled_GB": tiled / 1e9, "compulsory_GB": compulsory / 1e9,
                     "naive_flop_per_byte": flops / naive, "tiled_flop_per_byte": flops / tiled,
                     "naive_ms": naive / bw * 1e3, "tiled_ms": tiled / bw * 1e3, "compulsory_ms": compulsory / bw * 1e3,
                     "compute_ms": flops / peak * 1e3})
    return rows


def io_figure(rows: list[dict], reference: dict, block_q: int = 128):
    """Left: HBM bytes vs N. Right: those bytes as time at the measured bandwidth, the FLOPs as time at the
    measured matmul rate, and the measured forward times of math, flash and cuDNN (non-causal)."""
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 4))
    for key, label, style in (("naive", "naive: S and P written and read (fp32)", "-"),
                              ("tiled", f"tiled, K and V re-read per {block_q}-row query tile (no L2 reuse)", "-"),
                              ("compulsory", "compulsory: Q, K, V read once, O written once", "--")):
        ax_b.plot(ns, [r[f"{key}_GB"] for r in rows], style, marker="o", label=label)
        ax_t.plot(ns, [r[f"{key}_ms"] for r in rows], style, marker="o", label=f"bytes / {reference['copy_TBps']:.2f} TB/s: {key}")
    ax_t.plot(ns, [r["compute_ms"] for r in rows], ":", color="black",
              label=f"FLOPs / {reference['matmul_bf16_tflops']:.0f} TFLOP/s (measured matmul)")
    ref_rows = reference_rows(reference)
    for impl, marker in (("sdpa_math", "x"), ("sdpa_flash", "s"), ("sdpa_cudnn", "^")):
        xs, ys = _lookup(ref_rows, impl, False, 128, "fwd_ms")
        ax_t.plot(xs, ys, marker, color=IMPLS[impl][1], markersize=8, linestyle="none", label=f"measured: {IMPLS[impl][0]}")
    for ax in (ax_b, ax_t):
        _n_axis(ax, ns)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
    ax_b.set_ylabel("GB moved through HBM, one forward")
    ax_b.set_title("HBM traffic (model): naive grows as N^2 with 4x the constant", fontsize=10)
    ax_t.set_ylabel("ms")
    ax_t.set_title("as time on the H200, with the measured forwards", fontsize=10)
    fig.suptitle(f"bf16, B=2, H=16, d=128; bandwidth and matmul rate: {reference_data.label(reference)}", fontsize=9)
    fig.tight_layout()
    for ax in (ax_b, ax_t):  # under the panels: inside, the legends covered lines and the measured points
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    return fig


# ----------------------------------------------------------------------------------------------------------
# 4. Memory: measured peaks on the H200, and exact saved-for-backward bytes on CPU
# ----------------------------------------------------------------------------------------------------------

def naive_attention(q, k, v, causal: bool = False):
    """softmax(q k^T / sqrt(d)) v through ordinary autograd: the N x N scores and probabilities are tensors."""
    import torch

    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # [B, H, N, N]
    if causal:
        n = q.shape[-2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # [B, H, N, D]


def saved_for_backward_bytes(fn, *inputs) -> int:
    """Bytes of the tensors autograd keeps for backward while ``fn(*inputs)`` runs: each storage counted once,
    the inputs' own storage excluded. Exact (it sums the saved tensors' storages), not a timing or a sample."""
    import torch

    inputs_storage = {t.untyped_storage().data_ptr() for t in inputs}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs_storage:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(saved.values())


def saved_bytes_rows(ns, batch: int = 1, heads: int = 4, d: int = 64, block: int = 512) -> list[dict]:
    """saved_for_backward_bytes of naive attention and of the course's tiled Function, fp32 on CPU, per N.

    What the tiled Function saves does not depend on its tile size; large tiles just make the Python loop short."""
    import torch

    from workers.attention import flash_attention

    rows = []
    for n in ns:
        q, k, v = (torch.randn(batch, heads, n, d, requires_grad=True) for _ in range(3))
        naive = saved_for_backward_bytes(naive_attention, q, k, v)
        tiled = saved_for_backward_bytes(lambda a, b, c: flash_attention(a, b, c, impl="torch", block_q=block,
                                                                         block_k=block), q, k, v)
        rows.append({"n": n, "naive_bytes": naive, "tiled_bytes": tiled,
                     "inputs_bytes": 3 * batch * heads * n * d * 4})
    return rows


def memory_figure(reference: dict, saved_rows: list[dict]):
    """Left: forward peak memory measured on the H200 (reference) with the models. Right: exact bytes saved for
    backward on CPU (fp32), naive vs tiled."""
    import matplotlib.pyplot as plt

    from course_utils import attention_io as io

    fig, (ax_g, ax_c) = plt.subplots(1, 2, figsize=(12, 4))
    ref_rows = reference_rows(reference)
    for impl in ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn"):
        xs, ys = _lookup(ref_rows, impl, False, 128, "fwd_peak_mib")
        style = "s:" if impl == "sdpa_efficient" else "o-"  # efficient and cuDNN nearly coincide: keep both visible
        ax_g.plot(xs, ys, style, color=IMPLS[impl][1], label=f"measured: {IMPLS[impl][0]}", markersize=7)
    ns = [1024, 2048, 4096, 8192, 16384]
    for impl, copies, label in (("naive", 2, "model: O + S and P in fp32"), ("tiled", 0, "model: O + LSE (tiled)")):
        ax_g.plot(ns, [io.attention_peak_extra_bytes(n, 128, 2, 16, 2, impl, score_copies=copies, score_bytes=4)
                       / 2**20 for n in ns], "--", color="black" if impl == "naive" else "#1f77b4", label=label)
    ax_g.set_title("forward peak memory on the H200 (bf16, B=2, H=16, d=128)", fontsize=10)
    ax_g.set_ylabel("MiB above the inputs")
    xs = [r["n"] for r in saved_rows]
    ax_c.plot(xs, [r["naive_bytes"] / 2**20 for r in saved_rows], "o-", color=IMPLS["sdpa_math"][1],
              label="naive: saves P (N x N per head)")
    ax_c.plot(xs, [r["tiled_bytes"] / 2**20 for r in saved_rows], "o-", color=IMPLS["course_torch"][1],
              label="course tiled Function: saves O and LSE")
    ax_c.plot(xs, [r["inputs_bytes"] / 2**20 for r in saved_rows], ":", color="black", label="q, k, v themselves")
    ax_c.set_title("bytes saved for backward, exact, on CPU (fp32, B=1, H=4, d=64)", fontsize=10)
    ax_c.set_ylabel("MiB")
    for ax, axis_ns in ((ax_g, ns), (ax_c, xs)):
        _n_axis(ax, axis_ns)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
    fig.suptitle(f"left: {reference_data.label(reference)}; right: counted on this machine's CPU (exact, not timed)",
                 fontsize=9)
    fig.tight_layout()
    for ax in (ax_g, ax_c):  # under the panels: inside, the left legend covered the math and model lines
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    return fig


# ----------------------------------------------------------------------------------------------------------
# 5. The layout pitfall: (B, S, H, D) vs (B, H, S, D)
# ----------------------------------------------------------------------------------------------------------

def median_seconds(fn, reps: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def layout_timings(seqs, batch: int = 1, heads: int = 8, d: int = 64, reps: int = 5) -> list[dict]:
    """CPU wall times (fp32): three (B, S, H, D) -> (B, H, S, D) copies plus the output copied back, against
    SDPA's forward on the contiguous tensors. Timings of this machine's CPU, not of a GPU."""
    import torch
    import torch.nn.functional as F

    rows = []
    for s in seqs:
        q, k, v = (torch.randn(batch, s, heads, d) for _ in range(3))  # what a Linear + view gives: [B, S, H, D]
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, H, S, D]
        out = F.scaled_dot_product_attention(qt, kt, vt)

        def copies():
            for t in (q, k, v):
                t.transpose(1, 2).contiguous()
            out.transpose(1, 2).contiguous()

        rows.append({"seq": s, "copy_s": median_seconds(copies, reps),
                     "attention_s": median_seconds(lambda: F.scaled_dot_product_attention(qt, kt, vt), reps),
                     "copied_bytes": 4 * batch * s * heads * d * 4})
    return rows


def layout_copy_model(reference: dict, ns=(1024, 4096, 16384), batch: int = 2, heads: int = 16, d: int = 128,
                      bytes_per_element: int = 2) -> list[dict]:
    """H200: time of the four layout copies at the measured copy bandwidth (read + write of each tensor) next to
    the measured SDPA flash forward. A lower bound on the copies: a transposing copy is no faster than a plain one."""
    bw = reference["copy_TBps"] * 1e12
    flash = dict(zip(*_lookup(reference_rows(reference), "sdpa_flash", False, 128, "fwd_ms")))
    rows = []
    for n in ns:
        tensor_bytes = batch * n * heads * d * bytes_per_element
        copy_ms = 4 * 2 * tensor_bytes / bw * 1e3  # q, k, v in, out back: each read once and written once
        rows.append({"n": n, "copy_ms": copy_ms, "flash_fwd_ms": flash.get(n),
                     "copy_share": copy_ms / flash[n] if n in flash else None})
    return rows


def layout_figure(cpu_rows: list[dict], gpu_rows: list[dict], reference: dict):
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_g) = plt.subplots(1, 2, figsize=(12, 3.8))
    seqs = [r["seq"] for r in cpu_rows]
    ax_c.plot(seqs, [r["attention_s"] * 1e3 for r in cpu_rows], "o-", label="SDPA forward (B, H, S, D)")
    ax_c.plot(seqs, [r["copy_s"] * 1e3 for r in cpu_rows], "o-", label="transpose + contiguous: q, k, v, and out back")
    _n_axis(ax_c, seqs)
    ax_c.set_yscale("log")
    ax_c.set_xlabel("sequence length S")
    ax_c.set_ylabel("ms (CPU)")
    import torch

    threads = torch.get_num_threads()
    ax_c.set_title(f"measured on this machine's CPU ({threads} thread{'s' if threads > 1 else ''}, fp32, B=1, H=8, "
                   "D=64): not GPU numbers", fontsize=9)
    ax_c.legend(fontsize=9)
    labels = [f"N={r['n']}" for r in gpu_rows]
    shares = [100 * (r["copy_share"] or 0) for r in gpu_rows]
    ax_g.bar(labels, shares, color="#ff7f0e")
    for i, r in enumerate(gpu_rows):
        ax_g.text(i, shares[i], f"{r['copy_ms'] * 1e3:.0f} us vs {r['flash_fwd_ms'] * 1e3:.0f} us", ha="center",
                  va="bottom", fontsize=9)
    ax_g.set_ylim(0, 1.15 * max(shares + [1.0]))  # room above the tallest bar for its label
    ax_g.set_ylabel("copies / flash forward (%)")
    ax_g.set_title(f"H200 model: copies at {reference['copy_TBps']:.2f} TB/s vs the measured SDPA flash forward\n"
                   "(bf16, B=2, H=16, d=128; from data/reference)", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------
# 6. Showing the kernel
# ----------------------------------------------------------------------------------------------------------

def function_source(name: str, path: str | Path = ROOT / "workers" / "attention" / "triton_kernels.py") -> str:
    """The source of top-level function ``name`` in ``path``, decorators included (read from the file, so it
    works whether or not Triton compiled or interpreted the function)."""
    text = Path(path).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            return "\n".join(text.splitlines()[start - 1:node.end_lineno])
    raise KeyError(f"no top-level function {name!r} in {path}")
