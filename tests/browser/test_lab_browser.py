"""A learner's session, in a real browser on the real ``make lab`` (headless Chromium driven by Playwright).

``test_chapter_05_in_jupyterlab`` opens the learner's copy ``lab/05_attention_tp.ipynb`` (``make lab`` made it),
runs every cell with Run > Run All Cells, and uses the head-count widget, which reruns real ranks:

* every code cell ran, none printed an error, and the widget's first run came back from 4 ranks;
* moving "heads" from 8 to 7 (7 query heads cannot share 2 KV heads) shows the launcher's one-sentence message,
  no traceback, and nothing is launched; moving it back answers on the ranks Run All started (the chapter leaves
  them warm); left alone for the lab's idle time they stop by themselves, and TP 2 then starts new ones, saying so
  (and why) while they start, and draws a different figure;
* Kernel > Restart Kernel leaves none of the ranks behind;
* File > Save writes the learner's copy, and no tracked file changed: the course's notebook, its committed
  figures (Run All drew them under build/) and everything else ``git status`` watches.

``test_cancel_interrupt_and_a_crashed_rank_in_jupyterlab`` uses a scratch notebook under build/: the widget's
Cancel button stops a two-minute run and its ranks, Kernel > Interrupt Kernel stops a blocking ``cu.run`` and
its ranks, and a rank's exception is shown in the cell with that rank's traceback.

The slider-to-result latencies seen by the browser are printed and written to build/browser_check.json.
Run with ``make test-browser`` (needs Chromium; CI installs Debian's). Not part of ``make test``, which must
run on a learner's machine without a browser.
"""
from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from tests.browser.lab_ui import IDLE_S, lab_ranks, open_page, run_all, sha256, shut_down_kernels, tracked_changes
from tests.lab_server import ROOT, request

pytestmark = pytest.mark.browser
CHAPTER = "lab/05_attention_tp.ipynb"
SHIPPED = "notebooks/05_attention_tp.ipynb"
# The widget box of the chapter's LiveRun: the one with a Cancel button and a "heads" slider.
LIVE_BOX = ".widget-vbox:has(> .widget-hbox button:has-text('Cancel')):has(.widget-label:text-is('heads'))"


def status_text(box) -> str:
    return box.locator(".widget-html-content").first.inner_text()


def wait_status(page, box, predicate_js: str, timeout_s: float) -> float:
    """Seconds until the LiveRun's status line satisfies ``predicate_js`` (a JS expression over ``t``)."""
    t0 = time.perf_counter()
    handle = box.element_handle()
    page.wait_for_function(
        f"(box) => {{ const t = box.querySelector('.widget-html-content').innerText; return {predicate_js}; }}",
        arg=handle, timeout=timeout_s * 1000)
    return time.perf_counter() - t0


def test_chapter_05_in_jupyterlab(lab, browser, tmp_path):
    shipped, copy = ROOT / SHIPPED, ROOT / CHAPTER
    before, tracked_before, copy_before = sha256(shipped), tracked_changes(), sha256(copy)
    timings = {}
    page = open_page(browser, lab, CHAPTER)
    try:
        timings["run_all_s"] = run_all(page)

        prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()
        assert prompts and all(p.strip().startswith("[") and p.strip()[1:-2].isdigit() for p in prompts), (
            f"not every code cell ran: {[p for p in prompts if not p.strip()[1:-2].isdigit()]}")
        errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] "
                              ":text('Traceback')").count()
        assert errors == 0, "a cell printed a traceback"

        box = page.locator(LIVE_BOX)
        assert box.count() == 1, "the chapter's head-count widget did not render"
        first = status_text(box)
        assert "world 4" in first and "gloo" in first, first
        image = box.locator(".jp-OutputArea-output img").first
        figure_tp4 = image.get_attribute("src")

        heads = box.locator(".widget-hslider:has(.widget-label:text-is('heads')) .noUi-handle")
        heads.focus()
        page.keyboard.press("ArrowLeft")  # 8 -> 7 heads at TP 4
        timings["refusal_s"] = wait_status(page, box, "t.includes('heads=7')", 30)
        refusal = status_text(box)
        # it names the controls the learner moved (heads, KV heads), never the hidden size the widget derives
        assert "kv_heads=2" in refusal and "hidden" not in refusal and "Traceback" not in refusal, refusal
        assert len(refusal.rstrip(".").split(". ")) == 1, f"the refusal should be one sentence: {refusal!r}"

        # Back to 8: the ranks Run All started are still warm (the chapter leaves them running), so it answers at once
        page.keyboard.press("ArrowRight")
        timings["rerun_warm_s"] = wait_status(page, box, "t.includes('world 4') && t.includes('ran in')", 60)
        assert "warm ranks" in status_text(box), status_text(box)

        # Left alone for the idle time they stop by themselves; the next move starts new ones and says so, and why
        deadline = time.time() + IDLE_S + IDLE_S / 4 + 30
        while lab_ranks(lab.proc.pid) and time.time() < deadline:
            time.sleep(1)
        assert not lab_ranks(lab.proc.pid), f"the warm ranks were still running {IDLE_S} s + margin after the last run"
        tp = box.locator(".widget-hslider:has(.widget-label:text-is('TP')) .noUi-handle")
        tp.focus()
        marker = status_text(box)
        page.keyboard.press("ArrowLeft")  # TP 4 -> 3: 8 heads do not split over 3 ranks
        wait_status(page, box, "t.includes('tp=3')", 30)
        # the widget's world is the chapter's: the refusal names the ranks, not a world_size the learner never set
        assert "tp=3 does not divide the 4 ranks: choose 1, 2 or 4" in status_text(box), status_text(box)
        assert "world_size" not in status_text(box), status_text(box)
        page.keyboard.press("ArrowLeft")  # TP 2: valid, a different sharding and a different figure, on new ranks
        wait_status(page, box, "t.includes('had stopped after') && t.includes('starting 4 ranks (a cold start: about ')",
                    30)
        timings["rerun_tp2_cold_s"] = wait_status(page, box, f"t.includes('ran in') && t !== {json.dumps(marker)}", 120)
        assert "cold start" in status_text(box), status_text(box)
        image.wait_for(timeout=10_000)
        assert image.get_attribute("src") != figure_tp4, "TP 2 drew the same figure as TP 4"

        page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()  # the learner saves their copy
        page.locator(".lm-Menu-itemLabel:text-is('Save Notebook')").click()
        deadline = time.time() + 30
        while sha256(copy) == copy_before and time.time() < deadline:
            time.sleep(0.5)
        assert sha256(copy) != copy_before, f"File > Save did not write {CHAPTER}"

        ranks = lab_ranks(lab.proc.pid)
        assert len(ranks) >= 4, f"expected the warm ranks of world 4 under the kernel, found {len(ranks)}"
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
        page.locator(".lm-Menu-itemLabel:text-is('Restart Kernel…')").click()
        page.locator(".jp-Dialog-button.jp-mod-accept").click()
        page.get_by_text("Python 3 (course) | Idle").wait_for(timeout=90_000)
        _, alive = psutil.wait_procs(ranks, timeout=30)
        for p in alive:  # a failing test must not leave them behind either
            p.kill()
        assert not alive, f"ranks left after a kernel restart: {[p.pid for p in alive]}"
    except Exception:
        page.screenshot(path=str(tmp_path / "failure.png"))
        print(f"screenshot: {tmp_path / 'failure.png'}\nlab log:\n{lab.log_tail()}")
        raise
    finally:
        page.close()
        shut_down_kernels(lab)
    assert sha256(shipped) == before, f"{SHIPPED} was changed by the session"
    assert tracked_changes() == tracked_before, f"tracked files changed:\n{tracked_changes()}"
    print(json.dumps(timings))
    out = ROOT / "build" / "browser_check.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"chapter": CHAPTER, **timings}, indent=1))


SCRATCH_CELLS = [
    # 0: a LiveRun on the rank_faults worker: "sleep" keeps both ranks busy for two minutes
    "import ipywidgets as W\nimport course_utils as cu\nfrom course_utils.widgets import LiveRun\n"
    "live = LiveRun('workers.rank_faults', {'mode': W.Dropdown(options=['ok', 'sleep'], value='ok', description='mode')},\n"
    "               lambda result, params: f'{len(result.ranks)} ranks answered', params={'world_size': 2, 'seconds': 120},\n"
    "               timeout=300)\nlive",
    # 1: a blocking run that the learner interrupts with the stop button
    "cu.run('workers.rank_faults', world_size=2, mode='sleep', seconds=120, timeout=300)",
    # 2: a rank that raises
    "cu.run('workers.rank_faults', world_size=2, mode='raise', bad_rank=1, timeout=120)",
]


def scratch_notebook(lab, cells: list[str]) -> str:
    """Create build/<name>.ipynb through the server (the repository's build/ is ignored by git)."""
    path = f"build/browser_scratch_{os.getpid()}.ipynb"
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": [], "execution_count": None}
                    for c in cells],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (course)", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (ROOT / "build").mkdir(exist_ok=True)
    request(lab.url(f"api/contents/{path}"), method="PUT", body={"type": "notebook", "format": "json", "content": nb})
    return path


def code_cell(page, index: int):
    return page.locator(".jp-NotebookPanel:visible .jp-CodeCell").nth(index)


def run_cell(page, index: int) -> None:
    code_cell(page, index).locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def wait_for_ranks(lab, timeout_s: float = 60) -> list[psutil.Process]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        ranks = [p for p in lab_ranks(lab.proc.pid) if "workers.pool" in " ".join(p.cmdline())]
        if len(ranks) >= 2:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"no ranks appeared under the lab within {timeout_s} s")


def gone(ranks: list[psutil.Process], timeout_s: float = 30) -> list[int]:
    _, alive = psutil.wait_procs(ranks, timeout=timeout_s)
    for p in alive:
        p.kill()
    return [p.pid for p in alive]


def shown_text(cell) -> str:
    """What a cell shows (its last 1500 characters), or why it could not be read: for a failure's report."""
    try:
        return cell.inner_text(timeout=5_000)[-1500:]
    except Exception as exc:  # noqa: BLE001 - a report, never a second failure
        return f"(not readable: {exc})"


@pytest.mark.timeout(600)  # three runs each bounded by its own wait below (cold starts on a busy machine included)
def test_cancel_interrupt_and_a_crashed_rank_in_jupyterlab(lab, browser, tmp_path):
    """The widget's Cancel button, the toolbar's interrupt and a rank's exception, each through the real UI."""
    path = scratch_notebook(lab, SCRATCH_CELLS)
    page = open_page(browser, lab, path)
    try:
        run_cell(page, 0)
        box = page.locator(".widget-vbox:has(> .widget-hbox button:has-text('Cancel'))")
        box.wait_for(timeout=60_000)
        wait_status(page, box, "t.includes('world 2') && t.includes('ran in')", 120)
        assert "2 ranks answered" in box.locator(".jp-OutputArea-output").first.inner_text()

        box.locator("select").select_option("sleep")  # a run that would take two minutes
        wait_status(page, box, "t.includes('running on real ranks')", 30)
        ranks = wait_for_ranks(lab)
        cancel = box.locator("button:has-text('Cancel')")
        cancel.click()
        wait_status(page, box, "t.includes('cancelled')", 30)
        assert status_text(box) == "cancelled: the ranks were stopped"
        assert not gone(ranks), "the Cancel button left ranks running"
        # the widget greys the button out before it writes the status (tests/test_widgets.py holds that order); the
        # two are separate widget models, so the browser is given a moment to draw the second
        page.wait_for_function("b => b.disabled", arg=cancel.element_handle(), timeout=10_000)

        run_cell(page, 1)
        ranks = wait_for_ranks(lab)
        page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
        page.locator(".lm-Menu-itemLabel:text-is('Interrupt Kernel')").click()
        cell = code_cell(page, 1)
        cell.locator(".jp-OutputArea-output:has-text('KeyboardInterrupt')").wait_for(timeout=60_000)
        assert not gone(ranks), "interrupting the kernel left ranks running"
        page.get_by_text("Python 3 (course) | Idle").wait_for(timeout=60_000)  # as a learner sees it, before going on

        run_cell(page, 2)
        cell = code_cell(page, 2)
        error = cell.locator(".jp-OutputArea-output:has-text('was told to fail')")
        # a cold start of 2 ranks, then the failure (seconds); the run's own timeout is 120 s, so a run that hangs
        # shows its timeout before this wait ends, and the cells' outputs printed below say which it was
        error.wait_for(timeout=180_000)
        text = error.inner_text()
        assert "rank 1" in text and "ValueError: rank 1 was told to fail" in text and "rank_faults.py" in text, text[-2000:]
        page.get_by_text("Python 3 (course) | Idle").wait_for(timeout=30_000)  # the kernel survived
    except BaseException:  # pytest-timeout's Failed too
        page.screenshot(path=str(tmp_path / "failure.png"))
        outputs = [shown_text(code_cell(page, i)) for i in range(len(SCRATCH_CELLS))]
        print(f"screenshot: {tmp_path / 'failure.png'}\ncells as shown:\n" + "\n---\n".join(outputs)
              + f"\nlab log:\n{lab.log_tail()}")
        raise
    finally:
        page.close()
        shut_down_kernels(lab)
        request(lab.url(f"api/contents/{path}"), method="DELETE")
