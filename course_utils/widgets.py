"""Widgets that rerun real ranks: controls -> ``launch`` -> draw the results.

``LiveRun`` follows the usual rules: controls use ``continuous_update=False``; one job at a time per
widget (a change made while a job runs waits, and only the newest waiting settings run next); a cancel
button stops the ranks; a progress bar follows the job's metric stream; settings a learner can get wrong
are refused with the launcher's one-sentence message instead of a traceback. Drawing happens in the
notebook process from the ``RunResult``; nothing is cached: every change is a new run on real ranks.

While a run is pending the status line says what it waits for: warm ranks, or a cold start with the time it
is expected to take until the answer, the worker's first run on the new ranks included (``Job.start_note``: new ranks,
or ranks that had stopped after sitting idle; ``launcher.expected_cold_s``). The controls
wrap onto more rows at a narrow width instead of squeezing each other (a slider keeps room for its label and
its track).
"""
from __future__ import annotations

import base64
import io
import json
import os
import statistics
import threading
import time
from typing import Callable

import ipywidgets as W

from course_utils.launcher import launch
from course_utils.results import CourseError, InvalidParameter, JobCancelled, RunResult


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def slider(description: str, value: int, lo: int, hi: int, step: int = 1) -> W.IntSlider:
    return W.IntSlider(value=value, min=lo, max=hi, step=step, description=description,
                       continuous_update=False, style={"description_width": "initial"})


def controls_row(controls) -> W.HBox:
    """The controls on one row that wraps: none shrinks below its natural width, and a slider whose label is as
    wide as its text gets a width that leaves its track about 160 px (ipywidgets' fixed 300 px would leave a long
    label's slider a few pixels of track)."""
    for control in controls:
        control.layout.flex = "0 0 auto"
        if isinstance(control, (W.IntSlider, W.FloatSlider, W.SelectionSlider, W.FloatLogSlider)) \
                and control.style.description_width == "initial" and not control.layout.width:
            control.layout.width = f"{max(300, 7 * len(control.description) + 230)}px"
    return W.HBox(list(controls), layout=W.Layout(flex_flow="row wrap", align_items="center"))


class LiveRun:
    """``LiveRun("workers.ch01_collectives", {"world_size": slider(...), ...}, draw)``; display it as the cell's value.

    ``draw(result, params) -> matplotlib Figure | str``; ``params`` maps names to fixed extra parameters;
    ``progress_total(params)`` (optional) gives the number of metric steps to expect. ``derive(settings) -> dict``
    (optional) computes parameters from the controls' values (a hidden size that follows the head count), so a
    refusal never names a fixed value the learner cannot see or change; ``applies`` maps a control's name to
    ``settings -> bool``: where it is False the control is greyed out (an op for a collective that reduces
    nothing). ``announce(params, job) -> str`` (optional) words a cold start's wait itself, for a run that waits for
    more than starting the ranks and running the worker once (a run that torchrun restarts after a fault).
    """

    def __init__(self, worker: str, controls: dict[str, W.ValueWidget], draw: Callable[[RunResult, dict], object],
                 *, params: dict | None = None, timeout: float = 30.0, progress_total: Callable[[dict], int] | None = None,
                 derive: Callable[[dict], dict] | None = None, applies: dict[str, Callable[[dict], bool]] | None = None,
                 auto_start: bool = True, announce: Callable[[dict, object], str] | None = None):
        self.worker, self.controls, self.draw = worker, controls, draw
        self.fixed = dict(params or {})
        self.timeout = timeout
        self.progress_total = progress_total
        self.derive = derive
        self.applies = dict(applies or {})
        self.announce = announce
        self.out = W.Output()
        self.status = W.HTML()
        self.cancel_button = W.Button(description="Cancel", icon="stop", disabled=True)
        self.progress = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="200px", visibility="hidden"))
        self.cancel_button.on_click(lambda _: self.cancel())
        self._lock = threading.Lock()
        self._job = None
        self._pending: dict | None = None
        self.history: list[tuple[dict, object]] = []  # (settings, RunResult or exception), newest last
        self.idle = threading.Event()
        self.idle.set()
        for control in controls.values():
            control.observe(lambda _change: self.request(), names="value")
        self.box = W.VBox([controls_row(controls.values()),
                           W.HBox([self.cancel_button, self.progress, self.status]), self.out])
        if auto_start:
            self.request()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.box)

    def settings(self) -> dict:
        return {name: c.value for name, c in self.controls.items()}

    def request(self) -> None:
        """Run with the controls' current values now, or right after the job in flight."""
        settings = self.settings()
        for name, applies in self.applies.items():
            self.controls[name].disabled = not applies(settings)
        with self._lock:
            if self._job is not None:
                self._pending = self.settings()
                self.status.value = "<i>waiting for the run in flight...</i>"
                return
            self._start(self.settings())

    def _start(self, settings: dict) -> None:
        params = {**self.fixed, **settings, **(self.derive(settings) if self.derive else {})}
        world_size = params.pop("world_size", 2)
        try:
            job = launch(self.worker, world_size, timeout=self.timeout, on_event=self._on_event, **params)
        except InvalidParameter as exc:
            # the refusal answers these settings: the figure of earlier ones goes, so nothing shown belongs to others
            self.show(None)
            self.status.value = f"<span class='course-refusal' style='color:#cf222e'>{exc}</span>"
            self.history.append((settings, exc))
            return
        self.idle.clear()
        self._job = job
        total = self.progress_total(params | {"world_size": world_size}) if self.progress_total else 0
        self.progress.max, self.progress.value = max(total, 1), 0
        self.progress.layout.visibility = "visible" if total else "hidden"
        self.cancel_button.disabled = False
        # A cold start's note already counts the run itself (the worker's first run on new ranks): one number to wait.
        note = self.announce(params | {"world_size": world_size}, job) if job.cold and self.announce else \
            job.start_note
        self.status.value = (f"<i>{note}: running on real ranks...</i>" if job.cold
                             else "<i>running on real ranks (warm)...</i>")
        threading.Thread(target=self._finish, args=(job, settings), daemon=True).start()

    def show(self, shown) -> None:
        """Replace the output in one step (no flicker, and no kernel needed, so tests see it too)."""
        if isinstance(shown, str):
            outputs = ({"output_type": "stream", "name": "stdout", "text": shown + "\n"},)
        elif shown is not None:
            png = base64.b64encode(figure_png(shown)).decode("ascii")
            outputs = ({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": png, "text/plain": "<figure>"}},)
        else:
            outputs = ()
        self.out.outputs = outputs

    def _on_event(self, kind: str, rank: int, data: dict) -> None:
        if kind == "metric" and rank == 0:
            self.progress.value = min(self.progress.value + 1, self.progress.max)

    def _finish(self, job, settings: dict) -> None:
        # The status line is set last, after the Cancel button is greyed out and the progress bar hidden: a learner
        # (or a browser test) who reads "cancelled" or "ran in" must find the button already disabled.
        status, outcome = None, None
        try:
            result = job.wait()
            shown = self.draw(result, {**self.fixed, **settings, **(self.derive(settings) if self.derive else {})})
            self.show(shown)
            status, outcome = result.describe(), result
        except JobCancelled:
            status, outcome = "cancelled: the ranks were stopped", "cancelled"
        except CourseError as exc:
            first = str(exc).splitlines()[0]
            status, outcome = f"<span style='color:#cf222e'>{first}</span>", exc
        except Exception as exc:  # noqa: BLE001 - a drawing bug must not wedge the widget
            status, outcome = f"<span style='color:#cf222e'>drawing failed: {type(exc).__name__}: {exc}</span>", exc
        finally:
            self.cancel_button.disabled = True
            self.progress.layout.visibility = "hidden"
            if status is not None:
                self.status.value = status
                self.history.append((settings, outcome))
            with self._lock:
                self._job = None
                pending, self._pending = self._pending, None
                if pending is not None:
                    self._start(pending)
                if self._job is None:
                    self.idle.set()

    def cancel(self) -> None:
        with self._lock:
            job, self._pending = self._job, None
        if job is not None:
            job.cancel()

    def wait(self, timeout: float = 120) -> bool:
        """Block until no job is running or waiting (for tests and headless runs).

        Under ``make bench`` (``COURSE_WIDGET_BENCH`` names a file) the first wait also measures this widget as a
        learner meets it (``measure``) and appends the numbers to that file, so every chapter's widget is timed
        with the chapter's own settings."""
        ok = self.idle.wait(timeout)
        if ok and os.environ.get("COURSE_WIDGET_BENCH") and not getattr(self, "_measured", False):
            self._measured = True
            record = {"chapter": os.environ.get("COURSE_BENCH_CHAPTER", ""), **self.measure()}
            with open(os.environ["COURSE_WIDGET_BENCH"], "a") as f:
                f.write(json.dumps(record) + "\n")
        return ok

    def _alternatives(self):
        """(control name, another value) pairs, in the order of the controls: what a learner's first move could be."""
        for name, control in self.controls.items():
            if control.disabled:
                continue
            if hasattr(control, "options"):
                values = [o[1] if isinstance(o, tuple) else o for o in control.options]
                yield from ((name, v) for v in values if v != control.value)
            elif isinstance(control.value, bool):
                yield name, not control.value
            elif hasattr(control, "step"):
                for v in (control.value + control.step, control.value - control.step):
                    if control.min <= v <= control.max:
                        yield name, v

    def _settle(self, timeout: float = 600):
        if not self.idle.wait(timeout):
            raise RuntimeError(f"{self.worker}: no answer within {timeout:.0f} s: {self.status.value}")
        return self.history[-1][1] if self.history else None

    def measure(self, changes: int = 3) -> dict:
        """What a learner waits for, from a control moved to the new figure drawn: on warm ranks (the median of
        ``changes`` moves of the first control whose other value runs), and once cold (every warm rank stopped
        first, then the same settings again, with the seconds its status line announced for it). Restores the controls
        it moved; CPU wall times of this machine."""
        from course_utils.launcher import shutdown_pools

        started = time.perf_counter()
        self._settle()
        moved = None
        for name, value in list(self._alternatives())[:8]:
            before = self.controls[name].value
            self.controls[name].value = value
            if isinstance(self._settle(), RunResult):
                moved = (name, before, value)
                break
            self.controls[name].value = before  # refused or failed: put it back, try the next move
            self._settle()
        if moved is None:
            return {"worker": self.worker, "error": "no control move ran"}
        name, before, after = moved
        warm = []
        for value in ([before, after, before] * changes)[:changes]:
            t0 = time.perf_counter()
            self.controls[name].value = value
            outcome = self._settle()
            if isinstance(outcome, RunResult) and outcome.launch == "warm":
                warm.append(time.perf_counter() - t0)
        if self.controls[name].value != before:
            self.controls[name].value = before
            self._settle()
        shutdown_pools()
        t0 = time.perf_counter()
        self.request()
        announced = getattr(self._job, "expected_s", None)  # what the status line promised for this cold start
        outcome = self._settle()
        cold = time.perf_counter() - t0
        world = outcome.world_size if isinstance(outcome, RunResult) else None
        return {"worker": self.worker, "control": name, "world_size": world,
                "warm_median_s": statistics.median(warm) if warm else None, "warm_max_s": max(warm) if warm else None,
                "cold_s": cold if isinstance(outcome, RunResult) and outcome.launch == "cold" else None,
                "cold_startup_s": outcome.startup_seconds if isinstance(outcome, RunResult) else None,
                "cold_announced_s": announced,
                "measure_s": time.perf_counter() - started}
