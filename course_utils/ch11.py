"""Notebook-side helpers for chapter 11: the ledger's figures, ZeRO-1 results against the ledger, the memory
moments (accounted on any machine; ``torch.cuda.memory_allocated`` from committed GPU data), and FP8.

Every prediction comes from ``course_utils.ledger`` / ``course_utils.planner``, every FP8 number from
``course_utils.fp8``; measured numbers come from ranks (``workers/ch11_*.py``) or from ``data/gpu/*.json``,
files written by ``tools/gpu/ch11_memory.sh`` on a real GPU. Nothing here invents a measurement.
"""
from __future__ import annotations

import json

from course_utils import reference_data
from course_utils.ledger import (ACTIVATION_TERMS_SBH, DROPOUT_TERMS, GB, activation_bytes_per_layer,
                                 activation_terms_per_layer, model_state_bytes)
from course_utils.paths import DATA, ROOT
from course_utils.planner import Layout, plan

GPU_DATA = DATA / "gpu"
STATE_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}
MOMENTS = ("init", "forward", "backward", "step")


# -- 1. the four-state ledger -------------------------------------------------------------------------------

def ledger_plans(model: str, dps: tuple[int, ...], *, tp: int = 1, pp: int = 1, seq: int = 4096) -> dict:
    """{(dp, stage): Plan} for ZeRO stages 0-3 at each DP size (n_gpus = tp * pp * dp)."""
    out = {}
    for dp in dps:
        for stage in range(4):
            layout = Layout(tp=tp, pp=pp, zero=stage, seq=seq, sequence_parallel=True)
            out[(dp, stage)] = plan(model, layout, tp * pp * dp)
    return out


def ledger_figure(plans: dict, title: str, ax=None):
    """Grouped stacked bars: for each DP size, DDP and ZeRO-1/2/3, four states per GPU, GPU memory dashed."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.8))
    dps = sorted({dp for dp, _ in plans})
    x = 0.0
    ticks, labels = [], []
    for dp in dps:
        for stage in range(4):
            p = plans[(dp, stage)]
            bottom = 0.0
            for state, colour in STATE_COLOURS.items():
                v = p.memory[state] / GB
                ax.bar(x, v, bottom=bottom, color=colour, width=0.8, label=state if (dp, stage) == (dps[0], 0) else None)
                bottom += v
            ticks.append(x)
            labels.append("DDP" if stage == 0 else f"Z{stage}")
            x += 1
        ax.text(x - 2.5, -0.16, f"dp={dp}", transform=ax.get_xaxis_transform(), ha="center", fontsize=9)
        x += 0.8
    mem = next(iter(plans.values())).gpu_memory_bytes / GB
    ax.axhline(mem, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("GB per GPU (1e9 bytes)")
    ax.set_title(title + f"  (dashed: {mem:.1f} GB)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


# -- 2. ZeRO-1 on ranks against the ledger ------------------------------------------------------------------

def ledger_optimizer_bytes(n_params: int, world_size: int, bytes_per_param: float) -> float:
    """The ledger's optimizer bytes per GPU for ZeRO-1 at this DP size (K = bytes_per_param)."""
    return model_state_bytes(n_params, dp=world_size, zero_stage=1, optimizer_bytes_per_param=bytes_per_param).optimizer


def bytes_rows(results: dict) -> list[list[str]]:
    """``results``: {label: RunResult of workers.ch11_zero1}. One row per run: measured per-rank bytes vs ledger."""
    rows = []
    for label, res in results.items():
        r0 = res[0]
        n, k, world = r0["n_params"], r0["state_bytes_per_param"], len(res)
        per_rank = [s["elementwise"] + s["master"] for s in res.gather("state_bytes")]
        ledger = ledger_optimizer_bytes(n, world, k)
        rows.append([label, str(world), f"{n:,}", f"{k}", ", ".join(f"{b:,}" for b in per_rank), f"{ledger:,.0f}",
                     "equal" if all(b == ledger for b in per_rank) else
                     f"max/ledger = {max(per_rank) / ledger:.3f}, sum/(K*P) = {sum(per_rank) / (k * n):.3f}"])
    return rows


def bytes_figure(flat: dict, params: dict, ax=None):
    """Per-rank optimizer bytes against world size: the ledger's K*P/N line, each rank's measurement as a dot."""
    import matplotlib.pyplot as plt

    from course_utils.plots import log2_axis

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.6))
    any_res = next(iter(flat.values()))
    n, k = any_res[0]["n_params"], any_res[0]["state_bytes_per_param"]
    worlds = sorted(flat)
    ax.plot(worlds, [ledger_optimizer_bytes(n, w, k) for w in worlds], "-", color="black", label="ledger K·P/N")
    for results, marker, colour, name in ((flat, "o", "#4C72B0", "flat partition"),
                                         (params, "x", "#C44E52", "whole-tensor partition")):
        for w, res in sorted(results.items()):
            ys = [s["elementwise"] + s["master"] for s in res.gather("state_bytes")]
            ax.scatter([w] * len(ys), ys, marker=marker, color=colour, s=40, zorder=3,
                       label=name if w == min(results) else None)
    log2_axis(ax, worlds, "data-parallel ranks N")
    ax.set_ylabel("optimizer-state bytes on each rank")
    ax.set_title(f"measured on real ranks (gloo, CPU): {n:,} parameters, K = {k}", fontsize=10)
    ax.legend(fontsize=8)
    return ax


# -- 3. memory at the four moments ----------------------------------------------------------------------------

def moments_of(rank_result: dict, step: int | None = None) -> list[dict]:
    """The init moment and the four moments of ``step`` (default: the last, the steady state)."""
    moments = rank_result["moments"]
    last = max(m["step"] for m in moments) if step is None else step
    return [m for m in moments if m["step"] == 0] + [m for m in moments if m["step"] == last and m["moment"] != "init"]


def ledger_moment(config: dict, n_params: int, step: int, moment: str) -> dict:
    """What the ledger predicts, in bytes per rank, at ``moment`` of ``step`` (step 0 is init) of a ch11_memory run.

    Weights and gradients stay allocated throughout (the flat buffers). Optimizer state is the fp32 master shard
    from init (with bf16 weights), plus Adam's moments once the first step has run (K = 4 + 8 = 12 then).
    Activations, Korthikanti et al. 2022 Table 2 with selective recomputation (no stored scores, as SDPA), exist
    only between forward and backward.
    """
    bf16 = config["dtype"] == "bfloat16"
    w = 2 if bf16 else 4
    dp = config["world_size"] if config["zero"] == 1 else 1
    stepped = step >= 2 or (step == 1 and moment == "step")
    k = (4 if bf16 else 0) + ((8 if config["optimizer"] == "adamw" else 4) if stepped else 0)
    states = model_state_bytes(n_params, dp=dp, zero_stage=1, weight_bytes=w, grad_bytes=w,
                               optimizer_bytes_per_param=k)
    act = 0.0
    if moment == "forward":
        act = config["layers"] * activation_bytes_per_layer(config["seq"], config["micro_batch"], config["hidden"],
                                                            config["heads"], recompute="selective") * w / 2
    return {"params": states.params, "grads": states.grads, "optimizer": states.optimizer, "activations": act}


def ledger_moments(config: dict, n_params: int) -> dict:
    """The ledger at init and at the four moments of a steady-state step (after the first): {moment: bytes}."""
    return {m: ledger_moment(config, n_params, 0 if m == "init" else 2, m) for m in MOMENTS}


def moment_rows(runs: dict) -> list[list[str]]:
    """Table rows for ``{label: rank-0 result of ch11_memory}``: every moment of every step (so the first step,
    when Adam allocates its moments, is visible), accounted bytes per state, the saved tensors still alive, and
    the ledger's model states at that moment."""
    rows = []
    for label, r in runs.items():
        for m in r["moments"]:
            acc = m["accounted"]
            want = ledger_moment(r["config"], r["n_params"], m["step"], m["moment"])
            where = "init" if m["moment"] == "init" else f"step {m['step']}: {m['moment']}"
            rows.append([label, where] + [f"{acc[k]:,}" for k in STATE_COLOURS]
                        + [str(m.get("saved_tensors_alive", "")),
                           f"{sum(want[k] for k in ('params', 'grads', 'optimizer')):,.0f}"])
    return rows


def activation_terms(config: dict, device: str = "cpu") -> list[dict]:
    """What the forward pass of a ``workers/ch11_memory.py`` run saves for backward, term by term, in bytes per
    rank: [{"term", "source", "bytes"}]. Their sum is what that worker accounts after the forward (exactly, on the
    CPU; the test checks it).

    The transformer layers: Korthikanti et al. 2022, section 4.1, eq. (1), with selective recomputation's
    terms (section 5: no s x s scores; SDPA never stores them) and without the dropout masks, which this block
    does not have: 32 of the 34 sbh per layer (``ledger.activation_terms_per_layer(..., dropout=False)``). On top,
    what the paper leaves out: each LayerNorm's mean and 1/std ([b, s], in the activations' dtype on the CPU,
    fp32 on CUDA), SDPA's fp32 log-sum-exp ([b, a, s], what it keeps instead of the softmax), and, outside the
    layers, the token ids of the embedding, the final LayerNorm, the LM head's input, the fp32 log-probabilities
    of the loss ([b, s, V]), the targets and the loss's 4-byte normaliser.
    """
    b, s, h, a = config["micro_batch"], config["seq"], config["hidden"], config["heads"]
    layers, vocab = config["layers"], config["vocab"]
    w = 2 if config["dtype"] == "bfloat16" else 4
    stats = 4 if str(device).startswith("cuda") else w
    sbh = s * b * h
    per_layer = activation_terms_per_layer(s, b, h, a, recompute="selective", dropout=False, bytes_per_element=w)
    kept = ", ".join(f"{name} {units}" for name, units in ACTIVATION_TERMS_SBH.items() if name not in DROPOUT_TERMS)
    masks = " and ".join(name for name in ACTIVATION_TERMS_SBH if name in DROPOUT_TERMS)
    rows = [
        {"term": f"layers: {sum(per_layer.values()) / (sbh * w / 2):g} sbh each ({kept})"
                 + (" x 2 for fp32" if w == 4 else ""),
         "source": "Korthikanti et al. 2022, sec 4.1, eq. (1); selective recomputation (sec 5): no s x s terms",
         "bytes": layers * sum(per_layer.values())},
        {"term": f"layers: {masks}, 1 sbh each", "source": "in eq. (1); this block has no dropout", "bytes": 0},
        {"term": f"layers: LayerNorm mean and 1/std, 2 per LayerNorm, [b, s] x {stats} B",
         "source": "not in the paper", "bytes": layers * 2 * 2 * b * s * stats},
        {"term": "layers: SDPA log-sum-exp, fp32 [b, a, s]", "source": "not in the paper (replaces the softmax)",
         "bytes": layers * a * b * s * 4},
        {"term": "token ids for the embedding's backward, int64 [b, s]", "source": "outside the layers",
         "bytes": b * s * 8},
        {"term": "final LayerNorm: input 2sbh and mean, 1/std", "source": "outside the layers",
         "bytes": sbh * w + 2 * b * s * stats},
        {"term": "LM head input (the final LayerNorm's output) 2sbh", "source": "outside the layers",
         "bytes": sbh * w},
        {"term": "loss: fp32 log-probabilities [b, s, V]", "source": "outside the layers",
         "bytes": b * s * vocab * 4},
        {"term": "loss: int64 targets [b, s] and the fp32 normaliser", "source": "outside the layers",
         "bytes": b * s * 8 + 4},
    ]
    return [{**r, "bytes": int(r["bytes"])} for r in rows]


def moments_figure(runs: dict, *, gpu: bool = False, title: str = "", unit: float = 2**20, unit_name: str = "MiB"):
    """One panel per run ({label: rank-0 result of ch11_memory}): accounted bytes stacked by state at each moment,
    the ledger's total as a black tick, and ``cuda_allocated`` as a hollow bar when ``gpu``."""
    import matplotlib.pyplot as plt

    cols = len(runs) if len(runs) <= 3 else 2  # 4 runs in a row would be shown at half size: 2 x 2
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols + 1.5, 3.0 * rows + 0.6), sharey=True, squeeze=False)
    for ax in axes.flat[len(runs):]:
        fig.delaxes(ax)
    for ax, (label, r) in zip(axes.flat, runs.items()):
        ms = moments_of(r)
        ledger = ledger_moments(r["config"], r["n_params"])
        for i, m in enumerate(ms):
            bottom = 0.0
            for state, colour in STATE_COLOURS.items():
                v = m["accounted"][state] / unit
                ax.bar(i - (0.18 if gpu else 0), v, bottom=bottom, width=0.36 if gpu else 0.6, color=colour,
                       label=state if (i == 0 and ax is axes[0][0]) else None)
                bottom += v
            total = sum(ledger[m["moment"]].values()) / unit
            ax.hlines(total, i - 0.4, i + 0.4, color="black", linewidth=2,
                      label="ledger" if (i == 0 and ax is axes[0][0]) else None)
            if gpu and "cuda_allocated" in m:
                alloc = (m["cuda_allocated"] - r.get("baseline_cuda_allocated", 0)) / unit
                ax.bar(i + 0.18, alloc, width=0.36, fill=False, edgecolor="black", hatch="//",
                       label="cuda memory_allocated" if (i == 0 and ax is axes[0][0]) else None)
        ax.set_xticks(range(len(ms)), [m["moment"] for m in ms], fontsize=9)
        ax.set_title(label, fontsize=10)
    for row in axes:
        row[0].set_ylabel(unit_name)
    fig.legend(fontsize=8.5, loc="upper left", bbox_to_anchor=(1.0, 0.95), frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def gpu_data(kind: str = "memory") -> dict | None:
    """Committed GPU measurements (``tools/gpu/ch11_memory.sh``): data/gpu/ch11_<kind>_h200.json, else any GPU's."""
    preferred = GPU_DATA / f"ch11_{kind}_h200.json"
    paths = [preferred] if preferred.exists() else sorted(GPU_DATA.glob(f"ch11_{kind}_*.json"))
    if not paths:
        return None
    data = json.loads(paths[0].read_text())
    data["path"] = str(paths[0].relative_to(ROOT))
    return data


def gpu_memory_report(data: dict, title: str | None = None):
    """Figure and text for a GPU memory record (the JSON ``tools/gpu/ch11_memory.sh`` writes): every run that
    succeeded is drawn (accounted bytes, ledger, ``torch.cuda.memory_allocated``); every run that failed is named."""
    ok = {f"{'DDP' if r['zero'] == 0 else 'ZeRO-1'}, N={r['world_size']}": r["ranks"][0]
          for r in data["runs"] if "ranks" in r}
    lines = [f"GPU measurement: {reference_data.label(data)}"]
    lines += [f"  world {r['world_size']} zero {r['zero']} ({r.get('grad_sync', '')}) failed: {r['error']}"
              for r in data["runs"] if "error" in r]
    for label, r in ok.items():
        steady = moments_of(r)
        alloc = ", ".join(f"{m['moment']} {(m['cuda_allocated'] - r.get('baseline_cuda_allocated', 0)) / 2**30:.2f}"
                          for m in steady if "cuda_allocated" in m)
        lines.append(f"  {label} ({r['n_params'] / 1e9:.2f}e9 parameters), memory_allocated GiB: {alloc}")
    fig = moments_figure(ok, gpu=True, unit=2**30, unit_name="GiB",
                         title=title or f"{reference_data.label(data)}; hatched: torch.cuda.memory_allocated") if ok else None
    return fig, "\n".join(lines)


def live_memory_record(shape: dict | None = None, worlds: tuple[int, ...] = (1, 2),
                       zero_stages: tuple[int, ...] = (0, 1), timeout: float = 900) -> dict:
    """Run ``workers/ch11_memory.py`` now for DDP and ZeRO-1 at each world size (on one GPU, world 2 is two ranks
    sharing it: gloo on CUDA tensors, ZeRO-1's reduce-scatter and all-gather through host copies), and return a
    record in the format ``tools/gpu/ch11_memory.sh`` commits, for ``gpu_memory_report``. ``shape``: worker
    parameters (default: the worker's own ~1.1B-parameter shape, for a GPU). As in that script, ZeRO-1 falls
    back to ``grad_sync="all_reduce"`` if the reduce-scatter fails, and every failure is recorded, not raised."""
    import course_utils as cu
    from workers.provenance import record as provenance

    record = {"provenance": provenance(f"course_utils.ch11.live_memory_record(worlds={tuple(worlds)}, "
                                       f"zero_stages={tuple(zero_stages)})"), "live": True, "runs": []}
    for world in worlds:
        for zero in zero_stages:
            for grad_sync in ("reduce_scatter", "all_reduce"):
                try:
                    res = cu.run("workers.ch11_memory", world, zero=zero, grad_sync=grad_sync, timeout=timeout,
                                 **(shape or {}))
                    record["runs"].append({"world_size": world, "zero": zero, "grad_sync": grad_sync,
                                           "backend": res.backend, "ranks": res.ranks})
                    break
                except cu.InvalidParameter:
                    raise
                except Exception as exc:  # noqa: BLE001 - record it, try the next setting
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    record["runs"].append({"world_size": world, "zero": zero, "grad_sync": grad_sync,
                                           "error": f"{type(exc).__name__}: {first}"})
                    if zero == 0:
                        break  # DDP does not reduce-scatter; nothing else to try
    return record


def gemm_report(g: dict) -> str:
    """Text for an FP8 GEMM record (``workers/ch11_fp8_gemm.py``, live or committed)."""
    if not g.get("available"):
        return f"FP8 GEMM not measured: {g.get('reason') or g.get('error', 'unknown reason')}"
    lines = [f"{g['size']}^3 GEMM on {reference_data.label(g)}:"]
    for name in ("bf16", "fp8_e4m3_per_tensor"):
        r = g.get(name, {})
        if "error" in r:
            lines.append(f"  {name:<20} failed: {r['error']}")
        else:
            lines.append(f"  {name:<20} {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s, relative error {r['rel_error']:.4f}")
    if "ms" in g.get("bf16", {}) and "ms" in g.get("fp8_e4m3_per_tensor", {}):
        lines.append(f"  FP8 speed-up over bf16: {g['bf16']['ms'] / g['fp8_e4m3_per_tensor']['ms']:.2f}x")
    return "\n".join(lines)


# -- 4. FP8 -----------------------------------------------------------------------------------------------------

def outlier_activation(rows: int = 256, cols: int = 1024, n_outliers: int = 4, outlier_scale: float = 100.0,
                       seed: int = 0):
    """Activations [tokens, channels] ~ N(0, 1) with ``n_outliers`` channels ``outlier_scale`` times larger:
    the systematic outlier features of large transformers (Dettmers et al. 2022, LLM.int8(), section 3)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    channels = torch.randperm(cols, generator=g)[:n_outliers]
    x[:, channels] *= outlier_scale
    return x, channels


def granularity_errors(outlier_scales=(1, 10, 1e2, 1e3, 1e4, 1e5, 1e6), fmt: str = "e4m3") -> dict:
    """Relative error of fake-quantised activations, per granularity, on the ordinary channels only (the
    outliers themselves are always represented well: they set the scale)."""
    import torch

    from course_utils.fp8 import GRANULARITIES, fake_quantize, relative_error

    out = {g: [] for g in GRANULARITIES}
    for scale in outlier_scales:
        x, channels = outlier_activation(outlier_scale=float(scale))
        ordinary = torch.ones(x.shape[1], dtype=torch.bool)
        ordinary[channels] = False
        for g in GRANULARITIES:
            q = fake_quantize(x, fmt, g)
            out[g].append(relative_error(x[:, ordinary], q[:, ordinary]))
    return out


def granularity_figure(outlier_scales=(1, 10, 1e2, 1e3, 1e4, 1e5, 1e6)):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, fmt in zip(axes, ("e4m3", "e5m2")):
        errors = granularity_errors(outlier_scales, fmt)
        for g, style in zip(errors, ("o-", "s--", "^:")):
            ax.plot(outlier_scales, errors[g], style, label={"tensor": "per tensor", "tile": "per 1x128 tile",
                                                              "block": "per 128x128 block"}[g])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("outlier channels' magnitude / the rest")
        ax.set_title(f"{fmt.upper()}: error on the ordinary channels", fontsize=10)
    axes[0].set_ylabel("relative error (Frobenius)")
    axes[1].legend(fontsize=8)
    fig.suptitle("4 outlier channels in a 256 x 1024 activation (computed on the CPU with torch's FP8 casts)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def scaling_history(steps: int = 40, spike_at: int = 25, spike: float = 20.0, history_len: int = 16,
                    seed: int = 0) -> dict:
    """A tensor whose amax drifts slowly, then jumps ``spike`` times at ``spike_at`` for one step.

    For each step: the scale each recipe uses, the fraction of elements delayed scaling saturates, and both
    relative errors. Delayed scaling (Transformer Engine's DelayedScaling) uses the history of earlier amaxes;
    current scaling uses this tensor's own amax."""
    import torch

    from course_utils.fp8 import DelayedScaling, current_scale, fake_quantize, relative_error, saturated_fraction

    g = torch.Generator().manual_seed(seed)
    delayed = DelayedScaling("e4m3", history_len=history_len)
    out = {k: [] for k in ("amax", "delayed_scale", "current_scale", "saturated", "delayed_error", "current_error")}
    for step in range(steps):
        x = torch.randn(128, 512, generator=g) * (1 + 0.02 * step)
        if step == spike_at:
            x[:4] *= spike  # a few tokens with much larger activations: amax jumps, most values do not
        scale = delayed.scale
        q_delayed = delayed.quantize(x).dequantize()
        out["amax"].append(float(x.abs().max()))
        out["delayed_scale"].append(float(scale))
        out["current_scale"].append(float(current_scale(x)))
        out["saturated"].append(saturated_fraction(x, scale))
        out["delayed_error"].append(relative_error(x, q_delayed))
        out["current_error"].append(relative_error(x, fake_quantize(x, "e4m3", "tensor")))
    return out


def scaling_figure(**kw):
    import matplotlib.pyplot as plt

    h = scaling_history(**kw)
    steps = range(len(h["amax"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, h["amax"], "k-", label="amax of the tensor")
    ax1.plot(steps, [448 / s for s in h["delayed_scale"]], "--", color="#C44E52",
             label="amax delayed scaling assumes (history)")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.legend(fontsize=8)
    ax1.set_title("a spike in amax", fontsize=10)
    ax2.plot(steps, h["delayed_error"], "-", color="#C44E52", label="delayed scaling")
    ax2.plot(steps, h["current_error"], "-", color="#4C72B0", label="current scaling")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("relative error")
    ax2.legend(fontsize=8)
    ax2.set_title("E4M3 error per step (CPU, torch casts)", fontsize=10)
    fig.tight_layout()
    return fig, h


def emulated_gemm_errors(m: int = 512, k: int = 1024, n: int = 512, outlier_scale: float = 100.0, seed: int = 0):
    """Relative error of C = A B against fp32 for bf16 inputs and for E4M3 inputs at each granularity (A: activations
    with outlier channels along K, scaled along K in 1x128 tiles or 128x128 blocks; B: weights, scaled the same
    way along K). Products are accumulated in fp32, as tensor cores do; this is emulation on the CPU."""
    import torch

    from course_utils.fp8 import fake_quantize, relative_error

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    a[:, torch.randperm(k, generator=g)[:4]] *= outlier_scale  # [m, k]
    b = torch.randn(k, n, generator=g) / k**0.5  # [k, n]
    ref = a @ b
    out = {"bf16": relative_error(ref, (a.bfloat16().float() @ b.bfloat16().float()))}
    for gran in ("tensor", "tile", "block"):
        aq = fake_quantize(a, "e4m3", gran)  # groups run along k, the contraction dimension
        bq = fake_quantize(b.t().contiguous(), "e4m3", gran).t()
        out[f"e4m3 per {gran}"] = relative_error(ref, aq @ bq)
    return out


# -- 4. ZeRO-2 and ZeRO-3 by hand, and FSDP2 ------------------------------------------------------------------

ZERO3_SETTINGS = ((False, True), (True, True), (False, False), (True, False))  # (prefetch, reshard_after_forward)


def zero3_setting(prefetch: bool, reshard: bool) -> str:
    return f"prefetch {'on' if prefetch else 'off'}, reshard_after_forward {'on' if reshard else 'off'}"


def zero3_expected_peak(r: dict, prefetch: bool, reshard: bool) -> int:
    """Whole-parameter bytes at the peak, from the units alone: the root and one block whole at a time (two with
    prefetch), or every unit when nothing is freed after forward."""
    size = {u["name"]: u["bytes"] for u in r["units"]}
    root, blocks = size.pop("root"), sorted(size.values())
    if not reshard:
        return root + sum(blocks)
    return root + sum(blocks[-(2 if prefetch and len(blocks) > 1 else 1):])


def zero3_rows(runs: dict) -> list[list[str]]:
    """``runs``: {(prefetch, reshard): rank 0's result of workers.ch11_zero3}. Peak whole parameters against the
    units' sizes, and one step's traffic against 3 Psi (n-1)/n (2 Psi without resharding), Psi the padded model."""
    rows = []
    for (prefetch, reshard), r in runs.items():
        n, steps = r["world_size"], r["steps"]
        sent = (r["comm_bytes"]["all_gather"] + r["comm_bytes"]["reduce_scatter"]) / steps
        times = 3 if reshard else 2
        formula = times * (n - 1) / n * r["padded_bytes"]
        peak, expected = r["peak_params"], zero3_expected_peak(r, prefetch, reshard)
        rows.append([zero3_setting(prefetch, reshard), f"{peak:,}", f"{expected:,}",
                     f"{r['calls']['all_gather'] // steps} + {r['calls']['reduce_scatter'] // steps}",
                     f"{sent:,.0f}", f"{times}Ψ(n-1)/n = {formula:,.0f}",
                     "equal" if peak == expected and sent == formula else "DIFFERENT"])
    return rows


def zero3_timeline_figure(runs: dict, unit: float = 1024, axes=None):
    """Whole parameters (and whole gradients in ``.grad``) on rank 0 after every hook of one step, one panel per
    setting; the x axis counts the events in order (their times on a shared CPU are noise)."""
    import matplotlib.pyplot as plt

    fig = None
    if axes is None:  # 4 settings in a row would be shown at half size: 2 x 2
        cols = len(runs) if len(runs) <= 2 else 2
        rows = -(-len(runs) // cols)
        fig, grid = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.0 * rows), sharey=True, squeeze=False)
        for ax in grid.flat[len(runs):]:
            fig.delaxes(ax)
        axes = list(grid.flat[:len(runs)])
    for ax, ((prefetch, reshard), r) in zip(axes, runs.items()):
        events = r["timeline"]
        xs = range(len(events))
        ax.step(xs, [e["params"] / unit for e in events], where="post", color=STATE_COLOURS["params"],
                label="whole parameters")
        ax.step(xs, [e["grads"] / unit for e in events], where="post", color=STATE_COLOURS["grads"],
                label="whole gradients (.grad)")
        for i, e in enumerate(events):  # upright labels: forward's gathers are two events apart
            if e["kind"] in ("gather", "prefetch"):
                ax.annotate(e["unit"].replace("unit", "b"), (i, e["params"] / unit), xytext=(0, 2),
                            textcoords="offset points", fontsize=7.5, rotation=90, ha="center", va="bottom",
                            color="#333333")
        backward = next((i for i, e in enumerate(events) if e["kind"] == "grad"), None)
        if backward is not None:
            ax.axvline(backward - 0.5, color="grey", lw=0.8, ls=":")
        ax.axhline(r["padded_bytes"] / unit, color="black", lw=0.8, ls="--", label="the whole model")
        ax.set_title(zero3_setting(prefetch, reshard), fontsize=10)
        ax.set_xlabel("hook events in order (forward | backward)")
    top = 1.15 * max(r["padded_bytes"] for r in runs.values()) / unit  # room for the labels over the whole model
    for ax in axes:
        ax.set_ylim(top=top)
        if ax.get_subplotspec() is None or ax.get_subplotspec().is_first_col():
            ax.set_ylabel("KiB on rank 0" if unit == 1024 else f"bytes / {unit:g}")
    if fig is None:
        axes[0].legend(fontsize=8, loc="upper left")
    else:  # under the panels: inside, it covered the whole model's line
        fig.tight_layout()
        fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3,
                   fontsize=9, frameon=False)
    return axes


def fsdp2_rows(r: dict) -> list[list[str]]:
    """One step's collectives, by hand and by FSDP2, side by side: (kind, bytes in -> bytes out), in order; the
    hand version's extra call (the root's second all-gather) is marked."""
    hand, native = list(r["hand_calls"]), list(r["fsdp2_calls"])
    rows, j = [], 0
    for call in hand:
        theirs = native[j] if j < len(native) else None
        if theirs is not None and tuple(theirs) == tuple(call):
            rows.append([call[0], f"{call[1]:,} -> {call[2]:,}", f"{theirs[1]:,} -> {theirs[2]:,}", "same"])
            j += 1
        else:
            rows.append([call[0], f"{call[1]:,} -> {call[2]:,}", "(none)", "FSDP2 keeps its root whole"
                         if call == hand[0] else "differs"])
    for theirs in native[j:]:
        rows.append([theirs[0], "(none)", f"{theirs[1]:,} -> {theirs[2]:,}", "differs"])
    return rows


# -- 4b. ZeRO-3 with a mixed-precision policy ---------------------------------------------------------------------

# Mixed-precision ZeRO-3 (bf16 compute, fp32 reduce and master) against one process, SGD, 3 steps: measured 1.3e-4 to
# 2.4e-4 over seeds 0-2, world 2 and 4, native/avx2/default kernels (tests/test_zero3_mixed.py); fp32 is ~1e-7.
BF16_TOL = 1e-3


def mixed_wire_rows(runs: dict) -> list[list[str]]:
    """``runs``: {label: rank 0's result of workers.ch11_zero3_mixed}. One step's bytes sent per rank (ring
    accounting) by kind, against the formula: 2 all-gathers of Psi' elements in the param dtype, one reduce-scatter
    in the reduce dtype, each (n-1)/n on the wire."""
    size = {"bfloat16": 2, "float16": 2, "float32": 4}
    rows = []
    for label, r in runs.items():
        n, padded = r["world_size"], r["padded_numel"]
        ring = (n - 1) / n
        want = {"all_gather": 2 * size[r["param_dtype"]] * padded * ring,
                "reduce_scatter": size[r["reduce_dtype"]] * padded * ring}
        got = r["hand_comm_bytes"]
        rows.append([label, f"{got['all_gather']:,.0f}", f"{got['reduce_scatter']:,.0f}",
                     f"{got['all_gather'] + got['reduce_scatter']:,.0f}",
                     "equal" if got == want else f"DIFFERENT from {want}"])
    return rows


def mixed_moment_rows(r: dict, state_bytes: int) -> list[list[str]]:
    """Rank 0's bytes at the four moments of the first two steps of a mixed-precision ZeRO-3 run, by state, against
    the ledger's mixed-precision row at stage 3: 2 + 2 + K bytes per parameter over N, K = 4 (fp32 master) plus the
    optimizer's ``state_bytes`` once the first step has made them."""
    n, padded = r["world_size"], r["padded_numel"]
    rows = []
    for m in r["moments"]:
        if m["step"] > 2:
            continue
        stepped = m["step"] >= 2 or (m["step"] == 1 and m["moment"] == "step")
        ledger = model_state_bytes(padded, dp=n, zero_stage=3, weight_bytes=2, grad_bytes=2,
                                   optimizer_bytes_per_param=4 + (state_bytes if stepped else 0))
        held = m["params"] + m["grads"] + m["optimizer"]
        where = "init" if m["moment"] == "init" else f"step {m['step']}: {m['moment']}"
        rows.append([where, f"{m['params']:,}", f"{m['gathered']:,}", f"{m['grads']:,}", f"{m['optimizer']:,}",
                     f"{held:,}", f"{ledger.total:,.0f}",
                     "equal" if held == ledger.total else f"{held - ledger.total:+,.0f} (buckets in flight)"])
    return rows


ZERO_WIRE_PASSES = {0: 2, 1: 2, 2: 2, 3: 3}  # ZeRO sec 7.2: Psi per pass, (n-1)/n of it on the wire per rank


def stage_expected(r: dict, step: int, moment: str) -> dict:
    """What the ledger says a rank of a ``workers/ch11_stages.py`` run holds at ``moment`` of ``step`` (0 = init):
    ``model_state_bytes`` at this stage, evaluated at the padded parameter count Ψ' the flat buffers really hold
    (Ψ' = Ψ rounded up so every buffer splits into N equal shards), fp32 weights and gradients, and AdamW's
    K = 8 bytes once its first step has created the moments."""
    stepped = step >= 2 or (step == 1 and moment == "step")
    s = model_state_bytes(r["padded_numel"], dp=r["world_size"], zero_stage=r["stage"], weight_bytes=4,
                          grad_bytes=4, optimizer_bytes_per_param=8 if stepped else 0)
    return {"params": s.params, "grads": s.grads, "optimizer": s.optimizer}


def stage_wire_bytes(r: dict) -> float:
    """The ZeRO paper's traffic for one step of this run: 2Ψ'(n-1)/n for stages 0-2, 3Ψ'(n-1)/n for stage 3."""
    n = r["world_size"]
    passes = ZERO_WIRE_PASSES[r["stage"]] if r["stage"] < 3 or r["config"]["reshard_after_forward"] else 2
    return passes * (n - 1) / n * 4 * r["padded_numel"]


def stage_rows(runs: dict) -> list[list[str]]:
    """``runs``: {stage: rank 0's result of workers.ch11_stages}. One row per stage: what a rank holds after the
    last step's backward (the steady state's fullest moment), against the ledger; and one step's traffic, caught
    from the dispatched collectives, against the paper."""
    rows = []
    for stage, r in runs.items():
        last = max(m["step"] for m in r["moments"])
        held = next(m for m in r["moments"] if m["step"] == last and m["moment"] == "backward")
        want = stage_expected(r, last, "backward")
        every = all({k: m[k] for k in want} == stage_expected(r, m["step"], m["moment"]) for m in r["moments"])
        sent = sum(c["wire_bytes"] for c in r["comm"].values())
        calls = ", ".join(f"{c['calls']} {k}" for k, c in r["comm"].items())
        rows.append([f"ZeRO-{stage}" if stage else "DDP (stage 0)", f"{held['params']:,}", f"{held['grads']:,}",
                     f"{held['optimizer']:,}", f"{sum(want.values()):,.0f}", calls, f"{sent:,.0f}",
                     f"{stage_wire_bytes(r):,.0f}",
                     "equal" if every and sent == stage_wire_bytes(r) else "DIFFERENT"])
    return rows


def stages_live_draw(res, params: dict):
    """The chapter's explorer: for the stage, world size and switches chosen, every rank's bytes at the moments of
    the run (stacked by state; stage 3 adds the last step's hook timeline of whole parameters) and the messages of
    one step against the ZeRO paper's total."""
    import matplotlib.pyplot as plt

    ranks = res.ranks
    r0 = ranks[0]
    stage = r0["stage"]
    panels = 3 if stage == 3 else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 3.6))
    ax = axes[0]
    labels = ["init" if m["step"] == 0 else f"{m['moment'][0]}{m['step']}" for m in r0["moments"]]
    width = 0.8 / len(ranks)
    for k, r in enumerate(ranks):
        bottom = [0.0] * len(labels)
        for state in ("params", "grads", "optimizer"):
            ys = [m[state] / 1024 for m in r["moments"]]
            xs = [i + (k - (len(ranks) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, ys, width, bottom=bottom, color=STATE_COLOURS[state], edgecolor="white", lw=0.3,
                   label=state if k == 0 else None)
            bottom = [b + y for b, y in zip(bottom, ys)]
    want = [sum(stage_expected(r0, m["step"], m["moment"]).values()) / 1024 for m in r0["moments"]]
    ax.step(range(len(labels)), want, where="mid", color="black", lw=1, label="ledger (per rank)")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("KiB held, each rank (bars side by side)")
    ax.set_title(f"ZeRO-{stage} on {len(ranks)} rank(s): i = init, f/b/s = after forward/backward/step", fontsize=9)
    ax.legend(fontsize=7)
    if stage == 3:
        ax = axes[1]
        for k, r in enumerate(ranks):
            ax.step(range(len(r["timeline"])), [e["params"] / 1024 for e in r["timeline"]], where="post",
                    label=f"rank {k}", alpha=0.8)
        ax.set_xlabel("hook events of the last step, in order")
        ax.set_ylabel("KiB of whole parameters")
        cfg = r0["config"]
        ax.set_title(zero3_setting(cfg["prefetch"], cfg["reshard_after_forward"]), fontsize=9)
        ax.legend(fontsize=7)
    ax = axes[-1]
    kinds = list(r0["comm"])
    ax.bar(kinds, [r0["comm"][k]["wire_bytes"] / 1024 for k in kinds], color="#8172B3")
    for i, k in enumerate(kinds):
        ax.annotate(f"{r0['comm'][k]['calls']} call(s)", (i, r0["comm"][k]["wire_bytes"] / 1024), ha="center",
                    va="bottom", fontsize=8)
    paper = stage_wire_bytes(r0) / 1024
    ax.axhline(paper, color="black", lw=1, ls="--", label=f"paper, all kinds: {paper:,.1f} KiB")
    ax.set_ylabel("KiB sent by rank 0 in one step (ring)")
    ax.set_title(f"sent: {sum(c['wire_bytes'] for c in r0['comm'].values()) / 1024:,.1f} KiB", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
