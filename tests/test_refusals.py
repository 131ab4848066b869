"""The refusal kit (``workers/runtime.py``): the sentences every worker's ``check_params`` is made of, and the old
parameter names a learner's saved notebook may still pass.

Start here when writing a ``check_params``: each helper returns a clause or None, ``refusal`` joins the clauses that
apply into one sentence, and the launcher (a notebook) and ``entrypoint`` (a terminal) both refuse with it before any
process group exists.
"""
import subprocess
import sys
import warnings

import pytest

import course_utils as cu
from course_utils.paths import ROOT
from course_utils.results import InvalidParameter
from workers.runtime import (RENAMED, at_least, batch_over_world, choose_divisor, divides, one_of, refusal,
                             rename_params)


def test_each_helper_names_the_value_and_what_to_choose():
    assert divides("tp", 3, "heads", 8) == "tp=3 does not divide heads=8: choose 1, 2, 4 or 8"
    assert divides("tp", 2, "heads", 8) is None
    assert divides("tp", 0, "heads", 8).startswith("tp=0 does not divide")
    assert divides("tp", 2, "heads", 0) == "heads=0 must be at least 1"  # no divisor list of nothing
    assert choose_divisor(28672) == "choose a divisor of 28672"  # past eight divisors, the rule
    assert one_of("split", "striped", ("contiguous", "zigzag")) == \
        "split='striped' is not one of 'contiguous' or 'zigzag'"
    assert one_of("split", "zigzag", ("contiguous", "zigzag")) is None
    assert at_least("steps", 0) == "steps=0 must be at least 1" and at_least("steps", True) is not None
    assert at_least("lr", 0.0, 0) is None
    assert batch_over_world(10, 4) == "global_batch=10 does not split evenly over world_size=4 (choose a positive " \
                                      "multiple of 4)"
    assert batch_over_world(0, 4) is not None and batch_over_world(8, 4) is None


def test_refusal_joins_every_clause_that_applies_into_one_sentence():
    why = refusal(at_least("steps", 0), None, one_of("dtype", "int8", ("float32",)), batch_over_world(8, 4))
    assert why == "steps=0 must be at least 1; dtype='int8' is not one of 'float32'"
    assert refusal(None, None) is None


def test_an_old_keyword_is_renamed_with_a_warning_that_names_both():
    with pytest.warns(FutureWarning, match="tp_size= is now called tp="):
        assert rename_params({"tp_size": 2, "seq": 8}) == {"tp": 2, "seq": 8}
    assert set(RENAMED.values()) >= {"tp", "heads", "kv_heads", "ffn", "virtual_stages", "zero", "micro_batches",
                                     "fault"}


@pytest.mark.ranks
def test_a_saved_notebook_that_passes_an_old_name_still_runs():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = cu.run("workers.ch15_composed", world_size=2, dp=1, pp=2, micro_batches=2, chunks=1, steps=1,
                     drill="tied_not_reduced", report=False, timeout=120)
    assert res[0]["layout"]["virtual_stages"] == 1 and res[0]["config"]["fault"] == "tied_not_reduced"
    named = " ".join(str(w.message) for w in seen if issubclass(w.category, FutureWarning))
    assert "chunks= is now called virtual_stages=" in named and "drill= is now called fault=" in named


@pytest.mark.ranks
def test_a_worker_refuses_from_a_terminal_with_the_same_sentence():
    with pytest.raises(InvalidParameter) as notebook:
        cu.run("workers.ch15_composed", world_size=2, tp=3)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "workers/ch15_composed.py", "--tp", "3"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert str(notebook.value) in out.stderr  # before any process group: the same sentence, nothing launched


def _main_block_calls(tree) -> set[str]:
    import ast

    calls = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            calls |= {ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    return calls


def test_every_worker_with_a_refusal_runs_it_from_a_terminal_too():
    """A worker's ``check_params`` is what a notebook's launch refuses with; ``entrypoint`` runs it from a terminal.
    A worker that started its ranks another way would let ``torchrun workers/x.py --bad 3`` create process groups
    and fail deep inside, so every worker that has a refusal must start through ``entrypoint``."""
    import ast

    offenders = []
    for path in sorted((ROOT / "workers").rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "check_params" for n in tree.body):
            if "entrypoint" not in _main_block_calls(tree):
                offenders.append(path.relative_to(ROOT).as_posix())
    assert not offenders, f"these workers refuse from a notebook but not from a terminal: {offenders}"
