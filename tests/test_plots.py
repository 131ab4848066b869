"""Figures: ``plots.savefig`` writes where ``COURSE_FIGURES_DIR`` says (CI's runs must not rewrite the committed
figures), and every figure a chapter saves is also stored inline in its executed notebook (readers on GitHub
see the notebook, not the folder)."""
import json
import os
import subprocess
import sys

import pytest

from course_utils import notebooks
from course_utils.paths import ROOT



def test_figures_go_where_the_environment_says(tmp_path):
    code = ("import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt; from course_utils import plots; "
            "fig, ax = plt.subplots(); ax.plot([0, 1]); assert plots.savefig(fig, 'probe_figure') is fig")
    env = dict(os.environ, COURSE_FIGURES_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    assert (tmp_path / "probe_figure.png").stat().st_size > 1000
    assert not (ROOT / "notebooks" / "figures" / "probe_figure.png").exists()


@pytest.mark.parametrize("src", notebooks.sources(), ids=lambda p: p.stem)
def test_every_saved_figure_is_shown_in_the_stored_notebook(src):
    nb = json.loads(notebooks.notebook_for(src).read_text())
    missing = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or "savefig(" not in source:
            continue
        if "if " in source and "savefig(" not in source.split("if ")[0]:
            continue  # a figure drawn only when data exists (a GPU run, a committed file)
        if not any("image/png" in out.get("data", {}) for out in cell.get("outputs", [])):
            missing.append(i)
    assert not missing, f"{src.stem}: cells {missing} save a figure but the stored notebook shows none"


def test_log2_axis_puts_ticks_at_the_values_labelled_as_themselves():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_utils.plots import log2_axis

    fig, ax = plt.subplots()
    ax.plot([1, 8192], [1, 8])
    log2_axis(ax, [8, 1, 2, 1024, 8192, 1536], "n")
    log2_axis(ax, axis="y")
    assert ax.get_xscale() == ax.get_yscale() == "log" and ax.xaxis.get_transform().base == 2
    assert ax.yaxis.get_transform().base == 2
    assert list(ax.get_xticks()) == [1, 2, 8, 1024, 1536, 8192]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "8", "1k", "1536", "8k"]
    assert ax.get_xlabel() == "n" and ax.get_ylabel() == ""
    plt.close(fig)
