"""Plausible wrong answers, one module per chapter: ``WRONG = [(exercise, function, message fragment)]``."""
