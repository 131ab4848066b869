"""Each check of ``checks.py`` fails on a deliberately broken case, in the same lab and browser as the chapters.

A scratch notebook (under ``build/``, ignored by git) holds one broken case per check: a stored widget output that
shows its raw repr and a markdown cell in the builders' words (``page_text``), a widget that draws with
``plt.show()`` under Agg (``figure_shown``), one that appends its answer under an earlier refusal
(``no_stale_refusal``), one that announces a 1-second wait and answers after 4 (``wait_as_announced``), and printed
lines left to JupyterLab's own wrapping, which breaks inside words (``lines_wrap_at_words``). Each check
must raise on its case; the chapters' test holds every chapter to the same checks.
"""
from __future__ import annotations

import pytest

from tests.browser import checks
from tests.browser.lab_ui import open_page, run_all, shut_down_kernels
from tests.lab_server import ROOT, request

pytestmark = pytest.mark.browser

REPR = "VBox(children=(HBox(children=(Dropdown(description='model', index=2, options=('7B', '70B')),)),))"
BROKEN_CELLS = [
    ("markdown", "These are the layouts of the issue, compared in CI."),
    # a stored widget output, as papermill writes it without a placeholder: its model does not exist yet
    ("code", "print('the widget that was here is gone')"),
    # a figure drawn with plt.show() inside a widget: under Agg nothing reaches the page, the text does
    ("code", "import threading, time\nimport ipywidgets as W, matplotlib.pyplot as plt\n"
             "n = W.Dropdown(options=[1, 2, 3], value=1, description='n')\n"
             "def draw(n):\n    fig, ax = plt.subplots()\n    ax.plot(range(n))\n    plt.show()\n"
             "    print(f'drew {n} points')\n"
             "display(W.VBox([W.HBox([n]), W.interactive_output(draw, {'n': n})]))"),
    # a refusal that stays above the next valid answer (the output is appended to, not replaced)
    ("code", "choice = W.Dropdown(options=['ok', 'refused', 'ok again'], value='ok', description='setting')\n"
             "said = W.Output()\n"
             "def answer(change=None):\n    with said:\n"
             "        print('cannot run: setting=refused is not allowed' if choice.value == 'refused' "
             "else f'answer for {choice.value}')\n"
             "choice.observe(answer, names='value')\nanswer()\ndisplay(W.VBox([W.HBox([choice]), said]))"),
    # a wait announced as about 1 s that takes 4
    ("code", "k = W.IntSlider(value=1, min=1, max=3, description='k', continuous_update=False)\n"
             "status, shown = W.HTML(), W.Output()\n"
             "def slow(change=None):\n"
             "    status.value = '<i>starting 2 ranks (a cold start: about 1 s), then running on real ranks...</i>'\n"
             "    def later():\n        time.sleep(4)\n        status.value = 'done'\n"
             "        shown.outputs = ({'output_type': 'stream', 'name': 'stdout', 'text': f'k = {k.value}\\n'},)\n"
             "    threading.Thread(target=later, daemon=True).start()\n"
             "k.observe(slow, names='value')\ndisplay(W.VBox([W.HBox([k]), status, shown]))"),
]


def broken_notebook(lab) -> str:
    path = "build/browser/broken_widgets.ipynb"
    cells = []
    for kind, source in BROKEN_CELLS:
        cell = {"cell_type": kind, "metadata": {}, "source": source}
        if kind == "code":
            cell.update(outputs=[], execution_count=None)
        cells.append(cell)
    cells[1]["outputs"] = [{"output_type": "display_data", "metadata": {}, "data": {
        "application/vnd.jupyter.widget-view+json": {"model_id": "0" * 32, "version_major": 2, "version_minor": 0},
        "text/plain": REPR}}]
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (course)", "language": "python"}}}
    (ROOT / "build" / "browser").mkdir(parents=True, exist_ok=True)
    request(lab.url(f"api/contents/{path}"), method="PUT", body={"type": "notebook", "format": "json", "content": nb})
    return path


def test_each_check_fails_on_its_broken_case(lab, browser):
    page = open_page(browser, lab, broken_notebook(lab))
    try:
        with pytest.raises(AssertionError, match="raw widget repr"):
            checks.page_text(page, "the broken notebook as opened")
        run_all(page)
        with pytest.raises(AssertionError, match="builders"):
            checks.page_text(page, "the broken notebook after Run All")
        with pytest.raises(AssertionError, match="wrap inside words"):  # no plots.style(): JupyterLab's own rule
            checks.lines_wrap_at_words(page, "the broken notebook after Run All")
        widgets = page.locator(checks.WIDGET)
        assert widgets.count() == 3, widgets.count()
        drawn, refusing, slow = (widgets.nth(i) for i in range(3))

        before = checks.signature(drawn)
        drawn.locator("select").select_option(label="2")
        checks.settled(drawn, before)
        assert "drew 2 points" in checks.output_text(drawn)  # its text changed, so a text-only check would pass
        with pytest.raises(AssertionError, match="promises a figure and shows none"):
            checks.figure_shown(drawn, "the plt.show() widget", timeout_s=3)

        select = refusing.locator("select")
        select.select_option(label="refused")
        checks.wait_until(lambda: checks.refusal_shown(refusing), "the refusal shows")
        select.select_option(label="ok again")
        checks.wait_until(lambda: "answer for ok again" in checks.output_text(refusing), "the valid answer shows")
        with pytest.raises(AssertionError, match="a refusal is still shown after a valid setting"):
            checks.no_stale_refusal(refusing, "the appending widget")

        before = checks.signature(slow)
        handle = slow.locator(".noUi-handle")
        handle.focus()
        handle.press("ArrowRight")
        seconds, announced = checks.settled(slow, before)
        assert announced == 1 and seconds >= 3.5, (announced, seconds)
        with pytest.raises(AssertionError, match="announced about 1 s and answered after"):
            checks.wait_as_announced(seconds, announced, "the slow widget")
    finally:
        page.close()
        shut_down_kernels(lab)
        (ROOT / "build" / "browser" / "broken_widgets.ipynb").unlink(missing_ok=True)
