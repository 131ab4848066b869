"""Every worker runs unchanged under a plain ``torchrun`` from a terminal (no notebook, no results socket).

That is the promise to learners with a real cluster: the scripts in workers/ are real programs.
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ranks
ROOT = Path(__file__).resolve().parent.parent
WORKERS = sorted(p for p in (ROOT / "workers").glob("*.py")
                 if "entrypoint(main)" in p.read_text() and p.name != "runtime.py")


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("COURSE_RESULTS_ADDR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_hello_under_plain_torchrun(nproc):
    out = torchrun(ROOT / "workers" / "hello.py", nproc, "--value", "1.0")
    assert out.returncode == 0, out.stderr[-2000:]
    # every rank prints its result: the sum n + n(n-1)/2
    expected = nproc + nproc * (nproc - 1) / 2
    for rank in range(nproc):
        assert f"[rank {rank}] sum = {expected:.6g}" in out.stdout, out.stdout


@pytest.mark.parametrize("script", WORKERS, ids=lambda p: p.name)
def test_every_worker_runs_with_its_defaults_at_world_2(script):
    # A worker whose defaults are a GPU-sized run declares a CPU-sized example command line instead.
    match = re.search(r"^CPU_EXAMPLE_ARGS = (\[.*\])$", script.read_text(), re.M)
    args = ast.literal_eval(match.group(1)) if match else []
    out = torchrun(script, 2, *args)
    assert out.returncode == 0, (out.stdout[-1500:], out.stderr[-3000:])


def test_a_failing_rank_fails_torchrun_with_its_traceback():
    out = torchrun(ROOT / "workers" / "drills.py", 2, "--mode", "raise", "--bad-rank", "1")
    assert out.returncode != 0
    assert "rank 1 was told to fail" in out.stderr
