"""Widgets that rerun real ranks: controls -> ``launch`` -> draw the results.

``LiveRun`` follows the usual rules: controls use ``continuous_update=False``; one job at a time per
widget (a change made while a job runs waits, and only the newest waiting settings run next); a cancel
button stops the ranks; a progress bar follows the job's metric stream; settings a learner can get wrong
are refused with the launcher's one-sentence message instead of a traceback. Drawing happens in the
notebook process from the ``RunResult``; nothing is cached: every change is a new run on real ranks.
"""
from __future__ import annotations

import base64
import io
import threading
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


class LiveRun:
    """``LiveRun("workers.ch01_collectives", {"world_size": slider(...), ...}, draw)``; display it as the cell's value.

    ``draw(result, params) -> matplotlib Figure | str``; ``params`` maps names to fixed extra parameters;
    ``progress_total(params)`` (optional) gives the number of metric steps to expect.
    """

    def __init__(self, worker: str, controls: dict[str, W.ValueWidget], draw: Callable[[RunResult, dict], object],
                 *, params: dict | None = None, timeout: float = 30.0, progress_total: Callable[[dict], int] | None = None,
                 auto_start: bool = True):
        self.worker, self.controls, self.draw = worker, controls, draw
        self.fixed = dict(params or {})
        self.timeout = timeout
        self.progress_total = progress_total
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
        self.box = W.VBox([W.HBox(list(controls.values())),
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
        with self._lock:
            if self._job is not None:
                self._pending = self.settings()
                self.status.value = "<i>waiting for the run in flight...</i>"
                return
            self._start(self.settings())

    def _start(self, settings: dict) -> None:
        params = {**self.fixed, **settings}
        world_size = params.pop("world_size", 2)
        try:
            job = launch(self.worker, world_size, timeout=self.timeout, on_event=self._on_event, **params)
        except InvalidParameter as exc:
            self.status.value = f"<span style='color:#cf222e'>{exc}</span>"
            self.history.append((settings, exc))
            return
        self.idle.clear()
        self._job = job
        total = self.progress_total(params | {"world_size": world_size}) if self.progress_total else 0
        self.progress.max, self.progress.value = max(total, 1), 0
        self.progress.layout.visibility = "visible" if total else "hidden"
        self.cancel_button.disabled = False
        self.status.value = "<i>running on real ranks...</i>"
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
        try:
            result = job.wait()
            shown = self.draw(result, {**self.fixed, **settings})
            self.show(shown)
            self.status.value = f"{result.describe()}"
            self.history.append((settings, result))
        except JobCancelled:
            self.status.value = "cancelled: the ranks were stopped"
            self.history.append((settings, "cancelled"))
        except CourseError as exc:
            first = str(exc).splitlines()[0]
            self.status.value = f"<span style='color:#cf222e'>{first}</span>"
            self.history.append((settings, exc))
        except Exception as exc:  # noqa: BLE001 - a drawing bug must not wedge the widget
            self.status.value = f"<span style='color:#cf222e'>drawing failed: {type(exc).__name__}: {exc}</span>"
            self.history.append((settings, exc))
        finally:
            self.cancel_button.disabled = True
            self.progress.layout.visibility = "hidden"
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
        """Block until no job is running or waiting (for tests and headless runs)."""
        return self.idle.wait(timeout)
