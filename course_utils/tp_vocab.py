"""Chapter 04, notebook side, the two ends of the model split by vocabulary (runs of ``workers/ch04_vocab_parallel.py``).

Reads the worker's runs (``run``, ``read``: the loss, the verdict against the dense ends in float64, the bytes of
the logits each rank holds, the loss's three all-reduces), prints them (``equality_line``, ``bytes_table``,
``reductions_table``, ``drills_table``), and draws them: the logits' bytes per rank with and without loss
parallelism for a real model's shape with the chapter's measured points on top (``bytes_figure``), what each
missing reduction does to the loss (``drills_figure``), and the explorer's figure (``live_figure``, ``live``).

The real shape is Llama 3 8B's (``course_utils.model_shapes``): a vocabulary of 128,256 entries (Llama Team 2024,
*The Llama 3 Herd of Models*, arXiv:2407.21783, sec. 3.2 and Table 3: "a vocabulary with 128K tokens"; 128,256 is
the released tokenizer's count, 128,000 plus 256 special tokens), at the 8,192-token sequences it was pre-trained on
(sec. 3.4.1), in bf16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from course_utils.model_shapes import MODEL_SHAPES
from course_utils.tables import Table
from workers.parallel.faults import VOCAB_FAULTS
from workers.parallel.vocab_harness import RTOL, dense_reference

WORLD = 4  # the chapter's warm ranks: tp = 1, 2, 4 run as 4/tp groups side by side
SHAPE = {"vocab": 32, "hidden": 16, "seq": 8, "batch": 4}  # the toy: b s = 32 tokens, every word a target once
ELEMENT = 8  # float64, the dtype of every run here: equal to the dense ends within BOUND
BOUND = RTOL[torch.float64]  # 1e-12 of each tensor's largest entry (float64 sums in another order)
DRILLS = VOCAB_FAULTS  # max_not_reduced, target_not_masked, sum_exp_not_reduced, max_not_subtracted
SCALES = (1.0, 1e3)  # logits of order 1, and of order 1e3: exp() of an unshifted logit overflows even float64 there
REAL = {"model": "llama-3-8b", "seq": 8192, "batch": 1, "element": 2}  # one sequence of Llama 3 8B in bf16
# what the verdict saw, for each drill (vocab_harness.verdict reads the group together, never the fault's name)
SEEN = {"max_not_reduced": "loss wrong, finite, the same on every rank;\n  its gradient still sums to 0",
        "target_not_masked": "each token's gradient sums to 1 - t,\n  not 0: every rank subtracted a one-hot",
        "sum_exp_not_reduced": "the ranks' losses differ",
        "max_not_subtracted": "the loss is not finite"}
LABELS = {"": "no drill", "max_not_reduced": "max not reduced", "target_not_masked": "target not masked",
          "sum_exp_not_reduced": "sum of exp not reduced", "max_not_subtracted": "max not subtracted"}


def scale_name(scale: float) -> str:
    """``~1``, ``~1e3``: the order of the logits."""
    return f"~1e{round(math.log10(scale))}" if scale >= 10 else f"~{scale:g}"


@dataclass(frozen=True)
class VocabRun:
    """One run of the worker, read: group 0's ranks (every group runs the same ends)."""

    tp: int
    vocab: int
    seq: int
    batch: int
    hidden: int
    logit_scale: float
    fault: str
    logits_shape: list  # [s, b, V/t] on each rank
    logits_bytes: list  # per rank of group 0, measured: numel * element_size
    dense_logits_bytes: int  # the whole [s, b, V], what gathering them would hold on every rank
    losses: list  # the mean loss each rank of group 0 computed
    dense_loss: float  # the dense ends' loss in one process, float64
    verdict: dict  # vocab_harness.verdict: ok, mistake, why, errors, ranks_agree, grad_row_sum
    reductions: list = field(default_factory=list)  # the loss's all-reduces on rank 0: what, shape, bytes

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for x in self.losses)


def dense_loss(vocab: int, hidden: int, seq: int, batch: int, logit_scale: float = 1.0, tied: bool = False) -> float:
    """The mean loss of the dense ends in one process (float64), from the worker's own seed and tokens."""
    return dense_reference(vocab, hidden, seq, batch, tied=tied, logit_scale=logit_scale)["token_losses"].mean().item()


def read(res, params: dict) -> VocabRun:
    """``res`` a ``RunResult`` of the worker run with ``params`` (vocab, hidden, seq, batch, logit_scale, fault)."""
    shape = {**SHAPE, **{k: params[k] for k in SHAPE if k in params}}
    scale, fault = float(params.get("logit_scale", 1.0)), params.get("fault", "")
    ranks = [r for r in res.ranks if r["tp_group"] == res[0]["tp_group"]]
    return VocabRun(tp=len(ranks), **shape, logit_scale=scale, fault=fault, logits_shape=ranks[0]["logits_shape"],
                    logits_bytes=[r["logits_bytes"] for r in ranks], dense_logits_bytes=ranks[0]["dense_logits_bytes"],
                    losses=[r["loss"] for r in ranks],
                    dense_loss=dense_loss(shape["vocab"], shape["hidden"], shape["seq"], shape["batch"], scale),
                    verdict=ranks[0]["verdict"], reductions=ranks[0]["loss_all_reduces"])


def run(worker: str, tp: int, fault: str = "", logit_scale: float = 1.0, timeout: float = 60, **shape) -> VocabRun:
    """Run ``worker`` (the chapter's ``workers/ch04_vocab_parallel.py``) on the chapter's warm ranks (world
    ``WORLD``) at ``tp``, on the toy's ``SHAPE`` unless ``shape`` says otherwise, and read it."""
    import course_utils as cu

    params = {**SHAPE, **shape, "tp": tp, "fault": fault, "logit_scale": logit_scale}
    return read(cu.run(worker, world_size=WORLD, timeout=timeout, **params), params)


# -- what holds on every CPU: printed by checked cells ---------------------------------------------------------

def equality_line(r: VocabRun) -> str:
    """Whether the run equals the dense ends within ``BOUND`` (float64: an exact statement on every CPU)."""
    what = "equal" if r.verdict["ok"] else "NOT equal"
    return (f"tp = {r.tp}: loss and every gradient (embedding, head, head's input, logits) {what} to the dense ends' "
            f"within {BOUND:g} of their size, on every rank: {r.verdict['ok']}")


def bytes_table(runs: list[VocabRun]) -> Table:
    """Per tp: the logits one rank holds (measured) against the dense logits, and what the loss sent."""
    rows = []
    for r in runs:
        sent = sum(x["bytes"] for x in r.reductions)
        rows.append([r.tp, str(r.logits_shape), f"{r.logits_bytes[0]:,}", f"{r.dense_logits_bytes:,}",
                     f"1/{r.dense_logits_bytes // r.logits_bytes[0]}",
                     f"{len(r.reductions)} x {r.reductions[0]['bytes']:,} B" if r.reductions else "none",
                     f"{sent:,}"])
    return Table(["tp", "logits on a rank", "bytes per rank", "gathered", "share", "loss's all-reduces",
                  "bytes handed to them"], rows, caption=f"b = {runs[0].batch}, s = {runs[0].seq}, V = {runs[0].vocab}, "
                                             "float64, measured on the ranks (numel x element_size)")


def reductions_table(r: VocabRun) -> Table:
    """The loss's all-reduces on one rank, in the order they ran (the communication ledger's records)."""
    op = {"logits_max": "MAX", "predicted_logits": "SUM", "sum_exp_logits": "SUM"}
    return Table(["all-reduce", "op", "shape [s, b]", "bytes", "pass"],
                 [[x["what"], op.get(x["what"], "?"), str(x["shape"]), x["bytes"], x["pass"]] for x in r.reductions])


def drill_verdicts(drills: dict) -> Table:
    """``drills[(fault, scale)] = VocabRun``: which drill the comparison named, or that it passed (exact)."""
    rows = []
    for (fault, scale), r in drills.items():
        v = r.verdict
        named = "passes: equal to the dense ends" if v["ok"] else (
            f"caught, named {v['mistake']}" if v["mistake"] else "caught, not named")
        rows.append([fault or "(none)", scale_name(scale), named, "yes" if r.finite else "no",
                     "yes" if v["ranks_agree"] else "no"])
    return Table(["drill", "logits", "verdict", "loss finite", "ranks agree"], rows)


# -- numbers that vary in their last digits by machine: printed in cells nbval leaves out ---------------------

def drills_table(drills: dict) -> Table:
    """``drills[(fault, scale)] = VocabRun``: each rank's loss against the dense loss, and the verdict's reason."""
    rows = []
    for (fault, scale), r in drills.items():
        losses = list(dict.fromkeys(f"{x:.4g}" for x in r.losses))  # once each, in rank order
        rows.append([fault or "(none)", scale_name(scale), f"{r.dense_loss:.4g}", ", ".join(losses),
                     r.verdict["mistake"] or ("equal" if r.verdict["ok"] else "-")])
    return Table(["drill", "logits", "dense loss", "loss on the ranks", "named"], rows)


# -- bytes of the logits -----------------------------------------------------------------------------------------

def logits_bytes(batch: int, seq: int, vocab: int, tp: int = 1, element: int = 2, *, loss_parallel: bool = True) -> int:
    """Bytes of the logits one rank holds: ``b s V / tp`` split by vocabulary, ``b s V`` once gathered."""
    return batch * seq * vocab * element // (tp if loss_parallel else 1)


def largest_activations(model: str = REAL["model"], seq: int = REAL["seq"], batch: int = REAL["batch"],
                        element: int = REAL["element"]) -> Table:
    """The widest activations of one step of ``model``, per token and for ``batch`` sequences of ``seq``."""
    m = MODEL_SHAPES[model]
    rows = [("hidden state [b, s, h]", m.hidden), ("MLP inside [b, s, ffn]", m.ffn), ("logits [b, s, V]", m.vocab)]
    return Table(["activation", "per token", f"bytes (b = {batch}, s = {seq:,}, {8 * element}-bit)", "x hidden"],
                 [[what, f"{n:,}", f"{batch * seq * n * element:,}", f"{n / m.hidden:.1f}"] for what, n in rows],
                 caption=f"{m.name} ({m.source}): vocabulary {m.vocab:,}")


def _bytes_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    def label(v, _):
        for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if v >= size:
                return f"{v / size:g} {unit}"
        return f"{v:g} B"
    ax.yaxis.set_major_formatter(FuncFormatter(label))


def bytes_figure(runs: list[VocabRun], model: str = REAL["model"], seq: int = REAL["seq"], batch: int = REAL["batch"],
                 element: int = REAL["element"]):
    """Left: bytes of the logits per rank as tp grows, gathered (b s V) and split (b s V / tp), for ``model``'s
    shape, with the toy's formula lines and the chapter's measured points underneath. Right: as the vocabulary
    grows, at tp = 1 (gathered) to 8, with the published vocabularies marked."""
    import matplotlib.pyplot as plt

    from course_utils.plots import log2_axis

    m = MODEL_SHAPES[model]
    tps = [1, 2, 4, 8]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10.0, 4.6))
    real = f"{m.name}: s = {seq:,}, V = {m.vocab:,}, bf16"
    ax.plot(tps, [logits_bytes(batch, seq, m.vocab, 1, element)] * len(tps), "-", color="C3", lw=2,
            label=f"gathered, b·s·V ({real})")
    ax.plot(tps, [logits_bytes(batch, seq, m.vocab, t, element) for t in tps], "-", color="C0", lw=2,
            label="split by vocabulary, b·s·V/tp")
    toy = runs[0]
    ax.plot(tps, [logits_bytes(toy.batch, toy.seq, toy.vocab, 1, ELEMENT)] * len(tps), "--", color="C3", lw=1)
    ax.plot(tps, [logits_bytes(toy.batch, toy.seq, toy.vocab, t, ELEMENT) for t in tps], "--", color="C0", lw=1)
    ax.scatter([r.tp for r in runs], [r.dense_logits_bytes for r in runs], marker="s", s=40, color="C3",
               edgecolor="black", zorder=3, label="measured here, gathered (dense)")
    ax.scatter([r.tp for r in runs], [r.logits_bytes[0] for r in runs], marker="o", s=40, color="C0",
               edgecolor="black", zorder=3, label="measured here, one rank's shard")
    ax.text(1, toy.dense_logits_bytes * 3, f"the toy, measured here: b = {toy.batch}, s = {toy.seq}, V = {toy.vocab},\n"
            "float64 (dashed: its formula)", fontsize=8, va="bottom")
    ax.set_yscale("log")
    ax.set_ylim(toy.logits_bytes[0] / 10, logits_bytes(batch, seq, m.vocab, 1, element) * 20)
    _bytes_axis(ax)
    log2_axis(ax, tps, "tensor-parallel size tp")
    ax.set_ylabel("bytes of logits on one rank")
    ax.set_title("logits per rank: split vs gathered", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)

    ticks = [2 ** k for k in range(14, 19)]
    vocabs = [int(2 ** (14 + 4 * i / 200)) for i in range(201)]  # smooth on the log axis
    for t, colour in zip(tps, ("C3", "C1", "C0", "C2")):
        what = "gathered (any tp)" if t == 1 else f"split, tp = {t}"
        bx.plot(vocabs, [logits_bytes(batch, seq, v, t, element) / 1e9 for v in vocabs], "-", color=colour, lw=2,
                label=what)
    for key, name, offset, align in (("llama-2-7b", "Llama 2", (-6, 6), "right"), ("gpt-3-175b", "GPT-3", (-4, 18), "right"),
                                     ("llama-3-8b", "Llama 3", (-6, 6), "right")):
        shape = MODEL_SHAPES[key]
        gb = logits_bytes(batch, seq, shape.vocab, 1, element) / 1e9
        bx.scatter([shape.vocab], [gb], color="C3", edgecolor="black", zorder=3, s=30)
        bx.annotate(f"{name}\nV = {shape.vocab:,}", (shape.vocab, gb), textcoords="offset points", xytext=offset,
                    ha=align, va="bottom" if align == "right" else "top", fontsize=8)
    bx.set_xscale("log", base=2)
    bx.set_xticks(ticks, [f"{v // 1024}k" for v in ticks])
    bx.set_xlabel("vocabulary V")
    bx.set_ylabel(f"GB of logits on one rank (s = {seq:,}, bf16)")
    bx.set_ylim(0, logits_bytes(batch, seq, vocabs[-1], 1, element) / 1e9 * 1.08)
    bx.set_title("as the vocabulary grows", fontsize=10)
    bx.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


# -- the drills ----------------------------------------------------------------------------------------------

def drills_figure(drills: dict):
    """``drills[(fault, scale)] = VocabRun`` over ``SCALES``: one panel per scale, a bar per drill (one per rank where
    the ranks disagree) against the dense loss (dashed), a non-finite loss written where its bar would be, and on
    the right what the comparison with the dense ends saw and named."""
    import matplotlib.pyplot as plt

    scales = sorted({s for _, s in drills})
    faults = list(dict.fromkeys(f for f, _ in drills))
    fig, axes = plt.subplots(len(scales), 1, figsize=(10.0, 1.0 + 1.9 * len(scales)))
    for ax, scale in zip(axes, scales):
        runs = [drills[f, scale] for f in faults]
        dense = runs[0].dense_loss
        right = max([x for r in runs for x in r.losses if math.isfinite(x)] + [dense]) * 1.12
        for i, r in enumerate(runs):
            colour = "C2" if r.verdict["ok"] else "C3"
            if r.finite:
                height = 0.7 / len(set(r.losses))  # the ranks disagree: a thin bar each
                values = r.losses if len(set(r.losses)) > 1 else r.losses[:1]
                for k, x in enumerate(values):
                    ax.barh(i - 0.35 + (k + 0.5) * height, x, height * 0.9, color=colour, alpha=0.85)
            else:
                signs = sorted({"+inf" if x > 0 else "-inf" if x < 0 else "NaN" for x in r.losses
                                if not math.isfinite(x)})
                ax.text(max(dense * 1.1, right * 0.02), i, f"loss {' / '.join(signs)} on every rank", va="center", fontsize=8,
                        color="C3", fontweight="bold")
            seen = ("passes: equal to the dense ends" if r.verdict["ok"] else
                    f"named {r.verdict['mistake']}: {SEEN[r.verdict['mistake']]}" if r.verdict["mistake"]
                    else "caught, not named")
            ax.text(1.02, i, seen, transform=ax.get_yaxis_transform(), va="center", fontsize=8)
        ax.axvline(dense, color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(runs)), [LABELS.get(f, f) for f in faults], fontsize=8)
        ax.set_ylim(len(runs) - 0.5, -0.5)
        ax.set_xlim(0, right)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel("mean loss on each rank (one bar per rank where they differ)", fontsize=8)
        ax.set_title(f"logits {scale_name(scale)}, tp = {runs[0].tp}: the loss under each drill (dashed: the dense "
                     f"loss, {dense:.4g}), and what the comparison saw", fontsize=10, loc="left")
    fig.tight_layout()
    return fig


# -- the explorer ------------------------------------------------------------------------------------------------

def live_figure(r: VocabRun):
    """Bytes of the logits per rank against the dense logits, each rank's loss against the dense loss, the verdict."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.0, 3.4))
    ranks = list(range(r.tp))
    ax.bar(ranks, r.logits_bytes, 0.6, color="C0", label="one rank's shard")
    ax.axhline(r.dense_logits_bytes, color="C3", linestyle="--", linewidth=1.5)
    ax.annotate(f"gathered: {r.dense_logits_bytes:,} B", (r.tp - 0.6, r.dense_logits_bytes), xytext=(0, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=8, color="C3")
    ax.set_ylim(0, r.dense_logits_bytes * 1.2)
    ax.set_xticks(ranks, [f"rank {k}" for k in ranks], fontsize=8)
    ax.set_xlim(-0.6, max(r.tp, 2) - 0.4)
    ax.set_ylabel("bytes of logits")
    ax.set_title(f"V = {r.vocab}, tp = {r.tp}: {r.logits_bytes[0]:,} B of logits per rank, 1/{r.tp} of them",
                 fontsize=10)
    finite = [x for x in r.losses if math.isfinite(x)]
    top = max(finite + [r.dense_loss]) * 1.25
    for k, x in enumerate(r.losses):
        if math.isfinite(x):
            bx.bar(k, x, 0.6, color="C2" if r.verdict["ok"] else "C3")
        else:
            bx.text(k, top / 2, "+inf" if x > 0 else "-inf" if x < 0 else "NaN", ha="center", fontsize=9, color="C3")
    bx.axhline(r.dense_loss, color="black", linestyle="--", linewidth=1)
    bx.annotate(f"dense {r.dense_loss:.4g}", (r.tp - 0.6, r.dense_loss), xytext=(0, 3), textcoords="offset points",
                ha="right", va="bottom", fontsize=8)
    bx.set_ylim(0, top)
    bx.set_xticks(ranks, [f"rank {k}" for k in ranks], fontsize=8)
    bx.set_xlim(-0.6, max(r.tp, 2) - 0.4)
    bx.set_ylabel("mean loss")
    verdict = ("equal to the dense ends" if r.verdict["ok"] else
               f"caught: {r.verdict['mistake'] or 'not named'}")
    bx.set_title(f"{r.fault or 'no drill'}, logits {scale_name(r.logit_scale)}: {verdict}", fontsize=10)
    fig.tight_layout()
    return fig


def live(worker: str, vocab: int = SHAPE["vocab"], tp: int = WORLD, fault: str = "", logit_scale: float = 1.0):
    """The explorer of ``worker`` on the chapter's warm ranks: vocabulary, tp, logits' size and drill. A tp that does
    not divide the ranks or the vocabulary is refused in a sentence (the worker's ``check_params``) before anything
    starts."""
    import ipywidgets as W

    from course_utils.widgets import LiveRun, slider

    controls = {"vocab": slider("vocab", vocab, 8, 96, 2), "tp": slider("tp", tp, 1, WORLD),
                "logit_scale": W.Dropdown(options=[("~1", 1.0), ("~1e3", 1000.0)], value=logit_scale,
                                          description="logits"),
                "fault": W.Dropdown(options=[("none", "")] + [(f, f) for f in DRILLS], value=fault,
                                    description="drill")}
    fixed = {"world_size": WORLD, **{k: v for k, v in SHAPE.items() if k != "vocab"}}
    return LiveRun(worker, controls, lambda res, params: live_figure(read(res, params)), params=fixed, timeout=60)
