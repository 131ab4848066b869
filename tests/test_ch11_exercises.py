"""Chapter 11's exercise declarations (the grading itself is in tests/test_exercises.py): the ZeRO ledger is
checked in the notebook; the sharded optimizer step, ZeRO-2's and ZeRO-3's hooks and gradient-norm clipping over
ZeRO-3's shards on 2 and 4 real ranks."""
from course_utils.exercises import exercises


def test_chapter_11_declares_a_local_exercise_and_four_on_ranks():
    by_name = {e.name: e for e in exercises("11")}
    assert set(by_name) == {"zero_state_bytes", "zero1_step", "zero2_grad_hooks", "zero3_unit_hooks",
                            "clip_grad_norm_sharded"}
    assert by_name["zero_state_bytes"].local is not None
    for name in ("zero1_step", "zero2_grad_hooks", "zero3_unit_hooks", "clip_grad_norm_sharded"):
        assert by_name[name].worker == "workers.exercises.ch11" and by_name[name].world_sizes == (2, 4)


def test_the_collective_log_puts_torch_distributed_back_even_when_the_answer_raises():
    # The ranks stay warm between checks: a collective left wrapped would log (and slow) every later exercise.
    import pytest
    import torch.distributed as dist

    from workers.exercises.ch11 import COLLECTIVES, CollectiveLog

    before = {name: getattr(dist, name) for name in COLLECTIVES}
    with pytest.raises(ZeroDivisionError), CollectiveLog():
        assert dist.all_reduce is not before["all_reduce"]
        1 / 0
    assert {name: getattr(dist, name) for name in COLLECTIVES} == before
