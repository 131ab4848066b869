"""The chapter map: which files make each chapter, read from the code (``python -m course_utils.notebooks map``).

For chapter NN it reads ``notebooks/src/NN_*.py``, the chapter's glue (``course_utils/chNN.py``,
``chNN_<part>.py``) and its catalogue (``course_utils/catalogue/chNN.py``): what they import, and the workers they
name in a string constant (``cu.run("workers.ch13_pipeline")``, ``WORKER = "workers.ch16_moe"``,
``CHECKER = "workers.exercises.ch16"``, ``"workers/ch01_minimal.py"``). From those workers, and from what the
chapter's notebook-side modules import under ``workers/``, it follows every import inside ``workers/``
transitively, as Python would (importing ``workers.moe.train`` runs ``workers/moe/__init__.py`` too). It adds the
chapter's exercises (catalogue, checker, solution, wrong answers) and the tests that name any of its own files.
``docs/CHAPTERS.md`` is this module's output; ``tests/test_layout.py`` fails when it is stale, and when a file
under ``workers/`` belongs to no chapter. Nothing here imports the modules it reads: it parses them (``ast``), so
it runs in a second and never starts torch.
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from course_utils.paths import ROOT

SPINE = {"workers/__init__.py", "workers/runtime.py", "workers/protocol.py", "workers/pool.py", "workers/provenance.py"}
# The notebook side of the spine: every chapter starts its ranks through these, so no chapter lists them.
NOTEBOOK_SPINE = {"course_utils/__init__.py", "course_utils/launcher.py", "course_utils/jobs.py",
                  "course_utils/results.py", "course_utils/validate.py"}
_MODULE_STRING = re.compile(r"^(workers|course_utils|tests\.rank_helpers)(\.\w+)+$")
_PATH_STRING = re.compile(r"^workers/[\w/]+\.py$")


def resolve(module: str, root: Path = ROOT) -> str | None:
    """The repository file of a dotted module name (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(root).as_posix()
    return None


def _package(path: Path, root: Path) -> list[str]:
    """The dotted package ``path`` is in (``workers/moe/train.py`` -> ``["workers", "moe"]``), for relative imports."""
    try:
        parts = list(path.resolve().relative_to(root.resolve()).parts)
    except ValueError:
        return []
    return parts[:-1]


def _names(path: Path, *, strings: bool, root: Path = ROOT) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from .grid import RankGrid`, `from .. import x`
                package = _package(path, root)
                if node.level > len(package):
                    continue
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module:
                names.add(module)
                names.update(f"{module}.{a.name}" for a in node.names)  # `from pkg import module`
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_STRING.match(node.value):
                names.add(node.value)
            elif _PATH_STRING.match(node.value):
                names.add(node.value[:-3].replace("/", "."))
    return names


def _uses(path: Path, root: Path, *, strings: bool) -> set[str]:
    """Repository files ``path`` imports (and, with ``strings``, names in a string constant), ``__init__`` included."""
    path, root = path.resolve(), root.resolve()
    stat = path.stat()  # the parse is cached by file and version; what a name resolves to is looked up every time
    names = _names_cached(str(path), str(root), stat.st_mtime_ns, stat.st_size, strings)
    mine = path.relative_to(root).as_posix()
    return {f for f in (resolve(n, root) for n in names) if f and f != mine}


@functools.lru_cache(maxsize=8192)
def _names_cached(path: str, root: str, _mtime: int, _size: int, strings: bool) -> frozenset[str]:
    return frozenset(_names(Path(path), strings=strings, root=Path(root)))


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Repository files ``path`` imports (``import``/``from`` statements anywhere in it, also inside functions)."""
    return _uses(path, root, strings=False)


def references(path: Path, root: Path = ROOT) -> set[str]:
    """What ``path`` imports, plus the repository modules and worker files it names in a string constant (the
    workers a chapter runs: ``cu.run("workers.ch13_pipeline")``, ``WORKER = "workers.ch16_moe"``,
    ``"workers/ch01_minimal.py"``); ``__init__`` files left out."""
    return {f for f in _uses(path, root, strings=True) if not f.endswith("__init__.py")}


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
    # every file under workers/ the chapter loads (scripts, checker, libraries and the packages' __init__ files,
    # the spine left out): what the layout test's "every worker file belongs to a chapter" rule reads
    rank_side: list[str] = field(default_factory=list)

    def files(self) -> set[str]:
        """Every file the map gives this chapter."""
        return ({self.source} | set(self.glue) | set(self.helpers) | set(self.scripts) | set(self.libraries)
                | set(self.exercises) | set(self.tests) | set(self.rank_side))


def _title(src: Path) -> str:
    for line in src.read_text().splitlines():
        if line.startswith("# # "):
            return line[4:].strip()
    return src.stem


def _parents(rel: str, root: Path) -> set[str]:
    """The ``__init__.py`` files Python runs before ``rel`` (``workers/moe/train.py`` -> ``workers/moe/__init__.py``)."""
    parts = rel.split("/")[:-1]
    inits = ("/".join(parts[:i] + ["__init__.py"]) for i in range(1, len(parts) + 1))
    return {f for f in inits if f != rel and (root / f).is_file()}


def rank_side_closure(start: set[str], root: Path = ROOT) -> set[str]:
    """Everything under ``workers/`` these files load, transitively: what each imports or names as a worker, and the
    packages' ``__init__`` files on the way (the spine left out: every chapter uses it)."""
    seen, todo = set(), [f for f in start if f.startswith("workers/")]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        todo.extend(r for r in _uses(root / f, root, strings=True) | _parents(f, root)
                    if r.startswith("workers/") and r not in seen)
    return seen - SPINE


def _glue_files(nn: str, root: Path) -> list[Path]:
    return sorted(p for p in (root / "course_utils").glob(f"ch{nn}*.py") if re.match(rf"ch{nn}(_\w+)?\.py$", p.name))


def chapters(root: Path = ROOT) -> list[Chapter]:
    # test_layout names files of every chapter as data (the shims), not as what it tests
    tests = sorted(t for t in (root / "tests").glob("test_*.py") if t.name != "test_layout.py")
    test_refs = {t: references(t, root) for t in tests}
    out = []
    for src in sorted((root / "notebooks" / "src").glob("[0-9][0-9]_*.py")):
        nn = src.stem[:2]
        ch = Chapter(nn, _title(src), f"notebooks/{src.stem}.ipynb", src.relative_to(root).as_posix())
        # The chapter's own notebook-side files: its source, its glue (by name: chNN.py, chNN_<part>.py) and its
        # catalogue. Their imports and the workers they name are the chapter's.
        glue = [p.relative_to(root).as_posix() for p in _glue_files(nn, root)]
        catalogue = f"course_utils/catalogue/ch{nn}.py"
        own = [ch.source, *glue] + ([catalogue] if (root / catalogue).is_file() else [])
        uses = set().union(*(_uses(root / f, root, strings=True) for f in own))  # `from workers.layout import ...`
        refs = {f for f in uses if not f.endswith("__init__.py")}
        ch.glue = glue
        ch.helpers = sorted(r for r in refs if r.startswith("course_utils/") and r not in own
                            and r not in NOTEBOOK_SPINE and not r.startswith("course_utils/catalogue/"))
        exercises = [catalogue, f"workers/exercises/ch{nn}.py", f"solutions/ch{nn}.py", f"tests/wrong_answers/ch{nn}.py"]
        ch.exercises = [f for f in exercises if (root / f).is_file()]
        # Rank side: the workers the chapter's own files name or import, what its notebook-side modules import
        # under workers/ (one level: their own imports), then all of that's imports, transitively.
        named = {r for r in uses if r.startswith("workers/")}
        named |= {w for h in ch.helpers for w in imports(root / h, root) if w.startswith("workers/")}
        named |= {f for f in ch.exercises if f.startswith("workers/")}
        ch.rank_side = sorted(rank_side_closure(named, root))
        ch.scripts = sorted(f for f in refs | set(ch.rank_side) if is_script(f))
        ch.libraries = sorted(f for f in ch.rank_side if not f.endswith("__init__.py")
                              and f not in ch.scripts and f not in ch.exercises)
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
             ("Generated by `python -m course_utils.notebooks map` from the code: what each chapter's notebook, glue "
              "and catalogue import and the workers they name, followed through every import inside `workers/`; its "
              "exercises and tests. `tests/test_layout.py` fails when it is stale, and when a file under `workers/` "
              "belongs to no chapter and is not a listed shared library. Do not edit by hand.\n\n"),
             ("Every chapter also uses the spine: `course_utils/launcher.py` (with `jobs.py`, `results.py`, "
              "`validate.py`) starts `workers/runtime.py` ranks under torchrun, which answer through "
              "`workers/protocol.py`; warm ranks live in `workers/pool.py`. Where new code goes is in "
              "`docs/CONTRIBUTING.md` (\"Where files go\").\n")]
    for ch in chs:
        lines.append(f"\n## {ch.number} · {ch.title.split('·', 1)[-1].strip()}\n\n")
        lines.append(f"- **notebook:** `{ch.notebook}` (source `{ch.source}`)\n")
        lines.append(_files("chapter glue (notebook side)", ch.glue))
        lines.append(_files("shared notebook-side modules", ch.helpers))
        lines.append(_files("scripts it runs on ranks (named by its notebook, glue or catalogue)", ch.scripts))
        lines.append(_files("rank-side libraries (what its files and scripts import under `workers/`, transitively)",
                            ch.libraries))
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
