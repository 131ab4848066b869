"""Batch grading for instructors: ``python -m course_utils.grade SUBMISSIONS --out grades/``.

SUBMISSIONS holds learners' notebooks, either ``<learner>/<NN_chapter>.ipynb`` or ``<learner>__<NN_chapter>.ipynb``.
For each one the grader builds a grading notebook from the learner's answer cells (tagged ``exercise``)
followed by the course's own checks for that chapter (the learner's ``check`` cells are not trusted),
starts the ranks those checks use in a cell of its own (its time is not charged to any answer), executes it
headless in a separate process with a per-cell and a total time limit, and collects the verdicts. A submission that crashes, loops forever or leaves ranks behind costs only its own points:
the process tree is killed at the limit and every check that did not run scores zero with a reason. A
submission whose checks did not run for a reason that is not the answer's (ranks that never started) is
graded once more, and its feedback says so if that happens again.

Writes ``gradebook.csv`` (one row per learner and exercise) and ``feedback/<learner>.md``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

from course_utils import exercises as ex_mod
from course_utils import reaper

CHAPTER_RE = re.compile(r"(\d\d)_")
STARTUP_CELL_TAG = "grading-startup"
ANSWER_CELL_TAG = "grading-answer"
ANSWER_TIMEOUT = "the answer ran too long"
NOT_GRADED = ex_mod.NOT_GRADED


def chapter_of(path: Path) -> str:
    m = CHAPTER_RE.search(path.name)
    if not m:
        raise ValueError(f"{path.name}: cannot tell the chapter; name it like 01_collectives.ipynb")
    return m.group(1)


def learner_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    if len(rel.parts) > 1:
        return rel.parts[0]
    return path.stem.split("__")[0] if "__" in path.stem else path.stem


def grading_notebook(submission: nbformat.NotebookNode, chapter: str) -> nbformat.NotebookNode:
    """The learner's answer cells, then the course's checks for every exercise of the chapter."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = submission.metadata
    nb.cells.append(nbformat.v4.new_code_cell("import course_utils.exercises as _grader"))
    # Start the ranks before any answer runs, in a cell with a limit of its own (STARTUP_CELL_TAG): on a loaded
    # machine starting them can take longer than a check's cell may, and that time is not the learner's.
    nb.cells.append(nbformat.v4.new_code_cell(f"print(_grader.warm_up({chapter!r}))",
                                              metadata={"tags": [STARTUP_CELL_TAG]}))
    for cell in submission.cells:
        if cell.cell_type == "code" and "exercise" in cell.get("metadata", {}).get("tags", []):
            nb.cells.append(nbformat.v4.new_code_cell(cell.source, metadata={"tags": [ANSWER_CELL_TAG]}))
    for ex in ex_mod.exercises(chapter):
        nb.cells.append(nbformat.v4.new_code_cell(
            f"_grader.check({ex.name!r}, globals().get({ex.function!r}))"))
    return nb


def execute(nb_path: Path, log_path: Path, *, cell_timeout: float, total_timeout: float) -> str:
    """Run the grading notebook in a child process; returns '' or why it stopped early."""
    env = dict(os.environ, COURSE_GRADE_LOG=str(log_path))
    proc = subprocess.Popen([sys.executable, "-m", "course_utils.grade", "--execute", str(nb_path),
                             "--cell-timeout", str(cell_timeout)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=total_timeout)
    except subprocess.TimeoutExpired:
        reaper.kill_tree([proc.pid])
        proc.communicate()
        return f"stopped at the time limit of {total_timeout:g} s"
    reaper.kill_tree([proc.pid])  # nothing the submission started may outlive its grading
    if proc.returncode != 0:
        last = [l for l in out.strip().splitlines() if l.strip()][-1:] or ["no output"]
        return f"the notebook stopped early ({last[0][:200]})"
    return ""


def startup_limit() -> float:
    """How long the rank start-up cell may take: the launcher's own start-up limit for each world size, plus a margin."""
    from course_utils.jobs import default_startup_timeout_s

    return default_startup_timeout_s() * 2 + 60


def _execute_here(nb_path: str, cell_timeout: float) -> None:
    from nbclient import NotebookClient

    nb = nbformat.read(nb_path, as_version=4)
    limit = startup_limit()

    def timeout_for(cell) -> float:
        return limit if STARTUP_CELL_TAG in cell.get("metadata", {}).get("tags", []) else cell_timeout

    current: dict = {}

    def started(cell, cell_index, **_):
        current["cell"] = cell

    # allow_errors: a syntax error in one answer must not cost the learner the other exercises.
    client = NotebookClient(nb, timeout=cell_timeout, timeout_func=timeout_for, allow_errors=True,
                            kernel_name="python3", on_cell_start=started)
    try:
        client.execute()
    except TimeoutError:  # nbclient's CellTimeoutError: say whose cell it was, for the gradebook
        cell = current.get("cell", {})
        if ANSWER_CELL_TAG in cell.get("metadata", {}).get("tags", []):
            print(f"{ANSWER_TIMEOUT}: an exercise cell ran past the {cell_timeout:g} s limit (a loop that never ends?)")
        else:
            print(f"a check ran past the {timeout_for(cell):g} s limit of its cell")
        sys.exit(3)


def grade_submission(path: Path, root: Path, *, cell_timeout: float, total_timeout: float) -> list[dict]:
    chapter = chapter_of(path)
    learner = learner_of(path, root)
    expected = ex_mod.exercises(chapter)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "verdicts.jsonl"
        problem = ""
        try:
            nb = grading_notebook(nbformat.read(str(path), as_version=4), chapter)
            nb_path = Path(tmp) / path.name
            nbformat.write(nb, str(nb_path))
            problem = execute(nb_path, log, cell_timeout=cell_timeout, total_timeout=total_timeout)
        except Exception as exc:  # noqa: BLE001 - an unreadable notebook is a zero, not a crash
            problem = f"could not read the notebook: {exc}"
        if log.exists():
            for line in log.read_text().splitlines():
                v = json.loads(line)
                rows[v["exercise"]] = v
    out = []
    for e in expected:
        v = rows.get(e.name)
        if v is None and ANSWER_TIMEOUT in problem:  # the learner's own cell stopped the notebook
            v = {"status": "fail", "points": 0, "max_points": e.points,
                 "message": "the check did not run: " + problem.split(f"{ANSWER_TIMEOUT}: ", 1)[1][:-1]}
        elif v is None:
            v = {"status": "fail", "points": 0, "max_points": e.points,
                 "message": f"{NOT_GRADED}: {problem or 'the check did not run'}"}
        out.append({"learner": learner, "chapter": chapter, "exercise": e.name, "points": v["points"],
                    "max_points": e.points, "status": v["status"], "message": v["message"]})
    return out


def _first_problem(rows: list[dict]) -> str:
    return next(r["message"] for r in rows if r["message"].startswith(NOT_GRADED))[:160]


def write_reports(rows: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "gradebook.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["learner", "chapter", "exercise", "points", "max_points", "status", "message"])
        w.writeheader()
        w.writerows(rows)
    feedback = out_dir / "feedback"
    feedback.mkdir(exist_ok=True)
    for learner in sorted({r["learner"] for r in rows}):
        mine = [r for r in rows if r["learner"] == learner]
        got, total = sum(r["points"] for r in mine), sum(r["max_points"] for r in mine)
        lines = [f"# Feedback for {learner}: {got:g} / {total} points", ""]
        for r in mine:
            mark = {"pass": "passed", "fail": "not yet", "todo": "not attempted"}[r["status"]]
            lines.append(f"- **{r['chapter']} `{r['exercise']}`** ({r['points']:g}/{r['max_points']}, {mark}): {r['message']}")
        (feedback / f"{learner}.md").write_text("\n".join(lines) + "\n")


def grade_all(submissions: Path, out_dir: Path, *, cell_timeout: float = 120, total_timeout: float = 600) -> list[dict]:
    paths = sorted(p for p in submissions.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    rows: list[dict] = []
    for path in paths:
        mine = grade_submission(path, submissions, cell_timeout=cell_timeout, total_timeout=total_timeout)
        if any(r["message"].startswith(NOT_GRADED) for r in mine):
            # Ranks that never started (or a notebook stopped before its checks ran) grade the machine, not the
            # answer: grade it once more, and say so if it happens again.
            print(f"{path.relative_to(submissions)}: some checks did not run ({_first_problem(mine)}); grading it again",
                  flush=True)
            mine = grade_submission(path, submissions, cell_timeout=cell_timeout, total_timeout=total_timeout)
            for r in mine:
                if r["message"].startswith(NOT_GRADED):
                    r["message"] += " (graded twice; grade this submission again on a less loaded machine)"
        rows += mine
        got = sum(r["points"] for r in rows if r["learner"] == learner_of(path, submissions) and r["chapter"] == chapter_of(path))
        print(f"graded {path.relative_to(submissions)}: {got:g} points", flush=True)
    write_reports(rows, out_dir)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Grade learners' notebooks headless and write a gradebook.")
    p.add_argument("submissions", nargs="?", type=Path)
    p.add_argument("--out", type=Path, default=Path("grades"))
    p.add_argument("--cell-timeout", type=float, default=120)
    p.add_argument("--total-timeout", type=float, default=600)
    p.add_argument("--execute", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.execute:
        _execute_here(a.execute, a.cell_timeout)
        return 0
    if a.submissions is None or not a.submissions.is_dir():
        p.error("give the folder of submitted notebooks")
    rows = grade_all(a.submissions, a.out, cell_timeout=a.cell_timeout, total_timeout=a.total_timeout)
    print(f"wrote {a.out / 'gradebook.csv'} ({len(rows)} rows) and {a.out / 'feedback'}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
