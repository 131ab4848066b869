"""Chapter 15, notebook side: the planner of chapter 00 held to a composed run (the "truth table").

For one run of ``workers/ch15_composed.py`` this puts three numbers side by side, per parallel dimension and per
memory moment, for the rank the planner models (the first pipeline stage's rank at dp = cp = tp = 0):

* **planner**: chapter 00's model for the same shapes (``planner.step_collectives`` for bytes, the ledger's
  ``model_state_bytes`` and ``plan(...).memory`` for memory), with this run's element size;
* **this implementation**: the same bookkeeping written out for what the course's code actually does (which
  collectives, on which tensors, with which parameters). It is exact: a test asserts that the measured figure
  equals it to the byte, so every gap between the planner and the run is one of the reasons given in ``why``;
* **measured**: what the rank counted (its collectives' sizes through ``CommLedger`` and its own bookkeeping, the
  bytes it sent point to point, the tensors it holds, the peak of what autograd saved).

Activation memory is the one figure without an exact model here. Korthikanti et al.'s count (the ledger's
``activation_bytes_per_layer``) is for 16-bit activations, 1-byte dropout masks and the s x s attention scores
kept for backward (no FlashAttention); here activations are float64 (4x the bytes per element), there are no
masks at dropout 0, and PyTorch's attention (and the ring) saves its output and log-sum-exp instead of the
scores; the planner also leaves out the embedding and loss of a stage that is not the only one. Over the
chapter's eight layouts the planner's figure was 0.30-0.39 of the measured peak (a byte count, the same on every
CPU); the tests hold it to 0.25-0.45.
"""
from __future__ import annotations

import math

from course_utils import planner, timelines
from course_utils.ledger import model_state_bytes, pipeline_bubble_fraction
from course_utils.tables import Table
from workers.composed.model import dense_shapes, model_config
from workers.layout import Layout
from workers.context_parallel.blocks import work_per_rank
from workers.parallel.plan import REPLICATED, block_plan

ELEMENT = {"float64": 8, "float32": 4}


def model_shape(config: dict) -> planner.ModelShape:
    cfg = _cfg(config)
    return planner.ModelShape("chapter 15 GPT", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                              kv_heads=cfg.kv_heads, ffn=cfg.ffn, vocab=cfg.vocab, mlp="gelu", tied_embeddings=True,
                              source="workers/composed/model.py")


def _cfg(config: dict):
    return model_config(**{k: config[k] for k in ("vocab", "seq", "hidden", "heads", "layers", "dropout")})


def _step_layout(layout: dict, config: dict) -> Layout:
    """The run's layout with the step's shape the planner needs: sequences per micro-batch, tokens per sequence,
    and no recomputation (the course's trainer keeps every activation)."""
    return Layout(**{**layout, "micro_batch": config["global_batch"] // (layout["dp"] * layout["micro_batches"]),
                     "seq": config["seq"], "recompute": "none"})


def first_rank(ranks: list[dict]) -> dict:
    return next(r for r in ranks if not any(r["coords"].values()))


def _virtual_stages(layout: dict, stage: int) -> list[int]:
    return [c * layout["pp"] + stage for c in range(layout["virtual_stages"])]


def local_param_counts(layout: dict, config: dict, stage: int) -> dict[str, int]:
    """Elements of every parameter a rank of pipeline stage ``stage`` holds (TP shards counted at 1/tp)."""
    cfg, tp = _cfg(config), layout["tp"]
    shapes = dense_shapes(cfg)
    split = {f"{module}.{param}": how for module, param, how in block_plan()}
    V = layout["pp"] * layout["virtual_stages"]
    per = cfg.layers // V
    out = {}
    for vs in _virtual_stages(layout, stage):
        layers = range(vs * per, (vs + 1) * per)
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if name.startswith("blocks."):
                layer, rest = name.split(".", 2)[1:]
                if int(layer) in layers:
                    out[name] = numel // tp if split[rest] != REPLICATED else numel
            elif name == "embed.weight" and vs == 0:
                out[name] = numel // tp  # split by vocabulary: vocab/tp rows
            elif name == "pos" and vs == 0:
                out[name] = numel
            elif name.startswith("ln_f.") and vs == V - 1:
                out[name] = numel
        if vs == V - 1 and vs != 0:
            out["head.weight"] = cfg.vocab // tp * cfg.hidden  # the tied embedding's copy: the same vocab/tp rows
    return out


def buckets(layout: dict, config: dict, stage: int) -> tuple[list[str], list[int]]:
    """(the tied embedding's names on this stage, the elements of each gradient bucket): the trainer keeps the tied
    copy in a bucket of its own (``train.ComposedTrainer``), then everything else; empty buckets left out."""
    counts = local_param_counts(layout, config, stage)
    tied = [n for n in counts if n == "head.weight" or (n == "embed.weight" and layout["pp"] > 1)]
    sizes = [sum(counts[n] for n in tied), sum(v for n, v in counts.items() if n not in tied)]
    return tied, [n for n in sizes if n]


def state_bytes(layout: dict, config: dict, stage: int) -> dict[str, int]:
    """Parameters, gradients and AdamW's two moments a rank of ``stage`` (dp_cp index 0) holds, as the code keeps
    them: whole buffers (ZeRO-1 pads each bucket to a multiple of the dp x cp group) and the moments of the rank's
    shard (ZeRO-1: the group's first shard of each bucket)."""
    E, group = ELEMENT[config["dtype"]], layout["dp"] * layout["cp"]
    _, sizes = buckets(layout, config, stage)
    if layout["zero"] == 1:
        held = sum(math.ceil(n / group) * group for n in sizes)
        owned = sum(min(math.ceil(n / group), n) for n in sizes)
        return {"params": held * E, "grads": held * E, "optimizer": 2 * owned * E}
    total = sum(sizes)
    return {"params": total * E, "grads": total * E, "optimizer": 2 * total * E}


def implementation_bytes(layout: dict, config: dict, stage: int) -> dict[str, float]:
    """Bytes a rank of ``stage`` (at dp = cp = tp = 0) sends per step, per dimension, by what the code does."""
    cfg, E = _cfg(config), ELEMENT[config["dtype"]]
    tp, pp, cp, m, sp = layout["tp"], layout["pp"], layout["cp"], layout["micro_batches"], layout["sequence_parallel"]
    V = pp * layout["virtual_stages"]
    held = _virtual_stages(layout, stage)
    layers = len(held) * cfg.layers // V
    b = config["global_batch"] // (layout["dp"] * m)
    tokens = b * cfg.seq // cp  # b s/cp: the tokens of a micro-batch on this rank
    msg = tokens * cfg.hidden * E  # one [s/cp, b, h] activation
    first, last = 0 in held, V - 1 in held
    out = dict.fromkeys(("tp", "tp_parameters", "cp", "pp", "dp", "embedding"), 0.0)
    if tp > 1:  # 2 all-reduces (or their SP pairs) forward and 2 backward per layer: Megatron's f and g
        # the ends, split by vocabulary: the embedding's sum (an all-reduce; under SP a reduce-scatter and the
        # all-gather of its gradient) and the head's input gradient (f's all-reduce; under SP the all-gather of its
        # input and the reduce-scatter of its gradient), 2 (tp-1)/tp msg each; the loss's three all-reduces of
        # [s/cp, b], in the loss's precision (float32 at least)
        ends = (first + last) * 2 * (tp - 1) / tp * msg + last * 3 * 2 * (tp - 1) / tp * tokens * max(E, 4)
        out["tp"] = m * (layers * 4 * 2 * (tp - 1) / tp * msg + ends)
        if sp:  # LayerNorm weights and biases, row biases: partial gradients, all-reduced after each micro-batch;
            # the first stage's position rows too (each rank added its own rows: [s/cp, h])
            norms = 6 * cfg.hidden * layers + (2 * cfg.hidden if last else 0) \
                + (cfg.seq // cp * cfg.hidden if first else 0)
            out["tp_parameters"] = m * 2 * (tp - 1) / tp * norms * E
    if cp > 1:  # forward: K and V on cp-1 hops; backward: K and V again, and dK/dV on cp hops home
        out["cp"] = m * layers * (6 * cp - 4) * msg / tp
    if pp > 1:  # one activation forward (not from the last virtual stage), one gradient back (not from the first)
        rows = msg / tp if sp else msg
        out["pp"] = m * rows * sum((vs != V - 1) + (vs != 0) for vs in held)
    group = layout["dp"] * cp
    tied, sizes = buckets(layout, config, stage)
    if group > 1:
        if layout["zero"] == 1:  # reduce-scatter and all-gather of each bucket, padded to a multiple of the group
            out["dp"] = sum(2 * (group - 1) / group * math.ceil(n / group) * group * E for n in sizes)
        else:
            out["dp"] = sum(2 * (group - 1) / group * n * E for n in sizes)
    out["embedding"] = len(tied) * cfg.vocab // tp * cfg.hidden * E  # an all-reduce over 2 ranks sends its message once
    return out


WHY = {
    "tp": "the planner counts the layers' 4 all-reduces of b s/cp h (or their sequence-parallel pairs) exactly, not "
          "the ends split by vocabulary: the first stage sums the embedding's rows over TP, the last stage the head's "
          "input gradient, each as much as one all-reduce of b s/cp h, and the loss's three all-reduces of b s/cp",
    "tp_parameters": "not in the planner: under sequence parallelism the LayerNorm and row-bias gradients (and the "
                     "first stage's position rows) are partial sums, all-reduced after every micro-batch (small: 6h "
                     "per layer)",
    "cp": "the planner counts an all-gather of K and V forward and a reduce-scatter backward, (cp-1)/cp each; the "
          "ring sends K and V again in backward and carries dK/dV one hop further, home: (3cp-2)/(2cp-2) times that",
    "pp": "the planner charges every GPU one send each way per micro-batch, 1/tp of the activation; the first stage "
          "sends forward only, and without sequence parallelism every TP rank sends the whole activation",
    "dp": "the planner counts weights only (no biases, no learned positions, no LayerNorm biases) and divides them "
          "all by tp; here LayerNorms, row biases and positions are replicated over tp, and ZeRO pads",
    "embedding": "not in the planner: the tied embedding's gradient (this TP rank's vocab/tp rows), summed between the "
                 "first and last stage",
}


def comm_rows(ranks: list[dict], step: int = 0) -> list[dict]:
    """The truth table's communication part for the planner's rank: one row per dimension."""
    rank = first_rank(ranks)
    layout, config = rank["layout"], rank["config"]
    E = ELEMENT[config["dtype"]]
    plan_layout = _step_layout(layout, config)
    predicted = {dim: sum(c.wire_bytes for c in calls) for dim, calls in
                 planner.step_collectives(model_shape(config), plan_layout, weight_bytes=E, grad_bytes=E,
                                          bytes_per_element=E).items()}
    exact = implementation_bytes(layout, config, rank["stage"])
    rows = []
    for dim in ("tp", "tp_parameters", "cp", "pp", "dp", "embedding"):
        measured = rank["comm"][step][dim]["wire_bytes"]
        plan = predicted.get(dim, 0.0)
        rows.append({"dimension": dim, "planner": plan, "implementation": exact[dim], "measured": measured,
                     "planner_error": (plan - measured) / measured if measured else (0.0 if plan == 0 else math.inf),
                     "why": WHY[dim] if plan != measured else "exact"})
    return rows


def memory_rows(ranks: list[dict], step: int = 0) -> list[dict]:
    """Memory of the planner's rank at the four moments: planner, this implementation (exact except activations)
    and measured."""
    rank = first_rank(ranks)
    layout, config = rank["layout"], rank["config"]
    E = ELEMENT[config["dtype"]]
    shape = model_shape(config)
    plan_layout = _step_layout(layout, config)
    pp, tp = layout["pp"], layout["tp"]
    stage_params = shape.n_params if pp == 1 else math.ceil(shape.layers / pp) * shape.params_per_layer \
        + shape.vocab * shape.hidden
    group = layout["dp"] * layout["cp"]
    states = model_state_bytes(stage_params, dp=group, tp=tp, pp=1, zero_stage=layout["zero"], weight_bytes=E,
                               grad_bytes=E, optimizer_bytes_per_param=2 * E)  # AdamW: two moments
    # Korthikanti's count with the scores kept (no FlashAttention), the count this docstring compares; timed=False:
    # only the memory is wanted (this run's tiny shapes are not in the GPU's GEMM table)
    activations = planner.plan(shape, plan_layout, layout["dp"] * tp * pp * layout["cp"], cluster_name="h100-ib",
                               weight_bytes=E, grad_bytes=E, practice=planner.Practice(flash_attention=False),
                               timed=False).memory["activations"]
    exact = state_bytes(layout, config, rank["stage"])
    measured = rank["memory"][step]
    rows = []
    for moment, plan in (("params", states.params), ("grads", states.grads), ("optimizer", states.optimizer),
                         ("activations", activations)):
        rows.append({"moment": moment, "planner": plan, "implementation": exact.get(moment),
                     "measured": measured[moment], "planner_error": (plan - measured[moment]) / measured[moment]})
    return rows


def cp_work(ranks: list[dict], step: int = 0) -> dict:
    """Attention scores each CP rank computed (per ring call), against chapter 14's block count for the split."""
    rank = first_rank(ranks)
    layout, config = rank["layout"], rank["config"]
    if layout["cp"] == 1:
        return {}
    calls = layout["micro_batches"] * config["layers"] // layout["pp"]  # ring attention calls per step and rank
    measured = {r["coords"]["cp"]: r["score_entries"][step] // calls for r in ranks if r["coords"]["pp"] == 0}
    predicted = [w["score_entries"] for w in work_per_rank(config["seq"], layout["cp"], layout["split"], True)]
    return {"measured": [measured[c] for c in sorted(measured)], "predicted": predicted}


def bubble(ranks: list[dict], step: int = -1) -> dict:
    """Idle / total of the first pipeline (dp = cp = tp = 0) against (p-1)/(v m + p-1)."""
    rows = sorted((r for r in ranks if r["coords"]["dp"] == r["coords"]["cp"] == r["coords"]["tp"] == 0),
                  key=lambda r: r["coords"]["pp"])
    layout = rows[0]["layout"]
    idle = timelines.idle_fractions([r["timelines"][step] for r in rows])
    return {"measured": sum(idle) / len(idle), "per_stage": idle,
            "formula": pipeline_bubble_fraction(layout["pp"], layout["micro_batches"], layout["virtual_stages"],
                                                denominator="total")}


def exact_everywhere(ranks: list[dict]) -> bool:
    """Every stage's rank at dp = cp = tp = 0 sent, at every step, exactly what ``implementation_bytes`` says."""
    for r in ranks:
        if r["coords"]["dp"] == r["coords"]["cp"] == r["coords"]["tp"] == 0:
            exact = implementation_bytes(r["layout"], r["config"], r["stage"])
            for comm in r["comm"]:
                if not all(abs(comm[d]["wire_bytes"] - exact[d]) <= 1e-6 for d in exact):  # NaN: not exact
                    return False
    return True


def truth_rows(runs: dict) -> list[dict]:
    """Every (layout, dimension) of the truth table: ``layout``, ``dimension``, ``planner``, ``implementation``,
    ``measured`` (bytes rank 0 sent in a step). A dimension where neither the planner nor the run sends a byte is
    left out (nothing to compare); a planner of 0 or a measurement of 0 is kept."""
    return [{"layout": name, **{k: row[k] for k in ("dimension", "planner", "implementation", "measured")}}
            for name, res in runs.items() for row in comm_rows(res.ranks)
            if not row["planner"] == row["measured"] == 0]


def truth_table(runs: dict) -> Table:
    """One row per (layout, dimension): planner, this code's bookkeeping, measured (bytes rank 0 sent in a step)."""
    rows = [{"layout": r["layout"], "dimension": r["dimension"], "planner": f"{r['planner']:,.0f}",
             "this code": f"{r['implementation']:,.0f}", "measured": f"{r['measured']:,.0f}",
             "planner / measured": ratio_label(r["planner"], r["measured"])} for r in truth_rows(runs)]
    return Table.of(rows, ["layout", "dimension", "planner", "this code", "measured", "planner / measured"])


def ratio_label(planner: float, measured: float | None) -> str:
    """planner / measured as the table and the figure say it: ``exact``, ``0.5``, and in words where there is no
    ratio to draw on a log axis (a planner of 0: it does not model that traffic; no measurement)."""
    if not measured:
        return "no measurement (0 bytes measured)" if planner else "exact"
    if planner == measured:
        return "exact"
    if not planner:
        return "0 (not modelled)"
    return f"{planner / measured:.3g}"


RATIO_BAND = 0.25  # the shaded band around 1: within 25% of the measurement
DIMENSION_COLOURS = {d: i for i, d in enumerate(("tp", "tp_parameters", "cp", "pp", "dp", "embedding"))}


def ratio_figure(rows: list[dict], *, title: str = "", band: float = RATIO_BAND,
                 quantity: str = "planner / measured bytes"):
    """One line per row (``label`` or ``layout`` and ``dimension``; ``planner``; ``measured``): a bar from 1 to the
    ratio on a log2 axis, so that 0.5 and 2 are bars of the same length on either side of the line at 1, with the
    band of +-``band`` shaded. Rows without a ratio are drawn and labelled, never dropped: a planner of 0 (traffic it
    does not model) is a hatched bar running off the left edge, labelled 0; a missing or zero measurement has no bar
    and says so. The ratio of every row is written in a column right of the axes; the legend sits below them."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cmap = plt.get_cmap("tab10")
    n = len(rows)
    ratios = [r["planner"] / r["measured"] for r in rows if r["measured"] and r["planner"]]
    lo, hi = min(ratios + [1 - band]), max(ratios + [1 + band])
    left, right = 2.0 ** (math.floor(math.log2(lo)) - 1), 2.0 ** (math.ceil(math.log2(hi)) + 0.5)
    fig, ax = plt.subplots(figsize=(8.4, 0.27 * n + 1.6))
    ax.set_xscale("log", base=2)
    ax.set_xlim(left, right)
    ax.set_ylim(n - 0.5, -0.5)  # the first row on top
    ax.axvspan(1 - band, 1 + band, color="0.88", zorder=0)
    ax.axvline(1.0, color="black", lw=1.0, zorder=1)
    seen = {}
    for i, r in enumerate(rows):
        dim = r.get("dimension", "")
        colour = cmap(DIMENSION_COLOURS.get(dim, len(DIMENSION_COLOURS) + len(seen)) % 10)
        seen.setdefault(dim, colour)
        planner, measured = r["planner"], r["measured"]
        if not measured:  # nothing to divide by: no bar, a mark on the line, and the words
            ax.plot([1.0], [i], marker="x", color="0.3", ms=6, zorder=3)
        elif not planner:  # 0 / measured: infinitely far left on a log axis, so the bar runs off the edge
            ax.barh(i, 1.0 - left, left=left, height=0.66, color=colour, alpha=0.45, hatch="///", edgecolor=colour,
                    zorder=2)
        elif planner == measured:
            ax.plot([1.0], [i], marker="o", color=colour, ms=6, zorder=3)
        else:
            a, b = sorted((1.0, planner / measured))
            ax.barh(i, b - a, left=a, height=0.66, color=colour, zorder=2)
        ax.text(1.02, i, ratio_label(planner, measured), transform=ax.get_yaxis_transform(), va="center",
                ha="left", fontsize=8, clip_on=False)
        if i and r.get("layout") != rows[i - 1].get("layout"):  # a thin line between two layouts' rows
            ax.axhline(i - 0.5, color="0.75", lw=0.6, zorder=0)
    ax.set_yticks(range(n), [r.get("label") or f"{r['layout']}  {r.get('dimension', '')}" for r in rows],
                  fontsize=8)
    ax.grid(axis="y", visible=False)
    ticks = [2.0 ** k for k in range(int(math.log2(left)), int(math.ceil(math.log2(right))))]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(f"{quantity} (log scale; right of the line: the planner counts more)", fontsize=9)
    ax.set_title(title or "Chapter 00's planner against rank 0's measured traffic, one step", fontsize=9.5, pad=24)
    handles = [Patch(color=c, label=d) for d, c in sorted(seen.items(), key=lambda dc: DIMENSION_COLOURS.get(dc[0], 99))]
    handles.append(Patch(color="0.88", label=f"within {band:.0%}"))
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(len(handles), 7),
              fontsize=8, frameon=False, borderaxespad=0.2, handlelength=1.4, columnspacing=1.2)
    fig.tight_layout()
    return fig


def truth_figure(runs: dict):
    """planner / measured bytes of every row of ``truth_table``, as bars from 1 (``ratio_figure``)."""
    return ratio_figure(truth_rows(runs))


def memory_table(ranks: list[dict]) -> Table:
    rows = [{"moment": r["moment"], "planner": f"{r['planner']:,.0f}",
             "this code": "-" if r["implementation"] is None else f"{r['implementation']:,.0f}",
             "measured": f"{r['measured']:,.0f}", "planner / measured": f"{r['planner'] / r['measured']:.3g}"}
            for r in memory_rows(ranks)]
    return Table.of(rows, ["moment", "planner", "this code", "measured", "planner / measured"])
