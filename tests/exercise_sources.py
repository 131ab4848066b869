"""Helpers for the exercise tests: the stubs as shipped in the notebooks, as real functions."""
from __future__ import annotations

import importlib
import linecache

import jupytext
from course_utils.paths import ROOT



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
