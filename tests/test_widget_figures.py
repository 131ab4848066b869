"""A widget that promises a figure draws one under any matplotlib backend, Agg included (``make lab`` exports
``MPLBACKEND=Agg`` to its kernels, where ``plt.show()`` inside a widget's output shows nothing), and a refusal
replaces the previous figure and text instead of sitting above them.

The outputs are read from the widgets' ``ipywidgets.Output`` areas (``outputs``), which is what JupyterLab renders;
no kernel runs here, so a widget that drew with ``plt.show()`` or printed into a captured output shows nothing.
"""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import pytest

from course_utils import ch00

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def agg():
    """Agg, as ``make lab`` gives its kernels (MPLBACKEND=Agg), whatever backend this process started with."""
    before = matplotlib.get_backend()
    matplotlib.use("Agg", force=True)
    yield
    matplotlib.use(before, force=True)


def outputs(widget) -> list[dict]:
    """Every output of every ``Output`` area inside ``widget``, in the order they are laid out."""
    import ipywidgets as W

    if isinstance(widget, W.Output):
        return list(widget.outputs)
    return [o for child in getattr(widget, "children", ()) for o in outputs(child)]


def pngs(widget) -> list[str]:
    return [o["data"]["image/png"] for o in outputs(widget) if "image/png" in o.get("data", {})]


def text(widget) -> str:
    return "".join(o.get("text", "") for o in outputs(widget) if o.get("output_type") == "stream")


def test_the_planner_draws_its_figure_under_agg_and_a_refusal_replaces_it():
    import matplotlib.pyplot as plt

    open_before = plt.get_fignums()
    box = ch00.planner_widget()
    assert matplotlib.get_backend().lower() == "agg"
    first = pngs(box)
    assert len(first) == 1, f"no figure in the planner's output under Agg: {outputs(box)!r}"
    assert "Llama 3 70B on 256 GPUs" in text(box) and "cannot run" not in text(box)

    box.controls["micro_batch"].value = 2  # a valid move: a new figure replaces the old one, one summary
    assert len(pngs(box)) == 1 and pngs(box) != first
    assert text(box).count("Llama 3 70B on 256 GPUs") == 1

    box.controls["n_gpus"].value = 8  # tp x pp = 32 does not divide 8: refused
    assert pngs(box) == [], "the refusal left the previous setting's figure on screen"
    shown = text(box)
    assert shown.startswith("cannot run: ") and "does not divide the world's 8 ranks" in shown
    assert "memory per GPU" not in shown, "the refusal left the previous setting's summary on screen"

    box.controls["n_gpus"].value = 256  # valid again: a figure, the summary, and no refusal left above them
    assert len(pngs(box)) == 1
    assert "cannot run" not in text(box) and text(box).count("Llama 3 70B on 256 GPUs") == 1
    assert plt.get_fignums() == open_before, "the widget left figures open (each redraw would leak one)"


# Drawing into a widget's output with pyplot's display hooks, or capturing prints and plt.show() through
# interactive_output / ``with out:``, shows nothing under Agg (and nothing without a kernel): widgets set
# ``Output.outputs`` (course_utils/widgets.py: figure_png, LiveRun.show) or a ``W.Image``'s value instead.
TRAPS = {"plt.show()": re.compile(r"\bplt\.show\(\)"), "fig.show()": re.compile(r"\bfig\.show\(\)"),
         "interactive_output": re.compile(r"\binteractive_output\("), "@interact": re.compile(r"\binteract\(")}


def test_no_widget_draws_through_pyplots_display_hooks():
    sources = sorted((ROOT / "course_utils").rglob("*.py")) + sorted((ROOT / "notebooks" / "src").glob("*.py"))
    found = [f"{path.relative_to(ROOT)}:{n}: {name}" for path in sources
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for name, pattern in TRAPS.items() if pattern.search(line.split("#")[0])]
    assert not found, "draws nothing under MPLBACKEND=Agg; set the Output's outputs instead:\n" + "\n".join(found)
