"""Chapter 15, notebook side: run a layout of DP x TP x PP x CP (and ZeRO-1) on real ranks, hold it to the
one-process run, and draw what each rank holds and does.

The ranks run ``workers/ch15_composed.py``; the layout and its rules are ``workers/layout/rules.py`` (the trainer's
refusal, ``workers/composed/train.py: layout_problem``, adds what it does not implement); the ground truth is ``workers/composed/train.reference_run`` and the verdict ``workers/composed/equivalence.compare``.
What is computed here without ranks (``holdings``, ``group_rows``, ``micro_batch_weights``) is what the layout
*predicts*; ``holdings_mismatches`` holds the ranks' own reports to that prediction.
"""
from __future__ import annotations

from functools import lru_cache

import matplotlib.pyplot as plt
import torch

from course_utils.launcher import run as run_worker
from course_utils.plots import CPU_NOTE
from course_utils.results import RunResult
from course_utils.tables import Table
from course_utils.widgets import LiveRun
from workers.composed.equivalence import TIED, TOLERANCE, compare, relative_error
from workers.composed.model import MODEL, model_config
from workers.model.batch import make_batch
from workers.composed.train import layout_problem as trainer_problem
from workers.layout import Layout
from workers.layout.rules import DEGREES
from workers.model import GPTConfig
from workers.composed.faults import FAULTS
from workers.composed.train import reference_run
from workers.context_parallel.split import chunk_ranges
from workers.layout.grid import DIMS
from workers.pipeline.schedules import virtual_stage

WORKER = "workers.ch15_composed"
CONFIG = MODEL  # the worker's defaults: vocab 32, seq 16, hidden 32, heads 8, layers 4
GLOBAL_BATCH = 8  # the worker's default global batch (samples per optimizer step)
STEPS = 3
# the chapter's layouts, DPxTPxPPxCP: six of 8 ranks, then two of 4 (at most 8 ranks stay warm: world 8 first)
LAYOUTS_8 = ["8x1x1x1", "1x8x1x1", "2x2x2x1", "2x2x1x2", "1x2x2x2", "2x1x2x2"]
LAYOUTS_4 = ["1x1x4x1", "1x1x1x4"]
# fault -> (a layout where it shows, the options it needs); the same cases as tests/test_ch15_composed.py
FAULT_CASES = {
    "grads_over_dp_only": ("2x2x1x2", {}),
    "grads_over_tp": ("2x2x2x1", {}),
    "layernorm_not_reduced": ("2x2x1x2", {"sequence_parallel": True}),
    "per_microbatch_mean": ("2x2x2x1", {"micro_batches": 2}),
    "dropout_per_rank": ("2x2x2x1", {"dropout": 0.1}),
    "dropout_shared": ("2x2x1x2", {"dropout": 0.1, "sequence_parallel": True}),
    "tied_not_reduced": ("1x1x4x1", {"micro_batches": 4}),
}
# the parameters of one layer that tensor parallelism cuts (heads for attention, ffn columns for the MLP)
SHARDED_PER_LAYER = ("attention.qkv.weight", "attention.qkv.bias", "attention.proj.weight", "mlp.fc1.weight",
                     "mlp.fc1.bias", "mlp.fc2.weight")
SMALLEST_FONT = 7.0  # points: 9.7 px at the widget's 100 dpi, 10.7 px in a saved figure (110 dpi)
LAYOUT_OPTIONS = ("zero", "sequence_parallel", "micro_batches", "schedule", "virtual_stages", "split")


TEXT_WIDTH = 110  # characters: a printed line that fits the output area of a 1400-px JupyterLab window unbroken


def wrap(text: str, width: int = TEXT_WIDTH, indent: str = "") -> str:
    """``text`` in lines of at most ``width`` characters, broken between words only and never inside a parenthesis
    (JupyterLab breaks an output line that is too long anywhere, mid-word); ``indent`` starts every line."""
    import re
    import textwrap

    glue = "\0"  # a parenthesis, "(dp 0, tp 1, pp 0, cp 0)", stays on one line
    held = re.sub(r"\([^()]*\)", lambda m: m.group().replace(" ", glue), text)
    return textwrap.fill(held, width, initial_indent=indent, subsequent_indent=indent + "  ", break_long_words=False,
                         break_on_hyphens=False).replace(glue, " ")


# -- the layout, before any rank starts ---------------------------------------------------------------------------

def layout_for(name: str, **options) -> Layout:
    """``Layout.parse(name, **options)``, with two micro-batches per rank when there is a pipeline (so that 1F1B
    overlaps stages), unless ``micro_batches`` is given."""
    degrees = Layout.parse(name)
    options = {"micro_batches": 2 if degrees.pp > 1 else 1, **options}
    return Layout.parse(name, **{k: v for k, v in options.items() if k in LAYOUT_OPTIONS})


def worker_params(layout: Layout) -> dict:
    """The worker's parameters for ``layout`` (its degrees and options, by the worker's names)."""
    return {d: getattr(layout, d) for d in (*DEGREES, *LAYOUT_OPTIONS)}


def layout_problem(layout: Layout, world: int | None = None, cfg: GPTConfig = CONFIG,
                   global_batch: int = GLOBAL_BATCH) -> str | None:
    """The worker's refusal for this chapter's model: one sentence naming every degree that does not fit, or None."""
    return trainer_problem(layout, layout.world if world is None else world, cfg, global_batch)


def group_rows(layout: Layout) -> list[dict]:
    """Per rank: ``coords`` and ``groups``, the members of each of its groups, from the rank grid alone.

    ``dp_cp``: the ranks holding the same parameters with other samples or tokens (gradients are summed there);
    ``embedding``: the first and last stage of the rank's pipeline, when the rank is one of them and pp > 1."""
    grid = layout.grid
    rows = []
    for rank in range(grid.world):
        pipeline = grid.group("pp", rank)
        embedding = [pipeline[0], pipeline[-1]] if layout.pp > 1 and rank in (pipeline[0], pipeline[-1]) else []
        groups = {**{d: grid.group(d, rank) for d in reversed(DIMS)}, "dp_cp": grid.group(("dp", "cp"), rank),
                  "embedding": embedding}
        rows.append({"rank": rank, "coords": grid.coords(rank), "groups": groups})
    return rows


def grid_table(layout: Layout) -> Table:
    """One line per rank: its coordinates (dp, pp, cp, tp: the grid's order) and its groups."""
    rows = group_rows(layout)
    header = ["rank", "(dp, pp, cp, tp)", *(f"{g} group" for g in rows[0]["groups"])]
    return Table(header, [[r["rank"], str(tuple(r["coords"][d] for d in DIMS)),
                           *(str(m) if m else "-" for m in r["groups"].values())] for r in rows])


def group_table(layout: Layout) -> Table:
    """Every group of the mesh, once: the dimension (or combination) and its member lists."""
    grid = layout.grid
    rows = [[d, " ".join(str(g) for g in grid.groups(d))] for d in reversed(DIMS)]  # tp (innermost) first
    rows.append(["dp_cp", " ".join(str(g) for g in grid.groups(("dp", "cp")))])
    embedding = [[p[0], p[-1]] for p in grid.groups("pp")] if layout.pp > 1 else []
    rows.append(["embedding", " ".join(str(g) for g in embedding) or "(none: one stage holds both ends)"])
    return Table(["group", "members"], rows, caption=f"layout {layout.name} (dp x tp x pp x cp)")


def _span(values) -> str:
    values = list(values)
    if not values:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def holdings(layout: Layout, cfg: GPTConfig = CONFIG, global_batch: int = GLOBAL_BATCH) -> list[dict]:
    """What each rank holds under ``layout``, from the layout alone: its layers (per model chunk), its heads and
    ffn columns of each layer (TP), its tokens (CP; rows under sequence parallelism), its samples (DP), and which
    ends of the model it holds (the embedding and position table on the first stage, ``ln_f`` and the tied head on
    the last: the embedding itself when one stage holds both ends, a copy, ``head.weight``, otherwise)."""
    layout = layout.resolve(layout.world)  # dp None: one replica
    grid, per = layout.grid, cfg.layers // (layout.pp * layout.virtual_stages)
    out = []
    for rank in range(grid.world):
        c = grid.coords(rank)
        chunks = [virtual_stage(c["pp"], ch, layout.pp) for ch in range(layout.virtual_stages)]
        layers = [list(range(vs * per, (vs + 1) * per)) for vs in chunks]
        first, last = 0 in chunks, layout.pp * layout.virtual_stages - 1 in chunks
        heads = cfg.heads // layout.tp
        ffn = cfg.ffn // layout.tp
        tokens = [t for a, b in chunk_ranges(cfg.seq, layout.cp, c["cp"], layout.split) for t in range(a, b)]
        samples = global_batch // layout.dp
        ends = (["embed", "pos"] if first else []) + (["ln_f", "head (tied copy)" if not first else "head = embed"]
                                                         if last else [])
        head = "embed.weight" if first and last else ("head.weight" if last else None)
        # the embedding and its tied copy are split by vocabulary over TP (a block of rows, whole at tp 1)
        sharded = sorted([f"blocks.{i}.{n}" for chunk in layers for i in chunk for n in SHARDED_PER_LAYER]
                         + (["embed.weight"] if first else []) + (["head.weight"] if head == "head.weight" else []))
        out.append({"rank": rank, "coords": c, "stage": c["pp"], "layers": layers,
                    "heads": list(range(c["tp"] * heads, (c["tp"] + 1) * heads)),
                    "ffn": (c["tp"] * ffn, (c["tp"] + 1) * ffn), "tokens": tokens,
                    "rows": len(tokens) // (layout.tp if layout.sequence_parallel else 1),
                    "samples": list(range(c["dp"] * samples, (c["dp"] + 1) * samples)),
                    "embed": first, "head": head,
                    "ends": ends, "sharded": sharded})
    return out


def holding_label(h: dict) -> str:
    """A few lines for the rank's box in ``mesh_figure``."""
    layers = ", ".join(_span(chunk) for chunk in h["layers"])
    lines = [f"rank {h['rank']}", " ".join(f"{d}{h['coords'][d]}" for d in DEGREES),
             f"layers {layers}", f"heads {_span(h['heads'])}", f"tokens {_token_label(h['tokens'])}",
             f"samples {_span(h['samples'])}"]
    if h["ends"]:
        lines.append(" + ".join(h["ends"]))
    return "\n".join(lines)


def _token_label(tokens: list[int]) -> str:
    runs, start = [], tokens[0]
    for prev, t in zip(tokens, tokens[1:] + [None]):
        if t != prev + 1:
            runs.append(_span(range(start, prev + 1)))
            start = t
    return ",".join(runs)


def mesh_figure(layout: Layout, cfg: GPTConfig = CONFIG, global_batch: int = GLOBAL_BATCH, title: str | None = None,
                ax=None):
    """One box per rank, in the grid's order: a row per (dp, pp), a column per (cp, tp), so that a TP group is a run
    of boxes side by side, a pipeline a column going down inside its data-parallel replica (framed), and a CP ring
    the runs of TP groups across a row. Each box says what the rank holds (``holdings``); the colour is its stage."""
    rows_n, cols_n = layout.dp * layout.pp, layout.cp * layout.tp
    w, h = 2.0, 1.55
    if ax is None:
        _, ax = plt.subplots(figsize=(max(min(1.9 * cols_n + 0.6, 16), 5.2), 1.5 * rows_n + 0.8))
    fig = ax.figure
    colours = plt.get_cmap("Pastel1")
    for hold in holdings(layout, cfg, global_batch):
        c = hold["coords"]
        row, col = c["dp"] * layout.pp + c["pp"], c["cp"] * layout.tp + c["tp"]
        x, y = col * w, -row * h
        ax.add_patch(plt.Rectangle((x + 0.05, y + 0.05), w - 0.1, h - 0.1, facecolor=colours(c["pp"] % 9),
                                   edgecolor="0.35", lw=0.8))
        ax.text(x + w / 2, y + h / 2, holding_label(hold), ha="center", va="center", fontsize=SMALLEST_FONT,
                linespacing=1.15)
    for d in range(layout.dp):  # frame each data-parallel replica: one whole model
        y = -(d * layout.pp + layout.pp - 1) * h
        ax.add_patch(plt.Rectangle((0, y), cols_n * w, layout.pp * h, fill=False, edgecolor="k", lw=1.6))
        ax.text(-0.1, y + layout.pp * h / 2, f"dp {d}", ha="right", va="center", fontsize=8, rotation=90)
    for cp in range(1, layout.cp):  # the ring's members sit side by side: mark where one cp rank's TP group ends
        ax.plot([cp * layout.tp * w] * 2, [-(rows_n - 1) * h, h], color="k", lw=0.8, ls="--")
    ax.set_xlim(-0.5, cols_n * w + 0.05), ax.set_ylim(-(rows_n - 1) * h - 0.05, h + 0.05)
    ax.set_aspect("equal"), ax.axis("off")
    for d in range(layout.dp):  # the pipeline's messages go down a column, stage to stage
        for p in range(layout.pp - 1):
            y = -(d * layout.pp + p) * h
            for col in range(cols_n):
                ax.annotate("", xy=(col * w + w / 2, y - 0.1), xytext=(col * w + w / 2, y + 0.14),
                            arrowprops={"arrowstyle": "-|>", "color": "0.2", "lw": 0.8})
    ax.set_title(title or f"layout {layout.name} (dp x tp x pp x cp), {layout.world} ranks: a row per (dp, pp), a "
                          "column per (cp, tp)\ncolour = pipeline stage; frame = one data-parallel replica; "
                          "dashed = next cp rank", fontsize=8.5)
    return fig


def micro_batch_weights(dp: int, micro_batches: int, step: int = 0, global_batch: int = GLOBAL_BATCH,
                        cfg: GPTConfig = CONFIG, data_seed: int = 1) -> list[dict]:
    """For every (dp rank, micro-batch): its valid tokens n, the valid tokens N of the whole global batch (a token's
    right weight in the loss is 1/N), and n m dp (its weight is 1/(n m dp) when every micro-batch is averaged over
    its own tokens, then over m and dp: the ``per_microbatch_mean`` fault). The ragged batch is the worker's
    ``make_batch``."""
    _, valid = make_batch(cfg, global_batch, step, data_seed)  # [B, seq]
    total = int(valid.sum())
    b = global_batch // dp // micro_batches
    rows = []
    for d in range(dp):
        for i in range(micro_batches):
            first = (d * micro_batches + i) * b
            n = int(valid[first:first + b].sum())
            rows.append({"dp": d, "micro": i, "tokens": n, "total": total,
                         "per_micro_denominator": n * micro_batches * dp})
    return rows


# -- runs and verdicts --------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def reference(steps: int = STEPS, global_batch: int = GLOBAL_BATCH, lr: float = 0.01, seed: int = 0,
              data_seed: int = 1, dropout: float = 0.0, dtype: str = "float64") -> dict:
    """The one-process run every layout must equal (computed once per setting)."""
    return reference_run(model_config(dropout=dropout), steps=steps, global_batch=global_batch, lr=lr, seed=seed,
                         data_seed=data_seed, dtype=getattr(torch, dtype))


def run_layout(name: str, *, timeout: float = 240, **options):
    """Run layout ``name`` (``"2x2x2x1"``) with ``options`` (zero, sequence_parallel, micro_batches, dropout, fault,
    ...) on real ranks and compare it with the one-process run: ``(RunResult, verdict)``."""
    layout = layout_for(name, **options)
    extra = {k: v for k, v in options.items() if k not in LAYOUT_OPTIONS}
    res = run_worker(WORKER, world_size=layout.world, timeout=timeout, **worker_params(layout), **extra)
    return res, verdict_of(res.ranks)


def verdict_of(ranks: list[dict]) -> dict:
    """``compare`` the ranks' results with the one-process run of the same settings (steps, batch, lr, seeds,
    dropout, dtype: read from what the ranks report)."""
    cfg = ranks[0]["config"]
    return compare(ranks, reference(steps=cfg["steps"], global_batch=cfg["global_batch"], lr=cfg["lr"],
                                    seed=cfg["seed"], data_seed=cfg["data_seed"], dropout=cfg["dropout"],
                                    dtype=cfg["dtype"]))


def equivalence_row(name: str, zero: int, verdict: dict) -> dict:
    return {"layout": name, "zero": zero, "equal to one process": verdict["ok"],
            "largest relative difference": verdict["max_error"],
            "within tolerance": verdict["max_error"] <= verdict["tolerance"]}


def equivalence_table(rows: list[dict], *, differences: bool = True) -> Table:
    """The verdicts; ``differences`` adds the largest relative difference to 1 significant digit (it varies by CPU)."""
    columns = ["layout", "zero", "equal to one process", "within tolerance"]
    if differences:
        columns.append("largest relative difference")
    return Table.of(rows, columns, formats={"largest relative difference": "{:.0e}"})


def mesh_matches_grid(ranks: list[dict]) -> bool:
    """Whether torch's DeviceMesh handed every rank the course grid's group along every dimension."""
    grid = Layout(**ranks[0]["layout"]).grid
    return all(r["mesh_groups"] == {d: grid.group(d, i) for d in DIMS} for i, r in enumerate(ranks))


def reported_holdings(ranks: list[dict]) -> list[dict]:
    """What each rank says it holds: coordinates, layers, the ends of the model, the TP-sharded parameters."""
    out = []
    for i, r in enumerate(ranks):
        names = set(r["digests"][0])
        head = "head.weight" if "head.weight" in names else ("embed.weight" if "ln_f.weight" in names else None)
        out.append({"rank": i, "coords": r["coords"], "stage": r["stage"], "layers": r["layers"],
                    "embed": "embed.weight" in names and "pos" in names, "head": head, "sharded": sorted(r["sharded"])})
    return out


def holdings_mismatches(ranks: list[dict]) -> list[str]:
    """Where a rank's report differs from what its layout predicts (``holdings``); empty when they agree."""
    layout = Layout(**ranks[0]["layout"])
    cfg = CONFIG.replace(**{k: v for k, v in ranks[0]["config"].items() if k in CONFIG.as_dict()})
    predicted = holdings(layout, cfg, ranks[0]["config"]["global_batch"])
    out = []
    for want, got in zip(predicted, reported_holdings(ranks)):
        for key in ("coords", "stage", "layers", "embed", "head", "sharded"):
            if want[key] != got[key]:
                out.append(f"rank {got['rank']}: {key} is {got[key]}, the layout says {want[key]}")
    return out


def fault_row(fault: str, name: str, verdict: dict) -> dict:
    """What the check said about a fault: the first thing it names, and whether it was caught (failed, at the
    first step, by far more than rounding)."""
    first = verdict["first"]
    caught = not verdict["ok"] and first is not None and first["step"] == 0 and first["error"] > 1e-5
    return {"fault": fault, "layout": name, "breaks": FAULTS[fault][0],
            "first named": _named(first), "caught": caught}


def _named(first: dict | None) -> str:
    if first is None:
        return "-"
    if first["what"] == "loss":
        return "the loss"
    return f"{first['what']} of {TIED.get(first['tensor'], first['tensor'])}"


# -- timelines and the widget -------------------------------------------------------------------------------------

HATCHES = ("", "//", "xx", "..")  # model chunk 0, 1, ... of a rank (interleaved schedule)


def timeline_figure(ranks: list[dict], step: int = -1, title: str | None = None, ax=None):
    """One row per rank: its forward (light) and backward (dark) boxes of one step, coloured by micro-batch and
    hatched by model chunk, in ms since the step's barrier; white is waiting (a pipeline bubble, or a collective)."""
    cmap = plt.get_cmap("tab10")
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8.5, 0.38 * len(ranks) + 1.3))
    for i, r in enumerate(ranks):
        for e in r["timelines"][step]:
            ax.barh(i, (e["end"] - e["start"]) * 1e3, left=e["start"] * 1e3, height=0.75, color=cmap(e["micro"] % 10),
                    alpha=0.45 if e["kind"] == "F" else 1.0, edgecolor="k", lw=0.3,
                    hatch=HATCHES[e.get("chunk", 0) % len(HATCHES)])
    ax.set_yticks(range(len(ranks)), [f"rank {i}: " + " ".join(f"{d}{r['coords'][d]}" for d in DEGREES)
                                      for i, r in enumerate(ranks)], fontsize=7)
    ax.invert_yaxis(), ax.grid(axis="y", visible=False)
    steps = len(ranks[0]["timelines"])
    ax.set_xlabel(f"ms since the step's barrier (step {step % steps}); {CPU_NOTE}", fontsize=8)
    lay = ranks[0]["layout"]
    ax.set_title(title or f"layout {ranks[0]['layout_name']}, {lay['schedule']}, m = {lay['micro_batches']}: "
                          "F light, B dark, colour = micro-batch", fontsize=9)
    return fig if fig is not None else ax.figure


COMM_DIMS = ("tp", "tp_parameters", "cp", "pp", "dp", "embedding")
MOMENTS = ("params", "grads", "optimizer", "activations")


def _side_legend(ax, handles, labels, title: str) -> None:
    """A legend in its own empty axes (next to the bars), so it covers nothing."""
    ax.axis("off")
    ax.legend(handles, labels, loc="center left", fontsize=SMALLEST_FONT, title=title,
              title_fontsize=SMALLEST_FONT + 0.5, frameon=False, borderaxespad=0, handlelength=1.2)


def traffic_axes(ranks: list[dict], ax, step: int = -1, legend_ax=None) -> None:
    """Bytes each rank sent in one step, stacked by dimension (exact counts: ``workers/composed/train.py: _comm``).
    The legend goes into ``legend_ax`` (or outside ``ax``, to its right): never over a bar."""
    bottom = [0.0] * len(ranks)
    for i, dim in enumerate(COMM_DIMS):
        values = [r["comm"][step][dim]["wire_bytes"] / 1e3 for r in ranks]
        if any(values):
            ax.bar(range(len(ranks)), values, bottom=bottom, label=dim, color=plt.get_cmap("tab10")(i))
            bottom = [b + v for b, v in zip(bottom, values)]
    _bar_axes(ax, len(ranks), "kB sent in one step", "traffic per rank, by dimension", legend_ax)


def memory_axes(ranks: list[dict], ax, step: int = -1, legend_ax=None) -> None:
    """Each rank's parameters, gradients, optimizer state and peak saved activations (bytes it holds)."""
    bottom = [0.0] * len(ranks)
    for i, moment in enumerate(MOMENTS):
        values = [r["memory"][step][moment] / 1e3 for r in ranks]
        ax.bar(range(len(ranks)), values, bottom=bottom, label=moment, color=plt.get_cmap("Set2")(i))
        bottom = [b + v for b, v in zip(bottom, values)]
    _bar_axes(ax, len(ranks), "kB held", "memory per rank (float64)", legend_ax)


def _bar_axes(ax, n: int, ylabel: str, title: str, legend_ax) -> None:
    ax.set_xticks(range(n)), ax.set_xlabel("rank", fontsize=8), ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=SMALLEST_FONT + 0.5)
    ax.set_title(title, fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    if legend_ax is not None:
        _side_legend(legend_ax, handles[::-1], labels[::-1], "top to bottom")  # the stack's order, read downwards
    else:
        ax.legend(handles[::-1], labels[::-1], fontsize=SMALLEST_FONT, loc="upper left", bbox_to_anchor=(1.01, 1),
                  frameon=False)


def compact_label(h: dict, chars: int = 24, lines: int = 3) -> str:
    """The widget's short box label: rank, layers, heads (tp > 1), tokens (cp > 1), the ends of the model, packed
    into lines of at most ``chars`` characters (a word longer than that stands alone), at most ``lines`` of them (a
    grid of many small boxes drops the last words; the chapter's mesh figures say everything)."""
    words = [f"r{h['rank']}", "L" + ",".join(_span(chunk) for chunk in h["layers"])]
    if h["tp"] > 1:
        words.append(f"h{_span(h['heads'])}")
    if h["cp"] > 1:
        runs = _token_label(h["tokens"]).split(",")
        words += [f"t{runs[0]}"] + runs[1:]
    words += [e.split(" ")[0] for e in h["ends"] if e in ("embed", "head = embed", "head (tied copy)")]
    out = []
    for word in words:
        if out and len(out[-1]) + 1 + len(word) <= chars:
            out[-1] += " " + word
        else:
            out.append(word)
    return "\n".join(out[:lines])


def compact_mesh_axes(layout: Layout, ax, width_in: float, height_in: float, cfg: GPTConfig = CONFIG,
                      global_batch: int = GLOBAL_BATCH) -> None:
    """``mesh_figure`` small enough for the widget: one box per rank in the same grid (a row per (dp, pp), a column
    per (cp, tp)), coloured by stage, with a short label (``compact_label``), every text at least SMALLEST_FONT: as
    much of it as fits a box of the ``width_in`` x ``height_in`` inches the axes get."""
    rows_n, cols_n = layout.dp * layout.pp, layout.cp * layout.tp
    colours = plt.get_cmap("Pastel1")
    chars = max(4, int((width_in * 72 / cols_n - 4) // (SMALLEST_FONT * 0.62)))
    lines = max(1, int((height_in * 72 / rows_n - 4) // (SMALLEST_FONT * 1.25)))
    for hold in holdings(layout, cfg, global_batch):
        c = hold["coords"]
        row, col = c["dp"] * layout.pp + c["pp"], c["cp"] * layout.tp + c["tp"]
        ax.add_patch(plt.Rectangle((col + 0.04, -row - 0.96), 0.92, 0.92, facecolor=colours(c["pp"] % 9),
                                   edgecolor="0.35", lw=0.7))
        ax.text(col + 0.5, -row - 0.5, compact_label({**hold, "tp": layout.tp, "cp": layout.cp}, chars, lines),
                ha="center", va="center", fontsize=SMALLEST_FONT, linespacing=1.1)
    for d in range(layout.dp):  # frame each data-parallel replica
        ax.add_patch(plt.Rectangle((0, -(d + 1) * layout.pp), cols_n, layout.pp, fill=False, edgecolor="k", lw=1.4))
    for cp in range(1, layout.cp):
        ax.plot([cp * layout.tp] * 2, [-rows_n, 0], color="k", lw=0.8, ls="--")
    ax.set_xlim(-0.02, cols_n + 0.02), ax.set_ylim(-rows_n - 0.02, 0.02)
    ax.axis("off")
    ax.set_title("who holds what: r rank, L layers, h heads, t tokens\nrow = (dp, pp), column = (cp, tp); "
                 "colour = stage; frame = dp replica", fontsize=8)


def draw_run(res, params: dict | None = None, verdict: dict | None = None):
    """The widget's picture, 9 x 6 inches whatever the layout: the mesh (who holds what) beside every rank's
    timeline of the last step; below, the bytes each rank sent per dimension and the memory it holds, each with its
    legend beside it. The verdict's one line is the figure's title (the widget shows its whole sentence beside the
    controls: ``verdict_html``). ``verdict``: ``verdict_of(res.ranks)``, when the caller has it already."""
    verdict = verdict_of(res.ranks) if verdict is None else verdict
    layout = Layout(**res.ranks[0]["layout"])
    fig = plt.figure(figsize=(9.0, 6.0), layout="constrained")
    grid = fig.add_gridspec(2, 4, height_ratios=[3.2, 2.0], width_ratios=[1.0, 0.32, 1.0, 0.32])
    mesh_ax = fig.add_subplot(grid[0, :2])
    timeline_ax = fig.add_subplot(grid[0, 2:])
    compact_mesh_axes(layout, mesh_ax, width_in=4.2, height_in=3.0)  # its half of the top row, less the titles
    timeline_figure(res.ranks, ax=timeline_ax, title="every rank's last step: F light, B dark,\ncolour = micro-batch")
    timeline_ax.set_yticks(range(len(res.ranks)), [f"r{i} " + " ".join(f"{d}{r['coords'][d]}" for d in DEGREES)
                                                   for i, r in enumerate(res.ranks)], fontsize=SMALLEST_FONT)
    timeline_ax.tick_params(labelsize=SMALLEST_FONT)
    timeline_ax.set_xlabel("ms since the step's barrier (CPU, gloo)", fontsize=8)
    traffic_axes(res.ranks, fig.add_subplot(grid[1, 0]), legend_ax=fig.add_subplot(grid[1, 1]))
    memory_axes(res.ranks, fig.add_subplot(grid[1, 2]), legend_ax=fig.add_subplot(grid[1, 3]))
    fig.suptitle(f"{'EQUAL' if verdict['ok'] else 'DIFFERENT'}: {_short_verdict(verdict, layout)}", fontsize=9.5,
                 color="#1a7f37" if verdict["ok"] else "#bc4c00")
    return fig


def _short_verdict(verdict: dict, layout: Layout) -> str:
    if verdict["ok"]:
        return f"layout {layout.name} equals one process (every step's loss, gradients, final parameters)"
    first = verdict["first"]
    return f"layout {layout.name} differs from one process: {_named(first)} at step {first['step']}" if first \
        else f"layout {layout.name} differs from one process"


def verdict_html(verdict: dict) -> str:
    """The verdict's whole sentence (``verdict_of``), for the widget's text beside its controls."""
    import html

    # not the refusals' red (#cf222e): a run that differs from one process ran; it was not refused
    colour, mark = ("#1a7f37", "EQUAL") if verdict["ok"] else ("#bc4c00", "DIFFERENT")
    return f"<b style='color:{colour}'>{mark}</b>: {html.escape(verdict['message'])}"


def explorer_problem(settings: dict, limit: int | None = None) -> str | None:
    """Why the explorer will not run these settings, in terms of the controls a learner moves; or None.

    The product of the degrees is the number of ranks: more than this machine's lab runs is said as that product
    (the learner never sets a world size). A global batch that dp x m does not divide is said as the choice of dp
    and m (the batch is fixed here). Every other clause is the worker's own refusal."""
    from course_utils.validate import max_world_size

    limit = max_world_size() if limit is None else limit
    dp, tp, pp, cp = (settings.get(d, 1) for d in ("dp", "tp", "pp", "cp"))
    world = dp * tp * pp * cp
    if world > limit:
        return (f"dp x tp x pp x cp = {dp} x {tp} x {pp} x {cp} = {world} ranks; this machine's lab runs at most "
                f"{limit}: lower a degree")
    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=settings.get("zero", 0),
                    sequence_parallel=settings.get("sequence_parallel", False),
                    micro_batches=settings.get("micro_batches", 1))
    found = layout_problem(layout, world, global_batch=settings.get("global_batch", GLOBAL_BATCH))
    if found is None:
        return None
    return "; ".join(_explorer_clause(c, dp, layout.micro_batches) for c in found.split("; "))


def _explorer_clause(clause: str, dp: int, m: int) -> str:
    import re

    batch = re.search(r"does not divide global_batch=(\d+)", clause)
    if batch:
        b = int(batch.group(1))
        fits = ", ".join(str(k) for k in range(1, b + 1) if b % k == 0)
        return (f"dp x m = {dp} x {m} = {dp * m} does not divide the global batch of {b} samples: choose dp and m "
                f"whose product is one of {fits}")
    return clause


REFUSED_NOTE = "(no figure: these settings were refused; the sentence above says what to change)"


def explorer_controls() -> dict:
    """The explorer's controls, small enough for a two-row grid: the four degrees, then m, ZeRO and sequence
    parallelism (dropdowns of one width, so the grid's columns line up)."""
    import ipywidgets as W

    def degree(name, options, value):
        return W.Dropdown(options=options, value=value, description=name, layout=W.Layout(width="124px"),
                          style={"description_width": "38px"})

    return {"dp": degree("dp", [1, 2, 4, 8], 1), "tp": degree("tp", [1, 2, 4, 8], 2),
            "pp": degree("pp", [1, 2, 3, 4], 2), "cp": degree("cp", [1, 2, 4], 1),
            "micro_batches": degree("m", [1, 2, 3, 4], 2),
            "zero": degree("ZeRO", [0, 1], 0),
            "sequence_parallel": W.Checkbox(value=True, description="sequence parallel", indent=False,
                                            layout=W.Layout(width="150px"))}


class LayoutRun(LiveRun):
    """``LiveRun`` of the composed worker whose world size is the product of the chosen degrees.

    Laid out to fit a laptop's window (about 900 px with its figure): the controls in a grid of two rows, the status
    and the verdict's sentence beside them, then a 9 x 6 inch figure (``draw_run``). A layout that does not fit is
    refused before any rank starts (``explorer_problem``, in the controls' own terms, then the worker's
    ``check_params``); a refusal replaces the previous figure with a note, so what is shown always belongs to the
    settings on screen. While a new run is going, the text beside says the figure is the previous layout's."""

    def __init__(self, controls: dict | None = None, *, params: dict | None = None, timeout: float = 120,
                 auto_start: bool = True, **kw):
        import ipywidgets as W

        kw.setdefault("progress_total", lambda p: p.get("steps", STEPS))  # one metric per step from rank 0
        controls = explorer_controls() if controls is None else controls
        self.verdict = W.HTML(layout=W.Layout(width="auto"))
        self.verdict.observe(self._compact_lines, names="value")
        self.shown: str | None = None  # the layout name of the figure on screen
        super().__init__(WORKER, controls, self._draw, params=params, timeout=timeout, auto_start=False, **kw)
        # two rows of controls, 550 px wide, and the text beside them (below them in a window too narrow for both)
        grid = W.GridBox(list(controls.values()), layout=W.Layout(
            grid_template_columns="repeat(4, max-content)", grid_gap="2px 8px", align_items="center"))
        self.status.layout = W.Layout(width="auto")
        self.status.observe(self._compact_lines, names="value")
        left = W.VBox([grid, W.HBox([self.cancel_button, self.progress], layout=W.Layout(align_items="center"))],
                      layout=W.Layout(width="550px"))
        right = W.VBox([self.status, self.verdict], layout=W.Layout(width="390px", max_height="150px",
                                                                    overflow="auto", margin="0 0 0 12px"))
        self.box = W.VBox([W.HBox([left, right], layout=W.Layout(flex_flow="row wrap")), self.out])
        if auto_start:
            self.request()

    def settings(self) -> dict:
        s = super().settings()
        return {**s, "world_size": s["dp"] * s["tp"] * s["pp"] * s["cp"]}

    LINES = "<div style='line-height:1.35'>"

    def _compact_lines(self, change) -> None:
        """Text that wraps onto a second line at the usual line height, not a widget row's 28 px per line."""
        if change["new"] and not change["new"].startswith(self.LINES):
            change["owner"].value = f"{self.LINES}{change['new']}</div>"

    def _draw(self, res, params: dict):
        verdict = verdict_of(res.ranks)
        fig = draw_run(res, params, verdict)
        self.verdict.value = verdict_html(verdict)
        self.shown = res.ranks[0]["layout_name"]
        return fig

    def refuse(self, settings: dict, sentence: str) -> None:
        """Say why, and take the previous settings' figure and verdict off the screen."""
        from course_utils.results import InvalidParameter

        self.status.value = f"<span style='color:#cf222e'>refused: {sentence}</span>"
        self.verdict.value = ""
        self.show(REFUSED_NOTE)
        self.shown = None
        self.history.append((settings, InvalidParameter(sentence)))

    def _start(self, settings: dict) -> None:
        sentence = explorer_problem({**self.fixed, **settings})
        if sentence:
            self.refuse(settings, sentence)
            return
        if self.shown is not None:  # said at once: starting new ranks can take a while before the status changes
            self.verdict.value = (f"<i>the figure below is still layout {self.shown}'s: this run's replaces it when "
                                  "it ends</i>")
        before = len(self.history)
        super()._start(settings)
        if self._job is None and len(self.history) > before:  # refused by the launcher (check_params)
            _, exc = self.history.pop()
            self.refuse(settings, str(exc))

    def _finish(self, job, settings: dict) -> None:
        super()._finish(job, settings)
        outcome = next((o for s, o in reversed(self.history) if s is settings), None)
        if not isinstance(outcome, RunResult) and self.shown is not None:
            # cancelled, failed, or its drawing failed: the figure on screen is another layout's; take it off
            self.show("(no figure: this run did not finish; the status above says why)")
            self.shown = None
            self.verdict.value = ""


# -- PyTorch's own APIs, side by side (workers/ch15_native.py) ------------------------------------------------------

NATIVE_CASES = {  # api -> worker parameters, on 4 ranks
    "tp": {},  # parallelize_module, tp = 4: two of the 8 heads per rank
    "fsdp": {},  # FSDP2 fully_shard over 4 ranks (ZeRO-3)
    "tp_fsdp": {"tp": 2},  # a 2-D mesh: dp 2 x tp 2
    "pipelining": {"micro_batches": 4},  # torch.distributed.pipelining, 4 stages, Schedule1F1B
}


def native_errors(ranks: list[dict], reference: dict) -> dict:
    """Largest relative error of the losses, the gradients (per step) and the final parameters over every rank of a
    ``workers/ch15_native.py`` run, and which dense parameters the ranks covered (a pipeline rank holds its stage's)."""
    steps = len(reference["losses"])
    out = {"loss": [0.0] * steps, "grad": [0.0] * steps, "param": 0.0, "grad_names": [set() for _ in range(steps)],
           "param_names": set(), "by_name": [{} for _ in range(steps)]}
    for r in ranks:
        assert len(r["losses"]) == steps and len(r["grads"]) == steps
        for step in range(steps):
            loss, expected = (torch.tensor(v, dtype=torch.float64) for v in (r["losses"][step], reference["losses"][step]))
            out["loss"][step] = max(out["loss"][step], relative_error(loss, expected))
            for name, g in r["grads"][step].items():
                e = relative_error(g, reference["grads"][step][name])
                out["grad"][step] = max(out["grad"][step], e)
                out["by_name"][step][name] = max(out["by_name"][step].get(name, 0.0), e)
                out["grad_names"][step].add(name)
        for name, p in r["params"].items():
            out["param"] = max(out["param"], relative_error(p, reference["params"][name]))
            out["param_names"].add(name)
    return out


def native_row(api: str, ranks: list[dict], reference: dict) -> dict:
    err = native_errors(ranks, reference)
    tol = TOLERANCE["float64"]
    complete = all(names == set(reference["params"]) for names in err["grad_names"])
    return {"api": api, "loss": max(err["loss"]), "gradients": max(err["grad"]), "final parameters": err["param"],
            "equal to one process": complete and max(max(err["loss"]), max(err["grad"]), err["param"]) < tol}
