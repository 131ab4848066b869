"""PyTorch's own pipeline schedules (``torch.distributed.pipelining``) read as the course's action tables.

``workers/ch13_native.py`` runs chapter 13's model through ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``. Each of them keeps its plan
as data, one list per rank, as the course does: ``pipeline_order`` (the compute actions, ``None`` where the rank
idles) and, for the multi-stage ones, ``pipeline_order_with_comms`` (what its runtime executes: the same computations
with ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` and ``REDUCE_GRAD`` put in). An entry is an ``_Action``:
``(stage_index, computation_type, microbatch_index, sub_actions)``, printed ``3I0`` (virtual stage 3, input
gradient, micro-batch 0). This file turns those into the course's tuples, so that ``validity.check_schedule``,
``with_messages`` and a printout can take PyTorch's table as they take ours:

    PyTorch        course                     why
    F              ("F", i, c)
    I              ("B", i, c)                BACKWARD_INPUT is the course's B in a table that has W actions
    W              ("W", i, c)
    B              ("B", i, c)                FULL_BACKWARD in a table without W: the course's whole backward
                   ("B", i, c), ("W", i, c)   ... in a table with W (DualPipeV's full backwards): B then W, one call
    OVERLAP_F_B    its sub-actions, in order  DualPipeV's overlapped pair; the runtime runs them one after the other
    None           nothing                    an idle slot of PyTorch's own simulation, not an action
    REDUCE_GRAD    nothing                    after a stage's last backward: the 1/m scaling of its gradients
    UNSHARD ...    nothing                    FSDP's gathers; there is no FSDP here
    SEND_F ...     ("send_forward", i, c) ... only in the with-comms table (``with_messages``' names)

``c`` is the chunk: the position of the virtual stage on its rank (``zero_bubble.rank_of``, in the V or round the
ranks); with one chunk per rank the tuple is a pair, ``("F", i)``, as the course writes it. The attributes are read
by their string values, so this file imports nothing from ``torch.distributed.pipelining``: its tests run without
a process group, on hand-written actions.
"""
from __future__ import annotations

from workers.pipeline.schedules import all_stages
from workers.pipeline.validity import with_messages
from workers.pipeline.zero_bubble import placed_stage, rank_of, split_stages

# the worker's schedule names: the course's where the course has the same schedule, and PyTorch's class for each
NATIVE_CLASSES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                  "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                  "dualpipev": "ScheduleDualPipeV"}
NATIVE_SCHEDULES = tuple(NATIVE_CLASSES)
V_NATIVE = ("zb-v", "dualpipev")  # two stages per rank, in a V (PyTorch's ``style="v"`` stage-to-rank mapping)

COMPUTE = {"F": "F", "I": "B", "W": "W"}
MESSAGES = {"SEND_F": "send_forward", "RECV_F": "recv_forward", "SEND_B": "send_backward", "RECV_B": "recv_backward"}
SKIPPED = ("REDUCE_GRAD", "UNSHARD", "RESHARD")


def placement_of(schedule: str) -> str:
    return "v" if schedule in V_NATIVE else "loop"


def chunks_of(schedule: str, virtual_stages: int) -> int:
    return 2 if schedule in V_NATIVE else virtual_stages


def held_stages(schedule: str, num_stages: int, virtual_stages: int, stage: int) -> list[int]:
    """The virtual stages rank ``stage`` holds, chunk 0 first: ``[s, s + p, ...]`` round the ranks, ``[s, 2p-1-s]``
    in the V (the order PyTorch's schedule is handed its stages in)."""
    placement = placement_of(schedule)
    return [placed_stage(stage, c, num_stages, placement) for c in range(chunks_of(schedule, virtual_stages))]


def _kind(action) -> str:
    return getattr(action.computation_type, "value", str(action.computation_type))


def _leaves(action) -> list:
    """An action, or an overlapped pair's sub-actions in the order the runtime runs them."""
    return list(action.sub_actions) if action.sub_actions else [action]


def has_weight_actions(order: dict) -> bool:
    """Whether PyTorch's table splits backwards into I and W anywhere (then a full B is the course's B and W)."""
    return any(_kind(leaf) in ("I", "W") for row in order.values() for a in row if a is not None for leaf in _leaves(a))


def to_course(action, num_stages: int, chunks: int, placement: str, split: bool, comms: bool = False) -> list[tuple]:
    """One PyTorch action as the course's tuples (none, one, or two for a full backward in a split table)."""
    if action is None:
        return []
    out = []
    for leaf in _leaves(action):
        kind = _kind(leaf)
        if kind in SKIPPED or (kind in MESSAGES and not comms):
            continue
        chunk = rank_of(leaf.stage_index, num_stages, placement)[1]
        where = (leaf.microbatch_index,) if chunks == 1 else (leaf.microbatch_index, chunk)
        if kind in MESSAGES:
            out.append((MESSAGES[kind], *where))
        elif kind == "B":
            out += [("B", *where), ("W", *where)] if split else [("B", *where)]
        elif kind in COMPUTE:
            out.append((COMPUTE[kind], *where))
        else:
            raise ValueError(f"PyTorch's action {kind} (stage {leaf.stage_index}, micro-batch {leaf.microbatch_index}) "
                             "has no counterpart in the course's tables")
    return out


def course_rows(order: dict, num_stages: int, chunks: int, placement: str, comms: bool = False) -> list[list[tuple]]:
    """PyTorch's ``pipeline_order`` (or ``pipeline_order_with_comms``, ``comms=True``) as one course list per rank."""
    split = has_weight_actions(order)
    return [[t for a in order[r] for t in to_course(a, num_stages, chunks, placement, split, comms)]
            for r in range(num_stages)]


def spelled(order: dict, num_stages: int) -> list[list[str | None]]:
    """PyTorch's own spelling of its table, per rank (``"3I0"``, ``"(0F3;3B1)OVERLAP_F_B"``; None: an idle slot)."""
    return [[None if a is None else repr(a) for a in order[r]] for r in range(num_stages)]


def course_table(schedule: str, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> list | None:
    """The course's own table for the same schedule, or None where the course has none (PyTorch's looped zero
    bubble, v > 1) or refuses these sizes (interleaved with m not a multiple of p, DualPipeV with m < 2p)."""
    p, m = num_stages, micro_batches
    try:
        if schedule == "1f1b":
            return all_stages("1f1b", p, m)
        if schedule == "interleaved":
            return all_stages("interleaved", p, m, virtual_stages)
        if (schedule == "zb-h1" and virtual_stages == 1) or schedule in V_NATIVE:
            return split_stages(schedule, p, m)
    except ValueError:
        return None
    return None


def compare_rows(torch_rows: list[list[tuple]], course_rows_: list[list[tuple]]) -> list[dict]:
    """Per rank: whether the two lists are equal, whether they hold the same actions (in another order), the first
    position where they part and the two actions there (None past the end of a list)."""
    out = []
    for mine, ours in zip(torch_rows, course_rows_, strict=True):
        mine, ours = [tuple(a) for a in mine], [tuple(a) for a in ours]
        first = next((n for n, (a, b) in enumerate(zip(mine, ours)) if a != b),
                     None if len(mine) == len(ours) else min(len(mine), len(ours)))
        out.append({"equal": mine == ours, "same_actions": sorted(mine) == sorted(ours), "first_difference": first,
                    "torch_there": None if first is None or first >= len(mine) else mine[first],
                    "course_there": None if first is None or first >= len(ours) else ours[first]})
    return out


def messages_of(rows: list[list[tuple]], placement: str) -> list[list[tuple]]:
    """The course's messages for a compute table (``validity.with_messages``), per rank, in its wire order."""
    chunks = 1 + max((a[2] if len(a) > 2 else 0 for row in rows for a in row), default=0)
    return [[a for a in with_messages(row, len(rows), r, chunks, placement) if a[0] not in ("F", "B", "W")]
            for r, row in enumerate(rows)]
