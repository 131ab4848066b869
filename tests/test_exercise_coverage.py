"""Every exercise says what its check tries, class by class, and shows each class at work with a wrong answer.

``course_utils.exercises.INPUT_CLASSES`` names the classes of input a check can try (NaN, out-of-order gradients,
non-divisible sizes, ragged partitions, several layouts, traffic, mutated inputs, output device and dtype, memory
released, bits). Each exercise's ``tries`` describes every class, or says why it does not apply; for each class it
does try, ``tests/wrong_answers/chNN.py`` holds an answer marked ``@tries(class)`` that
``tests/test_exercises.py`` runs and requires caught with its reason. These tests need no ranks: they read the
catalogue and the wrong answers.
"""
import pytest

from course_utils.exercises import INPUT_CLASSES, coverage_problems, coverage_table, exercises
from course_utils.paths import ROOT
from tests.exercise_sources import wrong_answers

ALL = exercises()


@pytest.mark.parametrize("ex", ALL, ids=lambda e: e.name)
def test_every_exercise_describes_every_input_class(ex):
    assert not coverage_problems(ex), "\n".join(coverage_problems(ex))


@pytest.mark.parametrize("ex", ALL, ids=lambda e: e.name)
def test_every_class_a_check_tries_has_a_wrong_answer_that_shows_it(ex):
    shown = {c for name, fn, _ in wrong_answers(ex.chapter) if name == ex.name for c in getattr(fn, "tries", ())}
    unknown = shown - set(INPUT_CLASSES)
    assert not unknown, f"{ex.name}: wrong answers marked with unknown classes {sorted(unknown)}"
    missing = [c for c in INPUT_CLASSES if ex.applies(c) and c not in shown]
    assert not missing, (f"{ex.name}: its check tries {missing} but no wrong answer in "
                         f"tests/wrong_answers/ch{ex.chapter}.py is marked @tries(...) for them")
    claimed = [c for c in shown if not ex.applies(c)]
    assert not claimed, f"{ex.name}: wrong answers marked {claimed}, which the catalogue calls not applicable"


def test_the_exercise_table_is_up_to_date():
    assert (ROOT / "docs" / "EXERCISES.md").read_text() == coverage_table(), \
        "docs/EXERCISES.md is stale: run `python -m course_utils.exercises table > docs/EXERCISES.md`"


def test_a_missing_class_is_named():
    from course_utils.exercises import NOT_APPLICABLE, Exercise

    ex = Exercise("x", "99", "f", "t", local=print, tries={"order": NOT_APPLICABLE + "no"})
    problems = "\n".join(coverage_problems(ex))
    assert "'non-finite'" in problems and "'order' is not applicable without saying why" in problems


@pytest.mark.parametrize("chapter", sorted({e.chapter for e in ALL}))
def test_no_wrong_answer_carries_a_decorator(chapter):
    """A wrong answer travels as its source, decorator lines included: to the ranks (where ``@tries`` would raise
    NameError before the check looks at the answer) and into a notebook cell (the browser test types one in).
    Answers are marked after their definition, ``tries("order")(answer)``."""
    import inspect

    decorated = [fn.__name__ for _, fn, _ in wrong_answers(chapter) if inspect.getsource(fn).lstrip().startswith("@")]
    assert not decorated, f"chapter {chapter}: mark these after their definition instead: {decorated}"
