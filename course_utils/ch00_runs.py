"""Chapter 00, notebook side: the planner held to published training runs.

``runs_table`` lists every row of ``PUBLISHED_RUNS`` with the planner's seconds per step against the published
ones, their ratio and the term that dominates the predicted step; ``runs_figure`` draws predicted against
published with the +-15% band; ``breakdown_figure`` stacks each run's predicted step by term, scaled to its
published step, so a bar's end against the line at 1 is the error and its colours say where the time went;
``search_table`` ranks the layouts the planner finds for one published case and marks the published layout.
Every number comes from ``course_utils.planner_runs`` and ``course_utils.planner``.
"""
from __future__ import annotations

from course_utils.ch00 import TIME_COLOURS
from course_utils.planner import Plan
from course_utils.planner_runs import BAND, Comparison, summary
from course_utils.tables import Table

RUNS_HEADER = ["run", "paper", "GPUs", "tp/cp/pp/dp", "v", "published s/step", "planner s/step", "ratio",
               "largest term", "comm share", "counts"]


def _layout(c: Comparison) -> str:
    r = c.row
    return f"{r.tp}/{r.cp}/{r.pp}/{r.dp}"


def runs_table(comps: list[Comparison]) -> Table:
    rows = []
    for c in comps:
        why = "yes" if c.counts else ("derived" if c.row.flop_convention == "derived" else "assumption")
        rows.append([c.row.name, c.row.paper, f"{c.row.gpus:,}", _layout(c), f"{c.row.virtual_stages}",
                     f"{c.published_s:.2f}", f"{c.predicted.total:.2f}", f"{c.ratio:.2f}", c.predicted.dominant(),
                     f"{100 * c.predicted.comm_share:.0f}%", why])
    s = summary(comps)
    caption = (f"{s['rows']} published runs; {s['counted']} count toward the test (fully printed, or an assumption "
               f"that moves the prediction by at most {100 * BAND:.0f}%): median error "
               f"{100 * s['median_error']:.1f}%, outside +-{100 * BAND:.0f}%: {', '.join(s['outside_band']) or 'none'}")
    return Table(RUNS_HEADER, rows, caption)


def runs_figure(comps: list[Comparison], ax=None):
    """Predicted against published seconds per step, log-log, with the +-15% band; hollow marks do not count."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 6))
    papers = sorted({c.row.paper for c in comps})
    cmap = plt.get_cmap("tab10")
    lo = min(min(c.published_s, c.predicted.total) for c in comps) / 1.5
    hi = max(max(c.published_s, c.predicted.total) for c in comps) * 1.5
    xs = [lo, hi]
    ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="#DDDDDD",
                    label=f"+-{100 * BAND:.0f}%")
    ax.plot(xs, xs, color="black", linewidth=0.8)
    for i, paper in enumerate(papers):
        mine = [c for c in comps if c.row.paper == paper]
        for counted in (True, False):
            pts = [c for c in mine if c.counts == counted]
            if pts:
                ax.scatter([c.published_s for c in pts], [c.predicted.total for c in pts], s=36,
                           facecolors=cmap(i % 10) if counted else "none", edgecolors=cmap(i % 10),
                           label=paper if counted or not any(c.counts for c in mine) else None, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published seconds per step")
    ax.set_ylabel("planner's seconds per step")
    ax.set_title("the planner against published runs\n(hollow: an assumed value moves it by more than the band)",
                 fontsize=10)
    ax.legend(fontsize=9, loc="upper left", frameon=False)
    return ax


def breakdown_figure(comps: list[Comparison], ax=None):
    """One bar per run: the predicted step's terms, each divided by the published step (so 1.0 is exact)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.3 * len(comps) + 2))
    left = [0.0] * len(comps)
    for term, colour in TIME_COLOURS.items():
        values = [c.predicted.terms[term] / c.published_s for c in comps]
        if not any(values):
            continue
        ax.barh(range(len(comps)), values, left=left, color=colour,
                label=f"comm {term}" if term in ("tp", "cp", "ep", "pp", "dp") else term, height=0.7)
        left = [a + v for a, v in zip(left, values)]
    ax.axvline(1.0, color="black", linewidth=1)
    ax.axvspan(1 - BAND, 1 + BAND, color="#EEEEEE", zorder=0)
    ax.set_yticks(range(len(comps)), [run_label(c) for c in comps], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.4, max(left) * 1.05))
    ax.set_xlabel("predicted step by term / published step (1 = exact; grey: +-15%)")
    ax.set_title("where each run's predicted step goes", fontsize=10)
    ax.legend(fontsize=9, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.6 / max(len(comps), 4) - 0.08),
              frameon=False)
    return ax


def run_label(c: Comparison) -> str:
    """A run's name, with its paper's key where the name does not already say it (Korthikanti's "22B")."""
    name, paper = c.row.name, c.row.paper
    said = "".join(ch for ch in name.lower() if ch.isalnum())
    return name if "".join(ch for ch in paper.lower() if ch.isalpha())[:6] in said else f"{name} ({paper})"


SEARCH_HEADER = ["#", "tp/cp/pp/dp", "v", "micro-batch", "ZeRO", "recompute", "GB/GPU", "s/step", "MFU",
                 "comm share", "published?"]


def search_table(plans: list[Plan], published: dict, caption: str) -> Table:
    """The ranked layouts, the published one marked (``published``: the Layout fields that identify it)."""
    rows = []
    for i, p in enumerate(plans):
        lay = p.layout
        mark = all(getattr(lay, k) == v for k, v in published.items())
        rows.append([f"{i + 1}", f"{lay.tp}/{lay.cp}/{lay.pp}/{lay.dp}", f"{lay.virtual_stages}",
                     f"{lay.micro_batch}", f"{lay.zero}", lay.recompute, f"{p.total_memory_bytes / 1e9:.0f}",
                     f"{p.step_time_s:.2f}", f"{100 * p.mfu:.1f}%", f"{100 * p.comm_share:.0f}%",
                     "published" if mark else ""])
    return Table(SEARCH_HEADER, rows, caption)


def published_rank(plans: list[Plan], published: dict) -> int | None:
    """1-based rank of the published layout among ``plans``, None if it is not there."""
    for i, p in enumerate(plans):
        if all(getattr(p.layout, k) == v for k, v in published.items()):
            return i + 1
    return None
