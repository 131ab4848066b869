"""Chapter 00's exercise checks beyond the generic ones in tests/test_exercises.py: all four are checked in the
notebook process, and the layout exercise accepts any layout the planner says fits."""
from course_utils.exercises import FAIL, PASS, exercises


def test_chapter_00_declares_its_four_exercises_locally():
    mine = exercises("00")
    assert {e.name for e in mine} == {"zero_total_bytes", "layout_70b", "min_gpus_fsdp", "max_tp"}
    assert all(e.local is not None and e.worker is None for e in mine)


def test_the_reference_layout_is_checked_by_the_planner_not_by_a_fixed_answer():
    # Several layouts fit; the check must accept any of them and refuse one that does not fit.
    from course_utils.catalogue.ch00 import check_layout_70b

    assert check_layout_70b(lambda: dict(tp=8, pp=1, dp=32, zero=1))[0] == PASS
    assert check_layout_70b(lambda: dict(tp=4, pp=8, dp=8, zero=1))[0] == PASS
    status, message = check_layout_70b(lambda: dict(tp=1, pp=1, dp=256, zero=3))
    assert status == FAIL and "activations" in message
