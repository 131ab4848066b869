"""``make lab`` serves JupyterLab on the learner's copies of the chapters (``lab/``), with the widgets extension.

The real target, started as a learner would (plus options for a headless machine), asked over HTTP. What a
learner then does in the browser is tests/browser/test_lab_browser.py (``make test-browser``). The copies
(``course_utils/lab.py``) are tested on a temporary course folder: made once, refreshed when the course changes and
the learner did not edit them, kept when they did, moved aside only on request.
"""
import json
import os
import subprocess
import sys

import nbformat

import pytest

from course_utils import lab as labcopy
from tests.lab_server import ROOT, get, make_lab

pytestmark = pytest.mark.once  # a server and its files: the same on every CPU


def test_make_lab_serves_the_course(tmp_path):
    with make_lab(tmp_path) as lab:
        _, body = get(lab.url("api/contents/lab"))
        names = {item["name"] for item in json.loads(body)["content"]}
        shipped = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
        assert shipped and shipped <= names
        assert "JupyterLab opens your copies in lab/" in lab.log_tail()
        ignored = subprocess.run(["git", "check-ignore", "-q", "lab/00_overview.ipynb"], cwd=ROOT, timeout=30)
        assert ignored.returncode == 0, "lab/ must be ignored by git"
        status, page = get(lab.url("lab"))
        assert status == 200 and "JupyterLab" in page
        # the page's config lists the extensions the lab loads: the widgets manager makes ipywidgets render
        assert "@jupyter-widgets/jupyterlab-manager" in page


def _course(tmp_path, chapters=("03_alpha", "05_beta")):
    shipped = tmp_path / "notebooks"
    shipped.mkdir()
    for name in chapters:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {name}"),
                                             nbformat.v4.new_code_cell("x = 1")])
        nbformat.write(nb, str(shipped / f"{name}.ipynb"))
    return shipped, tmp_path / "lab"


def _edit(path, source=None, output=None):
    nb = nbformat.read(str(path), as_version=4)
    if source is not None:
        nb.cells[1].source = source
    if output is not None:  # what opening, running and saving does: outputs and kernel metadata, same sources
        nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text=output)]
        nb.metadata["language_info"] = {"name": "python", "version": "3.11.2"}
    nbformat.write(nb, str(path))


def test_prepare_copies_every_chapter_once_and_never_overwrites_a_run(tmp_path):
    shipped, lab = _course(tmp_path)
    assert [(a.name, a.what) for a in labcopy.prepare(shipped, lab)] == [("03_alpha.ipynb", "copied"),
                                                                         ("05_beta.ipynb", "copied")]
    assert (lab / "03_alpha.ipynb").read_bytes() == (shipped / "03_alpha.ipynb").read_bytes()
    _edit(lab / "03_alpha.ipynb", output="ran\n")
    ran = (lab / "03_alpha.ipynb").read_bytes()
    assert {a.what for a in labcopy.prepare(shipped, lab)} == {"current"}
    assert (lab / "03_alpha.ipynb").read_bytes() == ran, "a copy the learner ran was overwritten"


def test_a_new_course_version_replaces_an_unedited_copy_and_keeps_an_edited_one(tmp_path):
    shipped, lab = _course(tmp_path)
    labcopy.prepare(shipped, lab)
    _edit(lab / "03_alpha.ipynb", output="ran\n")            # opened and run: not edited
    _edit(lab / "05_beta.ipynb", source="x = 2  # my answer")  # an exercise answered
    mine = (lab / "05_beta.ipynb").read_bytes()
    for name in ("03_alpha", "05_beta"):                      # git pull brings new versions of both
        _edit(shipped / f"{name}.ipynb", source="x = 1  # clearer")
    actions = {a.name: a for a in labcopy.prepare(shipped, lab)}
    assert actions["03_alpha.ipynb"].what == "updated"
    assert labcopy.fingerprint(lab / "03_alpha.ipynb") == labcopy.fingerprint(shipped / "03_alpha.ipynb")
    assert actions["05_beta.ipynb"].what == "kept" and "make lab-update CHAPTERS=05" in actions["05_beta.ipynb"].line()
    assert (lab / "05_beta.ipynb").read_bytes() == mine

    moved = {a.name: a for a in labcopy.update(None, shipped, lab)}
    assert moved["05_beta.ipynb"].what == "moved"
    previous = list((lab / "previous").glob("05_beta.*.ipynb"))
    assert len(previous) == 1 and previous[0].read_bytes() == mine, "the learner's edited copy was lost"
    assert labcopy.fingerprint(lab / "05_beta.ipynb") == labcopy.fingerprint(shipped / "05_beta.ipynb")
    assert {a.what for a in labcopy.prepare(shipped, lab)} == {"current"}


def test_update_by_chapter_number_starts_an_edited_current_copy_over(tmp_path):
    shipped, lab = _course(tmp_path)
    labcopy.prepare(shipped, lab)
    _edit(lab / "03_alpha.ipynb", source="x = 3")
    assert [a.what for a in labcopy.update(None, shipped, lab)] == ["current", "current"]  # nothing newer
    assert labcopy.update(["03"], shipped, lab)[0].what == "moved"
    assert labcopy.fingerprint(lab / "03_alpha.ipynb") == labcopy.fingerprint(shipped / "03_alpha.ipynb")
    with pytest.raises(SystemExit, match="no chapter 07: name a chapter by its number"):
        labcopy.update(["07"], shipped, lab)


def test_figures_of_a_learners_run_go_under_build_not_the_committed_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COURSE_FIGURES_DIR"}
    out = subprocess.run([sys.executable, "-c", "from course_utils import paths; print(paths.FIGURES)"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert out == str(ROOT / "build" / "figures")


@pytest.mark.parametrize("out", [None, "executed"])
def test_only_make_notebooks_writes_the_committed_figures(tmp_path, monkeypatch, out):
    """``execute`` in place (``make notebooks``) regenerates the committed figures; ``--out`` (CI) writes beside it."""
    from course_utils import notebooks
    from course_utils.paths import COMMITTED_FIGURES

    seen = []
    monkeypatch.setattr(notebooks, "execute", lambda nb, dst, timeout: seen.append(
        (os.environ["COURSE_FIGURES_DIR"], os.environ.get("COURSE_SCRATCH_DIR"))) or 0.0)
    for name in ("COURSE_FIGURES_DIR", "COURSE_SCRATCH_DIR"):  # main() sets them: recorded, so restored after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    argv = ["execute", "00_overview"] + (["--out", str(tmp_path / out)] if out else [])
    assert notebooks.main(argv) == 0
    if out is None:  # in place: the committed figures, the usual scratch folders
        assert seen == [(str(COMMITTED_FIGURES), None)]
    else:  # beside: figures and scratch folders of its own (nbval may be executing the same chapters meanwhile)
        assert seen == [(str((tmp_path / out / "figures").resolve()), str((tmp_path / out / "scratch").resolve()))]
