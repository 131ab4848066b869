"""The test suite's own comparisons fail on NaN (tests/numeric.py)."""
import math

from tests.numeric import least, worst


def test_worst_and_least_see_a_nan_wherever_it_is():
    nan = float("nan")
    assert max([1e-9, nan]) == 1e-9 and min([1.0, nan]) == 1.0  # the blind spot they exist for
    for values in ([1e-9, nan], [nan, 1e-9], [0.0, 1e-9, nan, 2e-9]):
        assert math.isnan(worst(values)) and math.isnan(least(values))
        assert not worst(values) <= 1e-6 and not least(values) > 0.5
    assert worst([1, 3, 2]) == 3 and least([1, 3, 2]) == 1
    assert worst([float("inf"), 1.0]) == float("inf")
