"""Chapter 02's exercise declarations (the grading itself is in tests/test_exercises.py)."""
from course_utils.exercises import exercises
from tests.wrong_answers.ch02 import WRONG


def test_chapter_has_the_four_exercises_graded_at_world_2_and_4():
    mine = exercises("02")
    assert {e.name for e in mine} == {"ddp_by_hand", "bucketed_average", "shard_indices", "overlapped_hooks"}
    assert {name for name, _, _ in WRONG} == {e.name for e in mine}
    assert all(e.worker is not None and e.world_sizes == (2, 4) for e in mine)


def test_the_overlap_check_feeds_gradients_out_of_their_listed_order():
    # The second overlap case is there for LayerNorm's backward, which gives its weight's gradient before its bias's
    # while the buckets list the bias first; if autograd ever kept the listed order, that case would try nothing.
    from workers.data_parallel.model import Setup, loss_fn, make_batches
    from workers.exercises.ch02 import OVERLAP_CASES

    _, build, _, _ = OVERLAP_CASES[1]
    model = build(Setup())
    names = [name for name, _ in model.named_parameters()]
    arrived = []
    for name, p in model.named_parameters():
        p.register_hook(lambda _grad, name=name: arrived.append(name))
    x, y = make_batches(Setup(), steps=1)[0]
    loss_fn(model(x), y).backward()
    assert arrived.index("norm.weight") < arrived.index("norm.bias")
    assert names.index("norm.weight") < names.index("norm.bias")  # listed last first: bias, then weight
