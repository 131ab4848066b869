"""Graded exercises: ``check("ring_all_reduce", ring_all_reduce)`` right after the learner's cell.

An exercise is checked either on real ranks (``worker``: a rank-side checker module whose
``main(ctx, exercise, answer)`` runs the learner's function, shipped as source, against a reference and
returns ``{"status": "pass" | "fail" | "todo", "message": ...}`` per rank), or in the notebook process
(``local``: a function ``(answer) -> (status, message)``) for pure formulas.

``check`` never raises: a missing answer (the shipped stub raises NotImplementedError) scores zero with
"not attempted yet"; a crash or a hang inside the learner's code becomes a failing verdict that quotes the
rank's error. When ``COURSE_GRADE_LOG`` names a file, every verdict is appended to it as a JSON line:
that is how the batch grader (``course_utils.grade``) collects scores.
"""
from __future__ import annotations

import re

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from course_utils.results import CourseError, JobTimeout, WorkerFailed

PASS, FAIL, TODO = "pass", "fail", "todo"

# The classes of input a check can try. Every exercise says, for each class, what its check tries there (the inputs
# and the property it then verifies) or why the class does not apply to it, starting with NOT_APPLICABLE. A class a
# check tries has at least one plausible wrong answer in tests/wrong_answers/ that only that class catches
# (``tests.wrong_answers.tries``); ``tests/test_exercise_coverage.py`` keeps both, and ``docs/EXERCISES.md`` is the
# table (``python -m course_utils.exercises table``).
INPUT_CLASSES = {
    "non-finite": "an answer that returns NaN or infinity fails: every comparison is written so that NaN fails it",
    "order": "gradients arriving out of their listed order, and accumulating into a .grad that already holds one",
    "sizes": "sizes that divide the ranks evenly and sizes that do not (padding, remainders)",
    "ragged": "ragged and empty partitions: a rank, bucket or micro-batch with fewer items than the others, or none",
    "layouts": "more than one layout or shape, so that a rule true of only one (dp = m, world 2) fails",
    "traffic": "which collective ran and how many bytes it moved, not only the result",
    "mutation": "the answer leaves its inputs as they were",
    "output": "the device and dtype (and length) of what the answer returns",
    "memory": "memory really released: the tensors' own storage, not only a view or a buffer",
    "bits": "bits, not values: -0.0 against 0.0, one flipped low mantissa bit",
}
NOT_APPLICABLE = "not applicable: "
NOT_GRADED = "not graded"  # a failing verdict that says nothing about the answer (its ranks never started)


@dataclass(frozen=True)
class Exercise:
    name: str
    chapter: str  # "01", "02", ...
    function: str  # the name the learner's function must have in the notebook
    title: str
    points: int = 1
    worker: str | None = None  # rank-side checker module
    world_sizes: tuple[int, ...] = (2, 4)
    local: Callable | None = None  # notebook-side checker: answer -> (status, message)
    timeout_s: float = 30.0
    params: dict = field(default_factory=dict)
    # {input class: what the check tries there, or NOT_APPLICABLE + why}: one entry per INPUT_CLASSES key
    tries: dict = field(default_factory=dict)

    def applies(self, input_class: str) -> bool:
        return not self.tries.get(input_class, NOT_APPLICABLE).startswith(NOT_APPLICABLE)


REGISTRY: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    if exercise.name in REGISTRY and REGISTRY[exercise.name] != exercise:
        raise ValueError(f"two exercises are named {exercise.name!r}")
    REGISTRY[exercise.name] = exercise
    return exercise


def _load_catalogue() -> None:
    # Each chapter declares its exercises in course_utils/catalogue/chNN.py; importing registers them.
    import importlib
    import pkgutil

    from course_utils import catalogue

    for mod in pkgutil.iter_modules(catalogue.__path__):
        importlib.import_module(f"course_utils.catalogue.{mod.name}")


def exercises(chapter: str | None = None) -> list[Exercise]:
    _load_catalogue()
    return [e for e in REGISTRY.values() if chapter is None or e.chapter == chapter]


def get(name: str) -> Exercise:
    _load_catalogue()
    if name not in REGISTRY:
        import difflib

        close = difflib.get_close_matches(name, REGISTRY, n=1)
        raise KeyError(f"no exercise named {name!r}" + (f": did you mean {close[0]!r}?" if close else ""))
    return REGISTRY[name]


@dataclass(repr=False)
class Verdict:
    exercise: str
    status: str
    message: str
    points: float
    max_points: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def __str__(self) -> str:
        mark = {PASS: "PASS", FAIL: "FAIL", TODO: "TODO"}[self.status]
        return f"[{mark}] {self.exercise} ({self.points:g}/{self.max_points}): {self.message}"

    __repr__ = __str__  # no timing in the text: nbval compares it across runs

    def _repr_html_(self) -> str:
        colour = {PASS: "#1a7f37", FAIL: "#cf222e", TODO: "#9a6700"}[self.status]
        mark = {PASS: "&#10004; passed", FAIL: "&#10008; not yet", TODO: "&#9998; not attempted"}[self.status]
        import html

        return (f"<div style='border-left:4px solid {colour};padding:4px 10px'><b style='color:{colour}'>{mark}</b>"
                f" <code>{self.exercise}</code> ({self.points:g}/{self.max_points})<br>"
                f"<span style='white-space:pre-wrap'>{html.escape(self.message)}</span></div>")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def rank_world_sizes(chapter: str) -> list[int]:
    """Every world size the chapter's rank-side checks run at."""
    return sorted({w for e in exercises(chapter) if e.worker for w in e.world_sizes})


def warm_up(chapter: str) -> str:
    """Start (or find warm) the ranks every rank-side check of ``chapter`` uses, before any check runs.

    Starting ranks is the slow, load-dependent part of a check (torchrun and ``import torch`` on every rank);
    the batch grader calls this in a cell of its own, with a limit of its own, so that no answer's cell is
    charged for it. Returns one line saying what it did."""
    from course_utils.launcher import run

    start = time.perf_counter()
    sizes = rank_world_sizes(chapter)
    for world_size in sizes:
        run("workers.hello", world_size=world_size, timeout=60)
    if not sizes:
        return f"chapter {chapter}: every check runs in this process, no ranks to start"
    return (f"chapter {chapter}: ranks ready at world size {', '.join(map(str, sizes))} in "
            f"{time.perf_counter() - start:.1f} s (not counted against any answer)")


def _started(ex: Exercise, world_size: int, answer: Callable):
    """Run the check at one world size. Ranks that never started say nothing about the answer: that failure is
    retried once on fresh ranks, and if it happens again the verdict says so instead of blaming the answer."""
    from course_utils.launcher import run

    for attempt in (1, 2):
        try:
            return run(ex.worker, world_size=world_size, exercise=ex.name, answer=answer,
                       timeout=ex.timeout_s, **ex.params)
        except WorkerFailed as exc:
            if not exc.startup or attempt == 2:
                raise


def _run_on_ranks(ex: Exercise, answer: Callable) -> tuple[str, str]:
    for world_size in ex.world_sizes:
        try:
            res = _started(ex, world_size, answer)
        except JobTimeout as exc:
            where = "; ".join(f"rank {r} {w}" for r, w in exc.stuck.items())
            p2p = any(re.match(r"waiting in (send|recv|isend|irecv|batch_isend_irecv)\b", w) for w in exc.stuck.values())
            advice = ("Does every send have its matching receive on the peer, in an order that cannot leave every "
                      "rank waiting for another (one side sends first, or isend/irecv)?" if p2p else
                      "Does every rank call the same collectives, in the same order?")
            return FAIL, f"at world size {world_size} your code did not finish within {ex.timeout_s:g} s ({where}). {advice}"
        except WorkerFailed as exc:
            if exc.startup:
                return FAIL, (f"{NOT_GRADED}: the ranks for world size {world_size} did not start, twice "
                              f"({exc.summary.splitlines()[0]}). This says nothing about your answer: run the check "
                              "again when the machine is less loaded")
            if exc.error_type == "NotImplementedError":
                return TODO, "not attempted yet: replace the `raise NotImplementedError` with your code"
            if not exc.error_type:  # the process died: no Python exception to quote
                who = f"rank {exc.rank}'s process" if exc.rank is not None else "a rank's process"
                return FAIL, (f"at world size {world_size}, {who} died while your code ran, "
                              "without a Python error: a crash inside a collective, most often from a tensor freed, "
                              "resized or reused while an asynchronous collective still wrote into it (wait() on "
                              "every handle before touching its tensor)")
            said = _first_line(exc.rank_traceback) or exc.summary
            if said.startswith(f"{exc.error_type}: "):  # the traceback's last line names the type already
                said = said[len(exc.error_type) + 2:]
            return FAIL, f"at world size {world_size}, rank {exc.rank} raised {exc.error_type}: {said}"
        verdicts = res.gather("verdict")
        for rank, v in enumerate(verdicts):
            if v["status"] == TODO:  # not attempted: nothing happened at a world size or on a rank
                return TODO, v["message"]
            if v["status"] != PASS:
                return v["status"], where_seen(world_size, v.get("rank", rank), v["message"])
    sizes = ", ".join(str(w) for w in ex.world_sizes)
    return PASS, f"correct on real ranks at world size {sizes}"


def where_seen(world_size: int, rank: int, message: str) -> str:
    """``at world size 4, rank 1: <message>``: one sentence naming the world size and the one rank that saw it. A
    message that names the world size itself ("at world size 4 your step raised ...") is not told it twice."""
    own = re.match(rf"at world size {world_size}\b,? *", message)
    return f"at world size {world_size}, rank {rank}: {message[own.end():] if own else message}"


ANSWER_LIMIT_S = 30.0


class AnswerTooSlow(CourseError):
    """The learner's own function ran past its limit (``call_answer``), inside a check that itself runs longer."""


def call_answer(answer: Callable, *args, limit_s: float = ANSWER_LIMIT_S, **kwargs):
    """``answer(*args, **kwargs)`` with a limit on the learner's code alone: for a local check that then starts
    ranks of its own (a cold start of 8 ranks can take longer than any answer should), so the exercise's
    ``timeout_s`` covers the check and this covers the answer."""
    box: dict = {}

    def target():
        try:
            box["value"] = answer(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        raise AnswerTooSlow(f"your function did not finish within {limit_s:g} s: look for a loop that never ends "
                            "(it keeps running in the background until it does)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _run_local(ex: Exercise, answer: Callable) -> tuple[str, str]:
    """A notebook-side check in a thread, so an endless loop in an answer cannot freeze the notebook."""
    box: dict = {}

    def target():
        try:
            box["verdict"] = ex.local(answer)
        except NotImplementedError:
            box["verdict"] = (TODO, "not attempted yet: replace the `raise NotImplementedError` with your code")
        except BaseException as exc:  # noqa: BLE001 - reported as the verdict
            box["error"] = exc

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(ex.timeout_s)
    if worker.is_alive():
        return FAIL, (f"your function did not finish within {ex.timeout_s:g} s: look for a loop that never ends "
                      "(the check keeps running in the background until it does)")
    if "error" in box:
        exc = box["error"]
        if isinstance(exc, AnswerTooSlow):
            return FAIL, str(exc)
        return FAIL, f"your function raised {type(exc).__name__}: {exc}"
    return box["verdict"]


def check(name: str, answer: Callable | None) -> Verdict:
    """Check the learner's answer to exercise ``name``; prints (and returns) a verdict, never raises."""
    start = time.perf_counter()
    try:
        ex = get(name)
    except KeyError as exc:
        return _record(Verdict(name, FAIL, str(exc.args[0]), 0, 0, 0.0))
    if answer is None or not callable(answer):
        status, message = TODO, f"define a function named {ex.function} in the cell above, then run this cell"
    else:
        try:
            if ex.local is not None:
                status, message = _run_local(ex, answer)
            else:
                status, message = _run_on_ranks(ex, answer)
        except CourseError as exc:
            status, message = FAIL, str(exc).splitlines()[0]
        except Exception as exc:  # noqa: BLE001 - a broken answer must not break the notebook
            status, message = FAIL, f"your function raised {type(exc).__name__}: {exc}"
    points = ex.points if status == PASS else 0
    return _record(Verdict(ex.name, status, message, points, ex.points, time.perf_counter() - start))


def _record(verdict: Verdict) -> Verdict:
    log = os.environ.get("COURSE_GRADE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(verdict.__dict__) + "\n")
    return verdict


def coverage_problems(ex: Exercise) -> list[str]:
    """What is missing from ``ex.tries``: a class not described, an unknown class, a reason-less 'not applicable'."""
    problems = [f"{ex.name}: says nothing of input class {c!r}" for c in INPUT_CLASSES if not ex.tries.get(c, "").strip()]
    problems += [f"{ex.name}: unknown input class {c!r} (known: {', '.join(INPUT_CLASSES)})"
                 for c in ex.tries if c not in INPUT_CLASSES]
    problems += [f"{ex.name}: class {c!r} is not applicable without saying why" for c, text in ex.tries.items()
                 if text.startswith(NOT_APPLICABLE) and len(text) - len(NOT_APPLICABLE) < 12]
    return problems


def coverage_table() -> str:
    """``docs/EXERCISES.md``: for every exercise, what its check tries in each class of input, or why not."""
    lines = ["# What each exercise's check tries",
             "",
             "Generated by `python -m course_utils.exercises table` from `tries=` in `course_utils/catalogue/chNN.py`;",
             "`tests/test_exercise_coverage.py` fails when this file is stale, when an exercise leaves a class out, and",
             "when a class a check tries has no wrong answer in `tests/wrong_answers/chNN.py` that shows it caught.",
             "",
             "The classes of input:",
             ""]
    lines += [f"- **{c}**: {text}" for c, text in INPUT_CLASSES.items()]
    for ex in sorted(exercises(), key=lambda e: (e.chapter, e.name)):
        where = (f"on ranks, world size {', '.join(map(str, ex.world_sizes))} (`{ex.worker}`)" if ex.worker
                 else "in the notebook process")
        lines += ["", f"## {ex.chapter} `{ex.name}`: {ex.title}", "", f"Checked {where}.", "",
                  "| class | what the check tries |", "|---|---|"]
        for c in INPUT_CLASSES:
            text = ex.tries.get(c, "(missing)").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {c} | {'*' + text + '*' if text.startswith(NOT_APPLICABLE) else text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["table"]:
        sys.exit("usage: python -m course_utils.exercises table > docs/EXERCISES.md")
    # the catalogue registers into course_utils.exercises, which is not this __main__ module: ask that one
    from course_utils.exercises import coverage_table as table

    sys.stdout.write(table())
