"""The learner's own copies of the chapters: ``make lab`` opens ``lab/``, never the course's ``notebooks/``.

Opening a notebook in JupyterLab changes it (the kernel adds its metadata, autosave writes it back), and running
it rewrites its outputs; if those were the course's tracked files, a learner's next ``git pull`` would conflict.
So ``make lab`` first runs ``python -m course_utils.lab prepare``: every shipped chapter gets a copy in the
git-ignored folder ``lab/`` (made once, never overwritten), and the lab opens those. ``lab/.course_copies.json``
records, per copy, a fingerprint of the course version it was made from (the cells' types and sources).

After ``git pull`` brings a new version of a chapter:

* a copy whose cells are still the ones it was made from (opened, run, saved, but not edited) is replaced by the
  new version at the next ``make lab``;
* a copy the learner edited (an exercise answered, a cell changed) is left alone and ``make lab`` says so;
  ``make lab-update CHAPTERS="03 05"`` (or ``lab-update`` alone: every edited copy with a newer version) moves
  that copy to ``lab/previous/NN_name.<date-time>.ipynb`` and puts the new version in its place. Nothing the
  learner wrote is ever deleted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_utils.paths import ROOT

SHIPPED = ROOT / "notebooks"
LAB = ROOT / "lab"
RECORD_NAME = ".course_copies.json"


def fingerprint(path: Path) -> str:
    """What makes a version of a chapter: its cells' types and sources (not outputs, ids or metadata)."""
    nb = nbformat.read(str(path), as_version=4)
    h = hashlib.sha256()
    for cell in nb.cells:
        h.update(cell.cell_type.encode() + b"\0" + cell.source.strip().encode() + b"\0")
    return h.hexdigest()


@dataclass
class Action:
    name: str  # the notebook's file name
    what: str  # "copied", "updated", "kept", "moved", "current"
    note: str = ""

    def line(self) -> str:
        return f"{self.name}: {self.note}" if self.note else f"{self.name}: {self.what}"


def _record(lab: Path) -> dict:
    path = lab / RECORD_NAME
    return json.loads(path.read_text()) if path.exists() else {}


def _install(src: Path, dst: Path, record: dict) -> None:
    shutil.copyfile(src, dst)
    record[src.name] = fingerprint(src)


def _chapters(shipped: Path, chapters: list[str] | None) -> list[Path]:
    books = sorted(shipped.glob("[0-9][0-9]_*.ipynb"))
    if not chapters:
        return books
    unknown = [c for c in chapters if not any(b.name.startswith(c) or b.stem == c for b in books)]
    if unknown:
        raise SystemExit(f"no chapter {', '.join(unknown)}: name a chapter by its number (03) or its file's stem "
                         f"({books[3].stem if len(books) > 3 else books[0].stem})")
    return [b for b in books if any(b.name.startswith(c) or b.stem == c for c in chapters)]


def prepare(shipped: Path = SHIPPED, lab: Path = LAB) -> list[Action]:
    """Copy every chapter the learner has no copy of; replace the unedited copies of chapters that changed; leave
    edited ones alone (``update`` moves them aside on request)."""
    lab.mkdir(parents=True, exist_ok=True)
    record = _record(lab)
    actions = []
    for src in _chapters(shipped, None):
        dst = lab / src.name
        new = fingerprint(src)
        if not dst.exists():
            _install(src, dst, record)
            actions.append(Action(src.name, "copied"))
        elif record.get(src.name) == new:
            actions.append(Action(src.name, "current"))
        elif record.get(src.name) == fingerprint(dst):
            _install(src, dst, record)
            actions.append(Action(src.name, "updated", "the course's new version (you had not edited your copy)"))
        else:
            actions.append(Action(src.name, "kept", "the course has a newer version; your copy is edited, so it stays: "
                                  f"`make lab-update CHAPTERS={src.name[:2]}` keeps it under lab/previous/ and "
                                  "installs the new one"))
    (lab / RECORD_NAME).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return actions


def update(chapters: list[str] | None = None, shipped: Path = SHIPPED, lab: Path = LAB) -> list[Action]:
    """Install the course's version of ``chapters`` (default: every chapter whose copy is edited and out of date),
    moving an edited copy to ``lab/previous/`` first."""
    actions = prepare(shipped, lab)
    record = _record(lab)
    wanted = {p.name for p in _chapters(shipped, chapters)} if chapters else {a.name for a in actions if a.what == "kept"}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = []
    for action in actions:
        if action.name not in wanted or action.what in ("copied", "updated"):
            out.append(action)
            continue
        src, dst = shipped / action.name, lab / action.name
        if fingerprint(dst) == fingerprint(src):
            out.append(Action(action.name, "current", "already the course's version"))
            continue
        previous = lab / "previous" / f"{Path(action.name).stem}.{stamp}.ipynb"
        previous.parent.mkdir(exist_ok=True)
        shutil.move(str(dst), previous)
        _install(src, dst, record)
        out.append(Action(action.name, "moved", f"the course's version installed; yours is {previous.relative_to(lab.parent)}"))
    (lab / RECORD_NAME).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["prepare", "update"])
    p.add_argument("chapters", nargs="*", help="chapter numbers or stems (update only; default: every edited copy "
                                               "with a newer version)")
    a = p.parse_args(argv)
    actions = prepare() if a.command == "prepare" else update(a.chapters or None)
    changed = [x for x in actions if x.what != "current"]
    for action in changed:
        print(f"lab/{action.line()}")
    if a.command == "prepare":
        print("JupyterLab opens your copies in lab/ (git-ignored): the course's notebooks/ stay as shipped, so "
              "`git pull` never conflicts with your work.")
    elif not changed:
        print("every copy in lab/ is the course's current version")
    return 0


if __name__ == "__main__":
    sys.exit(main())
