"""Chapter 00's graded exercises, all checked in the notebook (pure Python, against the ledger and planner).

- ``layout_70b``: a TP/PP/DP/ZeRO layout for Llama 3 70B on 256 H100s that fits in 80 GB (the planner decides);
- ``min_gpus_fsdp``: the smallest GPU count whose memory holds a model's states fully sharded (ZeRO-3/FSDP);
- ``max_tp``: the largest tensor-parallel degree a head configuration allows inside one node;
- ``zero_total_bytes``: the ZeRO stage formulas, total bytes per GPU (Rajbhandari et al. 2020, Figure 1).
"""
from __future__ import annotations

import math
import numbers

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

BYTES_PER_PARAM = 16  # mixed-precision Adam: 2 + 2 + 12 (ZeRO sec 3.1)
H100_MEMORY = 80 * 2**30  # what the device exposes, in bytes (the planner's GPUS["h100"])


def not_whole(value, what: str, least: int = 1) -> str | None:
    """Why ``value`` is not a whole number >= ``least`` (NaN, infinity and 8.0 named as such), or None if it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"{what} should be a whole number (an int), got {value!r}"
    if not math.isfinite(value):
        return f"{what} is {value} (NaN or infinite), not a whole number: look for a division by zero"
    if not isinstance(value, numbers.Integral):
        return (f"{what} is {value!r}, a float: return an int (/ always gives a float, and so does // of a "
                "float: finish with math.ceil or int())")
    if value < least:
        return f"{what} should be at least {least}, got {value}"
    return None


# -- 1. a layout for 70B on 256 H100s ------------------------------------------------------------------

LAYOUT_KEYS = ("tp", "pp", "dp", "zero")
LAYOUT_FIXED = {"seq": 4096, "micro_batch": 1, "recompute": "selective"}


def plan_layout_70b(answer: dict):
    """The planner's verdict for the learner's layout (Llama 3 70B, 256 H100s, seq 4096, micro-batch 1)."""
    from course_utils.planner import Layout, plan

    layout = Layout(tp=answer["tp"], pp=answer["pp"], dp=answer["dp"], zero=answer["zero"], sequence_parallel=True,
                    **LAYOUT_FIXED)
    return plan("70B", layout, 256, cluster_name="h100-ib")


def check_layout_70b(answer) -> tuple[str, str]:
    from course_utils.ledger import GB
    from course_utils.planner import LayoutError

    from workers.runtime import rename_params

    got = answer()
    if isinstance(got, dict):
        got = rename_params(got)  # zero_stage= is the old name of zero= (one release)
    if not isinstance(got, dict) or not set(LAYOUT_KEYS) <= set(got):
        return FAIL, f"return a dict with the keys {', '.join(LAYOUT_KEYS)}, for example dict(tp=8, pp=1, dp=32, zero=1)"
    for key in LAYOUT_KEYS:
        problem = not_whole(got[key], key, least=0 if key == "zero" else 1)
        if problem:
            return FAIL, problem
    try:
        p = plan_layout_70b(got)
    except LayoutError as exc:
        return FAIL, str(exc)
    node = p.cluster.gpus_per_node
    if got["tp"] > node:  # valid (each of the 8 KV heads copied onto tp / 8 ranks), but not where TP belongs
        return FAIL, (f"tp={got['tp']} spans {got['tp'] // node} nodes of {node} GPUs: tensor parallelism talks in "
                      f"every layer (4 all-reduces per layer and micro-batch), over NVLink only inside a node, and "
                      f"each of Llama 3 70B's 8 KV heads would be copied onto {got['tp'] // 8} GPUs; keep tp <= {node} "
                      "and split further with pp")
    layers = p.model.layers
    if layers % got["pp"]:  # the planner only notes it; a real pipeline needs equal stages
        stages = sorted({layers // got["pp"], -(-layers // got["pp"])})
        return FAIL, (f"pp={got['pp']} does not divide the {layers} layers of Llama 3 70B: stages would hold "
                      f"{' or '.join(map(str, stages))} layers, and the fullest one sets the pace of the whole pipeline; "
                      f"use a pp that divides {layers} (and 256 / tp)")
    if not p.fits:
        biggest = max(p.memory, key=p.memory.get)
        return FAIL, (f"{p.total_memory_bytes / GB:.1f} GB per GPU does not fit in {p.gpu_memory_bytes / GB:.1f} GB "
                      f"(80 GiB); the largest term is {biggest} ({p.memory[biggest] / GB:.1f} GB): split the model "
                      "further (tp, pp) or shard more state (a higher zero)")
    return PASS, (f"fits: {p.total_memory_bytes / GB:.1f} GB of {p.gpu_memory_bytes / GB:.1f} GB per GPU, "
                  f"{p.step_time_s:.2f} s per step in the planner's model (MFU {100 * p.mfu:.0f}%)")


# -- 2. the smallest GPU count for FSDP alone ------------------------------------------------------------

FSDP_CASES = [  # (n_params, gpu_memory_bytes, reserved_bytes)
    (405.9e9, H100_MEMORY, 0.0),  # Llama 3.1 405B's model states alone
    (405.9e9, H100_MEMORY, 20e9),  # ... with 20 GB per GPU kept for activations and buffers
    (70.6e9, H100_MEMORY, 10e9),
    (7e9, 24e9, 0.0),  # a 7B model on 24 GB cards
    (5e9, 40e9, 0.0),  # 80 GB of states on 40 GB cards: exactly 2
    (1e9, 80e9, 0.0),  # fits on one GPU
    (70.6e9, H100_MEMORY, 0.0),  # 13.15 GPUs' worth: rounding to the nearest gives 13, one too few
    (8e9, 24e9, 0.0),  # 5.33 on 24 GB cards
]


def min_gpus_reference(n_params: float, gpu_memory_bytes: float, reserved_bytes: float = 0.0) -> int:
    usable = gpu_memory_bytes - reserved_bytes
    return max(1, math.ceil(BYTES_PER_PARAM * n_params / usable))


def check_min_gpus_fsdp(answer) -> tuple[str, str]:
    for n_params, memory, reserved in FSDP_CASES:
        got = answer(n_params, memory, reserved)
        want = min_gpus_reference(n_params, memory, reserved)
        case = f"n_params={n_params:g}, gpu_memory_bytes={memory:g}, reserved_bytes={reserved:g}"
        problem = not_whole(got, "the GPU count")
        if problem:
            return FAIL, f"for {case}, {problem}"
        if got == want:
            continue
        usable = memory - reserved
        if got == max(1, math.ceil(2 * n_params / usable)):
            hint = "you counted only the 2-byte weights; FSDP shards all 16 bytes per parameter (weights, grads, Adam)"
        elif reserved and got == max(1, math.ceil(BYTES_PER_PARAM * n_params / memory)):
            hint = "each GPU has only gpu_memory_bytes - reserved_bytes left for the model states"
        elif got == want - 1:
            exact = BYTES_PER_PARAM * n_params / usable
            hint = (f"the states need {exact:.2f} GPUs' worth of memory, and with {got} GPUs each would hold "
                    f"{BYTES_PER_PARAM * n_params / got / 1e9:.1f} GB of states, more than the {usable / 1e9:.1f} GB "
                    "available: round up (math.ceil), not down (int) and not to the nearest (round)")
        elif got == want + 1:
            hint = f"{want} GPUs already suffice (the division is exact or already above); use math.ceil, not int(x) + 1"
        else:
            hint = f"16 bytes x n_params / N must fit in gpu_memory_bytes - reserved_bytes; expected {want}"
        return FAIL, f"for {case} you returned {got}: {hint}"
    return PASS, "correct: 16 bytes per parameter, spread over N GPUs, rounded up"


# -- 3. the largest TP degree a head configuration allows -------------------------------------------------

TP_CASES = [  # (heads, kv_heads, gpus_per_node)
    (128, 8, 8),  # Llama 3.1 405B
    (64, 8, 8),  # Llama 3 70B
    (32, 32, 8),  # Llama 2 7B (no GQA)
    (12, 12, 8),  # 12 heads: 8 does not divide them
    (64, 4, 8),  # 4 KV heads
    (128, 8, 16),  # a 16-GPU NVLink domain: still capped by the 8 KV heads
    (14, 2, 8),
    (25, 5, 8),
    (64, 8, 72),  # a 72-GPU NVLink domain (GB200 NVL72): 8 divides the node even though it is not a power of two
    (48, 12, 72),  # 12 KV heads on NVL72: 12 divides 72
    (96, 12, 12),
]


def check_max_tp(answer) -> tuple[str, str]:
    for heads, kv_heads, node in TP_CASES:
        got = answer(heads, kv_heads, node)
        want = math.gcd(heads, kv_heads, node)
        case = f"heads={heads}, kv_heads={kv_heads}, gpus_per_node={node}"
        problem = not_whole(got, "the TP degree")
        if problem:
            return FAIL, f"for {case}, {problem}"
        if got == want:
            continue
        if heads % got:
            why = f"tp={got} does not divide the {heads} query heads, so a GPU would hold a fraction of a head"
        elif kv_heads % got:
            why = (f"tp={got} does not divide the {kv_heads} key/value heads: each GPU needs whole KV heads "
                   "(beyond that, KV heads must be replicated, which wastes memory and compute)")
        elif node % got:
            why = f"tp={got} does not tile a node of {node} GPUs, so some TP groups would straddle two nodes and leave NVLink"
        elif node & (node - 1) and want % got == 0:
            halving = [node]
            while halving[-1] > got:
                halving.append(halving[-1] // 2)
            why = (f"a larger degree, {want}, also divides the heads, the KV heads and the node; halving from the "
                   f"node size ({' -> '.join(map(str, halving))}) steps over it when the node is not a power of two: "
                   "look for the greatest common divisor (math.gcd) instead")
        else:
            why = f"a larger degree, {want}, also divides the heads, the KV heads and the node"
        return FAIL, f"for {case} you returned {got}: {why}"
    return PASS, "correct: the largest degree dividing the heads, the KV heads and the node, gcd(heads, kv_heads, node)"


# -- 4. ZeRO stage formulas, total bytes per GPU -------------------------------------------------------------

ZERO_CASES = [(7.5e9, 64, s) for s in range(4)] + [(70e9, 8, s) for s in range(4)] + [(1e9, 1, 3), (13e9, 3, 2)]


def check_zero_total_bytes(answer) -> tuple[str, str]:
    from course_utils.ledger import model_state_bytes

    for n_params, n_gpus, stage in ZERO_CASES:
        got = answer(n_params, n_gpus, stage)
        want = model_state_bytes(n_params, dp=n_gpus, zero_stage=stage).total
        case = f"n_params={n_params:g}, n_gpus={n_gpus}, stage={stage}"
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            return FAIL, f"return a number of bytes, got {got!r} for {case}"
        if not math.isfinite(got):
            return FAIL, (f"for {case} you returned {got} (NaN or infinite), where {want:.6g} bytes was expected: "
                          "bytes per GPU are finite; look for a division by zero")
        if abs(got - want) <= 1e-9 * want:
            continue
        hint = ""
        if abs(got * 1e9 / want - 1) < 1e-6:
            hint = "return bytes, not GB"
        else:
            for other in range(4):
                if other != stage and abs(got / model_state_bytes(n_params, dp=n_gpus, zero_stage=other).total - 1) < 1e-9:
                    hint = (f"that is stage {other}'s total; stage {stage} shards "
                            + {0: "nothing", 1: "the 12 bytes of optimizer state", 2: "optimizer state and gradients",
                               3: "all 16 bytes"}[stage])
                    break
        return FAIL, f"for {case} expected {want:.6g} bytes, got {got:.6g}" + (f": {hint}" if hint else "")
    return PASS, "correct: 120, 31.4, 16.6 and 1.9 GB for 7.5B parameters on 64 GPUs, as in the ZeRO paper's Figure 1"


# What none of chapter 00's exercises involve: they are formulas and plans on paper, checked in this process.
NO_GRADIENTS = NOT_APPLICABLE + "a formula on paper: no gradients, no hooks"
NO_RANKS = NOT_APPLICABLE + "a formula on paper: no collective runs"
NO_TENSORS = NOT_APPLICABLE + "the answer returns numbers; nothing is allocated or freed"
NO_BITS = NOT_APPLICABLE + "whole numbers, or bytes compared to a relative 1e-9: no floating-point bits to tell apart"
NUMBERS_IN = NOT_APPLICABLE + "the inputs are Python numbers, which a function cannot change"
ONE_CLUSTER = "one model on one cluster: "

register(Exercise("layout_70b", "00", "layout_70b",
                  "Pick TP/PP/DP and a ZeRO stage for Llama 3 70B on 256 H100s under 80 GB", local=check_layout_70b,
                  tries={
                      "non-finite": "every degree must be a whole, finite number: a NaN or infinite degree is refused "
                                    "by name",
                      "order": NO_GRADIENTS,
                      "sizes": "a pp that does not divide the 80 layers, and degrees whose product is not the 256 "
                               "GPUs, are refused",
                      "ragged": NOT_APPLICABLE + ONE_CLUSTER + "uneven pipeline stages are refused under sizes",
                      "layouts": NOT_APPLICABLE + ONE_CLUSTER + "the answer takes no arguments, and any layout the "
                                                  "planner fits is accepted",
                      "traffic": NOT_APPLICABLE + "a plan on paper; TP across nodes is refused as a rule of placement",
                      "mutation": NOT_APPLICABLE + "the answer takes no arguments",
                      "output": "a dict with the keys tp, pp, dp and zero, each an int: a degree given as a float "
                                "(256 / 32 = 8.0) is refused",
                      "memory": NO_TENSORS,
                      "bits": NO_BITS,
                  }))
register(Exercise("min_gpus_fsdp", "00", "min_gpus_fsdp",
                  "The smallest GPU count for a model with FSDP (ZeRO-3) alone", local=check_min_gpus_fsdp, tries={
                      "non-finite": "the count must be a finite whole number: NaN or infinity is refused by name",
                      "order": NO_GRADIENTS,
                      "sizes": "states that fill a whole number of GPUs exactly (80 GB on 40 GB cards) and states "
                               "that do not (13.15, 5.33 GPUs' worth): exactly the ceiling in both",
                      "ragged": NOT_APPLICABLE + "every GPU holds the same 1/N of the states: no partitions",
                      "layouts": NOT_APPLICABLE + "one formula; the model and card sizes vary under sizes",
                      "traffic": NO_RANKS,
                      "mutation": NUMBERS_IN,
                      "output": "the count must be an int: a float such as 14.0 (from -(-x // 1) or numpy) is refused",
                      "memory": NO_TENSORS,
                      "bits": NO_BITS,
                  }))
register(Exercise("max_tp", "00", "max_tp",
                  "Why 8 KV heads cap tensor parallelism at 8", local=check_max_tp, tries={
                      "non-finite": "the degree must be a finite whole number: NaN or infinity is refused by name",
                      "order": NO_GRADIENTS,
                      "sizes": "head counts that a node's 8 GPUs do not divide (12, 14, 25 heads): the degree must "
                               "divide the heads, the KV heads and the node",
                      "ragged": NOT_APPLICABLE + "a degree that divides everything it splits: no uneven parts",
                      "layouts": "eleven head configurations on nodes of 8, 12, 16 and 72 GPUs: a rule true of a "
                                 "power-of-two node alone (halving from the node size) fails",
                      "traffic": NO_RANKS,
                      "mutation": NUMBERS_IN,
                      "output": "the degree must be an int: a float such as 8.0 is refused",
                      "memory": NO_TENSORS,
                      "bits": NO_BITS,
                  }))
register(Exercise("zero_total_bytes", "00", "zero_total_bytes",
                  "The ZeRO stage formulas: bytes of model states per GPU", local=check_zero_total_bytes, tries={
                      "non-finite": "the byte count must be finite: NaN or infinity is refused by name",
                      "order": NO_GRADIENTS,
                      "sizes": NOT_APPLICABLE + "bytes per GPU are real numbers here: a share that is not whole is "
                                                "not rounded by the formula",
                      "ragged": NOT_APPLICABLE + "every GPU of a stage holds the same share: no partitions",
                      "layouts": NOT_APPLICABLE + "one formula, checked at stages 0-3 on 1, 3, 8 and 64 GPUs; a "
                                                  "stage confused with another is named, not a layout",
                      "traffic": NO_RANKS,
                      "mutation": NUMBERS_IN,
                      "output": NOT_APPLICABLE + "one Python number; int and float alike are accepted",
                      "memory": NO_TENSORS,
                      "bits": NO_BITS,
                  }))
