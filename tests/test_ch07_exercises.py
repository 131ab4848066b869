"""Chapter 07's exercises, checked in the notebook process, beyond the generic grading (tests/test_exercises.py):
malformed answers get a sentence, and any correct tiling passes."""
import pytest

from course_utils.exercises import FAIL, PASS, check, exercises
from tests.exercise_sources import solutions

CHAPTER = "07"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_three_local_exercises():
    mine = exercises(CHAPTER)
    assert {e.name for e in mine} == {"merge_attention", "forward_tile_loop", "backward_tile"}
    assert all(e.local is not None for e in mine)


@pytest.mark.parametrize("name,answer,fragment", [
    ("merge_attention", lambda *a: a[0], "return a pair"),
    ("forward_tile_loop", lambda q, k, v, causal=False, block=16: (q[:, :1], q[:, 0]), "out should have shape"),
    ("backward_tile", lambda q, k, v, out, dout, lse, scale: (v, None), "ds should be a tensor"),
    ("backward_tile", lambda q, k, v, out, dout, lse, scale: 1 / 0, "ZeroDivisionError"),
])
def test_malformed_answers_get_a_sentence_not_a_traceback(name, answer, fragment):
    verdict = check(name, answer)
    assert verdict.status == FAIL and fragment in verdict.message, verdict.message


def test_forward_check_accepts_any_correct_tiling():
    # A correct answer that ignores `block` for the tile size it uses internally, but still tiles, passes:
    # the check only forbids tensors as large as the whole score matrix.
    ref = solutions(CHAPTER).forward_tile_loop

    def smaller_tiles(q, k, v, causal=False, block=16):
        return ref(q, k, v, causal=causal, block=max(1, block // 2))

    assert check("forward_tile_loop", smaller_tiles).status == PASS
