"""Chapter 08, notebook side: floating-point formats, measured, and the figures of the mixed-precision half.

Every number here is read from ``torch.finfo`` or measured by casting in torch; the only typed-in numbers
are the published constants in ``PUBLISHED``, which ``tests/test_ch08_precision.py`` checks against torch:

- fp32, fp16: IEEE 754-2008 binary32 and binary16 (fp16's largest finite value is 65504);
- bf16: the top 16 bits of an fp32 number (8 exponent bits, 7 mantissa bits: fp32's range, less precision);
- FP8 E4M3 and E5M2: the OCP "8-bit Floating Point Specification (OFP8)" v1.0 (2023) and Micikevicius et al.
  2022, "FP8 Formats for Deep Learning", Table 1. E4M3 (``torch.float8_e4m3fn``, "fn": finite, no infinities)
  has max 448; E5M2 (``torch.float8_e5m2``) follows IEEE conventions, max 57344.

Rank-side results come from ``workers/ch08_precision.py``; the ``draw_*`` functions return a figure that the
notebook saves with ``course_utils.plots.savefig``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils.plots import log2_axis
from course_utils.tables import Table

FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# Published values, each checked against torch.finfo / the bit patterns in tests/test_ch08_precision.py.
PUBLISHED = {
    "fp16": {"max": 65504.0, "smallest_subnormal": 2.0**-24, "source": "IEEE 754-2008, binary16"},
    "fp8_e4m3": {"max": 448.0, "smallest_subnormal": 2.0**-9,
                 "source": "OCP OFP8 v1.0; Micikevicius et al. 2022, Table 1"},
    "fp8_e5m2": {"max": 57344.0, "smallest_subnormal": 2.0**-16,
                 "source": "OCP OFP8 v1.0; Micikevicius et al. 2022, Table 1"},
}
_INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}  # same-width integer type, to read bit patterns


def _dtype(fmt) -> torch.dtype:
    if isinstance(fmt, torch.dtype):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def _name(dtype: torch.dtype) -> str:
    return next(k for k, v in FORMATS.items() if v == dtype)


# -- the format table ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FormatInfo:
    name: str
    dtype: torch.dtype
    bits: int
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits (the leading 1 of a normal number is implicit)
    max: float  # largest finite value
    smallest_normal: float
    smallest_subnormal: float  # the bit pattern 0...01
    eps: float  # machine epsilon: the gap between 1 and the next larger value, 2^-mantissa_bits
    has_inf: bool
    nan_encodings: int  # bit patterns that decode to NaN

    @property
    def decimal_digits(self) -> float:
        return (self.mantissa_bits + 1) * math.log10(2)


def all_values(fmt) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit format, decoded to float32 (NaNs and infs included)."""
    dtype = _dtype(fmt)
    bits = torch.finfo(dtype).bits
    if bits == 8:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    elif bits == 16:
        codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    else:
        raise ValueError(f"{dtype} has 2^{bits} bit patterns: too many to list")
    return codes.view(dtype).float()


def format_info(fmt) -> FormatInfo:
    """One row of the table, from torch.finfo and from the bit patterns themselves."""
    dtype = _dtype(fmt)
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))  # eps = 2^-mantissa_bits
    one = torch.ones(1, dtype=_INT_VIEW[fi.bits])
    smallest_subnormal = float(one.view(dtype).float())  # decode the pattern 0...01
    if fi.bits <= 16:
        values = all_values(dtype)
        has_inf, n_nan = bool(values.isinf().any()), int(values.isnan().sum())
    else:  # 2^32 patterns: IEEE's rule instead, checked on fp16 by the tests (all-ones exponent, mantissa != 0)
        has_inf = bool(torch.tensor(float("inf"), dtype=dtype).isinf())
        n_nan = 2 * (2**mantissa - 1)
    return FormatInfo(_name(dtype), dtype, fi.bits, fi.bits - 1 - mantissa, mantissa, float(fi.max),
                      float(fi.smallest_normal), smallest_subnormal, float(fi.eps), has_inf, n_nan)


def format_table() -> list[FormatInfo]:
    return [format_info(name) for name in FORMATS]


def show_formats() -> Table:
    rows = [[f.name, str(f.dtype).removeprefix("torch."), f.bits, f"{f.exponent_bits}/{f.mantissa_bits}", f"{f.max:.6g}",
             f"2^{math.log2(f.smallest_normal):.0f}", f"2^{math.log2(f.smallest_subnormal):.0f}", f"2^{math.log2(f.eps):.0f}",
             f"{f.decimal_digits:.1f}", "yes" if f.has_inf else "no", f.nan_encodings] for f in format_table()]
    return Table(["format", "torch dtype", "bits", "exp/mant", "max", "min normal", "min subnormal", "eps",
                  "digits", "inf", "NaN codes"], rows, "read from torch.finfo and from the bit patterns")


# -- spacing and rounding ------------------------------------------------------------------------------------

def round_to(x: float, fmt) -> float:
    """x rounded to the format (torch's cast: round to nearest, ties to even), as a Python float."""
    return float(torch.tensor(x, dtype=torch.float32).to(_dtype(fmt)).float())


def ulp(x: float, fmt) -> float:
    """The gap between |x| (rounded to the format) and the next representable number above it.

    Read off the bit patterns: the next larger magnitude is the next integer. At the format's max the next
    pattern is inf or NaN, so the gap below is returned instead (the same within a binade).
    """
    dtype = _dtype(fmt)
    as_int = _INT_VIEW[torch.finfo(dtype).bits]
    v = torch.tensor(abs(x), dtype=torch.float32).to(dtype).reshape(1)
    code = v.view(as_int).to(torch.int32)
    up = (code + 1).to(as_int).view(dtype).float()
    if torch.isfinite(up).all():
        return float(up - v.float())
    return float(v.float() - (code - 1).to(as_int).view(dtype).float())


def spacing_table(magnitudes=(1e-3, 1.0, 1000.0, 60000.0), formats=("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2")) -> Table:
    """ulp of each format at each magnitude (``-`` where the magnitude is beyond the format's max)."""
    rows = []
    for fmt in formats:
        fmax = torch.finfo(_dtype(fmt)).max
        rows.append([fmt] + [f"{ulp(m, fmt):.3g}" if m <= fmax else "-" for m in magnitudes])
    return Table(["format"] + [f"ulp at {m:g}" for m in magnitudes], rows, "measured from the bit patterns")


def rounding_demo() -> Table:
    """bf16 and fp16 around 1.0: the half-ulp ties go to the even neighbour; an update below half an ulp vanishes."""
    rows = []
    for fmt in ("bf16", "fp16"):
        half = torch.finfo(_dtype(fmt)).eps / 2  # half the gap between 1 and the next value
        for label, x in (("1 + eps/2 (a tie; 1 is even)", 1 + half),
                         ("1 + eps/2 + a little", 1 + half * (1 + 2**-6)),
                         ("1 + 3 eps/2 (a tie; 1 + 2 eps is even)", 1 + 3 * half),
                         ("1 + eps", 1 + 2 * half)):
            rows.append([fmt, label, f"{x:.10g}", f"{round_to(x, fmt):.10g}"])
    return Table(["format", "x", "x exactly", "rounded"], rows, "torch's casts: round to nearest, ties to even")


def vanishing_update(w: float, dw: float, fmt="bf16") -> dict:
    """Does w + dw, computed and stored in the format, equal w? (bf16(w + dw) == w)."""
    dtype = _dtype(fmt)
    w_q = torch.tensor(w, dtype=torch.float32).to(dtype)
    new = (w_q.float() + torch.tensor(dw, dtype=torch.float32).to(dtype).float()).to(dtype)  # one rounding, as in-format
    return {"w": float(w_q.float()), "dw": dw, "w_plus_dw": float(new.float()), "vanished": bool(new == w_q),
            "half_ulp": ulp(w, fmt) / 2}


def accumulate(w: float, dw: float, n: int, fmt="bf16") -> float:
    """Add dw to w n times, storing the running sum in the format each time (a weight updated n times)."""
    dtype = _dtype(fmt)
    acc = torch.tensor(w, dtype=torch.float32).to(dtype)
    step = torch.tensor(dw, dtype=torch.float32).to(dtype)
    for _ in range(n):
        acc = (acc.float() + step.float()).to(dtype)
    return float(acc.float())


# -- overflow and underflow ------------------------------------------------------------------------------

def cast_table(fmt, values) -> list[tuple[float, float]]:
    """(x, x cast to the format and back to float32) for each x: what torch does, measured."""
    dtype = _dtype(fmt)
    got = torch.tensor(list(values), dtype=torch.float32).to(dtype).float()
    return list(zip([float(v) for v in values], got.tolist()))


def overflow_demo() -> Table:
    """Casting at and beyond each format's max; the inputs are derived from finfo, the outputs measured."""
    rows = []
    for fmt in ("fp16", "fp8_e4m3", "fp8_e5m2"):
        fmax = torch.finfo(_dtype(fmt)).max
        gap = ulp(fmax, fmt)  # the step below max; a next step up would be max + gap
        probes = [(fmax, "max"), (fmax + gap / 2 - 1e-3 * gap, "just under max + ulp/2"),
                  (fmax + gap / 2, "max + ulp/2 (a tie)"), (fmax + gap, "max + ulp"), (2 * fmax, "2 x max"),
                  (float("inf"), "inf"), (float("nan"), "NaN")]
        for (x, y), (_, label) in zip(cast_table(fmt, [p for p, _ in probes]), probes):
            rows.append([fmt, label, f"{x:.7g}", f"{y:.7g}"])
    x = torch.tensor(torch.finfo(torch.float16).max, dtype=torch.float16)
    rows.append(["fp16", "max * 2 in fp16 arithmetic", f"{float(x):.7g} * 2", f"{float(x * 2):.7g}"])
    return Table(["format", "input", "x", "cast to the format"], rows,
                 f"measured on this machine's torch {torch.__version__} (CPU)")


def underflow_demo(fmt="fp16", below: int = 3) -> Table:
    """Halving from the smallest normal down past the smallest subnormal: gradual underflow, then zero."""
    f = format_info(fmt)
    rows = []
    for k in range(f.mantissa_bits + below + 1):
        x = f.smallest_normal * 2.0**-k
        y = round_to(x, fmt)
        kind = "normal" if y >= f.smallest_normal else ("subnormal" if y > 0 else "zero")
        rows.append([f"2^{math.log2(x):.0f}", f"{x:.4g}", f"{y:.4g}", kind])
    for frac in (0.5, 0.75):  # between 0 and the smallest subnormal: round to nearest, ties to even (0)
        x = frac * f.smallest_subnormal
        y = round_to(x, fmt)
        rows.append([f"{frac} x min subnormal", f"{x:.4g}", f"{y:.4g}", "subnormal" if y > 0 else "zero"])
    return Table(["x", "value", f"in {fmt}", "kind"], rows,
                 f"{fmt}: normal down to 2^{math.log2(f.smallest_normal):.0f}, subnormal down to "
                 f"2^{math.log2(f.smallest_subnormal):.0f}, then zero")


def subnormal_relative_error(fmt="fp16", points: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """|round(x) - x| / x for x spread log-uniformly over the subnormal and the first normal binades."""
    f = format_info(fmt)
    x = np.logspace(math.log10(f.smallest_subnormal), math.log10(f.smallest_normal * 4), points)
    got = torch.tensor(x, dtype=torch.float32).to(f.dtype).double().numpy()
    return x, np.abs(got - x) / x


# -- replaying the scaler -----------------------------------------------------------------------------

def replay_scale(update_scale, skipped, init_scale: float, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> list[float]:
    """The scale before every step, if the scale followed ``update_scale`` over the measured ``skipped`` flags."""
    scale, good, out = float(init_scale), 0, []
    for found_inf in skipped:
        out.append(scale)
        scale, good = update_scale(scale, bool(found_inf), good, growth_factor=growth_factor,
                                   backoff_factor=backoff_factor, growth_interval=growth_interval)
    return out


# -- tables of the ranks' results ---------------------------------------------------------------------

def underflow_table(d: dict) -> Table:
    """``d``: one rank's result of part="underflow". Activation gradients as fp16 stored them; weight gradients
    after unscaling, against the fp32 backward."""
    rows = []
    for label in ("unscaled", "scaled"):
        r = d[label]
        run = f"{label} (S = {r['scale']:g})"
        for name, a in r["activations"].items():
            rows.append([run, f"d {name} output", f"{100 * a['flushed']:.2f}%", f"{100 * a['subnormal']:.2f}%",
                         f"{100 * a['overflowed']:.2f}%", ""])
        rows.append([run, "all weight gradients", "", "", "", f"{r['weight_grad_rel_error']:.2e}"])
    return Table(["fp16 backward", "gradient", "flushed to 0", "subnormal", "inf", "relative error vs fp32"], rows,
                 f"{d['tokens_per_rank']} tokens of a {d['tokens_per_step']:,}-token step")


def master_weights_table(d: dict) -> Table:
    rows = [[how, r["param_dtype"], f"{r['loss'][-1]:.3e}", f"{100 * r['vanished'][-1]:.0f}%",
             f"{100 * r['bf16_copy_unchanged'][-1]:.0f}%"] for how, r in d["runs"].items()]
    return Table(["run", "stored weights", f"loss after {d['steps']} steps", "updates lost (last step)",
                  "bf16 view unchanged (last step)"], rows, f"SGD, lr {d['lr']:g}, initial loss {d['initial_loss']:.3e}")


def master_weights_claims(d: dict) -> dict[str, bool]:
    """What the master-weights run shows, as claims that hold on every CPU's kernels: each with a margin over
    the spread measured across AVX-512 / AVX2 / plain kernels and seeds (``python -m course_utils.cpu_spread
    ch08_precision``: e.g. master within 0.5% of fp32 where 2% is asked, pure bf16 ending ~10x above fp32
    where 5x is asked). ``tests/test_ch08_precision.py`` holds the run to the same claims."""
    fp32, master, pure = (d["runs"][k] for k in ("fp32", "bf16_master_fp32", "pure_bf16"))
    third = len(fp32["loss"]) // 3
    return {
        "master weights: loss within 2% of fp32's at every step":
            all(abs(m / f - 1) < 0.02 for m, f in zip(master["loss"], fp32["loss"])),  # all(): a NaN step fails
        "master weights: under 1% of the updates lost in any step (fp32 alike)":
            all(v < 0.01 for v in master["vanished"] + fp32["vanished"]),
        "master weights: yet over 30% of its bf16 copy unchanged in the last step":
            master["bf16_copy_unchanged"][-1] > 0.3,
        "pure bf16: over half of the updates lost in the last step, more than in the first":
            pure["vanished"][-1] > 0.5 and pure["vanished"][-1] > pure["vanished"][0],
        "over the last third of the run fp32's loss at least halves, pure bf16's falls by under 25%":
            fp32["loss"][-1] < 0.5 * fp32["loss"][-third] and pure["loss"][-1] > 0.75 * pure["loss"][-third],
        "pure bf16 ends more than 5x above fp32": pure["loss"][-1] > 5 * fp32["loss"][-1],
    }


# -- figures ------------------------------------------------------------------------------------------

FORMAT_COLOURS = {"fp32": "#4C72B0", "fp16": "#DD8452", "bf16": "#55A868", "fp8_e4m3": "#C44E52", "fp8_e5m2": "#8172B3"}


def draw_format_ranges(table: list[FormatInfo] | None = None):
    """Each format's range on a log2 axis: subnormals (light) and normals (dark), with eps written in."""
    table = table or format_table()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for i, f in enumerate(reversed(table)):
        lo, mid, hi = math.log2(f.smallest_subnormal), math.log2(f.smallest_normal), math.log2(f.max)
        colour = FORMAT_COLOURS[f.name]
        ax.barh(i, mid - lo, left=lo, color=colour, alpha=0.3, height=0.6)
        ax.barh(i, hi - mid, left=mid, color=colour, alpha=0.9, height=0.6)
        ax.text(hi + 2, i, f"max {f.max:.4g}, eps 2^{math.log2(f.eps):.0f}", va="center", fontsize=8)
    ax.set_yticks(range(len(table)), [f.name for f in reversed(table)])
    ax.set_xlim(-160, 200)
    ax.set_xlabel("log2 |x|   (light: subnormals, dark: normal numbers)")
    ax.set_title("Range of each format (from torch.finfo)")
    return fig


def draw_fp8_grid():
    """Every positive finite E4M3 and E5M2 value: the gap doubles at each power of two."""
    fig, ax = plt.subplots(figsize=(8, 2.4))
    for i, fmt in enumerate(("fp8_e4m3", "fp8_e5m2")):
        v = all_values(fmt)
        v = v[torch.isfinite(v) & (v > 0)].unique().numpy()
        ax.vlines(v, i - 0.3, i + 0.3, color=FORMAT_COLOURS[fmt], lw=0.8)
        ax.text(v.max() * 1.3, i, f"{len(v)} values, max {v.max():g}", va="center", fontsize=8)
    log2_axis(ax, label="positive finite values (log2 axis)")
    ax.set_yticks([0, 1], ["E4M3", "E5M2"])
    ax.set_xlim(2**-17, 2**19)
    ax.set_title("FP8: 3 mantissa bits (E4M3) trade range for precision; 2 bits (E5M2) the reverse")
    ax.grid(False)
    return fig


def draw_subnormal_error(fmt="fp16"):
    """Relative rounding error against magnitude: flat at <= eps/2 for normal numbers, growing in the subnormals."""
    f = format_info(fmt)
    x, rel = subnormal_relative_error(fmt, points=400)
    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    ax.loglog(x, np.maximum(rel, 1e-9), ".", ms=3, color=FORMAT_COLOURS[f.name])
    ax.axhline(f.eps / 2, color="k", ls="--", lw=1, label=f"eps/2 = 2^{math.log2(f.eps / 2):.0f}")
    ax.axvline(f.smallest_normal, color="C2", lw=1, label=f"smallest normal 2^{math.log2(f.smallest_normal):.0f}")
    ax.axvline(f.smallest_subnormal, color="C3", lw=1,
               label=f"smallest subnormal 2^{math.log2(f.smallest_subnormal):.0f}")
    ax.set_ylim(1e-5, 1.5)
    ax.set_xlabel("|x|")
    ax.set_ylabel(f"|{fmt}(x) - x| / |x|")
    ax.set_title(f"{fmt}: gradual underflow keeps small values, with fewer and fewer significant bits")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def draw_loss_scaling(res):
    """The scale before each step (log2) and each rank's loss; skipped steps marked on both."""
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 4.8), sharex=True)
    markers = ["o", "s", "^", "D"]
    for rank, d in enumerate(res.ranks):
        steps = np.arange(len(d["scale"]))
        skipped = np.array(d["skipped"])
        ax1.step(steps, np.log2(d["scale"]), where="post", lw=1.5, alpha=0.8, label=f"rank {rank}")
        ax1.plot(steps[skipped], np.log2(np.array(d["scale"]))[skipped], markers[rank % 4], ms=7, mfc="none",
                 color="C3")
        loss = np.array(d["loss"], dtype=float)
        ax2.plot(steps, loss, lw=1, label=f"rank {rank} (its own rows)")
        ax2.plot(steps[skipped], np.nan_to_num(loss[skipped], nan=0.0), "x", color="C3", ms=7)
    who = "every rank" if res[0]["inf_rank"] == -1 else f"rank {res[0]['inf_rank']}"
    for i, s in enumerate(res[0]["inf_steps"]):  # where a bad gradient was injected
        ax1.axvline(s, color="k", ls="--", lw=0.8, label=f"{res[0]['inject']} injected on {who}" if i == 0 else None)
    ax1.set_ylabel("log2(loss scale)")
    args = res[0]["scaler_args"]
    ax1.set_title(f"GradScaler: x{args['growth_factor']:g} after {args['growth_interval']} good steps, "
                  f"x{args['backoff_factor']:g} and skip on inf/NaN (markers: skipped)", fontsize=10)
    ax2.set_ylabel("loss (fp16 autocast)")
    ax2.set_xlabel("step")
    for ax in (ax1, ax2):  # beside the panels: the scale's steps and the losses fill them wherever they go
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def _zones(ax, fp16: dict, shift: float = 0.0):
    lo, mid, hi = (math.log2(fp16["smallest_subnormal"]), math.log2(fp16["smallest_normal"]), math.log2(fp16["max"]))
    ax.axvspan(-100, lo - shift, color="C3", alpha=0.12, label="flushes to 0")
    ax.axvspan(lo - shift, mid - shift, color="C1", alpha=0.15, label="fp16 subnormal")
    ax.axvspan(mid - shift, hi - shift, color="C2", alpha=0.10, label="fp16 normal")
    ax.axvspan(hi - shift, 100, color="k", alpha=0.12, label="overflows to inf")


def draw_underflow(d: dict):
    """Activation-gradient exponents of the fp32 backward against fp16's range, unscaled and scaled by S
    (after Micikevicius et al. 2018, Fig. 3). Scaling by S moves the range, not the gradients: the zones
    shift left by log2(S)."""
    lo, hi = d["exponent_range"]
    edges = np.arange(lo, hi)
    counts = np.sum([np.array(c) for c in d["reference"]["exponents"].values()], axis=0)
    total = counts.sum()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, label in zip(axes, ("unscaled", "scaled")):
        r = d[label]
        shift = math.log2(r["scale"])
        _zones(ax, d["fp16"], shift)
        ax.bar(edges + 0.5, 100 * counts / total, width=1.0, color="#4C72B0", edgecolor="white", lw=0.3)
        ax.set_xlim(lo, hi)
        ax.set_title(f"loss scale S = {r['scale']:g}: {100 * r['flushed']:.1f}% flushed to 0", fontsize=10)
        ax.set_xlabel("log2 |activation gradient| (fp32 backward)")
    axes[0].set_ylabel("% of gradient values")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Activation gradients of a {d['tokens_per_step']:,}-token step vs the fp16 range", fontsize=11)
    fig.tight_layout()
    return fig


RUN_STYLES = {"fp32": ("fp32", "-", "#4C72B0"), "bf16_master_fp32": ("bf16 compute, fp32 master weights", "--", "#55A868"),
              "pure_bf16": ("pure bf16 (weights and update)", "-", "#C44E52")}


def draw_master_weights(d: dict):
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    for how, r in d["runs"].items():
        label, ls, colour = RUN_STYLES[how]
        steps = np.arange(1, len(r["loss"]) + 1)
        ax1.plot(steps, r["loss"], ls, color=colour, label=label)
        ax2.plot(steps, 100 * np.array(r["vanished"]), ls, color=colour, label=f"{label}: update lost")
        if how == "bf16_master_fp32":
            ax2.plot(steps, 100 * np.array(r["bf16_copy_unchanged"]), ":", color=colour,
                     label="... its bf16 copy unchanged")
    ax1.set_yscale("log")
    ax1.set_xlabel("SGD step")
    ax1.set_ylabel("loss (fp32 evaluation)")
    ax1.set_title(f"Same steps, same lr = {d['lr']:g}")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("SGD step")
    ax2.set_ylabel("% of weights")
    ax2.set_ylim(-3, 103)
    ax2.set_title("bf16(w - lr*g) == w: the update vanished")
    fig.tight_layout()
    # under the panel: the curves rise into every corner of it
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    return fig
