"""Chapter 14, notebook side, the second way to split a sequence: DeepSpeed-Ulysses (all-to-all) against the ring.

Everything here reads ``RunResult``s of ``workers/ch14_ulysses.py``: the check against float64 full attention in
one process (``workers/context_parallel/reference.compare_to_reference``), the picture of the two all-to-alls drawn
from a run's rows and shapes, and the bytes each rank sends, from the formulas of
``workers/context_parallel/ulysses.py`` with the ranks' own counts on top.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from course_utils import plots
from workers.context_parallel.reference import compare_to_reference
from workers.context_parallel.ulysses import kv_heads_sent, ring_bytes, ulysses_bytes

WORKER = "workers.ch14_ulysses"
# Ulysses alone computes each head's attention with the reference's own arithmetic (error 0 here); with a ring the
# merge reorders the sums (~1e-15 at these sizes). 1e-12 is float64 rounding with a wide margin on any CPU's kernels.
BOUND = 1e-12
PHASES = ("forward", "backward")
# The bytes figure: one panel per quantity moved away from BASE. Formula lines over SWEEPS; the world of 4 ranks
# measures every point with cp <= 4. The ring is measured where it runs: with as many KV heads as heads (the
# worker's ring, ring = cp, passes K and V expanded to the query heads).
BASE = {"seq": 64, "heads": 8, "kv_heads": 8, "cp": 4, "head_dim": 16}
SWEEPS = {"seq": (16, 32, 64, 128, 256), "kv_heads": (1, 2, 4, 8), "cp": (1, 2, 4, 8)}
ELEMENT = 8  # float64, the dtype every run here uses
COLORS = {"ulysses": "tab:blue", "ring": "tab:orange"}


# -- equal to full attention ---------------------------------------------------------------------------------

def check(res) -> dict:
    """``compare_to_reference`` of every copy, and whether every error is within ``BOUND`` (NaN fails)."""
    c = compare_to_reference(res.ranks)
    errors = torch.tensor(list(c["errors"].values()), dtype=torch.float64)
    return {**c, "bound": BOUND, "within_bound": bool((errors <= BOUND).all())}


def verdict(res) -> str:
    """One line that holds on every CPU: equal to full attention within ``BOUND``, and what the run was."""
    d, c = res[0], check(res)
    layout = f"cp = {d['cp']}" if d["ring"] == 1 else f"cp = {d['cp']} = {d['ulysses']} Ulysses x ring {d['ring']}"
    cfg = d["config"]
    return (f"{layout}, heads {cfg['heads']}, kv_heads {cfg['kv_heads']}, {'causal' if cfg['causal'] else 'no mask'}: "
            f"out, dq, dk, dv equal to float64 full attention within {BOUND:g}: {c['within_bound']}")


# -- bytes -----------------------------------------------------------------------------------------------------

def formula(seq: int, heads: int, kv_heads: int, cp: int, head_dim: int = 16, batch: int = 1,
            element_size: int = ELEMENT) -> dict:
    """Bytes one rank sends per attention layer, ``{"ulysses": {forward, backward}, "ring": {...}}``: Ulysses'
    all-to-alls (KV heads copied when there are fewer than cp) and a ring that passes K/V chunks of kv_heads heads."""
    return {"ulysses": ulysses_bytes(batch, heads, kv_heads, seq, head_dim, cp, element_size),
            "ring": ring_bytes(batch, kv_heads, seq, head_dim, cp, element_size)}


def measured_settings() -> list[dict]:
    """The runs behind the bytes figure's points: each sweep's values that 4 ranks run, Ulysses and (MHA) the ring."""
    settings = []
    for sweep, values in SWEEPS.items():
        for x in values:
            p = {**BASE, sweep: x}
            if p["cp"] > 4:
                continue
            settings.append({"sweep": sweep, "method": "ulysses", **p, "ring": 1})
            if p["kv_heads"] == p["heads"]:
                settings.append({"sweep": sweep, "method": "ring", **p, "ring": p["cp"]})
    return settings


def run_params(setting: dict) -> dict:
    """The worker's parameters of one ``measured_settings`` entry (forward and backward, float64)."""
    return {k: setting[k] for k in ("seq", "heads", "kv_heads", "cp", "head_dim", "ring")}


def bytes_point(setting: dict, res) -> dict:
    """What every rank of one run sent, against the formula: ``equal`` holds only if each rank's count is it."""
    want = formula(setting["seq"], setting["heads"], setting["kv_heads"], setting["cp"], setting["head_dim"])
    want = want[setting["method"]]
    sent = [d["sent_bytes"] for d in res.ranks]
    return {**setting, "sent": sent[0], "formula": want, "equal": all(s == want for s in sent)}


def bytes_figure(points: list[dict]):
    """Bytes per rank per attention layer, Ulysses against the ring, forward (solid) and backward (dashed), as the
    sequence, the KV heads and the degree move away from ``BASE``: the formulas' lines, the ranks' counts on top."""
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.5))
    labels = {"seq": "sequence length", "kv_heads": f"KV heads (of {BASE['heads']})", "cp": "degree cp"}
    for ax, (sweep, values) in zip(axes, SWEEPS.items()):
        for method in ("ulysses", "ring"):
            for phase, style in zip(PHASES, ("-", "--")):
                line = [formula(**{**BASE, sweep: x})[method][phase] / 1024 for x in values]
                ax.plot(values, line, style, color=COLORS[method], lw=1.6)
                got = [(p[sweep], p["sent"][phase] / 1024) for p in points if p["sweep"] == sweep
                       and p["method"] == method]
                if got:
                    ax.plot(*zip(*got), "o" if method == "ulysses" else "s", color=COLORS[method], ms=6,
                            mfc="white" if phase == "backward" else COLORS[method])
        plots.log2_axis(ax, values, labels[sweep])
        fixed = ", ".join(f"{k} {v}" for k, v in BASE.items() if k not in (sweep, "head_dim"))
        ax.set_title(fixed, fontsize=9)
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("KiB sent per rank (float64)")
    handles = [plt.Line2D([], [], color=COLORS["ulysses"], lw=1.6, label="Ulysses (all-to-all)"),
               plt.Line2D([], [], color=COLORS["ring"], lw=1.6, label="ring (K/V chunks)"),
               plt.Line2D([], [], color="0.3", ls="-", label="forward"),
               plt.Line2D([], [], color="0.3", ls="--", label="backward"),
               plt.Line2D([], [], color="0.3", marker="o", ls="", label="counted on 4 ranks (filled: forward; squares: ring)")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=8, frameon=False)
    fig.suptitle("bytes each rank sends per attention layer: lines from the formulas, points from the ranks",
                 fontsize=10)
    fig.tight_layout()
    return fig


def crossover_rows(heads: int, cp: int, seq: int, head_dim: int, kv_options, element_size: int = ELEMENT) -> list[dict]:
    """Per KV-head count: both methods' bytes per rank and which sends fewer in forward and over a whole step."""
    rows = []
    for kv in kv_options:
        f = formula(seq, heads, kv, cp, head_dim, element_size=element_size)
        u, r = f["ulysses"], f["ring"]
        step = {m: f[m]["forward"] + f[m]["backward"] for m in f}
        rows.append({"kv_heads": kv, "kv_sent": kv_heads_sent(kv, cp), "ulysses": u, "ring": r,
                     "fewer_forward": _fewer(u["forward"], r["forward"]), "fewer_step": _fewer(step["ulysses"],
                                                                                           step["ring"])})
    return rows


def _fewer(ulysses: int, ring: int) -> str:
    return "Ulysses" if ulysses < ring else "ring" if ring < ulysses else "equal"


def crossover_sentence(rows: list[dict], heads: int, cp: int) -> str:
    """Where the ring starts to send fewer bytes than Ulysses, said from ``crossover_rows``."""
    def where(key, winner):
        return [r["kv_heads"] for r in rows if r[key] == winner]

    parts = []
    for key, what in (("fewer_forward", "in forward"), ("fewer_step", "over forward and backward")):
        ring, uly, equal = where(key, "ring"), where(key, "Ulysses"), where(key, "equal")
        said = []
        if ring:
            said.append(f"the ring sends fewer bytes with kv_heads {_listed(ring)}")
        if uly:
            said.append(f"Ulysses with kv_heads {_listed(uly)}")
        if equal:
            said.append(f"the same with kv_heads {_listed(equal)}")
        parts.append(f"{what}, " + ", ".join(said))
    return f"heads {heads}, cp {cp}: " + "; ".join(parts)


def _listed(values) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def kv_copy_bytes(seq: int, heads: int, kv_heads: int, cp: int, head_dim: int = 16, element_size: int = ELEMENT) -> dict:
    """What copying the KV heads costs Ulysses' forward when there are fewer than cp of them: the bytes K and V
    carry as ``kv_heads_sent`` heads against as ``kv_heads`` heads (what they would be, could a head be cut)."""
    head_rows = (seq // cp) * head_dim * element_size  # one head's rows on one rank
    sent = kv_heads_sent(kv_heads, cp)
    with_copies, without = ((cp - 1) * 2 * n * head_rows // cp for n in (sent, kv_heads))
    return {"kv_sent": sent, "kv_bytes": with_copies, "kv_bytes_uncopied": without, "extra": with_copies - without,
            "forward": ulysses_bytes(1, heads, kv_heads, seq, head_dim, cp, element_size)["forward"]}


# -- the two all-to-alls, from a run -----------------------------------------------------------------------------

def _cmap(n: int) -> ListedColormap:
    return ListedColormap([plt.get_cmap("tab10")(i) for i in range(n)])


def all_to_all_figure(res):
    """Who holds which (position, head) of q, k, v and out, before and after each all-to-all, drawn from a run's
    rows (each rank's ``positions``) and shapes; colour: the rank. Copy 0 of the run."""
    ranks = sorted((d for d in res.ranks if d["copy"] == 0), key=lambda d: d["cp_index"])
    first, cfg = ranks[0], ranks[0]["config"]
    cp, seq, heads, kv = first["ulysses"], cfg["seq"], cfg["heads"], cfg["kv_heads"]
    if first["ring"] != 1:
        raise ValueError("draw a run of Ulysses alone (ring = 1)")
    b, _, rows, d = first["out"].shape
    owner = np.empty(seq, dtype=int)
    for r in ranks:
        owner[r["positions"].numpy()] = r["ulysses_index"]
    sent = kv_heads_sent(kv, cp)
    by_rows_q = np.repeat(owner[:, None], heads, axis=1)  # [seq, heads]: the rank holding each row
    by_heads_q = np.repeat((np.arange(heads) // (heads // cp))[None], seq, axis=0)  # rank j: heads j h/cp ..
    by_rows_kv = np.repeat(owner[:, None], kv, axis=1)
    by_heads_kv = np.repeat((np.arange(sent) // (sent // cp))[None], seq, axis=0)
    fig, axes = plt.subplots(2, 3, figsize=(10, 6.4), gridspec_kw={"width_ratios": [heads, heads, heads]})
    cmap, kw = _cmap(cp), {"aspect": "auto", "interpolation": "nearest", "vmin": -0.5, "vmax": cp - 0.5}
    a2a = first["messages"]["all_to_all"]["forward"]
    panels = [
        (axes[0, 0], by_rows_q, range(heads), f"q before: [b, h, s/cp, d] = {(b, heads, rows, d)}\n"
                                              "each rank: its rows, every head"),
        (axes[0, 1], by_heads_q, range(heads), f"after all-to-all 1: [b, h/cp, s, d] = {(b, heads // cp, seq, d)}\n"
                                               "each rank: every row, h/cp heads"),
        (axes[0, 2], by_rows_q, range(heads), f"out after all-to-all 2: {tuple(first['out'].shape)}\n"
                                              "back to its rows, every head"),
        (axes[1, 0], by_rows_kv, range(kv), f"k, v before: [b, kv, s/cp, d] = {(b, kv, rows, d)}"),
        (axes[1, 1], by_heads_kv, [i // (sent // kv) for i in range(sent)],
         f"k, v after all-to-all 1: {(b, sent // cp, seq, d)}" + (f"\n{kv} KV heads sent as {sent} copies"
                                                                  if sent != kv else "")),
    ]
    for ax, grid, ticks, title in panels:
        ax.imshow(grid, cmap=cmap, **kw)
        ax.set_xticks(range(grid.shape[1]), [str(t) for t in ticks], fontsize=8)
        ax.set_title(title, fontsize=8.5)
        ax.set_xlabel("KV head" if grid is by_rows_kv or grid is by_heads_kv else "head", fontsize=9)
        ax.grid(False)
        for x in np.arange(grid.shape[1] - 1) + 0.5:
            ax.axvline(x, color="white", lw=0.8)
    for ax in axes[:, 0]:
        ax.set_ylabel("sequence position")
    note = axes[1, 2]
    note.axis("off")
    u = first["ulysses_sent_bytes"]
    note.text(0.0, 0.95, f"cp = {cp}, seq = {seq}, {heads} heads, {kv} KV heads\n\n"
                         f"forward: {a2a} all-to-alls (q; k and v\nstacked; out)\n"
                         f"each keeps 1/cp of its tensor home\n\n"
                         f"bytes rank 0 sent: forward {u['forward']},\nbackward {u['backward']} "
                         f"(the gradients,\nthe other way)", fontsize=8.5, va="top", family="monospace")
    fig.legend(handles=[Patch(color=cmap(i), label=f"rank {i}") for i in range(cp)], loc="upper center",
               bbox_to_anchor=(0.5, 0.0), ncol=cp, fontsize=8, frameon=False)
    fig.suptitle("Ulysses: all-to-all 1 turns sequence shards into head shards, all-to-all 2 turns them back",
                 fontsize=10)
    fig.tight_layout()
    return fig


# -- the widget ----------------------------------------------------------------------------------------------

# What the chapter's widget lets a learner move on 4 ranks (cp a dropdown; heads and kv_heads sliders from and to;
# seq a dropdown): every refusal the worker gives there names only these four, and every value it suggests is one
# of them (tests/test_ch14_glue.py).
WIDGET_CHOICES = {"cp": [1, 2, 4], "heads": (1, 16), "kv_heads": (1, 16), "seq": [16, 32, 64, 128, 256]}


def refusal(world_size: int = 4, **params) -> str | None:
    """The sentence the launcher refuses these worker parameters with (what the widget shows), or None."""
    from course_utils.results import InvalidParameter
    from course_utils.validate import check_params

    try:
        check_params(WORKER, world_size, params)
    except InvalidParameter as exc:
        return str(exc)
    return None


def widget_settings():
    """Every setting the widget can reach."""
    import itertools

    heads, kv = (range(lo, hi + 1) for lo, hi in (WIDGET_CHOICES["heads"], WIDGET_CHOICES["kv_heads"]))
    for cp, h, k, seq in itertools.product(WIDGET_CHOICES["cp"], heads, kv, WIDGET_CHOICES["seq"]):
        yield {"cp": cp, "heads": h, "kv_heads": k, "seq": seq}


def widget_figure(res, params: dict):
    """Bytes per rank of this Ulysses run (counted on the ranks) against the ring at the same shape (the formula,
    which the ring's ranks send: section on the ring), with the equality check in the title."""
    d, c = res[0], check(res)
    ring = d["ring_alone_bytes"]
    fig, ax = plt.subplots(figsize=(5.6, 3.0))
    x = np.arange(len(PHASES))
    ax.bar(x - 0.2, [d["sent_bytes"][p] / 1024 for p in PHASES], 0.4, color=COLORS["ulysses"],
           label="Ulysses (counted)")
    ax.bar(x + 0.2, [ring[p] / 1024 for p in PHASES], 0.4, color=COLORS["ring"], label="ring (formula)")
    for bars in ax.containers:
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(x, PHASES), ax.set_ylabel("KiB sent per rank (float64)")
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title(f"cp {params['cp']}, heads {params['heads']}, kv_heads {params['kv_heads']}, seq {params['seq']}\n"
                 f"equal to full attention within {BOUND:g}: {c['within_bound']}", fontsize=9)
    return fig


def ulysses_widget(world_size: int = 4, timeout: float = 60):
    """The chapter's explorer: cp, heads, kv_heads and seq -> a Ulysses run on warm ranks, drawn by
    ``widget_figure``; a layout the worker refuses shows its sentence instead of a figure."""
    import ipywidgets as W

    from course_utils.widgets import LiveRun, slider

    choices = WIDGET_CHOICES
    controls = {"cp": W.Dropdown(options=choices["cp"], value=4, description="cp"),
                "heads": slider("heads", 8, *choices["heads"]),
                "kv_heads": slider("kv_heads", 2, *choices["kv_heads"]),
                "seq": W.Dropdown(options=choices["seq"], value=64, description="seq")}
    return LiveRun(WORKER, controls, widget_figure, params={"world_size": world_size}, timeout=timeout)
