"""Published or previously measured numbers the notebooks show next to their own: loaded with their provenance.

Files live in ``data/reference/``; each carries a ``provenance`` key (source, date, device, versions, what
was measured and how FLOPs were counted) and, below it, the source's data unchanged (the tests check its
hash). A notebook quotes these numbers through this module, never from memory, and labels them as what
they are: a reference run, not the course's own code, and not this machine.

It is also the one reader of every measurement's provenance: ``label(rec)`` captions a record written with
``workers.provenance.record()`` (the course's own GPU and CPU measurements), a reference file here, and the
older layouts (``"device"``, ``"device_name"``, ``meta``) that ``provenance_of`` maps to the same schema.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from course_utils.paths import DATA, ROOT
from workers.provenance import FIELDS, record

REFERENCE_DIR = DATA / "reference"


PUBLISHED_ALLREDUCE = "allreduce_8xH200_published.csv"


def published_allreduce_path() -> Path:
    """The published 8xH200 all_reduce sweep: the repository's copy, else ../shared/reference beside the clone."""
    candidates = [REFERENCE_DIR / PUBLISHED_ALLREDUCE, ROOT.parent / "shared" / "reference" / PUBLISHED_ALLREDUCE]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(f"{PUBLISHED_ALLREDUCE} is missing: expected it at {candidates[0]}")


def published_allreduce(path: str | os.PathLike | None = None) -> tuple[list[dict], list[str]]:
    """The sweep's rows (bytes, and busbw and algbw in bytes/s) and its header comment lines (source, licence,
    setup). Chapters 00, 01 and 10 draw it (stas00/ml-engineering, CC-BY-SA 4.0)."""
    path = Path(path) if path else published_allreduce_path()
    header, data = [], []
    for line in Path(path).read_text().splitlines(keepends=True):
        if line.startswith("#"):
            header.append(line[1:].strip())
        elif line.strip():
            data.append(line)
    rows = [{"bytes": int(rec["payload_bytes"]), "busbw": float(rec["busbw_GBps"]) * 1e9,
             "algbw": float(rec["algbw_GBps"]) * 1e9} for rec in csv.DictReader(data)]
    return rows, header


def load(name: str) -> dict:
    """``load("h200_block_fp8_baseline")`` -> the file's dict, ``provenance`` included."""
    path = REFERENCE_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in REFERENCE_DIR.glob("*.json"))
        raise FileNotFoundError(f"no reference data named {name!r} in data/reference: choose one of {known}")
    with open(path) as f:
        ref = json.load(f)
    ref.setdefault("provenance", {})["file"] = f"data/reference/{name}.json"  # where label() says it came from
    return ref


def _kind(device: str | None) -> str | None:
    if not device:
        return None
    return "cpu" if str(device).lower().startswith("cpu") or "(CPU)" in str(device) else "cuda"


def _torch_of(versions: str | None) -> str | None:
    """"torch 2.11.0+cu130, Triton 3.6.0" -> "2.11.0+cu130" (a reference file's ``versions`` line)."""
    words = str(versions or "").replace(",", " ").split()
    return next((words[i + 1] for i, w in enumerate(words[:-1]) if w.lower() == "torch"), None)


def provenance_of(rec: dict) -> dict:
    """Any measurement's provenance in ``workers.provenance``'s schema, plus ``source`` (the file it was read
    from, when known) and ``live`` (measured in this session). The one place old layouts are read:

    - ``{"provenance": record()}`` or a bare ``record()``: as is;
    - a reference file (``data/reference/*.json``: ``provenance`` with source/date/device/versions, and the
      source's own ``gpu``/``torch``/``triton`` keys) or its unwrapped copy in ../shared/reference;
    - ``{"meta": {...}}``: workers/bench_attention.py (gpu, torch, triton, cuda, date, command) and
      course_utils/cpu_spread.py (cpu, native_capability, torch, date, command) before the record existed;
    - flat keys: ``device_name`` (tools/gpu/ch11_memory.sh, workers/ch11_fp8_gemm.py) or ``device``
      (tools/gpu/tp_block_bench.py, tools/gpu/spine_check.py) next to torch, cuda, date, command.
    """
    prov = rec.get("provenance") if isinstance(rec.get("provenance"), dict) else {}
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    if "device_kind" in prov:
        out = {k: prov.get(k) for k in FIELDS}
    elif "device_kind" in rec:
        out = {k: rec.get(k) for k in FIELDS}
    elif prov:  # a published reference: its provenance key, and the source's own fields below it
        device = rec.get("gpu") or prov.get("device")
        out = dict.fromkeys(FIELDS)
        out.update(device=device, device_kind=_kind(device), torch=rec.get("torch") or _torch_of(prov.get("versions")),
                   cuda=rec.get("cuda"), triton=rec.get("triton"), date=prov.get("date"))
    else:
        old = meta or rec
        cpu = old.get("cpu")
        device = old.get("gpu") or old.get("device_name") or old.get("device") or (f"{cpu} (CPU)" if cpu else None)
        out = {k: old.get(k) for k in FIELDS}
        out.update(device=device, device_kind=_kind(device),
                   cpu_capability=old.get("cpu_capability") or old.get("native_capability"))
    out["source"] = rec.get("path") or rec.get("file") or prov.get("file")
    out["live"] = bool(rec.get("live"))
    return out


def label(rec: dict, source: str | None = None, live: bool | None = None) -> str:
    """The caption of any measurement (see ``provenance_of`` for the layouts it reads): device, versions, date,
    and where it came from. ``source`` overrides the file named (a bare name means data/reference/<name>.json);
    ``live``: measured in this session, on this machine (default: the record's own ``live`` key).

    "NVIDIA H200 · torch 2.11.0+cu130 · CUDA 13.0 · Triton 3.6.0 · 2026-12-02 (data/gpu/tp_block_h200.json)";
    "CPU AMD EPYC 9654 96-Core Processor (AVX512) · torch 2.13.0+cpu · 2026-12-02, measured on this machine:
    not GPU numbers"."""
    p = provenance_of(rec)
    if p["device_kind"] == "cpu":
        model = str(p["device"] or "").removesuffix(" (CPU)")
        model = "" if model.lower().startswith("cpu") else model  # the old "cpu (no GPU)" named no model
        cap = f" ({p['cpu_capability']})" if p.get("cpu_capability") else ""
        parts = [f"CPU {model}".strip() + cap]
    else:
        parts = [p["device"] or "unknown device"]
    parts.append(f"torch {p['torch'] or '?'}")
    if p["device_kind"] != "cpu" and p.get("cuda"):
        parts.append(f"CUDA {p['cuda']}")
    if p["device_kind"] != "cpu" and p.get("triton"):
        parts.append(f"Triton {p['triton']}")
    parts.append(str(p["date"])[:10] if p.get("date") else "date not recorded")
    text = " · ".join(parts)
    source = source or p["source"]
    if source:
        text += f" ({source if '/' in source or source.endswith('.json') else f'data/reference/{source}.json'})"
    if rec.get("live") if live is None else live:
        text += ", measured on this machine"
    if p["device_kind"] == "cpu":
        text += ": not GPU numbers"
    return text


def run_record(res) -> dict:
    """A provenance record for a run made now with ``course_utils.run`` (a ``RunResult``), for ``label``:
    its ranks' device, this process's versions, ``live`` set."""
    device = sorted(set(res.devices))[0] if getattr(res, "devices", None) else None
    rec = record(command=f"course_utils.run({res.worker!r}, world_size={res.world_size})",
                 device="cuda" if device and device.startswith("cuda") else "cpu")
    return {"provenance": rec, "live": True}


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
