"""The chapter map: which files make each chapter, read from the code (``python -m course_utils.notebooks map``).

For chapter NN it follows what ``notebooks/src/NN_*.py`` imports and the workers it names (``cu.run("workers.
ch13_pipeline")``, ``"workers/ch01_minimal.py"``), then what those scripts import inside ``workers/``; adds the
chapter's exercises (catalogue, checker, solution, wrong answers) and the tests that name any of its own files.
``docs/CHAPTERS.md`` is this module's output; ``tests/test_layout.py`` fails when it is stale. Nothing here
imports the modules it reads: it parses them (``ast``), so it runs in a second and never starts torch.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from course_utils.paths import ROOT

SPINE = {"workers/__init__.py", "workers/runtime.py", "workers/protocol.py", "workers/pool.py", "workers/provenance.py"}
_MODULE_STRING = re.compile(r"^(workers|course_utils|tests\.rank_helpers)(\.\w+)+$")
_PATH_STRING = re.compile(r"^workers/[\w/]+\.py$")


def resolve(module: str, root: Path = ROOT) -> str | None:
    """The repository file of a dotted module name (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(root).as_posix()
    return None


def _names(path: Path, *, strings: bool) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_STRING.match(node.value):
                names.add(node.value)
            elif _PATH_STRING.match(node.value):
                names.add(node.value[:-3].replace("/", "."))
    return names


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Repository files ``path`` imports (``import``/``from`` statements anywhere in it, also inside functions)."""
    return {f for f in (resolve(n, root) for n in _names(path, strings=False)) if f}


def references(path: Path, root: Path = ROOT) -> set[str]:
    """What ``path`` imports, plus the repository modules and worker files it names in a string (the workers a
    notebook runs: ``cu.run("workers.ch13_pipeline")``, ``"workers/ch01_minimal.py"``); ``__init__`` files left out."""
    files = {resolve(n, root) for n in _names(path, strings=True)}
    mine = path.resolve().relative_to(root.resolve()).as_posix()
    return {f for f in files if f and f != mine and not f.endswith("__init__.py")}


def is_script(rel: str) -> bool:
    return rel.startswith("workers/") and rel.count("/") == 1 and rel not in SPINE


@dataclass
class Chapter:
    number: str
    title: str
    notebook: str
    source: str
    glue: list[str] = field(default_factory=list)
    helpers: list[str] = field(default_factory=list)
    scripts: list[str] = field(default_factory=list)
    libraries: list[str] = field(default_factory=list)
    exercises: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)


def _title(src: Path) -> str:
    for line in src.read_text().splitlines():
        if line.startswith("# # "):
            return line[4:].strip()
    return src.stem


def _rank_side_closure(start: set[str], root: Path) -> set[str]:
    """Everything under ``workers/`` these files import, transitively (the spine left out: every chapter uses it)."""
    seen, todo = set(), [f for f in start if f.startswith("workers/")]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo.extend(r for r in references(root / f, root) if r.startswith("workers/") and r not in seen)
    return seen - SPINE


def chapters(root: Path = ROOT) -> list[Chapter]:
    # test_layout names files of every chapter as data (the shims), not as what it tests
    tests = sorted(t for t in (root / "tests").glob("test_*.py") if t.name != "test_layout.py")
    test_refs = {t: references(t, root) for t in tests}
    out = []
    for src in sorted((root / "notebooks" / "src").glob("[0-9][0-9]_*.py")):
        nn = src.stem[:2]
        refs = references(src, root)
        ch = Chapter(nn, _title(src), f"notebooks/{src.stem}.ipynb", src.relative_to(root).as_posix())
        glue = {r for r in refs if re.match(rf"course_utils/ch{nn}(_\w+)?\.py$", r)}
        glue |= {g for f in list(glue) for g in references(root / f, root)
                 if re.match(rf"course_utils/ch{nn}(_\w+)?\.py$", g)}  # a chapter's glue in two parts
        ch.glue = sorted(glue)
        ch.helpers = sorted(r for r in refs if r.startswith("course_utils/") and r not in glue
                            and not r.startswith("course_utils/catalogue/"))
        ch.scripts = sorted(r for r in refs if is_script(r))
        ch.libraries = sorted(_rank_side_closure({r for r in refs if r.startswith("workers/")}, root)
                              - set(ch.scripts))
        own = [f"course_utils/catalogue/ch{nn}.py", f"workers/exercises/ch{nn}.py", f"solutions/ch{nn}.py",
               f"tests/wrong_answers/ch{nn}.py"]
        ch.exercises = [f for f in own if (root / f).is_file()]
        mine = set(ch.glue) | set(ch.scripts) | set(ch.exercises) | {ch.source}
        ch.tests = sorted(t.relative_to(root).as_posix() for t in tests
                          if t.stem.startswith(f"test_ch{nn}") or test_refs[t] & mine)
        out.append(ch)
    return out


def _files(label: str, files: list[str]) -> str:
    return f"- **{label}:** " + (", ".join(f"`{f}`" for f in files) if files else "none") + "\n"


def render(root: Path = ROOT) -> str:
    chs = chapters(root)
    lines = ["# Chapter map\n\n",
             "Generated by `python -m course_utils.notebooks map` from the code (imports, the workers each notebook "
             "runs, its exercises and tests); `tests/test_layout.py` fails when it is stale. Do not edit by hand.\n\n",
             "Every chapter also uses the spine: `course_utils/launcher.py` (with `jobs.py`, `results.py`, "
             "`validate.py`) starts `workers/runtime.py` ranks under torchrun, which answer through "
             "`workers/protocol.py`; warm ranks live in `workers/pool.py`. Where new code goes is in "
             "`docs/CONTRIBUTING.md` (\"Where files go\").\n"]
    for ch in chs:
        lines.append(f"\n## {ch.number} · {ch.title.split('·', 1)[-1].strip()}\n\n")
        lines.append(f"- **notebook:** `{ch.notebook}` (source `{ch.source}`)\n")
        lines.append(_files("chapter glue (notebook side)", ch.glue))
        lines.append(_files("shared notebook-side modules", ch.helpers))
        lines.append(_files("scripts it runs on ranks", ch.scripts))
        lines.append(_files("rank-side libraries (imported by the notebook or its scripts)", ch.libraries))
        lines.append(_files("exercises (catalogue, checker, solution, wrong answers)", ch.exercises))
        lines.append(_files("tests", ch.tests))
    users: dict[str, list[str]] = {}
    for ch in chs:
        for f in ch.helpers + ch.libraries:
            users.setdefault(f, []).append(ch.number)
    shared = {f: nns for f, nns in users.items() if len(nns) > 1}
    lines.append("\n## Shared by several chapters\n\n")
    lines.append("A change here reaches every chapter listed.\n\n| file | chapters |\n| --- | --- |\n")
    lines += [f"| `{f}` | {', '.join(nns)} |\n" for f, nns in sorted(shared.items())]
    return "".join(lines)


def write(root: Path = ROOT) -> Path:
    path = root / "docs" / "CHAPTERS.md"
    path.write_text(render(root))
    return path
