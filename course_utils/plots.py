"""Figures: one style for the course; ``savefig`` writes a PNG and shows it inline.

``savefig`` writes ``<figures>/<name>.png`` (``course_utils.paths.FIGURES``) and, inside a notebook, shows that
PNG inline, so the stored notebook carries every figure too. ``make notebooks`` regenerates the committed copies
in ``notebooks/figures`` (what README and GitHub readers see); every other run (a learner's lab, CI's
``execute --out``, nbval) writes under ``build/``, so it never rewrites a tracked file.
"""
from __future__ import annotations


import matplotlib

from course_utils.paths import FIGURES

CPU_NOTE = "measured on this machine's CPU (gloo): not GPU numbers"


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def savefig(fig, name: str):
    """Save ``fig`` as <figures>/<name>.png. In a notebook, show that PNG inline and close the figure (rendered
    once, shown once, whatever the backend; returns None); elsewhere return ``fig``."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    if not _in_kernel():
        return fig
    import matplotlib.pyplot as plt
    from IPython.display import Image, display

    plt.close(fig)
    display(Image(data=path.read_bytes(), format="png"))
    return None


def log2_axis(ax, values=None, label: str | None = None, *, axis: str = "x") -> None:
    """A log2 scale on ``ax``'s x axis (``axis="y"``: its y axis). ``values``: ticks at exactly these values,
    labelled with the values themselves (``1k``, ``4k`` for multiples of 1024) instead of matplotlib's powers of
    two; ``label``: the axis label."""
    getattr(ax, f"set_{axis}scale")("log", base=2)
    if values is not None:
        ticks = sorted(set(values))
        getattr(ax, f"set_{axis}ticks")(ticks, [_tick_label(v) for v in ticks])
    if label is not None:
        getattr(ax, f"set_{axis}label")(label)


def _tick_label(v) -> str:
    if v >= 1024 and v % 1024 == 0:
        return f"{int(v) // 1024}k"
    return f"{v:g}" if isinstance(v, float) else str(v)


# JupyterLab breaks printed output anywhere (``.jp-OutputArea-output pre {word-break: break-all}``): a table or a
# long line then wraps in the middle of a number or a word. Printed lines wrap at spaces instead, and only a token
# longer than the line is broken.
LAB_CSS = "<style>.jp-OutputArea-output pre {word-break: normal; overflow-wrap: anywhere;}</style>"


def style() -> None:
    """The course's figure style; in a notebook's kernel also the lab's wrapping of printed lines (``LAB_CSS``)."""
    matplotlib.rcParams.update({"figure.figsize": (7.5, 3.6), "axes.grid": True, "grid.alpha": 0.3,
                                "axes.spines.top": False, "axes.spines.right": False, "font.size": 10})
    if _in_kernel():
        from IPython.display import HTML, display

        display(HTML(LAB_CSS))
