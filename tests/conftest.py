import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Tests get their own job registry so a test that reaps cannot touch a learner's notebook jobs.
os.environ.setdefault("COURSE_CACHE_DIR", str(ROOT / ".pytest_cache" / "course"))


@pytest.fixture(scope="session", autouse=True)
def _stop_warm_ranks():
    yield
    from course_utils import shutdown_pools

    shutdown_pools()


@pytest.fixture(scope="module")
def one_thread():
    """Small tensor ops on a shared 2-core machine: a second OpenMP thread mostly waits on the first."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_runtest_logreport(report):
    """A wrong answer's row of the mutation report, from its test's report: in the process that prints the summary,
    which with pytest-xdist (make test's -n) is not the one that ran the test."""
    if report.when == "call":
        from tests.exercise_sources import MUTANT, MUTANTS

        MUTANTS.extend(value for name, value in report.user_properties if name == MUTANT)


def pytest_terminal_summary(terminalreporter):
    """The mutation report (tests/exercise_sources.py: mutation_report) after any run of the wrong-answer tests."""
    from tests.exercise_sources import MUTANTS, mutation_report

    if MUTANTS:
        terminalreporter.write_sep("-", "mutation report: every wrong answer in tests/wrong_answers/ against its check")
        terminalreporter.write_line(mutation_report(MUTANTS))
