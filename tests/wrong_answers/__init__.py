"""Plausible wrong answers, one module per chapter: ``WRONG = [(exercise, function, message fragment)]``.

A wrong answer that shows one class of input at work (``course_utils.exercises.INPUT_CLASSES``: an answer caught
only because the check feeds gradients out of order, a non-divisible size, a NaN...) is marked with
``tries("order")(answer)`` after its definition; ``tests/test_exercise_coverage.py`` asks for one such answer per
class each check tries. Never as a decorator: an answer travels as its source (to the ranks, where ``tries`` does not
exist, and into a notebook cell in the browser test), decorator line included."""


def tries(*classes: str):
    """Mark a wrong answer as the one that shows the check trying ``classes``."""
    def mark(fn):
        fn.tries = tuple(classes)
        return fn
    return mark
