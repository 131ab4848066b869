"""Does a layout train exactly like one process? The check every chapter 15 run goes through.

``compare(ranks, reference)`` takes what the ranks of ``workers/ch15_composed.py`` returned and what
``train.reference_run`` computed, and checks, step by step:

* the **loss** of every step against the reference's;
* every **gradient**, put back together from its TP shards (``plan.assemble``), against the reference's
  (a pipeline stage holds its own layers: the shards of a name come from the ranks of that stage);
* the **parameters** after the last step;
* **replicas**: every rank that holds the same shard of a parameter (its DP and CP copies, its TP copies
  when the parameter is replicated over TP, and the tied embedding's copy on the last stage) holds it bit
  for bit equal after every step, by digest.

The verdict names the first thing that differs, in the order training met it (step, then the model's
parameter order): which tensor, on which ranks (and their mesh coordinates), and by how much, relative to the
tensor's largest reference entry.

Tolerance. Every layout computes the same sums in another order (a ring all-reduce, per-shard GEMMs, the
ring attention's online softmax merge), so in float64 the differences are rounding: at most 4.5e-12 relative
over the chapter's 16 layout cases, sequence parallelism and dropout, seeds 0-2, under the native AVX-512
kernels (3.6e-12), AVX2 (4.5e-12) and the plain ones (3.5e-12). The float64 tolerance 1e-10 leaves a factor
20; every fault is off by more than 1e-4. In float32 the parameters after three AdamW steps differ by up to
1.5e-3 of their tensor's largest entry (the same runs: 6.6e-4 to 1.5e-3), and it is AdamW, not the layout:
the key bias gets a gradient that is exactly zero in exact arithmetic (adding it shifts every score of a
query's row by the same amount, which softmax ignores), so what it gets is rounding noise, which Adam divides
by its own size (plus eps = 1e-8) and turns into steps of up to lr. In float64 that noise (~1e-17) is far
below eps and damped; in float32 (~1e-9) it is not. The float32 tolerance is 5e-3.
"""
from __future__ import annotations

import torch

from workers.parallel.plan import assemble

TOLERANCE = {"float64": 1e-10, "float32": 5e-3}
TIED = {"head.weight": "embed.weight"}  # the last stage's copy of the tied embedding, and what it copies


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the absolute error when the reference is all zeros)."""
    scale = expected.abs().max().item()
    err = (actual.to(torch.float64) - expected.to(torch.float64)).abs().max().item()
    return err / scale if scale > 0 else err


def _coords(rank: dict) -> str:
    c = rank["coords"]
    return f"(dp {c['dp']}, tp {c['tp']}, pp {c['pp']}, cp {c['cp']})"


def _where(ranks: list[dict], indices: list[int]) -> str:
    return ", ".join(f"rank {i} {_coords(ranks[i])}" for i in indices)


def _assembled(ranks: list[dict], step: int | None, shapes: dict) -> tuple[dict, dict, list[str]]:
    """Full tensors from the reporting ranks' shards: ``(tensors, holders by name, problems)``.

    ``step`` None: the final parameters; else the gradients of that step."""
    holders: dict[str, list[int]] = {}
    records: dict[str, list[dict]] = {}
    for i, r in enumerate(ranks):
        rec = r["params"] if step is None else r["grads"][step]
        if not rec:
            continue
        for name, item in rec.items():
            name = TIED.get(name, name)
            holders.setdefault(name, []).append(i)
            records.setdefault(name, []).append({name: item})
    full, problems = {}, []
    for name, shape in shapes.items():
        if name not in records:
            problems.append(f"{name}: no rank reported it")
            continue
        got, bad = assemble(records[name], {name: shape})
        full.update(got)
        problems += bad
    return full, holders, problems


def _shard_errors(ranks, holders, step, name, expected, tol: float) -> list[int]:
    """The reporting ranks whose own shard of ``name`` is off."""
    off = []
    for i in holders.get(name, []):
        rec = ranks[i]["params"] if step is None else ranks[i]["grads"][step]
        item = rec.get(name) or rec.get("head.weight")
        part = expected if item["dim"] < 0 else expected.index_select(item["dim"], item["index"])
        if relative_error(item["value"], part) > tol:
            off.append(i)
    return off


def replica_problems(ranks: list[dict], step: int) -> list[str]:
    """Ranks holding the same shard of a parameter whose bytes differ after ``step`` (by digest)."""
    copies: dict[tuple, list[tuple[int, str]]] = {}
    for i, r in enumerate(ranks):
        for name, dig in r["digests"][step].items():
            sharded = name in r.get("sharded", ())
            key = (TIED.get(name, name), r["coords"]["tp"] if sharded else None)
            copies.setdefault(key, []).append((i, dig))
    out = []
    for (name, tp), held in copies.items():
        if len({d for _, d in held}) > 1:
            first = held[0][1]
            odd = [i for i, d in held if d != first]
            shard = f" (TP shard {tp})" if tp is not None else ""
            out.append(f"{name}{shard} differs between its copies after step {step}: ranks {[i for i, _ in held]} "
                       f"should be bit for bit equal, but {_where(ranks, odd)} differ from rank {held[0][0]}")
    return out


def compare(ranks: list[dict], reference: dict, *, tolerance: float | None = None) -> dict:
    """The verdict (see the module docstring): ``ok``, ``message``, ``first`` (or None), ``max_error``, the
    per-step loss errors, the worst gradient error of each step, and the replica problems."""
    config = ranks[0]["config"]
    tol = TOLERANCE[config["dtype"]] if tolerance is None else tolerance
    steps = len(reference["losses"])
    shapes = {n: tuple(t.shape) for n, t in reference["params"].items()}
    order = list(shapes)
    losses = next((r["losses"] for r in ranks if r["losses"][0] is not None), None)
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])]
    findings, grad_errors, replicas, max_error = [], [], [], max(loss_errors)
    for step in range(steps):
        if loss_errors[step] > tol:
            findings.append({"step": step, "what": "loss", "tensor": "loss", "error": loss_errors[step],
                             "ranks": [i for i, r in enumerate(ranks) if r["losses"][step] is not None]})
        full, holders, problems = _assembled(ranks, step, shapes)
        errors = {n: relative_error(full[n], reference["grads"][step][n]) for n in order if n in full}
        grad_errors.append(max(errors.values()))
        max_error = max(max_error, grad_errors[-1])
        for name in order:
            if errors.get(name, 0.0) > tol:
                findings.append({"step": step, "what": "gradient", "tensor": name, "error": errors[name],
                                 "ranks": _shard_errors(ranks, holders, step, name, reference["grads"][step][name], tol)})
        findings += [{"step": step, "what": "shards", "tensor": p.split(":")[0], "error": float("inf"), "ranks": [],
                      "detail": p} for p in problems]
        for p in replica_problems(ranks, step):
            replicas.append(p)
            findings.append({"step": step, "what": "replicas", "tensor": p.split(" ")[0], "error": float("inf"),
                             "ranks": [], "detail": p})
    final, holders, problems = _assembled(ranks, None, shapes)
    param_errors = {n: relative_error(final[n], reference["params"][n]) for n in order if n in final}
    for name in order:
        if param_errors.get(name, 0.0) > tol:
            findings.append({"step": steps - 1, "what": "parameter after the last step", "tensor": name,
                             "error": param_errors[name],
                             "ranks": _shard_errors(ranks, holders, None, name, reference["params"][name], tol)})
    max_error = max(max_error, max(param_errors.values()))
    first = findings[0] if findings else None
    if first is None:
        message = (f"layout {ranks[0]['layout_name']} equals one process: {steps} steps, losses, every gradient and "
                   f"the final parameters within {tol:g} (largest relative difference {max_error:.1e}), replicas bit "
                   "for bit equal")
    elif "detail" in first:
        message = f"step {first['step']}: {first['detail']}"
    else:
        where = f" on {_where(ranks, first['ranks'])}" if first["ranks"] else ""
        what = "the loss" if first["what"] == "loss" else f"the {first['what']} of {first['tensor']}"
        message = (f"step {first['step']}: {what} differs from one process by {first['error']:.2g} (relative, "
                   f"tolerance {tol:g}){where}")
    return {"ok": first is None, "message": message, "first": first, "findings": findings, "max_error": max_error,
            "loss_errors": loss_errors, "grad_errors": grad_errors, "param_errors": param_errors,
            "replica_problems": replicas, "tolerance": tol}
