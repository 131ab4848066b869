"""Chapter 06's graded exercises: the block's two all-reduces (real ranks), and attention's share of the FLOPs."""
from course_utils.exercises import FAIL, PASS, Exercise, register

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
        if abs(got - want) <= 1e-9:
            continue
        where = f"at s={seq}, h={hidden}: got {got:.4g}, expected {want:.4g}"
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
                  worker=CHECKER, world_sizes=(4, 2)))
register(Exercise("attention_flop_share", "06", "attention_flop_share",
                  "Attention's share of a layer's forward FLOPs as a function of s and h", local=check_attention_flop_share))
