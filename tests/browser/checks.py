"""What the browser tests hold every chapter's page to, one function per failure a learner would see.

Each check raises ``AssertionError`` with one sentence; ``test_checks_catch.py`` shows each one failing on a
deliberately broken notebook, so a check that could not fail would be noticed.

* ``page_text``: no raw widget repr (what JupyterLab shows for a stored widget output before its cell runs) and no
  word meant for the course's builders in any output or markdown a learner reads (``tests/notebook_text.py``);
* ``figure_shown``: a widget or a cell that promises a figure shows a loaded image (under ``make lab``'s Agg
  backend, ``plt.show()`` inside a widget shows nothing though its text changed);
* ``no_stale_refusal``: after a valid setting no refusal is left on the widget, and while a refusal is shown no
  figure of earlier settings is shown unmarked;
* ``wait_as_announced``: a widget that announced a wait ("a cold start: about N s") answered within 1.5 N;
* ``lines_wrap_at_words``: printed output (tables, summaries, progress lines) wraps at spaces, not inside a word or
  a number (JupyterLab's own rule breaks them anywhere; ``plots.style()`` replaces it).
"""
from __future__ import annotations

import re
import time

from tests.browser.lab_ui import BUSY
from tests.notebook_text import WIDGET_REPR, builder_words

# What a widget shows when it is broken rather than answering: a drawing that raised, a rank's exception, a run
# that timed out (a refusal is an answer: one sentence about the settings).
BROKEN = ("drawing failed", "Traceback", " raised ", "timed out", "Error: ")
# A cell output with controls in it: one widget as the learner sees it.
WIDGET = (".jp-CodeCell .jp-OutputArea-output:has(.widget-hslider, .widget-dropdown, .widget-toggle-buttons, "
          ".widget-checkbox)")
# A drawn figure inside a widget: an image in one of its output areas (matplotlib's PNG; a canvas or an svg for
# other renderers) or an Image widget.
FIGURE = ".widget-output img, .widget-output canvas, .widget-output svg, img.widget-image"
# A refusal as the widgets show it: the launcher's one-sentence refusal in the status line (red), or "cannot run:"
REFUSAL = ("cannot run:", "refused")
REFUSAL_CSS = "[style*='cf222e'], .course-refusal"
# A figure shown beside a refusal must say it belongs to earlier settings
STALE = "earlier settings"
# "starting 4 ranks (a cold start: about 6 s, ...)": the wait a widget announces
ANNOUNCED = re.compile(r"about (\d+(?:\.\d+)?) s\b")
WAIT_SLACK = 1.5


def signature(widget) -> str:
    """What a move must change: the widget's status lines and outputs (verdicts, refusals, figures), not the
    controls' own labels and read-outs, which change at once."""
    texts = widget.locator(".widget-html-content, .widget-output").all_inner_texts()
    # in one call: an image that a refusal takes off the page between listing and reading it must not stall us
    images = widget.locator("img").evaluate_all("els => els.map(e => e.getAttribute('src') || '')")
    return "|".join(texts) + "|" + "|".join(str(hash(src)) for src in images)


def widget_text(widget) -> str:
    return "\n".join(widget.locator(".widget-html-content, .widget-output").all_inner_texts())


def output_text(widget) -> str:
    return "\n".join(widget.locator(".widget-output").all_inner_texts())


def settled(widget, before: str, timeout_s: float = 240) -> tuple[float, float | None]:
    """Seconds until the widget's output differs from ``before`` and nothing in it says it is still busy, and the
    wait it announced meanwhile (seconds, or None when it announced none)."""
    t0 = time.perf_counter()
    announced = None
    while time.perf_counter() - t0 < timeout_s:
        now = signature(widget)
        said = ANNOUNCED.search(widget_text(widget)) if any(b in now for b in BUSY) else None
        if said and announced is None:
            announced = float(said.group(1))
        if (now != before or any(b in now for b in BROKEN)) and not any(b in now for b in BUSY):
            return time.perf_counter() - t0, announced
        time.sleep(0.25)
    raise AssertionError(f"the widget did not answer within {timeout_s:.0f} s: {widget.inner_text()[:300]!r}")


def figures_shown(widget) -> int:
    """Figures the widget's outputs show now: loaded images (a broken or empty image does not count), canvases,
    svgs."""
    return widget.locator(FIGURE).evaluate_all(
        "els => els.filter(e => e.tagName !== 'IMG' || (e.complete && e.naturalWidth > 0)).length")


def wait_until(condition, what: str, timeout_s: float = 30) -> float:
    t0 = time.perf_counter()
    while not condition():
        if time.perf_counter() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)
    return time.perf_counter() - t0


def refusal_shown(widget) -> bool:
    return widget.locator(REFUSAL_CSS).count() > 0 or any(r in widget_text(widget) for r in REFUSAL)


# -- the checks ---------------------------------------------------------------------------------------------------

def figure_shown(widget, what: str, timeout_s: float = 10) -> None:
    """A widget that promises a figure shows one (the image arrives with the output: a moment to decode it)."""
    try:
        wait_until(lambda: figures_shown(widget) > 0, what, timeout_s=timeout_s)
    except AssertionError:
        raise AssertionError(f"{what} promises a figure and shows none: {output_text(widget)[:300]!r}") from None


def no_stale_refusal(widget, what: str) -> None:
    """Now that the settings are valid, nothing on the widget may still say they were refused."""
    if refusal_shown(widget):
        raise AssertionError(f"{what}: a refusal is still shown after a valid setting: {widget_text(widget)[:300]!r}")


def refusal_alone(widget, what: str) -> None:
    """While a refusal is shown, no figure of the earlier settings is shown as if it answered this one."""
    if figures_shown(widget) and STALE not in widget_text(widget):
        raise AssertionError(f"{what}: the refusal left the earlier settings' figure on the page, unmarked")


def wait_as_announced(seconds: float, announced: float | None, what: str) -> None:
    """A wait the widget announced ("about N s") is not exceeded by more than half."""
    if announced is not None and seconds > WAIT_SLACK * max(announced, 1.0):
        raise AssertionError(f"{what} announced about {announced:g} s and answered after {seconds:.1f} s "
                             f"(more than {WAIT_SLACK:g} times the announced wait)")


def page_text(page, what: str) -> None:
    """No raw widget repr and no builder's words in what the page shows (outputs and rendered markdown)."""
    outputs = page.locator(".jp-OutputArea-output").all_inner_texts()
    reprs = [t[:80] for t in outputs if WIDGET_REPR.search(t)]
    if reprs:
        raise AssertionError(f"{what}: a raw widget repr is shown where a widget belongs: {reprs[0]!r}")
    prose = page.locator(".jp-MarkdownOutput").all_inner_texts()
    words = [w for text in outputs + prose for w in builder_words(text)]
    if words:
        raise AssertionError(f"{what}: words meant for the course's builders: {words[0]}")


def cell_figures_shown(page, cells: list[int], what: str) -> None:
    """Each code cell (by index among code cells) that saves a figure shows it as a loaded image."""
    code = page.locator(".jp-CodeCell")
    missing = []
    for i in cells:
        images = code.nth(i).locator(".jp-OutputArea-output img")
        loaded = images.evaluate_all("els => els.filter(e => e.complete && e.naturalWidth > 0).length")
        if not loaded:
            missing.append(i)
    if missing:
        raise AssertionError(f"{what}: code cell(s) {missing} draw a figure and show none on the page")


def lines_wrap_at_words(page, what: str) -> None:
    """Printed output wraps at spaces: no output's text is set to break inside words (JupyterLab's default)."""
    breaking = page.locator(".jp-OutputArea-output pre").evaluate_all(
        "els => els.filter(e => getComputedStyle(e).wordBreak === 'break-all').length")
    if breaking:
        raise AssertionError(f"{what}: {breaking} printed output(s) wrap inside words (word-break: break-all)")
