"""Compare what tensor-parallel ranks sent back with the dense module, computed here in one process.

    res = cu.run("workers.ch04_tp_layers", world_size=4, module="mlp")
    report = compare(res, "mlp", config_of(res))
    report.ok, report.errors["grads.fc1.weight"]

The ranks send their part of the output, of the input gradient and of every parameter gradient, each
with the indices of the dense entries it holds (``workers/parallel/harness.py``). ``compare`` puts the
parts back together (``plan.assemble``, which also checks that replicated parts agree across ranks) and
measures the largest error against ``dense.reference`` (float64, same float32 weights and inputs).

Tolerance: float32 on the ranks, values of order 1, sums of at most a few hundred terms:
``|got - want| <= ATOL + RTOL * |want|`` with ATOL = RTOL = 1e-5. A dropped, doubled or misplaced
collective misses by far more (order 1), which is what the tests check.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.parallel import dense as D
from workers.parallel.plan import assemble

ATOL = 1e-5
RTOL = 1e-5


@dataclass
class Comparison:
    errors: dict[str, float]  # max |got - want| per tensor: "output", "grad_input", "grads.<name>"
    problems: list[str] = field(default_factory=list)  # replicated parts that disagree, entries no rank held
    failed: list[str] = field(default_factory=list)  # tensors outside the tolerance

    @property
    def ok(self) -> bool:
        return not self.problems and not self.failed

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.errors, key=self.errors.get)
        return name, self.errors[name]

    def verdict(self) -> str:
        """The outcome without the error sizes (which depend on the CPU's rounding): safe to compare in CI."""
        if self.ok:
            return f"equal to the dense module: all {len(self.errors)} tensors within {ATOL:g} + {RTOL:g}*|want|"
        kinds = {p.split(": ")[-2] if p.count(": ") > 1 else p.split(":")[0]:
                 ("ranks disagree on a replicated part" if "disagrees" in p else "entries missing") for p in self.problems}
        notes = [f"{name} ({why})" for name, why in kinds.items()]
        return f"DIFFERENT from the dense module: {', '.join(self.failed + notes)}"

    def __repr__(self) -> str:
        verdict = "equal to the dense module" if self.ok else f"DIFFERENT: {', '.join(self.failed + self.problems)}"
        name, err = self.worst
        return (f"<Comparison {len(self.errors)} tensors, {verdict}; largest error {err:.2g} ({name}); "
                f"tolerance {ATOL:g} + {RTOL:g}*|want|>")


def config_of(params: dict) -> D.BlockConfig:
    """The BlockConfig a worker was run with, from its keyword arguments."""
    fields = D.BlockConfig.__dataclass_fields__
    return D.BlockConfig(**{k: v for k, v in params.items() if k in fields})


def _records(result) -> list[dict]:
    return list(result.ranks) if hasattr(result, "ranks") else list(result)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.all((got - want).abs() <= ATOL + RTOL * want.abs()))


def tensor_parallel_groups(result) -> list[list[dict]]:
    """The ranks' records split by tensor-parallel group (a run with ``tp_size`` < world has several)."""
    records = _records(result)
    if not records or "tp_group_ranks" not in records[0]:
        return [records]
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault(tuple(rec["tp_group_ranks"]), []).append(rec)
    return list(groups.values())


def compare(result, kind: str, cfg: D.BlockConfig, *, seq: int, batch: int, seed: int = 0) -> Comparison:
    """Every output, input gradient and parameter gradient of the ranks against the dense module's.

    With several tensor-parallel groups in one run, each group is rebuilt and compared on its own; the
    result holds the largest error over the groups.
    """
    ref = D.reference(kind, cfg, seq, batch, seed)
    want = {"output": ref["output"], "grad_input": ref["grad_input"],
            **{f"grads.{name}": g for name, g in ref["grads"].items()}}
    groups = tensor_parallel_groups(result)
    errors, failed, problems = {}, [], []
    for index, records in enumerate(groups):
        parts = [{"output": r["output"], "grad_input": r["grad_input"],
                  **{f"grads.{name}": item for name, item in r["grads"].items()}} for r in records]
        got, found = assemble(parts, {name: tuple(t.shape) for name, t in want.items()})
        prefix = f"TP group {index}: " if len(groups) > 1 else ""
        problems += [prefix + p for p in found]
        for name, w in want.items():
            if name not in got:
                continue
            errors[name] = max(errors.get(name, 0.0), (got[name] - w).abs().max().item())
            if not _close(got[name], w) and name not in failed:
                failed.append(name)
    return Comparison(errors, problems, failed)


def compare_training(result, cfg: D.BlockConfig, *, seq: int, batch: int, steps: int, lr: float, seed: int = 0):
    """(dense losses, each rank's losses, largest relative difference) for the same optimizer steps."""
    from workers.parallel.harness import train_dense

    want = train_dense(cfg, seq=seq, batch=batch, steps=steps, lr=lr, seed=seed)
    got = [r["losses"] for r in _records(result)]
    worst = max(abs(g - w) / abs(w) for losses in got for g, w in zip(losses, want))
    return want, got, worst


def comm_rows(result, rank: int = 0, kind: str | None = "activation") -> list[dict]:
    """Rank ``rank``'s communication summary: one row per (layer, collective, pass)."""
    rows = _records(result)[rank]["comm_summary"]
    return [r for r in rows if kind is None or r["kind"] == kind]


def comm_count(result, collective: str, pass_: str, rank: int = 0, kind: str | None = "activation") -> int:
    return sum(r["calls"] for r in comm_rows(result, rank, kind)
               if r["collective"] == collective and r["pass"] == pass_)


def comm_wire_bytes(result, rank: int = 0, kind: str | None = "activation", pass_: str | None = None) -> float:
    return sum(r["wire_bytes"] for r in comm_rows(result, rank, kind) if pass_ is None or r["pass"] == pass_)


# -- FLOPs of one layer (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", sec. 5.1; Korthikanti et al. 2022, sec. 6): a multiply-add is 2 FLOPs ------

def layer_forward_flops(seq: int, hidden: int, batch: int = 1, ffn: int = 0) -> dict:
    """Forward FLOPs of one GPT layer by part (MHA, full s x s scores: no causal saving counted)."""
    b, s, h, f = batch, seq, hidden, ffn or 4 * hidden
    parts = {"qkv": 6 * b * s * h * h, "scores": 2 * b * s * s * h, "attention_v": 2 * b * s * s * h,
             "proj": 2 * b * s * h * h, "mlp": 4 * b * s * h * f}
    parts["attention"] = parts["qkv"] + parts["scores"] + parts["attention_v"] + parts["proj"]
    parts["total"] = parts["attention"] + parts["mlp"]  # 24bsh^2 + 4bs^2h with f = 4h
    return parts


def attention_flop_share(seq: int, hidden: int) -> float:
    """Attention's share of a layer's forward FLOPs: (8bsh^2 + 4bs^2h) / (24bsh^2 + 4bs^2h) = (2h + s) / (6h + s)."""
    return (2 * hidden + seq) / (6 * hidden + seq)
