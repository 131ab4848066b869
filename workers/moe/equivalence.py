"""Is the expert-parallel layer the one-process layer? Outputs, routing, drops, losses and every gradient.

``reference(case_config, run)`` computes, in one process and token by token (``layer.reference_forward``), what
the ranks of ``workers/ch16_moe.py`` should have returned; ``compare(cases, ref)`` lists every difference as a
sentence naming the tensor and the ranks, and says what a difference looks like when it has a known cause (a
gradient ``ep`` times too large, an unreduced router, rows added to the wrong tokens, another aux loss).
An empty list means equal within ``TOLERANCE``; a NaN or an infinity anywhere is a difference, named as such.
"""
from __future__ import annotations

import math

import torch

from workers.moe.batch import DTYPES, balance, batch
from workers.moe.config import MoEConfig
from workers.moe.layer import build_weights, reference_forward

# float64 throughout: the ranks and the reference add the same products in other orders (a batched matmul
# against one token at a time, an all-reduce's sum), which moves the last bits only. Measured max |diff| over the
# 32 cases of tests/test_moe_ep.py, outputs and gradients: 1.8e-15 (native AVX-512), 2.2e-15 (AVX2), 1.3e-15 (plain
# kernels); 1e-10 leaves a wide margin on any CPU and is still 1e6 times below the smallest fault's effect (3e-4:
# the local aux loss, on the input's gradient).
TOLERANCE = 1e-10


def reference(cfg: MoEConfig, run: dict) -> dict:
    """The one-process forward and backward for ``run``'s batch (``run``: what rank 0 returned, for its settings)."""
    dtype = DTYPES[run["dtype"]]
    built = build_weights(cfg, run["seed"], dtype)
    built = balance(cfg, built) if run["balanced"] else built
    weights = {n: w.clone().requires_grad_(True) for n, w in built.items()}
    x, g = batch(cfg, run["tokens"], run["data_seed"], run["skew"], dtype, built, run["balanced"])
    x = x.clone().requires_grad_(True)
    y, records, aux, z = reference_forward(cfg, weights, x, groups=run["world"])
    loss = (y * g).sum(dim=-1).mean() + cfg.aux_coeff * aux + cfg.z_coeff * z
    loss.backward()
    return {"y": y.detach(), "input_grad": x.grad, "grads": {n: w.grad for n, w in weights.items()},
            "records": records, "aux": aux.item(), "z": z.item(), "loss": loss.item()}


def _equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within ``TOLERANCE``; written so that a NaN or an infinity in ``got`` is a difference (NaN > tol is
    False, and the max of a tensor holding NaN is NaN)."""
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= TOLERANCE


def _how_far(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = ~torch.isfinite(got)
    if bad.any():
        return f"{int(bad.sum())} of its {got.numel()} entries are NaN or infinite"
    return f"max |diff| {float((got - want).abs().max()):.2e}"


def _ratio(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """``got / want`` when ``got`` is a multiple of ``want`` (to 1e-6), else None (also when ``got`` is not finite)."""
    if not float(want.abs().max()) or not bool(torch.isfinite(got).all()):
        return None
    r = float((got * want).sum() / (want * want).sum())
    return r if float((got - r * want).abs().max()) <= 1e-6 * float(want.abs().max()) else None


def compare(cases: list[dict], ref: dict, world: int, ep: int) -> list[str]:
    """``cases``: each rank's entry for one case, in rank order. Returns the differences, one sentence each."""
    out = []
    for rank, case in enumerate(cases):
        experts, keep = ref["records"][rank]
        if not torch.equal(case["experts"], experts):
            out.append(f"rank {rank} routed its tokens to other experts than one process does")
        elif not torch.equal(case["keep"], keep):
            out.append(f"rank {rank} dropped {case['dropped']} token choices, one process drops "
                       f"{int((~keep).sum())} (or others) for the same tokens")
    if out:
        return out
    y = torch.cat([c["y"] for c in cases])
    bad = ~((y - ref["y"]).abs().amax(dim=-1) <= TOLERANCE)  # [T]; a token holding NaN is bad too
    if bad.any():
        tokens = [int(t) for t in bad.nonzero()[:, 0]]
        where = ", ".join(f"rank {t // (len(y) // world)} token {t % (len(y) // world)}" for t in tokens[:4])
        out.append(f"the output differs at {len(tokens)} of {len(y)} tokens ({where}{', ...' if len(tokens) > 4 else ''})"
                   f", {_how_far(y, ref['y'])}, although every token chose and kept the same "
                   "experts: the fault lies between dispatch and combine (the rows' order, their weights, or the experts)")
    aux = sum(c["aux"] for c in cases) / len(cases)
    if not math.isfinite(aux):
        out.append(f"the load-balancing loss is {aux} (the ranks' mean), not finite, against {ref['aux']:.6f} in one "
                   "process")
    elif not abs(aux - ref["aux"]) <= TOLERANCE:
        out.append(f"the load-balancing loss is {aux:.6f} (the ranks' mean) against {ref['aux']:.6f} in one process: "
                   "its f_i must count the tokens of the whole batch (all-reduced), not each rank's own")
    for name, want in ref["grads"].items():
        holders = [r for r, c in enumerate(cases) if name in c["grads"]]
        wrong = [r for r in holders if not _equal(cases[r]["grads"][name], want)]
        if not wrong:
            continue
        got = cases[wrong[0]]["grads"][name]
        ratio = _ratio(got, want)
        held = "" if len(holders) == world else f" (held by rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))})"
        msg = (f"{name}'s gradient differs on rank{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))}{held}: "
               f"{_how_far(got, want)}")
        if ratio is not None and not abs(ratio - 1) <= 1e-6:
            msg += f", exactly {ratio:.2f}x the reference's"
            if abs(ratio - ep) < 1e-6 and name.startswith("experts."):
                msg += f" = ep ({ep}): averaged over the expert-data-parallel group, not the world"
        replicas = [cases[r]["grads"][name] for r in holders]
        if len(replicas) > 1 and any(not torch.equal(replicas[0], t) for t in replicas[1:]) \
                and not name.startswith("experts."):
            mean = sum(replicas) / len(replicas)
            msg += ("; the replicas disagree, and their mean is the reference's: this gradient was never all-reduced"
                    if _equal(mean, want) else "; the replicas disagree")
        out.append(msg)
    xg = torch.cat([c["input_grad"] for c in cases])
    if not _equal(xg, ref["input_grad"]):
        out.append(f"the input's gradient differs, {_how_far(xg, ref['input_grad'])}")
    return out
