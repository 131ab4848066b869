"""Full attention in one process, float64, with grouped-query heads: what a context-parallel run must equal.

``full_attention_grads`` is ``workers/attention/reference.attention_reference_grads`` with each KV head read by
heads / kv_heads consecutive query heads (expanded inside the autograd graph, so dk and dv come back summed over
the query heads that read them, shaped ``[b, kv_heads, seq, d]``). ``compare_to_reference`` puts the ranks' rows
back in sequence order (each rank reports the global position of every row it holds) and measures every copy.
"""
from __future__ import annotations

import torch

from workers.attention.reference import RELATIVE_TOLERANCE, attention_reference, relative_error
from workers.context_parallel.inputs import DTYPES, make_inputs

COMPARED = ("out", "dq", "dk", "dv")


def full_attention_grads(q, k, v, dout, causal: bool):
    """Float64 ``(out, dq, dk, dv)`` of attention over the whole sequence, q/dout ``[b, h, s, d]``, k/v ``[b, kv, s, d]``."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]  # query heads per KV head
    out, _ = attention_reference(q64, k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1),
                                 causal=causal)  # [b, h, s, d]
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return out.detach(), dq, dk, dv


def assemble(rows: list[dict], key: str, seq: int) -> torch.Tensor:
    """The whole-sequence ``[b, h, seq, d]`` of ``key`` from one copy's rank dicts; rows no rank holds stay NaN."""
    first = rows[0][key]
    whole = torch.full((*first.shape[:2], seq, first.shape[-1]), float("nan"), dtype=torch.float64)
    for d in rows:
        whole[:, :, d["positions"]] = d[key].double()
    return whole


def compare_to_reference(ranks: list[dict]) -> dict:
    """Largest relative error of out, dq, dk, dv of every copy against ``full_attention_grads``; NaN fails.

    ``ranks``: the rank dicts of ``workers/ch14_ulysses.py`` (each with ``config``, ``copy``, ``positions``).
    """
    cfg = ranks[0]["config"]
    q, k, v, dout = make_inputs(cfg["batch"], cfg["heads"], cfg["seq"], cfg["head_dim"], cfg["seed"], cfg["dtype"],
                                kv_heads=cfg["kv_heads"])
    ref = dict(zip(COMPARED, full_attention_grads(q, k, v, dout, cfg["causal"])))
    tolerance = RELATIVE_TOLERANCE[DTYPES[cfg["dtype"]]]
    measured = {name: [] for name in COMPARED if name in ranks[0]}
    for copy in sorted({d["copy"] for d in ranks}):
        rows = [d for d in ranks if d["copy"] == copy]
        for name in measured:
            measured[name].append(relative_error(assemble(rows, name, cfg["seq"]), ref[name]))
    errors = {name: torch.tensor(errs).max().item() for name, errs in measured.items()}  # torch's max keeps a NaN
    return {"tolerance": tolerance, "errors": errors, "copies": len({d["copy"] for d in ranks}),
            "within_tol": all(err <= tolerance for err in errors.values())}  # NaN <= tol is False
