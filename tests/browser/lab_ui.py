"""What the browser tests do in JupyterLab, as a learner would: open a chapter, Run All, move a widget, save.

Shared by ``test_lab_browser.py`` (chapter 05 in depth, Cancel, interrupt, a crashed rank) and
``test_every_chapter.py`` (every chapter once). The fixtures (one lab server and one Chromium for the whole
session) are in ``conftest.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time

import psutil
import pytest

from tests.lab_server import ROOT, get, request

SETTINGS = {
    # every cell in the DOM, so the tests can read each one's prompt and outputs
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}
# How long warm ranks may sit idle in the tests' lab before they stop by themselves (a learner's default is 600 s):
# short, so that "close the tab, and the ranks are gone after the idle time" is seen within the test.
IDLE_S = 40
# Signs that a widget is still working on the latest move (LiveRun and the sharding widget say so while busy).
BUSY = ("running on real ranks", "then running", "waiting for the run in flight", "drawing hidden",
        "this run's replaces it")  # chapter 15's explorer: "the figure below is still layout X's: this run's replaces it"


def chromium_path() -> str:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    pytest.fail("no Chromium found: install it (Debian: apt-get install chromium) or set CHROMIUM=/path/to/chrome")


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tracked_changes() -> str:
    """``git status --porcelain`` for tracked files (what a learner's ``git pull`` could conflict with)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60).stdout


def lab_ranks(lab_pid: int, kernel_pid: int | None = None) -> list[psutil.Process]:
    """Processes under the lab server (or under one kernel) that are course ranks (started through torchrun)."""
    out = []
    try:
        children = psutil.Process(kernel_pid or lab_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in children:
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "workers.pool" in cmd or "torchrun" in cmd or "torch.distributed.run" in cmd:
            out.append(p)
    return out


def kernel_pids(lab_pid: int) -> set[int]:
    """The kernels' processes under the lab server."""
    return {p.pid for p in psutil.Process(lab_pid).children(recursive=True)
            if "ipykernel_launcher" in " ".join(_cmdline(p))}


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def open_page(browser, lab, path: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(lab.url(f"lab/tree/{path}?reset"))  # ?reset: a fresh workspace, not the previous test's tabs
    page.get_by_text("Python 3 (course) | Idle").wait_for(timeout=90_000)
    return page


def menu(page, top: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=top).first.click()
    page.locator(f".lm-Menu-itemLabel:text-is('{item}')").click()


def run_all(page, timeout_s: float = 900) -> float:
    """Run > Run All Cells; seconds until every code cell has run (none waits, "[*]", and the last is numbered), or
    until a cell raised: Run All stops there, so the last cell would never be numbered (the caller's check for a
    traceback then says so at once instead of waiting out the timeout)."""
    t0 = time.perf_counter()
    menu(page, "Run", "Run All Cells")
    page.wait_for_function(
        """() => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')]
                               .map(e => e.innerText.trim());
                   const raised = [...document.querySelectorAll(
                       ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")]
                       .some(e => e.innerText.includes('Traceback'));
                   return raised || (p.length > 0 && !p.includes('[*]:') && /^\\[\\d+\\]:$/.test(p[p.length - 1])); }""",
        timeout=timeout_s * 1000)
    return time.perf_counter() - t0


def run_new_cell(page, code: str, timeout_s: float = 120) -> None:
    """Add a code cell at the end of the open notebook and run it, as a learner would type one; wait until it ran.
    (The copy under ``lab/`` is the learner's: the cell goes into it, never into ``notebooks/``.)"""
    cells = page.locator(".jp-Notebook .jp-Cell")
    cells.last.locator(".jp-InputPrompt").first.click()  # select the last cell, in command mode
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new cell below it, selected
    page.keyboard.press("Enter")  # edit it
    page.keyboard.insert_text(code)
    page.keyboard.press("Control+Enter")  # run it in place (Shift+Enter on the last cell would add another below)
    page.wait_for_function(
        """() => { const p = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
                   const last = p[p.length - 1]; return last && /^\\[\\d+\\]:$/.test(last.innerText.trim()); }""",
        timeout=timeout_s * 1000)


def save(page) -> None:
    menu(page, "File", "Save Notebook")


def shut_down_kernels(lab) -> None:
    """Close the lab's kernels through the server's API, as closing the tab and choosing Shut Down would."""
    for kernel in json.loads(get(lab.url("api/kernels"))[1]):
        request(lab.url(f"api/kernels/{kernel['id']}"), method="DELETE")
