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
20; every fault is off by more than 1e-4. In float32 the parameters after three AdamW steps differed by up to
1.5e-3 of their tensor's largest entry (the same runs: 6.6e-4 to 1.5e-3), and it was AdamW, not the layout: the key
bias gets a gradient that is exactly zero in exact arithmetic (adding it shifts every score of a query's row by the
same amount, which softmax ignores), so what it gets is rounding noise, which Adam divides by its own size (plus
eps = 1e-8) and turns into steps of up to lr. In float64 that noise (~1e-17) is far below eps and damped; in float32
(~1e-9) it is not. With the key rows held to their own bound (below), float32 leaves at most 1.1e-4 (2x2x2x1 and
2x2x1x2, seed 0, CPU); the float32 tolerance stays 5e-3, measured on few runs.

Parameters whose gradient is zero in exact arithmetic (``zero_gradient_masks``: the key rows of every QKV bias) are
held to that property instead of to the reference's rounding: their gradient must be zero to the tolerance in both
runs, and their values may differ by what AdamW makes of noise, at most ``noise_step_bound`` (each step moves an
entry by at most about lr, whatever the gradient's size). Held to 1e-10 they would fail correct runs: with larger
initial weights two correct computations already differ there by 1.2e-10 after three steps, in float64.

Every comparison fails on NaN and infinity: an error is infinite when either tensor holds a non-finite entry, and a
tensor is within tolerance only if ``error <= tol`` (never ``not error > tol``, which NaN passes).
"""
from __future__ import annotations

import math

import torch

from workers.parallel.plan import assemble

TOLERANCE = {"float64": 1e-10, "float32": 5e-3}
TIED = {"head.weight": "embed.weight"}  # the last stage's copy of the tied embedding, and what it copies


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (the absolute error when the reference is all zeros); infinite when
    either holds a NaN or an infinity, so that ``error <= tol`` fails on them (``max`` of a NaN is not reliable)."""
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return math.inf
    if actual.numel() == 0:
        return 0.0
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    return err / scale if scale > 0 else err


def loss_error(actual: float | None, expected: float) -> float:
    """|actual - expected| / |expected| of a step's loss; infinite when it is missing, NaN or infinite."""
    if actual is None or not (math.isfinite(actual) and math.isfinite(expected)):
        return math.inf
    return abs(actual - expected) / abs(expected) if expected else abs(actual)


def zero_gradient_masks(config: dict, shapes: dict) -> dict[str, torch.Tensor]:
    """``{name: bool mask}`` of the entries whose gradient is zero in exact arithmetic: the key rows of every QKV
    bias. q . (k + b_k) = q . k + q . b_k adds the same number to every score of a query's row, and softmax ignores a
    shift of its row (with a LayerNorm on k the bias is no longer a shift, hence the condition)."""
    if not config.get("qkv_bias", config.get("bias", True)) or config.get("qk_layernorm", False):
        return {}
    d = config["hidden"] // config["heads"]
    kv_heads = config.get("kv_heads") or config["heads"]
    keys = slice(config["heads"] * d, (config["heads"] + kv_heads) * d)  # qkv rows: all queries, all keys, all values
    masks = {}
    for name, shape in shapes.items():
        if name.endswith("attention.qkv.bias"):
            mask = torch.zeros(shape, dtype=torch.bool)
            mask[keys] = True
            masks[name] = mask
    return masks


def noise_step_bound(lr: float, steps: int, betas: tuple[float, float] = (0.9, 0.95)) -> float:
    """The most two runs' AdamW can move an entry apart in ``steps`` steps when its gradient is noise: each run's
    step t is lr |m_t / (1 - b1^t)| / (sqrt(v_t / (1 - b2^t)) + eps), at most lr times the Cauchy-Schwarz bound
    below (1.0 to 1.001 for t <= 3 at betas (0.9, 0.95)), whatever the noise's size; weight decay only shrinks a
    difference."""
    b1, b2 = betas
    per_step = [(1 - b1) / math.sqrt(1 - b2) * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)))
                * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) for t in range(1, steps + 1)]
    return 2 * lr * sum(per_step)


def parameter_error(actual: torch.Tensor, expected: torch.Tensor, zero: torch.Tensor | None) -> tuple[float, float]:
    """(relative error of the entries with a gradient, largest |difference| of the zero-gradient entries ``zero``);
    both infinite when either tensor holds a non-finite entry."""
    if zero is None or not zero.any():
        return relative_error(actual, expected), 0.0
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    if not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
        return math.inf, math.inf
    scale = expected.abs().max().item()
    err = (actual - expected).abs()
    rest = err[~zero].max().item() if (~zero).any() else 0.0
    return (rest / scale if scale > 0 else rest), err[zero].max().item()


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


def _shard_errors(ranks, holders, step, name, expected, tol: float, zero=None, bound: float = 0.0) -> list[int]:
    """The reporting ranks whose own shard of ``name`` is off (``zero``, ``bound``: as for the final parameters)."""
    off = []
    for i in holders.get(name, []):
        rec = ranks[i]["params"] if step is None else ranks[i]["grads"][step]
        item = rec.get(name) or rec.get("head.weight")
        cut = (lambda t: t) if item["dim"] < 0 else (lambda t: t.index_select(item["dim"], item["index"]))
        rest, moved = parameter_error(item["value"], cut(expected), None if zero is None else cut(zero))
        if not (rest <= tol and moved <= bound):
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
    zeros = zero_gradient_masks(config, shapes)
    bound = noise_step_bound(config["lr"], steps)
    losses = next((r["losses"] for r in ranks if r["losses"][0] is not None), [None] * steps)
    loss_errors = [loss_error(a, b) for a, b in zip(losses, reference["losses"])]
    findings, grad_errors, replicas, max_error = [], [], [], max(loss_errors)
    for step in range(steps):
        if losses[step] is None:
            findings.append({"step": step, "what": "loss", "tensor": "loss", "error": math.inf, "ranks": [],
                             "detail": "no rank reported the loss (the last stage reports it)"})
        elif not loss_errors[step] <= tol:
            findings.append({"step": step, "what": "loss", "tensor": "loss", "error": loss_errors[step],
                             "ranks": [i for i, r in enumerate(ranks) if r["losses"][step] is not None]})
        full, holders, problems = _assembled(ranks, step, shapes)
        expected = reference["grads"][step]
        # a name no rank reported is one of ``problems``; it still counts as an infinite error
        errors = {n: relative_error(full[n], expected[n]) if n in full else math.inf for n in order}
        grad_errors.append(max(errors.values()))
        max_error = max(max_error, grad_errors[-1])
        for name in order:
            if name not in full:
                continue
            if not errors[name] <= tol:
                findings.append({"step": step, "what": "gradient", "tensor": name, "error": errors[name],
                                 "ranks": _shard_errors(ranks, holders, step, name, expected[name], tol)})
            elif name in zeros:  # the property itself: zero to the tolerance in both runs
                scale = expected[name].abs().max().item() or 1.0  # all zero: absolute, as relative_error
                for run, grad in (("", full[name]), ("one process's ", expected[name])):
                    size = grad[zeros[name]].abs().max().item() / scale
                    if not size <= tol:
                        findings.append({"step": step, "what": "gradient", "tensor": name, "error": size, "ranks": [],
                                         "detail": f"{run}gradient of {name}'s key rows is {size:.2g} of the tensor's "
                                                   f"largest entry: it is zero in exact arithmetic (softmax ignores "
                                                   f"the key bias), so more than rounding ({tol:g}) is a bug"})
        findings += [{"step": step, "what": "shards", "tensor": p.split(":")[0], "error": math.inf, "ranks": [],
                      "detail": p} for p in problems]
        for p in replica_problems(ranks, step):
            replicas.append(p)
            findings.append({"step": step, "what": "replicas", "tensor": p.split(" ")[0], "error": math.inf,
                             "ranks": [], "detail": p})
    final, holders, problems = _assembled(ranks, None, shapes)
    findings += [{"step": steps - 1, "what": "shards", "tensor": p.split(":")[0], "error": math.inf, "ranks": [],
                  "detail": p} for p in problems]
    param_errors, moved = {}, {}
    for name in order:
        param_errors[name], moved[name] = (parameter_error(final[name], reference["params"][name], zeros.get(name))
                                           if name in final else (math.inf, math.inf))
        if name not in final:
            continue
        off = _shard_errors(ranks, holders, None, name, reference["params"][name], tol, zeros.get(name), bound)
        if not param_errors[name] <= tol:
            findings.append({"step": steps - 1, "what": "parameter after the last step", "tensor": name,
                             "error": param_errors[name], "ranks": off})
        elif not moved[name] <= bound:
            findings.append({"step": steps - 1, "what": "parameter after the last step", "tensor": name,
                             "error": moved[name], "ranks": off,
                             "detail": f"{name}'s key rows, whose gradient is zero, differ from one process's by "
                                       f"{moved[name]:.2g}, more than AdamW's steps on rounding noise can make "
                                       f"(2 x lr x {steps} steps = {bound:.2g})"})
    max_error = max(max_error, max(param_errors.values()))
    first = findings[0] if findings else None
    if first is None:
        message = (f"layout {ranks[0]['layout_name']} equals one process: {steps} steps, losses, every gradient and "
                   f"the final parameters within {tol:g} (largest relative difference {max_error:.1e}), replicas bit "
                   "for bit equal")
    elif "detail" in first:
        where = f" on {_where(ranks, first['ranks'])}" if first["ranks"] else ""
        message = f"step {first['step']}: {first['detail']}{where}"
    else:
        where = f" on {_where(ranks, first['ranks'])}" if first["ranks"] else ""
        what = "the loss" if first["what"] == "loss" else f"the {first['what']} of {first['tensor']}"
        size = "is NaN or infinite" if not math.isfinite(first["error"]) else f"differs from one process by " \
            f"{first['error']:.2g} (relative, tolerance {tol:g})"
        message = f"step {first['step']}: {what} {size}{where}"
    return {"ok": first is None, "message": message, "first": first, "findings": findings, "max_error": max_error,
            "loss_errors": loss_errors, "grad_errors": grad_errors, "param_errors": param_errors,
            "replica_problems": replicas, "tolerance": tol}
