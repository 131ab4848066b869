"""Where files go: the rules of docs/CONTRIBUTING.md ("Where files go"), checked on the tree.

Start here before adding a file. Rank side: a file directly under ``workers/`` is the spine or a torchrun
script that nothing imports; what is imported lives in a topic package; nothing in ``workers/`` imports
``course_utils``. Notebook side: ``course_utils/chNN.py`` / ``chNN_<part>.py`` is chapter NN's glue, imported only
by that chapter's notebook, catalogue and other glue, the tests, and the two tools that measure every chapter;
what two chapters use gets a topic name. ``docs/CHAPTERS.md`` is regenerated from the code. Each rule is a
function of the tree's root, so the last tests can show it catching a misplaced file in a scratch copy.
"""
from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_utils.chapter_map import ROOT, SPINE, chapters, imports, render

# Thin re-exports kept because a path is part of the course's public surface (see CONTRIBUTING).
SHIMS = {
    "workers/bench_attention.py": "`python -m workers.bench_attention` is printed in chapter 07 and the docs",
    "workers/ch02_model.py": "outside adapters import it; kept one release, then removed",
}
# Tools that measure every chapter, and so may import every chapter's glue.
CROSS_CHAPTER_TOOLS = {"course_utils/cpu_spread.py", "course_utils/bench.py"}
# One topic with a notebook side and a rank side, by design: the same name says so.
TWO_SIDES = {"exercises": "course_utils/exercises.py grades in the notebook; workers/exercises/ checks on ranks"}
# Files under workers/ that belong to no chapter because every chapter runs through them. Everything else under
# workers/ is in some chapter of docs/CHAPTERS.md (named by its notebook, glue or catalogue, or imported from there),
# or is a shim above. A key ending in "/" stands for a whole package.
SHARED_LIBRARY = {
    "workers/__init__.py": "the package every worker is imported from (the spine)",
    "workers/runtime.py": "the spine: the entrypoint each worker's main(ctx) runs under, free_port, collective timeout",
    "workers/protocol.py": "the spine: how every rank answers the launcher",
    "workers/pool.py": "the spine: the warm ranks that load any chapter's worker",
    "workers/provenance.py": "the spine: the record every measurement carries",
    "workers/calibrate.py": "this machine measured as a device of chapter 00's planner (course_utils/calibration.py, "
                            "`make bench`'s planner section): matmul rates, op overheads, gloo collectives",
    "workers/hello.py": "the smallest worker: the warm-up before every rank-side grade (course_utils/exercises.py) "
                        "and the spine's smoke test",
    "workers/attention/compile_report.py": "a command run by hand (`python -m workers.attention.compile_report`) that "
                                           "writes the compile facts of chapter 07's kernels quoted in "
                                           "docs/attention_kernel_notes.md",
}
SCANNED = ("workers", "course_utils", "notebooks/src", "tests", "solutions", "tools")
GLUE = re.compile(r"course_utils/ch(\d\d)(_\w+)?\.py$")


def _python_files(root: Path) -> list[Path]:
    return sorted(p for d in SCANNED if (root / d).is_dir() for p in (root / d).rglob("*.py")
                  if ".ipynb_checkpoints" not in p.parts)


def _import_graph(root: Path) -> dict[str, set[str]]:
    return {p.relative_to(root).as_posix(): imports(p, root) for p in _python_files(root)}


def _is_script(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    main_guard = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
    plain_torchrun = any("init_process_group" in ast.unparse(n) for n in tree.body if isinstance(n, ast.Expr))
    return main_guard or plain_torchrun


def rank_side_violations(root: Path) -> list[str]:
    graph = _import_graph(root)
    importers: dict[str, set[str]] = {}
    for f, deps in graph.items():
        for d in deps:
            importers.setdefault(d, set()).add(f)
    out = []
    for path in sorted((root / "workers").glob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in SPINE:
            continue
        if rel in SHIMS:
            body = [n for n in ast.parse(path.read_text()).body
                    if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # docstring
            if len(body) > 6 or not all(isinstance(n, (ast.ImportFrom, ast.Import, ast.Assign, ast.If)) for n in body):
                out.append(f"{rel} is kept as a shim but holds code: a shim only re-exports")
            continue
        if not _is_script(path):
            out.append(f"{rel} is not a torchrun script: move it into a topic package under workers/")
        users = sorted(importers.get(rel, set()) - {rel})
        if users:
            out.append(f"{rel} is a script but {', '.join(users)} import(s) it: move what they use into a topic package")
    for f, deps in graph.items():
        if f.startswith("workers/"):
            bad = sorted(d for d in deps if d.startswith("course_utils/"))
            if bad:
                out.append(f"{f} imports {', '.join(bad)}: the rank side never imports course_utils")
    return out


def notebook_side_violations(root: Path) -> list[str]:
    out = []
    for f, deps in _import_graph(root).items():
        for d in sorted(deps):
            m = GLUE.match(d)
            if not m:
                continue
            nn = m.group(1)
            allowed = (f.startswith("tests/") or f in CROSS_CHAPTER_TOOLS
                       or re.match(rf"notebooks/src/{nn}_\w+\.py$", f)
                       or f == f"course_utils/catalogue/ch{nn}.py" or re.match(rf"course_utils/ch{nn}(_\w+)?\.py$", f))
            if not allowed:
                out.append(f"{f} imports {d}, chapter {nn}'s glue: give what two chapters use a topic module")
    collisions = sorted(p.stem for p in (root / "course_utils").glob("*.py")
                        if (root / "workers" / p.stem).is_dir() and p.stem not in TWO_SIDES)
    out += [f"course_utils/{c}.py shares its name with the package workers/{c}/: name it for its chapter or role"
            for c in collisions]
    return out


def unmapped_worker_violations(root: Path) -> list[str]:
    """Files under ``workers/`` that no chapter of the map loads and that are neither shared library nor a shim."""
    chs = chapters(root)
    mapped = set().union(*(ch.files() for ch in chs))
    out = []
    for path in sorted((root / "workers").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in path.parts or ".ipynb_checkpoints" in path.parts:
            continue
        shared = rel in SHARED_LIBRARY or any(k.endswith("/") and rel.startswith(k) for k in SHARED_LIBRARY)
        if rel not in mapped and not shared and rel not in SHIMS:
            out.append(f"{rel} belongs to no chapter: name it from a chapter's notebook, glue or catalogue (or import "
                       "it from one of its workers), or list it in SHARED_LIBRARY with the reason")
    for key in sorted(SHARED_LIBRARY):
        if not (root / key).exists():
            out.append(f"SHARED_LIBRARY lists {key}, which is gone: drop it")
        users = [ch.number for ch in chs if key in ch.files() or (key.endswith("/") and
                                                                   any(f.startswith(key) for f in ch.files()))]
        if users:
            out.append(f"SHARED_LIBRARY lists {key}, but chapter(s) {', '.join(users)} load it: the map places it, drop it")
    return out


def test_the_rank_side_has_only_the_spine_scripts_and_topic_packages():
    assert rank_side_violations(ROOT) == []


def test_chapter_glue_is_imported_only_by_its_own_chapter():
    assert notebook_side_violations(ROOT) == []


def test_every_shim_still_works_as_documented():
    for rel in SHIMS:
        assert (ROOT / rel).is_file(), f"{rel} is gone: remove it from SHIMS and CONTRIBUTING"
    from workers import ch02_model
    from workers.data_parallel import buckets, model

    assert ch02_model.TinyMLP is model.TinyMLP and ch02_model.bucket_assignment is buckets.bucket_assignment
    out = subprocess.run([sys.executable, "-m", "workers.bench_attention", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--quick" in out.stdout, out.stderr


def test_the_chapter_map_is_up_to_date():
    assert (ROOT / "docs" / "CHAPTERS.md").read_text() == render(ROOT), \
        "docs/CHAPTERS.md is stale: run `python -m course_utils.notebooks map`"


def test_every_worker_file_belongs_to_a_chapter_or_the_shared_library():
    assert set(SPINE) <= set(SHARED_LIBRARY), "the spine is shared library: list each spine file with its reason"
    assert unmapped_worker_violations(ROOT) == []


def test_the_map_follows_the_workers_a_chapters_glue_names():
    """Chapter 16's notebook names no worker; its glue does (``WORKER, TRAIN = "workers.ch16_moe", ...``), and the
    train script's package is found through the script's imports."""
    ch16 = next(ch for ch in chapters(ROOT) if ch.number == "16")
    assert {"workers/ch16_moe.py", "workers/ch16_moe_train.py"} <= set(ch16.scripts)
    assert {"workers/moe/train.py", "workers/moe/batch.py", "workers/moe/equivalence.py"} <= set(ch16.libraries)


# -- the rules catch a misplaced file (in a scratch copy of the tree) ---------------------------------------------

@pytest.fixture()
def tree(tmp_path):
    for d in SCANNED + ("docs",):
        if (ROOT / d).is_dir():
            shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "*.ipynb", "data"))
    return tmp_path


def _new(after: list[str], before: list[str]) -> list[str]:
    """What the misplaced file added (the copy may hold its own faults; the tests above judge those)."""
    return [v for v in after if v not in before]


def test_a_library_at_the_top_of_workers_is_caught(tree):
    before = rank_side_violations(tree)
    (tree / "workers" / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    (tree / "workers" / "ch04_tp_layers.py").write_text(
        (tree / "workers" / "ch04_tp_layers.py").read_text() + "\nfrom workers.helpers import double\n")
    assert _new(rank_side_violations(tree), before) == ["workers/helpers.py is not a torchrun script: move it into a topic package under workers/",
                                          "workers/helpers.py is a script but workers/ch04_tp_layers.py import(s) it: "
                                          "move what they use into a topic package"]


def test_a_script_imported_by_another_and_a_rank_importing_course_utils_are_caught(tree):
    before = rank_side_violations(tree)
    (tree / "workers" / "parallel" / "extra.py").write_text("from workers.ch13_pipeline import main\nimport course_utils.plots\n")
    assert _new(rank_side_violations(tree), before) == [
        "workers/ch13_pipeline.py is a script but workers/parallel/extra.py import(s) it: move what they use into a topic package",
        "workers/parallel/extra.py imports course_utils/plots.py: the rank side never imports course_utils"]


def test_glue_used_by_another_chapter_and_a_colliding_name_are_caught(tree):
    before = notebook_side_violations(tree)
    src = next((tree / "notebooks" / "src").glob("04_*.py"))
    src.write_text(src.read_text() + "\nfrom course_utils.ch03 import *  # noqa\n")
    (tree / "course_utils" / "attention.py").write_text("X = 1\n")
    assert _new(notebook_side_violations(tree), before) == [
        f"notebooks/src/{src.name} imports course_utils/ch03.py, chapter 03's glue: give what two chapters use a topic module",
        "course_utils/attention.py shares its name with the package workers/attention/: name it for its chapter or role"]


def test_a_worker_file_in_no_chapter_is_caught(tree):
    before = unmapped_worker_violations(tree)
    (tree / "workers" / "scratchpkg").mkdir()
    (tree / "workers" / "scratchpkg" / "__init__.py").write_text("")
    (tree / "workers" / "scratchpkg" / "helper.py").write_text("def double(x):\n    return 2 * x\n")
    (tree / "workers" / "scratchpkg" / "orphan.py").write_text("def triple(x):\n    return 3 * x\n")
    (tree / "workers" / "ch16_scratch.py").write_text(
        "from workers.scratchpkg.helper import double\n\n\ndef main(ctx):\n    return double(ctx.rank)\n")
    glue = tree / "course_utils" / "ch16.py"  # named by chapter 16's glue: the script and what it imports belong
    glue.write_text(glue.read_text() + '\nSCRATCH = "workers.ch16_scratch"\n')
    assert _new(unmapped_worker_violations(tree), before) == [
        ("workers/scratchpkg/orphan.py belongs to no chapter: name it from a chapter's notebook, glue or catalogue (or "
         "import it from one of its workers), or list it in SHARED_LIBRARY with the reason")]


def test_a_stale_map_is_caught(tree):
    (tree / "tests" / "test_ch13_new.py").write_text("def test_x():\n    pass\n")
    assert render(tree) != (tree / "docs" / "CHAPTERS.md").read_text()


# -- one vocabulary for a model's shape ---------------------------------------------------------------------------

# Other codebases' names for the same shape ("dim" alone is left out: it also names a tensor or grid dimension), and
# the course's own retired names (workers/runtime.py: RENAMED, still accepted from a learner for one release).
OTHER_SPELLINGS = {"d_model", "n_layers", "num_layers", "n_layer", "n_embd", "n_head", "hidden_size", "model_dim",
                   "num_heads", "num_attention_heads", "ffn_dim", "intermediate_size",
                   "tp_size", "n_heads", "n_kv_heads", "ffn_hidden", "zero_stage", "num_microbatches", "chunks",
                   "stages", "drill"}


def shape_spelling_violations(root: Path) -> list[str]:
    """Dataclass fields and worker parameters spelt other than ``layers, hidden, heads, kv_heads, ffn``."""
    out = []
    for path in _python_files(root):
        if not path.relative_to(root).as_posix().startswith(("workers/", "course_utils/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                names = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                         and "InitVar" not in ast.unparse(s.annotation)]  # an InitVar is an old name, accepted
            elif isinstance(node, ast.FunctionDef) and node.name in ("main", "check_params"):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
            out += [f"{path.relative_to(root).as_posix()}:{node.lineno} {node.name} spells {n}" for n in names
                    if n in OTHER_SPELLINGS]
    return out


def test_a_model_shape_has_one_spelling():
    assert shape_spelling_violations(ROOT) == []


def test_every_shape_reads_the_same_names():
    from course_utils.planner import ModelShape
    from workers.model import BlockConfig, GPTConfig

    shapes = [GPTConfig(hidden=64, heads=4), BlockConfig(hidden=64, heads=4, kv_heads=0, ffn=0),
              ModelShape("toy", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=32, mlp="gelu")]
    assert [(s.hidden, s.heads, s.kv_heads, s.ffn) for s in shapes] == [(64, 4, 4, 256)] * 3


def test_another_spelling_is_caught(tree):
    before = shape_spelling_violations(tree)
    (tree / "workers" / "model" / "gpt.py").write_text(
        (tree / "workers" / "model" / "gpt.py").read_text().replace("    hidden: int", "    d_model: int", 1))
    assert [v.split(" ", 1)[1] for v in _new(shape_spelling_violations(tree), before)] == ["GPTConfig spells d_model"]
