"""Chapter 15, notebook side: run a layout of DP x TP x PP x CP (and ZeRO-1) on real ranks, hold it to the
one-process run, and draw what each rank holds and does.

The ranks run ``workers/ch15_composed.py``; the layout and its rules are ``workers/layout/rules.py`` (the trainer's
refusal, ``workers/composed/train.py: layout_problem``, adds what it does not implement); the ground truth is ``workers/composed/train.reference_run`` and the verdict ``workers/composed/equivalence.compare``.
What is computed here without ranks (``holdings``, ``group_rows``, ``micro_batch_weights``) is what the layout
*predicts*; ``holdings_mismatches`` holds the ranks' own reports to that prediction.
"""
from __future__ import annotations

import textwrap
from functools import lru_cache

import matplotlib.pyplot as plt
import torch

from course_utils.launcher import run as run_worker
from course_utils.plots import CPU_NOTE
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
LAYOUT_OPTIONS = ("zero", "sequence_parallel", "micro_batches", "schedule", "virtual_stages", "split")


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
        sharded = sorted(f"blocks.{i}.{n}" for chunk in layers for i in chunk for n in SHARDED_PER_LAYER)
        out.append({"rank": rank, "coords": c, "stage": c["pp"], "layers": layers,
                    "heads": list(range(c["tp"] * heads, (c["tp"] + 1) * heads)),
                    "ffn": (c["tp"] * ffn, (c["tp"] + 1) * ffn), "tokens": tokens,
                    "rows": len(tokens) // (layout.tp if layout.sequence_parallel else 1),
                    "samples": list(range(c["dp"] * samples, (c["dp"] + 1) * samples)),
                    "embed": first, "head": "embed.weight" if first and last else ("head.weight" if last else None),
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
        ax.text(x + w / 2, y + h / 2, holding_label(hold), ha="center", va="center", fontsize=6.5)
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


def traffic_axes(ranks: list[dict], ax, step: int = -1) -> None:
    """Bytes each rank sent in one step, stacked by dimension (exact counts: ``workers/composed/train.py: _comm``)."""
    bottom = [0.0] * len(ranks)
    for i, dim in enumerate(COMM_DIMS):
        values = [r["comm"][step][dim]["wire_bytes"] / 1e3 for r in ranks]
        if any(values):
            ax.bar(range(len(ranks)), values, bottom=bottom, label=dim, color=plt.get_cmap("tab10")(i))
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(ranks))), ax.set_xlabel("rank"), ax.set_ylabel("kB sent in one step")
    ax.set_title("traffic per rank, by dimension", fontsize=9)
    ax.legend(fontsize=7, ncol=2)


def memory_axes(ranks: list[dict], ax, step: int = -1) -> None:
    """Each rank's parameters, gradients, optimizer state and peak saved activations (bytes it holds)."""
    bottom = [0.0] * len(ranks)
    for i, moment in enumerate(MOMENTS):
        values = [r["memory"][step][moment] / 1e3 for r in ranks]
        ax.bar(range(len(ranks)), values, bottom=bottom, label=moment, color=plt.get_cmap("Set2")(i))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(ranks))), ax.set_xlabel("rank"), ax.set_ylabel("kB held")
    ax.set_title("memory per rank at the four moments (float64)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)


def draw_run(res, params: dict):
    """The widget's picture: the verdict against one process; the mesh (who holds what); every rank's timeline of the
    last step; the bytes each rank sent per dimension and the memory it holds."""
    verdict = verdict_of(res.ranks)
    mark = "EQUAL" if verdict["ok"] else "DIFFERENT"
    layout = Layout(**res.ranks[0]["layout"])
    n = len(res.ranks)
    fig = plt.figure(figsize=(11, 1.5 * layout.dp * layout.pp + 0.4 * n + 5.5))
    grid = fig.add_gridspec(3, 2, height_ratios=[1.5 * layout.dp * layout.pp + 0.6, 0.38 * n + 1.0, 2.6])
    mesh_figure(layout, ax=fig.add_subplot(grid[0, :]))
    timeline_figure(res.ranks, ax=fig.add_subplot(grid[1, :]),
                    title="\n".join(textwrap.wrap(f"{mark}: {verdict['message']}", 120)))
    traffic_axes(res.ranks, fig.add_subplot(grid[2, 0]))
    memory_axes(res.ranks, fig.add_subplot(grid[2, 1]))
    fig.tight_layout()
    return fig


class LayoutRun(LiveRun):
    """``LiveRun`` of the composed worker whose world size is the product of the chosen degrees.

    A layout that does not fit is refused by the worker's ``check_params`` (``train.layout_problem``) before any rank
    starts, and its one sentence shows in the widget's status line."""

    def __init__(self, controls: dict, *, params: dict | None = None, timeout: float = 120, **kw):
        kw.setdefault("progress_total", lambda p: p.get("steps", STEPS))  # one metric per step from rank 0
        super().__init__(WORKER, controls, draw_run, params=params, timeout=timeout, **kw)

    def settings(self) -> dict:
        s = super().settings()
        return {**s, "world_size": s["dp"] * s["tp"] * s["pp"] * s["cp"]}


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
