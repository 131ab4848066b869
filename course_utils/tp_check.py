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

``compare_training`` does the same for chapter 06's training runs: the course's GPT made of the block, trained for a
few Adam steps on the ranks, against the same GPT trained here (its losses and its final parameters; tolerances
and their measurements by ``LOSS_RTOL``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from workers.model import dense as D
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
    """The BlockConfig a worker was run with, from its keyword arguments (or the ``config`` it sent back)."""
    names = {f.name for f in dataclasses.fields(D.BlockConfig)}
    return D.BlockConfig(**{k: v for k, v in params.items() if k in names})


def _records(result) -> list[dict]:
    return list(result.ranks) if hasattr(result, "ranks") else list(result)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(torch.all((got - want).abs() <= ATOL + RTOL * want.abs()))


def tensor_parallel_groups(result) -> list[list[dict]]:
    """The ranks' records split by tensor-parallel group (a run with ``tp`` < world has several)."""
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


# -- training: the course's GPT on the ranks against the same GPT in one process ------------------------------------
#
# The ranks train in float32, the reference in float64 from the same float32 initial weights (``train_dense``), so
# what is measured is the ranks' float32 rounding, carried through a few Adam steps. Measured on chapter 06's
# cases (TP 1, 2, 4, with and without SP, GQA 8q/2kv, MQA with SwiGLU, dropout 0.1, two TP groups of 2 in a world
# of 4; 4 steps at lr 1e-3, seeds 0-2), under the native AVX-512 kernels and ATEN_CPU_CAPABILITY=default:
# * LOSS_RTOL: every step's loss within 1e-5 relative of the reference's. Measured at most 1.5e-7 (native) and
#   1.3e-7 (default): a margin of 65.
# * PARAM_RTOL: each final parameter within 5e-3 of its tensor's largest reference entry (``relative_error``),
#   chapter 15's float32 tolerance (``workers/composed/equivalence.py``), for the same reason: every parameter
#   but one is within 1e-4; the fused QKV bias reaches 1.3e-3 (native) and 9.4e-4 (default), a margin of 3.7.
#   Its key part has a gradient that is exactly zero (adding it shifts every score of a query's row by the same
#   amount, which softmax ignores), so what it gets is rounding noise, which Adam divides by its own size (plus
#   eps = 1e-8) and turns into steps of a sizeable part of lr: ~1e-9 of float32 noise is not small against eps,
#   the float64 reference's ~1e-17 is.
# Every injected fault that applies to a run misses both by far more: its parameters by 0.1 to 0.2 of their
# largest entry after the same 4 steps (20 times the tolerance), its losses by 9e-4 to 0.15.
LOSS_RTOL = 1e-5
PARAM_RTOL = 5e-3


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (the absolute error when the reference is all zeros)."""
    scale = want.abs().max().item()
    err = (got.to(torch.float64) - want.to(torch.float64)).abs().max().item()
    return err / scale if scale > 0 else err


@dataclass
class TrainingComparison:
    dense_losses: list[float]  # the single-process GPT's loss at every step
    losses: list[list[float]]  # each rank's
    loss_error: float  # the largest |got - want| / want over steps and ranks
    param_errors: dict[str, float]  # per parameter after the last step, relative to its largest reference entry
    problems: list[str] = field(default_factory=list)  # replicated parts that disagree, entries no rank held

    @property
    def failed(self) -> list[str]:
        bad = [name for name, err in self.param_errors.items() if not err <= PARAM_RTOL]
        return (["losses"] if not self.loss_error <= LOSS_RTOL else []) + [f"params.{name}" for name in bad]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.failed

    @property
    def ranks_agree(self) -> bool:
        """Every rank reports the same losses, bit for bit (each computes the whole loss from the whole logits)."""
        return all(losses == self.losses[0] for losses in self.losses)

    @property
    def worst(self) -> tuple[str, float]:
        name = max(self.param_errors, key=self.param_errors.get)
        return name, self.param_errors[name]

    def verdict(self) -> str:
        """The outcome without the error sizes (which depend on the CPU's rounding): safe to compare in CI."""
        if self.ok:
            return (f"trains like the GPT in one process: {len(self.dense_losses)} losses within {LOSS_RTOL:g} "
                    f"(relative), all {len(self.param_errors)} parameters within {PARAM_RTOL:g} of their largest entry")
        return f"DIFFERENT from the GPT in one process: {', '.join(self.failed + self.problems)}"

    def __repr__(self) -> str:
        name, err = self.worst
        return (f"<TrainingComparison {self.verdict()}; largest loss error {self.loss_error:.2g}, largest parameter "
                f"error {err:.2g} ({name})>")


def compare_training(result, cfg: D.BlockConfig, *, seq: int, batch: int, steps: int, lr: float,
                     seed: int = 0) -> TrainingComparison:
    """The ranks' losses and final parameters against the same GPT trained in one process (``harness.train_dense``).

    ``cfg``, ``seq`` and ``batch`` are the run's: the GPT is ``harness.gpt_config(cfg, seq)``. With several
    tensor-parallel groups in one run, each group's parameters are put back together and compared on their own.
    """
    from workers.parallel.harness import gpt_config, train_dense

    want_losses, want_params = train_dense(gpt_config(cfg, seq), batch=batch, steps=steps, lr=lr, seed=seed)
    losses = [list(r["losses"]) for r in _records(result)]
    loss_error = max((abs(g - w) / abs(w) for got in losses for g, w in zip(got, want_losses)), default=0.0)
    if any(len(got) != steps for got in losses):
        loss_error = float("inf")
    shapes = {name: tuple(p.shape) for name, p in want_params.items()}
    groups = tensor_parallel_groups(result)
    param_errors, problems = {}, []
    for index, records in enumerate(groups):
        got, found = assemble([r["params"] for r in records], shapes)
        problems += [(f"TP group {index}: " if len(groups) > 1 else "") + p for p in found]
        for name, want in want_params.items():
            if name in got:
                param_errors[name] = max(param_errors.get(name, 0.0), relative_error(got[name], want))
    return TrainingComparison(want_losses, losses, loss_error, param_errors, problems)


def comm_rows(result, rank: int = 0, kind: str | None = "activation") -> list[dict]:
    """Rank ``rank``'s communication summary: one row per (layer, collective, pass)."""
    rows = _records(result)[rank]["comm_summary"]
    return [r for r in rows if kind is None or r["kind"] == kind]


def comm_count(result, collective: str, pass_: str, rank: int = 0, kind: str | None = "activation") -> int:
    return sum(r["calls"] for r in comm_rows(result, rank, kind)
               if r["collective"] == collective and r["pass"] == pass_)


def comm_wire_bytes(result, rank: int = 0, kind: str | None = "activation", pass_: str | None = None) -> float:
    return sum(r["wire_bytes"] for r in comm_rows(result, rank, kind) if pass_ is None or r["pass"] == pass_)


# -- FLOPs of one layer (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM", arXiv:2104.04473: the per-GEMM count of its appendix on floating-point operations, whose
# total, 24bsh^2 + 4bs^2h per layer forward, sec. 5.1 uses): a multiply-add is 2 FLOPs ----------------------

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


# -- activation memory of one layer (Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.1, eq. 1) -------------
#
# Each term is what one operation keeps for its backward. The paper writes them in bytes for 16-bit
# activations ("2sbh" is s*b*h elements of 2 bytes) and 1-byte dropout masks; ``bytes_per_element`` scales
# the activations to the dtype actually run (masks stay 1 byte: torch keeps them as bool). With every term,
# at 2 bytes: sbh(34 + 5as/h).

def activation_terms(seq: int, batch: int, hidden: int, heads: int, *, bytes_per_element: float = 2,
                     hidden_dropout: bool = True, attention_dropout: bool = True,
                     stores_probabilities: bool = True) -> list[dict]:
    """Korthikanti's terms for one layer: ``{"segment", "what", "paper", "bytes", "applies", "why"}`` each.

    ``segment`` is the submodule of ``DenseBlock`` whose forward saves it (the label
    ``workers.parallel.activations`` gives); a term that does not apply to the block as run keeps its
    bytes, with ``applies`` False and ``why``:
    * ``hidden_dropout`` False: no dropout after attention and the MLP, so no sbh masks;
    * ``attention_dropout`` False: no dropout on the probabilities, so no as^2b mask and no second s x s
      tensor (the probabilities themselves feed P.V);
    * ``stores_probabilities`` False: a fused kernel (FlashAttention, PyTorch's CPU flash kernel) keeps no
      s x s tensor at all; it recomputes them in backward from its output and a log-sum-exp per row.
    """
    s, b, h, a, e = seq, batch, hidden, heads, bytes_per_element
    sbh, as2b = s * b * h, a * s * s * b
    no_hd, no_ad, no_p = "no dropout after the sub-layer", "no dropout on the probabilities", \
        "the attention kernel stores no s x s tensor"

    def term(segment, what, paper, nbytes, why=None):
        return {"segment": segment, "what": what, "paper": paper, "bytes": nbytes, "applies": why is None,
                "why": why or ""}

    return [
        term("ln1", "LayerNorm 1 input", "2sbh", sbh * e),
        term("attention.qkv", "QKV input (LayerNorm 1 output)", "2sbh", sbh * e),
        term("attention", "Q and K, for QK^T", "4sbh", 2 * sbh * e),
        term("attention", "softmax output", "2as^2b", as2b * e, None if stores_probabilities else no_p),
        term("attention", "softmax dropout mask", "as^2b", as2b,
             None if stores_probabilities and attention_dropout else (no_p if not stores_probabilities else no_ad)),
        term("attention", "dropout output, for P.V", "2as^2b", as2b * e,
             None if stores_probabilities and attention_dropout else (no_p if not stores_probabilities else no_ad)),
        term("attention", "V, for P.V", "2sbh", sbh * e),
        term("attention.proj", "output projection input", "2sbh", sbh * e),
        term("dropout", "attention dropout mask", "sbh", sbh, None if hidden_dropout else no_hd),
        term("ln2", "LayerNorm 2 input", "2sbh", sbh * e),
        term("mlp.fc1", "fc1 input (LayerNorm 2 output)", "2sbh", sbh * e),
        term("mlp", "GeLU input", "8sbh", 4 * sbh * e),
        term("mlp.fc2", "fc2 input (GeLU output)", "8sbh", 4 * sbh * e),
        term("dropout", "MLP dropout mask", "sbh", sbh, None if hidden_dropout else no_hd),
    ]


def activation_table(terms: list[dict], measured: dict[str, dict]) -> str:
    """Per segment: Korthikanti's terms ("(no)": does not apply), the bytes of those that apply, and each
    measurement's bytes saved there.

    ``measured`` maps a column title to ``saved_for_backward(...)["by_segment"]``. Segments in the
    measurements that no term names (a checkpoint's input) get rows of their own.
    """
    segments = list(dict.fromkeys([t["segment"] for t in terms] + [k for m in measured.values() for k in m]))
    titles = list(measured)
    head = f"{'segment':<16}{'Korthikanti terms, 16-bit notation':<48}{'expected':>10}" + \
        "".join(f"{t:>16}" for t in titles)
    lines = [head, "-" * len(head)]
    for seg in segments:
        mine = [t for t in terms if t["segment"] == seg]
        names = ", ".join(t["paper"] + ("" if t["applies"] else " (no)") for t in mine) or "-"
        expected = sum(t["bytes"] for t in mine if t["applies"])
        lines.append(f"{seg:<16}{names:<48}{expected:>10.0f}" +
                     "".join(f"{m.get(seg, 0):>16.0f}" for m in measured.values()))
    total = sum(t["bytes"] for t in terms if t["applies"])
    lines.append("-" * len(head))
    lines.append(f"{'total':<64}{total:>10.0f}" + "".join(f"{sum(m.values()):>16.0f}" for m in measured.values()))
    return "\n".join(lines)
