"""Chapter 02's exercise declarations (the grading itself is in tests/test_exercises.py)."""
from course_utils.exercises import exercises
from tests.wrong_answers.ch02 import WRONG


def test_chapter_has_the_four_exercises_graded_at_world_2_and_4():
    mine = exercises("02")
    assert {e.name for e in mine} == {"ddp_by_hand", "bucketed_average", "shard_indices", "overlapped_hooks"}
    assert {name for name, _, _ in WRONG} == {e.name for e in mine}
    assert all(e.worker is not None and e.world_sizes == (2, 4) for e in mine)
