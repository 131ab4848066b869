"""Comparisons that a NaN cannot pass.

``max([1e-9, nan])`` is 1e-9 (Python's ``max`` keeps the first of two values that do not compare greater, and
nothing compares greater than or equal to NaN), so ``assert max(errors) <= tol`` passes a run with a NaN error
anywhere but first. ``worst`` is the ``max`` to assert on."""
from __future__ import annotations

import math
from typing import Iterable


def worst(values: Iterable[float]) -> float:
    """The largest of ``values``; NaN if any of them is NaN."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def least(values: Iterable[float]) -> float:
    """The smallest of ``values``; NaN if any of them is NaN (``min`` has the same blind spot as ``max``)."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else min(values)
