"""Published or previously measured numbers the notebooks show next to their own: loaded with their provenance.

Files live in ``data/reference/``; each carries a ``provenance`` key (source, date, device, versions, what
was measured and how FLOPs were counted) and, below it, the source's data unchanged (the tests check its
hash). A notebook quotes these numbers through this module, never from memory, and labels them as what
they are: a reference run, not the course's own code, and not this machine.
"""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = ROOT / "data" / "reference"


def load(name: str) -> dict:
    """``load("h200_block_fp8_baseline")`` -> the file's dict, ``provenance`` included."""
    path = REFERENCE_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in REFERENCE_DIR.glob("*.json"))
        raise FileNotFoundError(f"no reference data named {name!r} in data/reference: choose one of {known}")
    with open(path) as f:
        return json.load(f)


def label(ref: dict, name: str) -> str:
    prov = ref.get("provenance", {})
    return (f"{prov.get('device', '?')}, {prov.get('versions', '?')}, measured {prov.get('date', '?')} "
            f"(data/reference/{name}.json)")


def block_baseline_table(ref: dict | None = None) -> str:
    """The plain H200 block's runs as text: shape, mode, time, TFLOP/s and the fraction of the bf16 matmul."""
    ref = ref or load("h200_block_fp8_baseline")
    lines = [f"{'s':>5} {'b':>3} {'mode':>8} {'ms':>7} {'TFLOP/s':>8} {'of bf16 matmul':>15}"]
    for r in ref["block"]:
        lines.append(f"{r['S']:>5} {r['B']:>3} {r['mode']:>8} {r['ms']:>7.2f} {r['tflops']:>8.0f} "
                     f"{r['frac_of_matmul_peak']:>14.0%}")
    lines.append(f"bf16 8192^3 matmul in the same run: {ref['matmul_bf16_tflops']:.0f} TFLOP/s; "
                 f"FLOPs counted as {ref['provenance']['flops']}")
    return "\n".join(lines)


def fp8_gemm_summary(ref: dict | None = None) -> str:
    ref = ref or load("h200_block_fp8_baseline")
    bf16, fp8 = ref["matmul_bf16_tflops"], ref["matmul_fp8_tflops"]
    return (f"an 8192^3 matmul at {bf16:.0f} TFLOP/s in bf16 and {fp8:.0f} TFLOP/s with torch._scaled_mm in E4M3, "
            f"{fp8 / bf16:.2f}x")
