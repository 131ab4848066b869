"""Chapter 13 beside PyTorch's own pipeline schedules (``workers/ch13_native.py``): start here.

The same model, data and cut as ``workers/ch13_pipeline.py``, each chunk a ``torch.distributed.pipelining``
``PipelineStage``, run by ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` (at one
chunk per rank it is ZB-H1; at two, PyTorch's looped ZB-H1), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on
gloo, CPU, float64. Three things are checked against something independent of PyTorch:

* the numbers, against the single-process reference (``workers/pipeline/reference.py: reference_step_in``): every
  step's loss, every gradient, the weights after three SGD steps, for every pipeline copy (p = 2 runs two side by
  side on the 4 ranks). Only the order of the additions differs (m micro-batches' gradients summed against one
  batch), so they agree to a few ulps: 1e-12 absolute on values of order 1e-4 to 1, where a dropped micro-batch or
  a gradient scaled by m twice is off by more than 1e-6;
* PyTorch's tables (``pipeline_order``, read as course tuples by ``workers/pipeline/native.py``), against the course's
  validity checker and the course's own tables;
* what its runtime executes (``pipeline_order_with_comms``), against the course's messages for the same table
  (``validity.with_messages``).

All runs share one cold start of 4 warm ranks; each takes a fraction of a second.
"""
import pytest
import torch

import course_utils as cu
from course_utils import ch13
from course_utils.results import InvalidParameter
from tests.numeric import worst
from workers.pipeline import native
from workers.pipeline.model import PipelineConfig, make_model
from workers.pipeline.reference import reference_step_in
from workers.pipeline.schedules import all_stages
from workers.pipeline.validity import check_schedule, table_problem
from workers.pipeline.zero_bubble import split_stages

WORKER, WORLD, LIMITS = "workers.ch13_native", 4, {"timeout": 90}
F64_ATOL = 1e-12
STEPS = 3


def run(schedule, p, m, v=1, steps=STEPS, **kw):
    return cu.run(WORKER, world_size=WORLD, schedule=schedule, pp=p, micro_batches=m, virtual_stages=v, steps=steps,
                  **kw, **LIMITS)


def tuples(rows):
    """The results protocol returns tuples as lists: back to the course's tuples."""
    return [[tuple(a) for a in row] for row in rows]


# --- reading PyTorch's actions (no ranks) --------------------------------------------------------------------------

def test_pytorchs_actions_read_as_the_courses_tuples():
    from torch.distributed.pipelining.schedules import _Action

    def read(text, p, chunks, placement, split=True, comms=False):
        return native.to_course(_Action.from_str(text), p, chunks, placement, split, comms)

    # V at p = 2: virtual stage 3 is rank 0's chunk 1, stage 2 rank 1's chunk 1
    assert read("3I0", 2, 2, "v") == [("B", 0, 1)]  # BACKWARD_INPUT is the course's B in a table with W
    assert read("2W3", 2, 2, "v") == [("W", 3, 1)]
    # DualPipeV's overlapped pair runs its sub-actions in order; its full backward is B then W
    assert read("(0F3;3B1)OVERLAP_F_B", 2, 2, "v") == [("F", 3, 0), ("B", 1, 1), ("W", 1, 1)]
    # round the ranks at p = 2: stage 3 is rank 1's chunk 1; one chunk per rank writes pairs
    assert read("3F2", 2, 2, "loop") == [("F", 2, 1)]
    assert read("1B2", 2, 1, "loop", split=False) == [("B", 2)]  # 1F1B: B is the whole backward
    # what has no counterpart among the course's compute actions is left out, messages only when asked for
    assert read("0REDUCE_GRAD", 2, 1, "loop") == [] and native.to_course(None, 2, 1, "loop", False) == []
    assert read("1SEND_F2", 2, 1, "loop") == []
    assert read("1SEND_F2", 2, 1, "loop", comms=True) == [("send_forward", 2)]
    assert read("2RECV_B0", 2, 2, "v", comms=True) == [("recv_backward", 0, 1)]
    with pytest.raises(ValueError, match="no counterpart"):
        native.to_course(_Action(0, "X", 0), 2, 1, "loop", False)


def test_a_table_is_split_if_any_rank_has_weight_actions():
    from torch.distributed.pipelining.schedules import _Action

    order = {0: [_Action.from_str(a) for a in ("0F0", "0B0")], 1: [_Action.from_str(a) for a in ("1F0", "1I0", "1W0")]}
    assert native.course_rows(order, 2, 1, "loop") == [[("F", 0), ("B", 0), ("W", 0)], [("F", 0), ("B", 0), ("W", 0)]]


# --- on real ranks ---------------------------------------------------------------------------------------------------

RUNS = [("1f1b", 2, 4, 1), ("1f1b", 2, 5, 1), ("1f1b", 4, 8, 1),
        ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
        ("zb-h1", 2, 4, 1), ("zb-h1", 4, 3, 1), ("zb-h1", 4, 8, 1),
        ("zb-h1", 2, 4, 2), ("zb-h1", 4, 8, 2),  # PyTorch's looped ZB-H1: no course table beside it
        ("zb-v", 2, 1, 2), ("zb-v", 2, 4, 2), ("zb-v", 4, 5, 2), ("zb-v", 4, 8, 2),
        ("dualpipev", 2, 4, 2), ("dualpipev", 2, 7, 2), ("dualpipev", 4, 8, 2), ("dualpipev", 4, 10, 2)]


def assert_equals_one_process(res, steps=STEPS):
    cfg = PipelineConfig(**res[0]["config"])
    ref = reference_step_in(cfg, torch.float64, steps=steps)
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3  # training moved: equal weights say something
    p = res[0]["pp"]
    for pipe in range(WORLD // p):  # every copy of the pipeline
        for key in ("grads", "weights"):
            got = ch13.merged(res, key, pipe)
            assert sorted(got) == sorted(ref[key])  # all 16 parameters, each on exactly one rank
            assert all(got[n].dtype == torch.float64 for n in got)
            err = worst((got[n] - ref[key][n]).abs().max().item() for n in ref[key])
            assert err <= F64_ATOL, (key, pipe, err)
        rows = ch13.pipeline_ranks(res, pipe)
        (loss_row,) = [d for d in rows if d["stage"] == d["loss_stage"]]
        assert loss_row["stage"] == (0 if loss_row["placement"] == "v" else p - 1)  # the V ends on rank 0
        assert worst(abs(a - b) for a, b in zip(loss_row["losses"], ref["losses"], strict=True)) <= F64_ATOL


@pytest.mark.ranks
@pytest.mark.parametrize("schedule, p, m, v", RUNS)
def test_pytorchs_schedule_equals_one_process_and_its_table_the_courses(schedule, p, m, v):
    res = run(schedule, p, m, v)
    d = res[0]
    assert [r["refused"] for r in res.ranks] == [None] * WORLD
    assert d["torch_class"] == native.NATIVE_CLASSES[schedule] and d["torch"] == torch.__version__
    assert_equals_one_process(res)

    # every rank derives the whole table, as the course's ranks do: all four report the same one
    assert all(r["torch_table"] == d["torch_table"] and r["table"] == d["table"] for r in res.ranks)
    table, placement = tuples(d["table"]), d["placement"]
    ours = native.course_table(schedule, p, m, v)
    assert (ours is None) == (schedule == "zb-h1" and v == 2)  # the looped ZB-H1 is the one the course does not build
    if schedule == "1f1b":
        # Schedule1F1B's pipeline_order is a description its own loop does not read (it runs _step_microbatches),
        # and on the last rank it is off by one in torch 2.13: its forwards are numbered 1..m (the counter is bumped
        # before its first use when that rank has no warm-up). The course's checker names it; the other ranks' lists
        # are the course's 1F1B exactly. (If a later torch fixes it, this assertion fails: then the table is ours.)
        assert table_problem(table, m) == (f"rank {p - 1} runs F of micro-batch {m} on stage {p - 1}, but the "
                                           f"micro-batches are 0 to {m - 1}")
        assert [a for a in table[-1] if a[0] == "F"] == [("F", i) for i in range(1, m + 1)]
        assert table[:-1] == ours[:-1]
        assert [c["equal"] for c in d["comparison"]] == [True] * (p - 1) + [False]
        assert d["comparison"][-1] == {"equal": False, "same_actions": False, "first_difference": 0,
                                       "torch_there": ["F", 1], "course_there": ["F", 0]}
        assert d["table_with_comms"] is None  # a single-stage schedule has no lowered table
    else:
        check_schedule(table, m, placement)  # complete per rank, dependencies kept, no deadlock on the wire
        if ours is not None:
            # ZB-V and DualPipeV (and interleaved 1F1B, ZB-H1) at these sizes: PyTorch's order of F, B and W on
            # every rank is the course's, action for action
            assert table == ours, [c for c in d["comparison"] if not c["equal"]]
            assert all(c["equal"] for c in d["comparison"])
        check_lowered(tuples(d["table_with_comms"]), table, placement)


def check_lowered(lowered, table, placement):
    """What PyTorch's runtime executes: its compute actions are the table's, in the table's order; its messages are
    the ones the course's ``with_messages`` derives from the same table; each receive comes before the action that
    needs it and each send after the one that produced it. The order of the messages is not the course's: PyTorch's
    lowering (``_add_send_recv``) replays every rank's table round-robin and puts a receive into the receiver's list
    where the sender's send is placed, and its runtime posts it there as an ``irecv``, waited for at the compute; the
    course's wire model receives, blocking, right before the compute."""
    compute = [[a for a in row if a[0] in ("F", "B", "W")] for row in lowered]
    assert compute == table
    theirs = [[a for a in row if a[0] not in ("F", "B", "W")] for row in lowered]
    ours = native.messages_of(table, placement)
    assert [sorted(row) for row in theirs] == [sorted(row) for row in ours]
    for row in lowered:
        at = {a: n for n, a in enumerate(row)}
        for a, n in at.items():
            kind, where = a[0], a[1:]
            if kind in ("recv_forward", "recv_backward"):
                assert n < at[("F" if kind == "recv_forward" else "B", *where)], (a, row)
            elif kind in ("send_forward", "send_backward"):
                assert n > at[("F" if kind == "send_forward" else "B", *where)], (a, row)


@pytest.mark.ranks
def test_zb_v_side_by_side_at_p2_m4():
    # The chapter's example: PyTorch's ZB-V table at p = 2, m = 4 in its own spelling (virtual stage, kind,
    # micro-batch; "3I0" is stage 3's input gradient of micro-batch 0) and read as the course's tuples.
    d = run("zb-v", 2, 4, 2, steps=1)[0]
    assert d["torch_table"][0][:6] == ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0"]  # rank 0: stages 0 and 3 (the loss)
    assert d["torch_table"][1][:3] == [None, "1F0", "2F0"]  # an idle slot: its first input is still on its way
    assert tuples(d["table"]) == split_stages("zb-v", 2, 4)
    print("\n" + ch13.side_by_side(d))


@pytest.mark.ranks
def test_pytorchs_default_scaling_gives_the_same_step():
    # scaling="grads": the plain mean per micro-batch and scale_grads=True (PyTorch divides the summed gradients by m
    # after the last backward) against the course's loss / m with scale_grads=False. At m = 4 dividing by m is exact
    # (a power of two), so the two are equal bit for bit; at m = 5 they round differently but both stay within
    # 1e-12 of one process.
    course, default = (run("zb-v", 2, 4, 2, scaling=s) for s in ("loss", "grads"))
    for key in ("grads", "weights"):
        a, b = ch13.merged(course, key), ch13.merged(default, key)
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a), key
    assert course[0]["losses"] == default[0]["losses"]
    assert_equals_one_process(run("dualpipev", 2, 5, 2, scaling="grads"))


# PyTorch's own rules for the micro-batches, which the course's executor does not share: its exception comes back as
# `refused` on every rank (after an all-gather, so none is left waiting), and the warm ranks run on.
@pytest.mark.ranks
@pytest.mark.parametrize("schedule, p, m, v, words", [
    ("1f1b", 4, 2, 1, r"ValueError: Number of microbatches \(2\) must be greater than or equal to the number of "
                      r"stages \(4\)"),
    ("dualpipev", 4, 6, 2, r"ValueError: DualPipeV requires at least as many microbatches as stages, but got 6 "
                           r"microbatches and 8 stages"),
    ("interleaved", 4, 9, 2, r"ValueError: Interleaved 1F1B requires the number of microbatches to be a multiple of "
                             r"the number of rounds \(2\), but got 9"),
])
def test_pytorchs_refusal_is_reported_by_every_rank(schedule, p, m, v, words):
    import re

    res = run(schedule, p, m, v)
    said = {r["refused"] for r in res.ranks}
    assert len(said) == 1 and re.match(words, said.pop())
    assert all(r["refused_in"] == "schedule" and r["refused_by"] == 0 for r in res.ranks)
    assert all(r["losses"] == [] and r["grads"] == {} and r["torch_table"] is None for r in res.ranks)
    # nothing ran: every rank's weights are still the seeded model's, bit for bit
    seeded = {n: q.detach().double() for n, q in make_model(PipelineConfig(**res[0]["config"])).named_parameters()}
    got = ch13.merged(res, "weights")
    assert sorted(got) == sorted(seeded) and all(torch.equal(got[n], seeded[n]) for n in seeded)
    # where the course builds a table for these sizes, its checker accepts it: the rule is PyTorch's, not the
    # pipeline's (the course's 1F1B warms up with min(p - s - 1, m) forwards)
    ours = native.course_table(schedule, p, m, v)
    assert res[0]["course_table"] == ([[list(a) for a in row] for row in ours] if ours else None)
    if schedule == "1f1b":
        check_schedule(all_stages("1f1b", p, m), m)
    assert_equals_one_process(run("1f1b", 4, 4))  # the same warm ranks, the next run


@pytest.mark.parametrize("params, fragment", [
    ({"schedule": "gpipe"}, "schedule='gpipe' is not one of '1f1b', 'interleaved', 'zb-h1', 'zb-v' or 'dualpipev'"),
    ({"schedule": "zb-v"}, "schedule='zb-v' holds two chunks per rank in a V: set virtual_stages=2, not 1"),
    ({"schedule": "interleaved"}, "the interleaved schedule needs pp >= 2 and virtual_stages >= 2"),
    ({"pp": 3}, "pp=3 does not divide the 4 ranks: choose 1, 2 or 4"),
    ({"layers": 6}, "pp=4 does not divide layers=6 into equal stages"),
    ({"schedule": "zb-v", "virtual_stages": 2, "layers": 12}, "pp x virtual_stages = 8 does not divide layers=12"),
    ({"schedule": "zb-h1", "virtual_stages": 3}, "pp x virtual_stages = 12 does not divide layers=8 into equal chunks"),
    ({"schedule": "zb-h1", "virtual_stages": 0}, "virtual_stages=0 must be at least 1"),
    ({"scaling": "sum"}, "scaling='sum' is not one of 'loss' or 'grads'"),
])
def test_what_the_courses_model_needs_is_refused_before_launch(params, fragment):
    with pytest.raises(InvalidParameter, match=fragment):
        cu.run(WORKER, world_size=WORLD, **params, **LIMITS)


def test_the_courses_messages_for_a_v_table_leave_out_the_hand_off():
    # ZB-V at p = 2, m = 1: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. Stage 1 hands its output to stage 2
    # (and stage 2 its gradient to stage 1) in memory, on rank 1: four messages per rank, none for the hand-off.
    # PyTorch's runtime skips the same one ("V-schedule special case"), so its lowered messages can be set beside these.
    msgs = native.messages_of(split_stages("zb-v", 2, 1), "v")
    assert msgs == [[("send_forward", 0, 0), ("recv_forward", 0, 1), ("send_backward", 0, 1), ("recv_backward", 0, 0)],
                    [("recv_forward", 0, 0), ("send_forward", 0, 1), ("recv_backward", 0, 1), ("send_backward", 0, 0)]]
