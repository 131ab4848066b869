"""Every worker is a real program: it runs unchanged under a plain ``torchrun`` from a terminal (no notebook,
no results socket), and its ``main`` runs with its defaults on real ranks.

That is the promise to learners with a real cluster. The glue that makes a worker a torchrun script is one
function, ``runtime.entrypoint`` (command line from ``main``'s signature, process group, printed results),
so plain torchrun is exercised on a few workers, and every worker's command line is parsed and its
defaults run on two warm ranks (a cold torchrun per worker would cost ten seconds each on this machine).
"""
import ast
import contextlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import course_utils as cu
from workers.runtime import _cli_params
from course_utils.paths import ROOT

pytestmark = [pytest.mark.ranks, pytest.mark.once]  # command lines and process handling, with whole-number results: the same on every CPU
WORKERS = sorted(p for p in (ROOT / "workers").glob("*.py")
                 if "entrypoint(main)" in p.read_text() and p.name != "runtime.py")
UNDER_PLAIN_TORCHRUN = ["ch03_mappings.py", "ch11_zero1.py"]  # groups; a model, an optimizer, broadcast


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The learner's command line, exactly; its torchelastic_* log folder goes to a temporary TMPDIR, removed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TMPDIR=tmp)
        env.pop("COURSE_RESULTS_ADDR", None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(script), *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def example_args(script: Path) -> list[str]:
    """A worker whose defaults are a GPU-sized run declares a CPU-sized example command line instead."""
    match = re.search(r"^CPU_EXAMPLE_ARGS = (\[.*\])$", script.read_text(), re.M)
    return ast.literal_eval(match.group(1)) if match else []


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_hello_under_plain_torchrun(nproc):
    out = torchrun(ROOT / "workers" / "hello.py", nproc, "--value", "1.0")
    assert out.returncode == 0, out.stderr[-2000:]
    # every rank prints its result: the sum n + n(n-1)/2
    expected = nproc + nproc * (nproc - 1) / 2
    for rank in range(nproc):
        assert f"[rank {rank}] sum = {expected:.6g}" in out.stdout, out.stdout


@pytest.mark.parametrize("name", UNDER_PLAIN_TORCHRUN)
def test_chapter_workers_under_plain_torchrun(name):
    script = ROOT / "workers" / name
    out = torchrun(script, 2, *example_args(script))
    assert out.returncode == 0, (out.stdout[-1500:], out.stderr[-3000:])
    assert "[rank 1]" in out.stdout, out.stdout[-1500:]  # results printed by every rank


@contextlib.contextmanager
def _quorum_replica(tmp_path):
    """workers/ch17_quorum.py runs one rank per replica group beside a torchft lighthouse that the notebook starts:
    here, one replica alone (min_replicas 1) with a lighthouse of its own, as its command line in a terminal would."""
    from course_utils.ch17_quorum import lighthouse

    with lighthouse(min_replicas=1) as address:
        yield 1, {"lighthouse": address, "replicas": 1, "min_replicas": 1, "run_dir": str(tmp_path)}


# the world size and extra settings a worker needs beyond its defaults, from what its notebook starts beside it
BESIDE = {"ch17_quorum.py": _quorum_replica}


@pytest.mark.parametrize("script", WORKERS, ids=lambda p: p.name)
def test_every_worker_parses_its_command_line_and_runs_its_defaults_at_world_2(script, tmp_path):
    module = importlib.import_module(f"workers.{script.stem}")
    params = _cli_params(module.main, example_args(script))  # what `torchrun script.py` would pass to main
    beside = BESIDE.get(script.name, lambda _: contextlib.nullcontext((2, {})))
    with beside(tmp_path) as (world_size, extra):
        res = cu.run(f"workers.{script.stem}", world_size=world_size, timeout=180, **{**params, **extra})
    assert len(res.ranks) == world_size


def test_a_failing_rank_fails_torchrun_with_its_traceback():
    out = torchrun(ROOT / "workers" / "rank_faults.py", 2, "--mode", "raise", "--bad-rank", "1")
    assert out.returncode != 0
    assert "rank 1 was told to fail" in out.stderr
