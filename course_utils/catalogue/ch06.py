"""Chapter 06's graded exercises: the block's two all-reduces (real ranks), and attention's share of the FLOPs."""
import math

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
