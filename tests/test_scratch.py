"""Notebook scratch folders: one run's files at most, under build/, never in /tmp."""
import os
import re
import subprocess
import sys

import pytest

from course_utils.scratch import SCRATCH, scratch_dir
from course_utils.paths import ROOT



def test_asking_again_empties_the_folder():
    first = scratch_dir("test_scratch")
    (first / "old.pt").write_bytes(b"x" * 10)
    (first / "sub").mkdir()
    second = scratch_dir("test_scratch")
    assert second == first and second.is_dir() and not any(second.iterdir())
    assert SCRATCH in second.parents and (ROOT / "build") in second.parents  # build/ is git-ignored
    second.rmdir()


@pytest.mark.parametrize("bad", ["", "..", "a/b", "../etc"])
def test_names_cannot_escape_the_scratch_folder(bad):
    with pytest.raises(ValueError, match="letters, digits"):
        scratch_dir(bad)


def test_no_notebook_writes_temporary_directories_that_outlive_its_kernel():
    # A TemporaryDirectory or mkdtemp made in a notebook is left in /tmp when the kernel is stopped (Jupyter and
    # papermill stop kernels without running finalizers): chapter 08 left 100 MB of checkpoints per run that way.
    offenders = [src.name for src in sorted((ROOT / "notebooks" / "src").glob("*.py"))
                 if re.search(r"\b(mkdtemp|TemporaryDirectory)\(", src.read_text())]
    assert not offenders, f"use course_utils.scratch.scratch_dir in {offenders}"


def test_course_scratch_dir_moves_the_folders(tmp_path):
    """Two executions of the chapters at once (make test: papermill beside nbval) each get their own."""
    out = subprocess.run([sys.executable, "-c", "from course_utils.scratch import scratch_dir; print(scratch_dir('x'))"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env=dict(os.environ, COURSE_SCRATCH_DIR=str(tmp_path / "mine")))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "mine" / "x") and (tmp_path / "mine" / "x").is_dir()
