"""Chapter 04's graded exercises: column-parallel, row-parallel with the bias once, SwiGLU's split, and the
cross-entropy from logits split by vocabulary (real ranks)."""
from course_utils.exercises import NOT_APPLICABLE, Exercise, register

CHECKER = "workers.exercises.ch04"
COMMON = {
    "order": NOT_APPLICABLE + "one layer's backward, run once: its gradients have no order of arrival to vary",
    "sizes": NOT_APPLICABLE + "tensor parallelism needs the layer's width (16) to be a multiple of the group's size: "
                              "it is for groups of 2 and 4",
    "ragged": NOT_APPLICABLE + "every rank holds an equal shard of the layer, as tensor parallelism requires",
    "memory": NOT_APPLICABLE + "the answer is one forward; it keeps nothing for later",
    "bits": NOT_APPLICABLE + "float32 against a float64 dense layer: equal to rounding, compared with a tolerance",
}
LAYOUTS = ("the whole world as the group, then at world 4 two groups of 2, consecutive and non-contiguous, each with "
           "its own layer and data: its collective stays inside the group given")
MUTATION = NOT_APPLICABLE + ("x, weight and bias are leaves that require grad, built afresh for every case: autograd "
                             "refuses to change them in place")

register(Exercise("column_parallel_forward", "04", "column_parallel_forward",
                  "Column-parallel linear: this rank's output columns, and f so that the input gradient is whole",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      **COMMON,
                      "non-finite": "the output columns and the gradients of x, weight and bias: NaN or inf is named",
                      "layouts": LAYOUTS,
                      "traffic": NOT_APPLICABLE + "f's one all-reduce in backward is the whole of the traffic; without "
                                                  "it, or doubled, the input gradient compared shows it",
                      "mutation": MUTATION,
                      "output": "the output's shape: this rank's out/t columns, not the whole (gathered) output",
                  }))
register(Exercise("row_parallel_forward", "04", "row_parallel_forward",
                  "Row-parallel linear: sum the partial products with g, then add the bias once",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      **COMMON,
                      "non-finite": "the output and the gradients of x, weight and bias: NaN or inf is named",
                      "layouts": LAYOUTS,
                      "traffic": NOT_APPLICABLE + "g's one all-reduce in forward is the whole of the traffic; without "
                                                  "it, or doubled, the output compared shows it",
                      "mutation": MUTATION,
                      "output": NOT_APPLICABLE + "the output is whole on every rank, [s, b, out]: its shape is the "
                                                 "dense layer's, compared with it",
                  }))
register(Exercise("swiglu_shard", "04", "swiglu_shard",
                  "SwiGLU's fused [gate; up] weight: the rows each rank must hold",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      **COMMON,
                      "non-finite": "the shard's values and the parallel MLP's output built from it: NaN or inf is "
                                    "named",
                      "layouts": NOT_APPLICABLE + "one fused [gate; up] layout, the chapter's; its row rule is tried at "
                                                  "t = 4 and 2",
                      "traffic": NOT_APPLICABLE + "the answer only slices a tensor: it communicates nothing",
                      "mutation": NOT_APPLICABLE + "the answer is handed a copy of the fused weight, so changing it "
                                                   "cannot reach the layer",
                      "output": "the shard's shape on every rank (2*ffn/t rows), the last rank's included",
                  }))
register(Exercise("vocab_parallel_loss", "04", "vocab_parallel_loss",
                  "Loss parallelism: the cross-entropy from this rank's block of the vocabulary, three [s, b] "
                  "all-reduces", worker=CHECKER, world_sizes=(4, 2), tries={
                      "non-finite": "logits of order 1e3, where exp() of an unshifted logit overflows float32 and a "
                                    "max summed over the ranks underflows every exponential: an infinite or NaN loss "
                                    "is named, with the max to all-reduce (MAX)",
                      "order": NOT_APPLICABLE + "one forward, run once: nothing arrives in an order that could vary",
                      "sizes": NOT_APPLICABLE + "every rank holds V/t words, as Megatron requires (it pads the "
                                                "vocabulary to a multiple of t): 24 words over groups of 2 and 4",
                      "ragged": NOT_APPLICABLE + "the blocks of the vocabulary are equal; every rank holds targets of "
                                                 "its own and targets of other ranks, in every case",
                      "layouts": "the whole world as the group, then at world 4 two groups of 2, non-contiguous and "
                                 "consecutive, each with its own logits and targets: the three all-reduces stay inside "
                                 "the group given, and a rank's block starts at its rank in the group",
                      "traffic": "counts what each collective is handed: more than three [s, b] tensors means the "
                                 "logits (or their exponentials) were gathered, which is what the split avoids",
                      "mutation": "the caller's logits and target are compared before and after: the max subtracted "
                                  "in place (as Megatron does, to save memory) is named",
                      "output": "the loss's shape: one loss per token, [s, b], not their mean",
                      "memory": NOT_APPLICABLE + "what the answer keeps is not measured; gathering the logits, the "
                                                 "memory the split saves, is caught by its traffic",
                      "bits": NOT_APPLICABLE + "float32 logits against the float64 loss: equal to rounding, compared "
                                               "with a tolerance of 1e-5 of the loss's size",
                  }))
