"""Figures: ``plots.savefig`` writes where ``COURSE_FIGURES_DIR`` says (CI's runs must not rewrite the committed
figures), and every figure a chapter saves is also stored inline in its executed notebook (readers on GitHub
see the notebook, not the folder)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_utils import notebooks

ROOT = Path(__file__).resolve().parent.parent


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
        if cell["cell_type"] != "code" or not any(f in source for f in ("savefig(", "save_and_show(")):
            continue
        if "if " in source and "savefig(" not in source.split("if ")[0]:
            continue  # a figure drawn only when data exists (a GPU run, a committed file)
        if not any("image/png" in out.get("data", {}) for out in cell.get("outputs", [])):
            missing.append(i)
    assert not missing, f"{src.stem}: cells {missing} save a figure but the stored notebook shows none"
