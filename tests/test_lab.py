"""``make lab`` serves JupyterLab on the course: the chapters are listed, the widgets extension is installed.

The real target, started as a learner would (plus options for a headless machine), asked over HTTP. What a
learner then does in the browser is tests/browser/test_lab_browser.py (``make test-browser``).
"""
import json

import pytest

from tests.lab_server import ROOT, get, make_lab

pytestmark = pytest.mark.once  # a server and its files: the same on every CPU


def test_make_lab_serves_the_course(tmp_path):
    with make_lab(tmp_path) as lab:
        _, body = get(lab.url("api/contents/notebooks"))
        names = {item["name"] for item in json.loads(body)["content"]}
        shipped = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
        assert shipped and shipped <= names
        status, page = get(lab.url("lab"))
        assert status == 200 and "JupyterLab" in page
        # the page's config lists the extensions the lab loads: the widgets manager makes ipywidgets render
        assert "@jupyter-widgets/jupyterlab-manager" in page
