"""Every chapter, as a learner meets it in ``make lab``: open the copy in ``lab/``, Run All, move every widget, answer
one exercise wrong, save, close the tab.

For each chapter, in one lab session (``conftest.py``), in the headless Chromium:

* Run > Run All Cells runs every code cell, and no cell prints a traceback;
* every widget (each cell output that holds controls) has its first control that is not greyed out moved once,
  and its output changes (a new figure, a new verdict or a one-sentence refusal) with nothing left saying it is
  busy and nothing saying it broke (a drawing that raised, a rank's exception, a timeout); a widget that promises
  a figure (``FIGURES``, read from the chapter's source) shows one after the move, a loaded image in its output
  (a widget whose figure never reaches the page, as ``plt.show()`` under ``make lab``'s Agg did, fails here even
  though its text changed); chapter 00's planner is then refused (its GPU count) and set back: the refusal replaces
  the figure, and the valid setting's figure replaces the refusal; a screenshot of each is saved under
  ``build/browser/`` for review;
* one exercise (the first with a wrong answer in ``tests/wrong_answers/``) gets that wrong answer typed into its
  cell; running the cell and its check shows the check's reason for it;
* File > Save writes the learner's copy; the tab is closed (the kernel keeps running, as after closing a tab);
  the chapter's ranks are then gone within the lab's idle time (``lab_ui.IDLE_S``) plus the reaper's period.

Finally no tracked file changed (``git status --porcelain``): figures went under ``build/``, notebooks into
``lab/``. Per chapter, Run All's seconds and each widget's seconds to answer are written to
``build/browser/every_chapter.json``.
"""
from __future__ import annotations

import inspect
import json
import re
import time

import pytest

from course_utils.exercises import exercises
from tests.browser.lab_ui import (BUSY, IDLE_S, kernel_pids, lab_ranks, open_page, run_all, save, shut_down_kernels,
                                  tracked_changes)
from tests.exercise_sources import wrong_answers
from tests.lab_server import ROOT, get, request

pytestmark = pytest.mark.browser
CHAPTERS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
OUT = ROOT / "build" / "browser"
REPORT: dict[str, dict] = {}
CLOSED: list[tuple[str, int, float]] = []  # (chapter, kernel pid, when its tab closed)
# What a widget shows when it is broken rather than answering: a drawing that raised, a rank's exception, a run
# that timed out (a refusal is an answer: one sentence about the settings).
BROKEN = ("drawing failed", "Traceback", " raised ", "timed out", "Error: ")
# A cell output with controls in it: one widget as the learner sees it.
WIDGET = (".jp-CodeCell .jp-OutputArea-output:has(.widget-hslider, .widget-dropdown, .widget-toggle-buttons, "
          ".widget-checkbox)")
# A drawn figure inside a widget: an image in one of its output areas (matplotlib's PNG; a canvas or an svg for
# other renderers) or an Image widget.
FIGURE = ".widget-output img, .widget-output canvas, .widget-output svg, img.widget-image"


# What makes a control in a chapter's source, and what makes a widget that draws a figure: ``LiveRun`` (its draw
# returns a figure) and every subclass of it in course_utils, the sharding, tile-walk and planner widgets, and an
# ``Image`` widget that a callback fills with a figure's PNG. A widget that only prints (chapter 10's alpha-beta
# model) promises no figure.
CONTROL = re.compile(r"\b(slider|W\.(IntSlider|FloatSlider|FloatLogSlider|SelectionSlider|Dropdown|ToggleButtons|"
                     r"Checkbox))\(")
LIVE_RUNS = {"LiveRun", *re.findall(r"^class (\w+)\(LiveRun\)", "\n".join(
    p.read_text() for p in sorted((ROOT / "course_utils").glob("*.py"))), flags=re.M)}
FIGURE_MAKER = re.compile(r"\b(" + "|".join(sorted(LIVE_RUNS | {"ShardingWidget", "sharding_widget", "tile_walk_widget",
                                                                "planner_widget"})) + r")\(|\bW\.Image\(")


def widget_cells(chapter: str) -> list[str]:
    """The code cells of a chapter's source (notebooks/src) that make a control, in order: one widget each on the
    page (a cell that makes controls displays them)."""
    source = (ROOT / "notebooks" / "src" / chapter.replace(".ipynb", ".py")).read_text()
    cells = re.split(r"^# %%.*$", source, flags=re.M)
    kinds = re.findall(r"^# %%(.*)$", source, flags=re.M)
    code = ["\n".join(line.split("#")[0] for line in cell.splitlines())
            for kind, cell in zip(kinds, cells[1:]) if "[markdown]" not in kind]
    return [cell for cell in code if CONTROL.search(cell) or FIGURE_MAKER.search(cell)]


# chapter -> one entry per widget on its page, in order: does it promise a figure?
FIGURES = {chapter: tuple(bool(FIGURE_MAKER.search(cell)) for cell in widget_cells(chapter)) for chapter in CHAPTERS}


@pytest.fixture(scope="module")
def session_start(lab):
    OUT.mkdir(parents=True, exist_ok=True)
    return {"tracked": tracked_changes()}


def signature(widget) -> str:
    """What a move must change: the widget's status lines and outputs (verdicts, refusals, figures), not the
    controls' own labels and read-outs, which change at once."""
    texts = widget.locator(".widget-html-content, .widget-output").all_inner_texts()
    images = [img.get_attribute("src") or "" for img in widget.locator("img").all()]
    return "|".join(texts) + "|" + "|".join(str(hash(src)) for src in images)


def move_first_control(widget) -> str:
    """Move the first control a learner can use; return what was moved."""
    for slider in widget.locator(".widget-hslider").all():
        handle = slider.locator(".noUi-handle")
        if handle.count() == 0 or slider.locator("[disabled]").count() or "disabled" in (slider.get_attribute("class") or ""):
            continue
        now, top = float(handle.get_attribute("aria-valuenow")), float(handle.get_attribute("aria-valuemax"))
        handle.focus()
        handle.press("ArrowLeft" if now >= top else "ArrowRight")
        return f"slider {slider.locator('.widget-label').first.inner_text()!r}"
    for select in widget.locator(".widget-dropdown select").all():
        if select.is_disabled():
            continue
        n = select.locator("option").count()
        if n < 2:
            continue
        index = select.evaluate("s => s.selectedIndex")
        select.select_option(index=(index + 1) % n)
        return f"dropdown -> option {(index + 1) % n}"
    for group in widget.locator(".widget-toggle-buttons").all():
        buttons = [b for b in group.locator("button:not(.mod-active)").all() if not b.is_disabled()]
        if buttons:
            buttons[0].click()
            return f"toggle -> {buttons[0].inner_text()!r}"
    for box in widget.locator(".widget-checkbox input[type=checkbox]").all():
        if not box.is_disabled():
            box.click()
            return "checkbox"
    raise AssertionError(f"no control to move in a widget: {widget.inner_text()[:200]!r}")


def settled(widget, before: str, timeout_s: float = 240) -> float:
    """Seconds until the widget's output differs from ``before`` and nothing in it says it is still busy."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        now = signature(widget)
        if (now != before or any(b in now for b in BROKEN)) and not any(b in now for b in BUSY):
            return time.perf_counter() - t0
        time.sleep(0.25)
    raise AssertionError(f"the widget did not answer within {timeout_s:.0f} s: {widget.inner_text()[:300]!r}")


def figures_shown(widget) -> int:
    """Figures the widget's outputs show now: loaded images (a broken or empty image does not count), canvases,
    svgs."""
    return widget.locator(FIGURE).evaluate_all(
        "els => els.filter(e => e.tagName !== 'IMG' || (e.complete && e.naturalWidth > 0)).length")


def output_text(widget) -> str:
    return "\n".join(widget.locator(".widget-output").all_inner_texts())


def wait_until(condition, what: str, timeout_s: float = 30) -> float:
    t0 = time.perf_counter()
    while not condition():
        if time.perf_counter() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)
    return time.perf_counter() - t0


def planner_refusal_then_valid(widget) -> dict:
    """Chapter 00's planner: a GPU count that the layout does not divide is refused, and the refusal replaces the
    figure and the summary; the valid count again draws a figure, and no refusal is left above it."""
    gpus = widget.locator(".widget-dropdown:has(> .widget-label:text-is('GPUs')) select")
    valid = gpus.evaluate("s => s.options[s.selectedIndex].text")
    gpus.select_option(label="8")  # tp 8 x pp 4 = 32 does not divide 8 GPUs
    refused_s = wait_until(lambda: "cannot run: " in output_text(widget), "the planner refused 8 GPUs")
    refusal = output_text(widget)
    assert "does not divide" in refusal and "memory per GPU" not in refusal, f"the summary stayed: {refusal!r}"
    assert figures_shown(widget) == 0, "the refusal left the previous setting's figure on the page"
    gpus.select_option(label=valid)
    valid_s = wait_until(lambda: figures_shown(widget) > 0 and "cannot run" not in output_text(widget),
                         f"{valid} GPUs again: a figure, and the refusal gone: {output_text(widget)[:300]!r}")
    assert figures_shown(widget) == 1, f"{figures_shown(widget)} figures after one valid setting"
    return {"refusal_s": round(refused_s, 2), "valid_again_s": round(valid_s, 2)}


# (chapter, widget index) -> what else to do with that widget after its first move
FURTHER = {("00_overview.ipynb", 0): planner_refusal_then_valid}


def answer_wrong(page, chapter: str) -> dict:
    """Type the chapter's first wrong answer into its exercise cell, run it and its check; return what was shown."""
    number = chapter[:2]
    catalogue = {e.name: e for e in exercises() if e.chapter == number}
    name, fn, fragment = wrong_answers(number)[0]
    function = catalogue[name].function
    source = re.sub(rf"^def {fn.__name__}\(", f"def {function}(", inspect.getsource(fn), count=1, flags=re.M)
    cells = page.locator(".jp-CodeCell")
    index = next(i for i in range(cells.count())
                 if f"def {function}(" in cells.nth(i).locator(".jp-InputArea-editor").inner_text())
    editor = cells.nth(index).locator(".jp-InputArea-editor")
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(source)  # as pasted: no auto-indent, no auto-closed brackets
    page.keyboard.press("Shift+Enter")  # the answer; the check cell below is selected
    check = cells.nth(index + 1)
    before = check.locator(".jp-OutputArea").inner_text()
    page.keyboard.press("Shift+Enter")
    t0 = time.perf_counter()
    deadline = t0 + 600
    while time.perf_counter() < deadline:
        shown = check.locator(".jp-OutputArea").inner_text()
        if shown != before and fragment in shown:
            return {"exercise": name, "answer": fn.__name__, "seconds": time.perf_counter() - t0}
        time.sleep(0.5)
    raise AssertionError(f"{chapter}: the check of {name} did not show {fragment!r} for {fn.__name__}: {shown[-800:]!r}")


def shut_down_kernel_of(lab, path: str) -> None:
    for session in json.loads(get(lab.url("api/sessions"))[1]):
        if session["path"] == path:
            request(lab.url(f"api/kernels/{session['kernel']['id']}"), method="DELETE")


def ranks_gone_after_idle(lab, closed: list[tuple[str, int, float]]) -> list[str]:
    """Chapters whose ranks are still running later than the idle time (plus the reaper's period and a stop)
    after their tab closed."""
    late = []
    for chapter, kernel, when in closed:
        deadline = when + IDLE_S + IDLE_S / 4 + 30
        while lab_ranks(lab.proc.pid, kernel) and time.time() < deadline:
            time.sleep(1)
        left = lab_ranks(lab.proc.pid, kernel)
        if left:
            late.append(f"{chapter}: {len(left)} rank process(es) {IDLE_S} s + margin after its tab closed")
            for p in left:
                p.kill()
    return late


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_in_jupyterlab(lab, browser, session_start, chapter):
    kernels_before = kernel_pids(lab.proc.pid)
    page = open_page(browser, lab, f"lab/{chapter}")
    report = REPORT.setdefault(chapter, {"widgets": []})
    try:
        report["run_all_s"] = run_all(page)
        tracebacks = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] "
                                  ":text('Traceback')").count()
        assert tracebacks == 0, f"{chapter}: a cell printed a traceback"

        widgets = page.locator(WIDGET)
        promised = FIGURES[chapter]
        assert widgets.count() == len(promised), (
            f"{chapter}: {widgets.count()} widgets on the page, {len(promised)} in its source ({promised})")
        for i in range(widgets.count()):
            widget = widgets.nth(i)
            widget.scroll_into_view_if_needed()
            before = signature(widget)
            assert not any(b in before for b in BUSY), f"{chapter} widget {i} still busy after Run All: {before[:300]!r}"
            assert not any(b in before for b in BROKEN), f"{chapter} widget {i} broken after Run All: {before[:400]!r}"
            moved = move_first_control(widget)
            seconds = settled(widget, before)
            widget.screenshot(path=str(OUT / f"{chapter[:-6]}_widget{i}.png"))
            shown = signature(widget)
            assert not any(b in shown for b in BROKEN), f"{chapter} widget {i} after {moved}: {shown[:400]!r}"
            entry = {"moved": moved, "seconds": round(seconds, 2)}
            if promised[i]:  # the image arrives with the output; give the browser a moment to decode it
                wait_until(lambda: figures_shown(widget) > 0,
                           f"{chapter} widget {i} promises a figure; after {moved} it shows none: "
                           f"{output_text(widget)[:300]!r}", timeout_s=10)
            if (chapter, i) in FURTHER:
                entry.update(FURTHER[chapter, i](widget))
            report["widgets"].append(entry)

        if wrong_answers(chapter[:2]):
            report["exercise"] = answer_wrong(page, chapter)
        save(page)
        kernel = next(iter(kernel_pids(lab.proc.pid) - kernels_before), None)
        assert kernel is not None, f"{chapter}: no kernel of its own"
    except Exception:
        page.screenshot(path=str(OUT / f"{chapter[:-6]}_failure.png"))
        print(f"screenshot: {OUT / (chapter[:-6] + '_failure.png')}\nlab log:\n{lab.log_tail()}")
        page.close()
        shut_down_kernels(lab)
        raise
    page.close()  # the tab closes; its kernel, and any ranks the widgets started, keep running
    CLOSED.append((chapter, kernel, time.time()))
    # Earlier chapters' ranks should be gone by now or soon: check them, then let their kernels go (memory).
    done = [c for c in CLOSED if time.time() - c[2] > IDLE_S + IDLE_S / 4 + 30]
    late = ranks_gone_after_idle(lab, done)
    for c in done:
        CLOSED.remove(c)
        shut_down_kernel_of(lab, f"lab/{c[0]}")
    assert not late, late
    print(json.dumps({chapter: report}), flush=True)


def test_every_closed_chapter_lost_its_ranks_and_no_tracked_file_changed(lab, session_start):
    late = ranks_gone_after_idle(lab, CLOSED)
    shut_down_kernels(lab)
    (OUT / "every_chapter.json").write_text(json.dumps(REPORT, indent=1))
    assert not late, late
    assert tracked_changes() == session_start["tracked"], f"tracked files changed:\n{tracked_changes()}"
    assert len(REPORT) == len(CHAPTERS)
