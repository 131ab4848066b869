"""Chapter 06's graded exercises: the block's two all-reduces (real ranks), attention's share of the FLOPs, and the
block order of a collective matmul's rings."""
import math
import operator

from course_utils.exercises import FAIL, NOT_APPLICABLE, PASS, Exercise, register

CHECKER = "workers.exercises.ch06"


def check_attention_flop_share(answer) -> tuple[str, str]:
    """``answer(seq, hidden)`` against (8bsh^2 + 4bs^2h) / (24bsh^2 + 4bs^2h).

    The per-GEMM count is Narayanan et al. 2021 (arXiv:2104.04473), the appendix on floating-point operations
    (sec. 5.1 uses its total), as cited in chapter 06.
    """
    from course_utils.tp_check import attention_flop_share

    for seq, hidden in ((128, 4096), (2048, 4096), (8192, 4096), (32768, 8192), (4096, 1024)):
        want = attention_flop_share(seq, hidden)
        got = answer(seq, hidden)
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return FAIL, f"attention_flop_share should return a number between 0 and 1, not {type(got).__name__}"
        where = f"at s={seq}, h={hidden}: got {got:.4g}, expected {want:.4g}"
        if not math.isfinite(got):
            return FAIL, f"{where}. The share is NaN or infinite: a share of FLOPs is finite; look for a division by zero"
        if abs(got - want) <= 1e-9:
            continue
        if abs(got - attention_flop_share(hidden, seq)) < 1e-9:
            return FAIL, f"{where}. That is the formula with s and h swapped: s is the sequence length, h the hidden size"
        if abs(got - 1 / 3) < 1e-9:
            return FAIL, f"{where}. Your share does not change with s: the 4bs²h of the scores and of P·V are missing"
        if abs(got - seq / (6 * hidden + seq)) < 1e-9:
            return FAIL, (f"{where}. That is only the s² part (scores and P·V); the QKV and output projections "
                          "(8bsh²) are attention's FLOPs too")
        if abs(got - (2 * hidden + seq) / (4 * hidden + seq)) < 1e-9:
            return FAIL, f"{where}. Check the MLP: h -> 4h -> h is 2 x 2 x 4 = 16bsh², so the layer is 24bsh² + 4bs²h"
        return FAIL, f"{where}. Count 2 FLOPs per multiply-add: QKV 6bsh², QKᵀ 2bs²h, P·V 2bs²h, output 2bsh², MLP 16bsh²"
    return PASS, "matches (8bsh² + 4bs²h) / (24bsh² + 4bs²h) at every shape tried"


# tp 1, 2 first (where the left and the right neighbour are one rank), then 4 and 8, then sizes that are not powers of
# two: each kind of mistake fails where it first shows, with its own message
RING_SIZES = (1, 2, 4, 8, 3, 5, 6)


def _as_index(value, what: str, where: str) -> tuple[int | None, str]:
    """``value`` as a block index, or a message saying why it is not one."""
    if value is None:
        return None, f"{where}: the {what} is None"
    if isinstance(value, bool) or isinstance(value, float):
        return None, f"{where}: the {what} is {value!r}; return an int (a rank of the TP group)"
    try:
        return operator.index(value), ""
    except TypeError:
        return None, f"{where}: the {what} is a {type(value).__name__}; return an int (a rank of the TP group)"


def _named_rule(table, tp: int, rules: dict) -> str | None:
    """The name of the first rule in ``rules`` (name -> f(rank, step)) that ``table[rank][step]`` follows everywhere."""
    for name, rule in rules.items():
        if all(table[r][k] == rule(r, k) for r in range(tp) for k in range(tp)):
            return name
    return None


def check_collective_matmul_blocks(answer) -> tuple[str, str]:
    """``answer(rank, tp, step) -> (shard, block)`` against the course's rings (``workers/parallel/collective_matmul.py``,
    ``ring_all_gather`` and ``ring_reduce_scatter``, driven without communication by ``tp_overlap.ring_order``).

    The ring sends to rank + 1 and receives from rank - 1. All-gather ring: at step k rank r multiplies the shard of
    rank (r - k) mod tp. Reduce-scatter ring: at step k rank r computes its addend for block (r - k - 1) mod tp, adds
    the running sum of that block received from r - 1, and sends it on to r + 1; at the last step the block is r's
    own, complete, and kept.
    """
    from course_utils.tp_overlap import ring_order

    for tp in RING_SIZES:
        gather, scatter = [[None] * tp for _ in range(tp)], [[None] * tp for _ in range(tp)]
        for rank in range(tp):
            for step in range(tp):
                where = f"at tp={tp}, rank {rank}, step {step}"
                got = answer(rank, tp, step)
                if not isinstance(got, (tuple, list)) or len(got) != 2:
                    return FAIL, (f"{where}: got {got!r}; return a pair (shard, block): the shard this rank multiplies "
                                  "in the all-gather ring and the block it computes (and sends on) in the "
                                  "reduce-scatter ring")
                if got[1] is None and step == tp - 1:
                    return FAIL, (f"{where}: the block is None. At the last step nothing is sent, but the step still "
                                  "computes a block: the rank adds its addend to the sum that arrived and keeps the "
                                  "result, its own block. Return the rank itself there")
                for slot, what, value in ((gather, "shard", got[0]), (scatter, "block", got[1])):
                    index, problem = _as_index(value, what, where)
                    if problem:
                        return FAIL, problem
                    if not 0 <= index < tp:
                        hint = " (negative: wrap around the ring with % tp)" if index < 0 else ""
                        return FAIL, f"{where}: the {what} is {index}, not a rank of the group 0..{tp - 1}{hint}"
                    slot[rank][step] = index
        want = [ring_order(r, tp) for r in range(tp)]
        want_gather, want_scatter = [w[0] for w in want], [w[1] for w in want]
        if gather != want_gather:
            first = next((r, k) for r in range(tp) for k in range(tp) if gather[r][k] != want_gather[r][k])
            where = (f"at tp={tp}, rank {first[0]}, step {first[1]}: the all-gather ring multiplies shard "
                     f"{gather[first[0]][first[1]]}, expected {want_gather[first[0]][first[1]]}")
            rule = _named_rule(gather, tp, {"left": lambda r, k: (r + k) % tp, "mask": lambda r, k: (r - k) & (tp - 1),
                                            "fixed": lambda r, k: k})
            if rule == "left":
                return FAIL, (f"{where}. Your shards travel to the left (rank r receives from r + 1). In this ring each "
                              "rank sends to r + 1 and receives from r - 1, so at step k it holds the shard of rank "
                              "r - k (mod tp). At tp 2 both neighbours are the same rank, which hides the direction")
            if rule == "mask":
                return FAIL, (f"{where}. (r - k) & (tp - 1) wraps around only when tp is a power of two: use % tp")
            if rule == "fixed" or any(gather[r][0] != r for r in range(tp)):
                return FAIL, (f"{where}. At step 0 each rank multiplies its own shard, the only one it holds before "
                              "anything arrives; every step after, the shard its left neighbour held one step earlier")
            return FAIL, (f"{where}. What rank r multiplies at step k is what rank r - 1 held at step k - 1 (it passed "
                          "it on): the shard of rank r - k (mod tp)")
        if scatter != want_scatter:
            first = next((r, k) for r in range(tp) for k in range(tp) if scatter[r][k] != want_scatter[r][k])
            where = (f"at tp={tp}, rank {first[0]}, step {first[1]}: the reduce-scatter ring computes block "
                     f"{scatter[first[0]][first[1]]}, expected {want_scatter[first[0]][first[1]]}")
            rule = _named_rule(scatter, tp, {"gather": lambda r, k: (r - k) % tp,
                                             "left": lambda r, k: (r + k + 1) % tp,
                                             "mask": lambda r, k: (r - k - 1) & (tp - 1)})
            if rule == "gather":
                return FAIL, (f"{where}. That is the all-gather ring's order: it starts on the rank's own block and "
                              "ends on another rank's. A reduce-scatter ring must end on the block the rank keeps (its "
                              "own, with every rank's addend in it), so it starts one block earlier: (r - k - 1) mod tp")
            if rule == "left":
                return FAIL, (f"{where}. Your running sums travel to the left. In this ring each rank sends to r + 1 "
                              "and receives from r - 1, so at step k rank r adds to block (r - k - 1) mod tp. At tp 2 "
                              "both neighbours are the same rank, which hides the direction")
            if rule == "mask":
                return FAIL, (f"{where}. (r - k - 1) & (tp - 1) wraps around only when tp is a power of two: use % tp")
            if any(scatter[r][tp - 1] != r for r in range(tp)):
                return FAIL, (f"{where}. The last step must complete the block this rank keeps, its own: every other "
                              "rank's addend has reached it by then")
            return FAIL, (f"{where}. Rank r adds its addend to the running sum its left neighbour sent at step k - 1, "
                          "so it must compute the block r - 1 computed one step earlier: (r - k - 1) mod tp")
    return PASS, ("matches the course's rings at tp 1, 2, 3, 4, 5, 6 and 8, every rank and step: shard (r - k) mod tp, "
                  "block (r - k - 1) mod tp")


register(Exercise("block_forward", "06", "block_forward",
                  "The Megatron block's forward: f and g around each sub-layer, biases once",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      "non-finite": "the block's output must be finite on every rank: a NaN is named before any "
                                    "comparison",
                      "order": NOT_APPLICABLE + "one forward and one backward of one block: no gradient hooks, no "
                                                "accumulation",
                      "sizes": NOT_APPLICABLE + "the heads and FFN columns are split by the course's block, not by "
                                                "the answer",
                      "ragged": NOT_APPLICABLE + "every rank holds the same number of heads and FFN columns",
                      "layouts": "the whole world as the group, then two groups of 2 side by side (ranks [0, 2] [1, "
                                 "3], then [0, 1] [2, 3]): an answer right only on the world group fails",
                      "traffic": "the all-reduces of the f and g regions are counted: exactly two in forward and two "
                                 "in backward, and none outside the group given",
                      "mutation": NOT_APPLICABLE + "x is a leaf that requires grad: torch itself refuses to change it "
                                                   "in place",
                      "output": "the returned tensor has the input's shape and stays in the autograd graph on every "
                                "rank",
                      "memory": NOT_APPLICABLE + "the block's memory is the course's; the answer allocates only "
                                                 "activations",
                      "bits": NOT_APPLICABLE + "sums over ranks in another order differ in the last bits: compared "
                                               "within 1e-5",
                  }))
register(Exercise("attention_flop_share", "06", "attention_flop_share",
                  "Attention's share of a layer's forward FLOPs as a function of s and h", local=check_attention_flop_share,
                  tries={
                      "non-finite": "the share must be finite: NaN or infinity is refused by name",
                      "order": NOT_APPLICABLE + "a formula of two integers: no gradients, no hooks",
                      "sizes": NOT_APPLICABLE + "a formula of two integers: nothing is split over ranks",
                      "ragged": NOT_APPLICABLE + "a formula of two integers: no partitions",
                      "layouts": "five (s, h) shapes, s both below and above h: a formula right at one shape, or "
                                 "with s and h swapped, fails",
                      "traffic": NOT_APPLICABLE + "a formula on paper: no collective runs",
                      "mutation": NOT_APPLICABLE + "the inputs are Python ints, which a function cannot change",
                      "output": NOT_APPLICABLE + "one Python number; int and float alike are accepted",
                      "memory": NOT_APPLICABLE + "a formula: nothing is allocated or freed",
                      "bits": NOT_APPLICABLE + "compared within 1e-9: the formula is a ratio of floats",
                  }))
register(Exercise("collective_matmul_blocks", "06", "collective_matmul_blocks",
                  "Collective matmul's rings: which shard a rank multiplies and which block it sends at step k",
                  local=check_collective_matmul_blocks, tries={
                      "non-finite": NOT_APPLICABLE + "block indices are integers: a float, NaN included, is refused "
                                                     "as not an int before any comparison",
                      "order": NOT_APPLICABLE + "an index formula: no gradients, no hooks, no accumulation",
                      "sizes": "tp 3, 5 and 6 as well as powers of two: a wrap-around written as a bit mask "
                               "(& (tp - 1)), right only for powers of two, fails",
                      "ragged": NOT_APPLICABLE + "every rank holds one equal shard: the worker refuses a sequence "
                                                 "that tp does not divide",
                      "layouts": "tp 1, 2, 4 and 8, every rank and every step: a ring turned the wrong way, which tp 2 "
                                 "cannot show (both neighbours are one rank), fails from tp 4 on",
                      "traffic": NOT_APPLICABLE + "the answer names blocks; no transfer runs (the chapter counts the "
                                                  "rings' bytes on real ranks)",
                      "mutation": NOT_APPLICABLE + "the inputs are Python ints, which a function cannot change",
                      "output": "a pair of ints in range(tp) at every step, the last included: None at the last step "
                                "of the reduce-scatter ring (where nothing is sent) is named",
                      "memory": NOT_APPLICABLE + "a formula: nothing is allocated or freed",
                      "bits": NOT_APPLICABLE + "indices are compared exactly as integers",
                  }))
