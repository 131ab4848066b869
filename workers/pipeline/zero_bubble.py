"""Zero-bubble schedules as data: the backward split into B (input gradient) and W (weight gradient).

The action tables have the format of ``schedules.py`` with one more kind: ``("W", i)`` / ``("W", i, c)``, the weight
gradient of micro-batch i (chunk c). In a table that has W actions, ``("B", i)`` is the input gradient only
(``split_backward.backward_input``); in a table without them it stays the full backward, as in GPipe and 1F1B.
B is what the previous stage waits for; W is what nobody waits for, so a schedule may put it anywhere after its B,
into the gaps where a stage would otherwise idle.

* ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, section 2, Figure 3 top): 1F1B's
  order of forwards and input backwards, with W held back. Stage s runs, step x = 0, 1, ..., m + p - 2, the forward
  of micro-batch x, the B of x - (p-1-s) and the W of x - (p-1), each where it exists. So it has 1F1B's warm-up
  (p-1-s forwards), then s steps of F and B without a W, then F B W, then B W, then s trailing W's, and at most
  p - s micro-batches between their F and their B, as 1F1B: the same activation memory. Its bubble is
  (p-1)(T_F + T_B - T_W): a third of 1F1B's (p-1)(T_F + T_B + T_W) when the three times are equal (the replay in
  ``validity.simulate_split`` gives exactly that while T_W <= T_F; at T_W > T_F it is (p-1) T_B, the W no longer fitting the gap).
* ZB-H2 (the same paper, section 2, Figure 3 bottom): the same diagonal with twice the warm-up, the F of x, the B
  of x - 2(p-1-s) and the W of x - 2(p-1). Stage 0 holds up to 2p - 1 micro-batches' activations, and every
  stage runs without a gap from its first forward to its last W: the step is a parallelogram, not a trapezoid.
  Its bubble is max(0, (p-1)(T_F + T_B - 2 T_W)), zero at equal times once m >= 2p - 1, counted as the paper
  counts it: with the optimizer
  step validated afterwards (the paper's section 5, no all-reduce before it), stage s starts the next step's
  forwards as soon as its own last W is done, so only the idle inside a stage's own span costs time. The start
  skew, (p-1) T_F on the last stage, is paid once per run, not per step.
* ZB-V (the same paper, section 6 of its later version; ``torch.distributed.pipelining.ScheduleZBVZeroBubble``): two
  chunks per rank in a V, rank s holding virtual stages s and 2p-1-s, so the last virtual stage, and the loss, live
  on rank 0, and virtual stages p-1 and p are both on rank p-1 (a local hand-off, no message). Rank s warms up with
  2(p-s) - 1 forwards of chunk 0, then s pairs (F chunk 1, F chunk 0), then p - s triples (F, B, W of chunk 1);
  the steady state is (F0, B0, W0, F1, B1, W1); the cool-down s pairs (B0, B1), p - s pairs (B0, W), then every W
  left. Activation memory as 1F1B's (2p chunk-halves on rank 0), twice the messages, zero bubble at equal times
  once m >= 2p - 1.
  Fewer than 2p - 1 micro-batches: the table for 2p - 1 with the missing micro-batches' actions taken out.
* DualPipeV (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437, section 3.2.1, cut in half by Sea
  AI Lab; deepseek-ai/DualPipe ``dualpipev.py``, ``torch.distributed.pipelining.ScheduleDualPipeV``): the same V
  placement, in eight phases per rank: 2(p-s-1) forwards of chunk 0; s + 1 pairs (F0, F1); p-s-1 triples (B1, W,
  F1) with W right away; m - 2p + s + 1 quadruples (F0, B1, F1, B0) with full backwards (B and W together); p-s-1
  triples (B1, F1, B0); s + 1 pairs (B1, B0), the second half of them with W held back; p-s-1 pairs (W, B0) with W
  held back; s + 1 W's. W's held back run first in, first out. In the repository each (F, B) pair of the main
  phase is one overlapped call (one chunk's compute hides the other's all-to-all); here they run one after the
  other. It needs m >= 2p. Its bubble, from the repository's table with PP = 2p virtual stages, is
  (p-1)(F&B + B_full - 3W), F&B the time of an overlapped forward and backward: (p-1)(F + 2B - W) without overlap,
  2(p-1) chunk-actions at equal times. That holds for DeepSeek's code, where an overlapped pair or a full backward
  is one call that sends only when done (``dualpipev_calls``); the executor here runs each action on its own (a B
  sends before its W), which leaves (p-1) at equal times.
"""
from __future__ import annotations

from collections import deque

Action = tuple  # ("F", micro) | ("B", micro) | ("W", micro) | the same with a chunk: ("W", micro, chunk)

SPLIT_SCHEDULES = ("zb-h1", "zb-h2", "zb-v", "dualpipev")
V_SCHEDULES = ("zb-v", "dualpipev")  # two chunks per rank, placed in a V
PLACEMENTS = ("loop", "v")


def placement_of(name: str) -> str:
    """How a schedule's chunks sit on the ranks: "loop" (chunk c of rank s is virtual stage c p + s, round the ranks
    as interleaved 1F1B) or "v" (chunk 0 of rank s is virtual stage s, chunk 1 is 2p-1-s: down and back up)."""
    return "v" if name in V_SCHEDULES else "loop"


def chunks_of(name: str) -> int:
    """v: model chunks per rank the schedule needs (2 for the V-shaped ones)."""
    return 2 if name in V_SCHEDULES else 1


def placed_stage(stage: int, chunk: int, num_stages: int, placement: str = "loop") -> int:
    """The virtual stage that chunk ``chunk`` of rank ``stage`` holds."""
    if placement == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def virtual_count(num_stages: int, chunks: int, placement: str = "loop") -> int:
    """How many virtual stages ``num_stages`` ranks of ``chunks`` chunks make (a V always two per rank)."""
    return num_stages * chunks if placement == "loop" else 2 * num_stages


def rank_of(virtual: int, num_stages: int, placement: str = "loop") -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual stage ``virtual``: the inverse of ``placed_stage``."""
    if placement == "v":
        return (virtual, 0) if virtual < num_stages else (2 * num_stages - 1 - virtual, 1)
    return virtual % num_stages, virtual // num_stages


def _diagonal(num_stages: int, micro_batches: int, stage: int, lag_b: int, lag_w: int) -> list[Action]:
    """Step x = 0, 1, ...: the F of x, the B of x - lag_b, the W of x - lag_w, each where 0 <= micro < m."""
    actions = []
    for x in range(micro_batches + lag_w):
        for kind, micro in (("F", x), ("B", x - lag_b), ("W", x - lag_w)):
            if 0 <= micro < micro_batches:
                actions.append((kind, micro))
    return actions


def zb_h1_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """ZB-H1: 1F1B's forwards and input backwards (B lags F by p-1-s steps), W lagging F by p-1 on every stage."""
    p = num_stages
    return _diagonal(p, micro_batches, stage, lag_b=p - 1 - stage, lag_w=p - 1)


def zb_h2_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """ZB-H2: twice ZB-H1's lags, so every stage has work from its first forward to its last W."""
    p = num_stages
    return _diagonal(p, micro_batches, stage, lag_b=2 * (p - 1 - stage), lag_w=2 * (p - 1))


def zb_v_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """ZB-V on rank ``stage``: chunk 0 is virtual stage s, chunk 1 virtual stage 2p-1-s."""
    p, s = num_stages, stage
    n = max(micro_batches, 2 * p - 1)  # fewer micro-batches: build for 2p - 1, then drop the ones that do not exist
    count = {(k, c): 0 for k in "FBW" for c in (0, 1)}
    actions = []

    def run(kind: str, chunk: int) -> None:
        actions.append((kind, count[(kind, chunk)], chunk))
        count[(kind, chunk)] += 1

    for _ in range(2 * (p - s) - 1):  # warm-up: chunk 0 forwards until the first comes back down the V
        run("F", 0)
    for _ in range(s):
        run("F", 1), run("F", 0)
    for _ in range(p - s):  # chunk 1's first backwards, each with its W at once
        run("F", 1), run("B", 1), run("W", 1)
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < n:  # steady state
        if count[("F", 0)] < n:
            run("F", 0)
        run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)
    for _ in range(s):  # cool-down: input gradients first, their W's fill the tail
        run("B", 0), run("B", 1)
    for _ in range(p - s):
        run("B", 0), run("W", 0)
    while count[("W", 1)] < count[("B", 1)]:
        run("W", 1)
    while count[("W", 0)] < count[("B", 0)]:
        run("W", 0)
    return [a for a in actions if a[1] < micro_batches]


def _dualpipev(num_stages: int, micro_batches: int, stage: int) -> tuple[list[Action], list[tuple[int, int]]]:
    """DualPipeV's actions on rank ``stage``, and the ``(first, last)`` index ranges that DeepSeek's code runs as one
    call: each overlapped forward-and-full-backward pair, and each full backward (B and W in one autograd pass)."""
    p, s, m = num_stages, stage, micro_batches
    if m < 2 * p:
        raise ValueError(f"micro_batches={m} is fewer than the {2 * p} virtual stages: DualPipeV fills its V with "
                         f"at least one micro-batch per virtual stage; choose micro_batches >= {2 * p}")
    done = {(k, c): 0 for k in "FB" for c in (0, 1)}
    held: deque = deque()  # (micro, chunk) whose W waits, first in first out
    actions, calls = [], []

    def forward(chunk: int) -> None:
        actions.append(("F", done[("F", chunk)], chunk))
        done[("F", chunk)] += 1

    def backward(chunk: int, hold_w: bool = False, alone: bool = True) -> None:
        micro = done[("B", chunk)]
        done[("B", chunk)] += 1
        actions.append(("B", micro, chunk))
        if hold_w:
            held.append((micro, chunk))
        else:
            actions.append(("W", micro, chunk))  # a full backward: its W at once
            if alone:
                calls.append((len(actions) - 2, len(actions) - 1))

    def weight() -> None:
        micro, chunk = held.popleft()
        actions.append(("W", micro, chunk))

    def overlap(forward_chunk: int, backward_chunk: int) -> None:
        first = len(actions)
        forward(forward_chunk), backward(backward_chunk, alone=False)
        calls.append((first, len(actions) - 1))

    for _ in range(2 * (p - s - 1)):  # 1: chunk 0 forwards
        forward(0)
    for _ in range(s + 1):  # 2: (F0, F1)
        forward(0), forward(1)
    for _ in range(p - s - 1):  # 3: (B1, W, F1), the W taken at once
        backward(1, hold_w=True), weight(), forward(1)
    for k in range(m - 2 * p + s + 1):  # 4, the main phase: (F0 with B1), (F1 with B0)
        if k == 0 and s == p - 1:  # DeepSeek: "we don't overlap these two chunks to further reduce bubble size"
            forward(0), backward(1)
        else:
            overlap(0, 1)
        overlap(1, 0)
    for _ in range(p - s - 1):  # 5: B1, (F1 with B0)
        backward(1), overlap(1, 0)
    hold = False
    for k in range(s + 1):  # 6: (B1, B0), W held back from the middle on (odd ranks from a B1, even from a B0)
        hold = hold or (k == (s + 1) // 2 and s % 2 == 1)
        backward(1, hold)
        hold = hold or (k == (s + 1) // 2 and s % 2 == 0)
        backward(0, hold)
    for _ in range(p - s - 1):  # 7: (W, B0)
        weight(), backward(0, hold_w=True)
    for _ in range(s + 1):  # 8: the W's left
        weight()
    return actions, calls


def dualpipev_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """DualPipeV on rank ``stage`` (DeepSeek's eight phases, each overlapped pair run one after the other); m >= 2p."""
    return _dualpipev(num_stages, micro_batches, stage)[0]


def dualpipev_calls(num_stages: int, micro_batches: int, stage: int) -> list[tuple[int, int]]:
    """Index ranges of ``dualpipev_schedule``'s list that DeepSeek's code runs as one call (an overlapped forward and
    full backward; a full backward): it starts once all its inputs are in and sends only when all of it is done
    (``validity.simulate_split(calls=...)``). The executor here runs every action on its own instead: a B sends its
    gradient before its W, and a forward does not wait for the gradient of the backward it is paired with."""
    return _dualpipev(num_stages, micro_batches, stage)[1]


def split_schedule(name: str, num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Rank ``stage``'s actions for one of ``SPLIT_SCHEDULES``."""
    makers = {"zb-h1": zb_h1_schedule, "zb-h2": zb_h2_schedule, "zb-v": zb_v_schedule, "dualpipev": dualpipev_schedule}
    if name not in makers:
        raise ValueError(f"schedule={name!r} is not a split-backward schedule: choose one of {', '.join(makers)}")
    return makers[name](num_stages, micro_batches, stage)


def split_stages(name: str, num_stages: int, micro_batches: int) -> list[list[Action]]:
    """Every rank's actions: the whole table, which each rank checks before it runs its own row."""
    return [split_schedule(name, num_stages, micro_batches, s) for s in range(num_stages)]
