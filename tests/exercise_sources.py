"""Helpers for the exercise tests: the stubs as shipped in the notebooks, as real functions."""
from __future__ import annotations

import importlib
import linecache

import jupytext

from course_utils.paths import ROOT

# What each wrong answer got from its check: tests/test_exercises.py records it as a property of its test's report
# (named MUTANT), tests/conftest.py collects those reports from every pytest worker into MUTANTS and prints them at
# the end of the run (`make mutants` runs only those tests): the per-exercise mutation report.
MUTANT = "mutant"
MUTANTS: list[dict] = []


def define(source: str, filename: str) -> dict:
    """Exec ``source`` the way IPython does, so ``inspect.getsource`` finds it (answers travel as source)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def notebook_cells(chapter: str):
    [src] = (ROOT / "notebooks" / "src").glob(f"{chapter}_*.py")
    return jupytext.read(src).cells


def stubs(chapter: str) -> dict:
    """Functions defined in the cells tagged ``exercise`` of chapter ``chapter``'s notebook source."""
    out = {}
    for i, cell in enumerate(notebook_cells(chapter)):
        if cell.cell_type == "code" and "exercise" in cell.metadata.get("tags", []):
            ns = define(cell.source, f"<notebook {chapter} cell {i}>")
            out.update({k: v for k, v in ns.items() if callable(v) and not k.startswith("__")})
    return out


def solutions(chapter: str):
    return importlib.import_module(f"solutions.ch{chapter}")


def wrong_answers(chapter: str) -> list:
    try:
        return importlib.import_module(f"tests.wrong_answers.ch{chapter}").WRONG
    except ModuleNotFoundError:
        return []


def mutation_report(rows: list[dict]) -> str:
    """Per exercise: how many wrong answers its check caught with the right reason, and which escaped."""
    by_ex: dict[tuple, list[dict]] = {}
    for r in rows:
        by_ex.setdefault((r["chapter"], r["exercise"]), []).append(r)
    lines = [f"{'chapter':<8}{'exercise':<34}{'wrong answers':>14}{'caught':>8}{'right reason':>14}{'slowest s':>11}  escaped"]
    for (chapter, name), rs in sorted(by_ex.items()):
        caught = sum(r["caught"] for r in rs)
        reason = sum(r["caught"] and r["reason"] for r in rs)
        escaped = [r["answer"] + ("" if not r["caught"] else " (wrong reason)") for r in rs
                   if not (r["caught"] and r["reason"])]
        lines.append(f"{chapter:<8}{name:<34}{len(rs):>14}{caught:>8}{reason:>14}{max(r['seconds'] for r in rs):>11.1f}  "
                     + (", ".join(escaped) or "none"))
    total = len(rows)
    good = sum(r["caught"] and r["reason"] for r in rows)
    lines.append(f"{len(by_ex)} exercises, {total} wrong answers, {good} caught with their reason, {total - good} not")
    return "\n".join(lines)
