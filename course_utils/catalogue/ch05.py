"""Chapter 05's graded exercises: the head-aware split of a fused QKV weight, and GQA's KV heads per rank (real ranks)."""
from course_utils.exercises import NOT_APPLICABLE, Exercise, register

CHECKER = "workers.exercises.ch05"
NO_GRADIENTS = NOT_APPLICABLE + "the answer picks rows or head numbers once: no gradients, no hooks"
NO_COLLECTIVES = NOT_APPLICABLE + "the answer runs no collective: the check's attention does, the same for every answer"
WHOLE_HEADS = NOT_APPLICABLE + "every configuration gives each rank the same number of query heads: none is short or empty"

register(Exercise("split_fused_qkv", "05", "split_fused_qkv",
                  "Split a fused [Q; K; V] weight by heads (MHA, GQA split, GQA replicated)",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      "non-finite": "the shard must hold no NaN or infinity (w holds none): named before the "
                                    "attention's output is compared",
                      "order": NO_GRADIENTS,
                      "sizes": "KV heads that the ranks divide (4 at tp 4) and that they do not (1 at tp 2, 2 at tp "
                               "4): a KV head is never cut, it is replicated",
                      "ragged": WHOLE_HEADS,
                      "layouts": "multi-head attention and GQA side by side: a rule true of kv_heads == heads alone "
                                 "(K and V cut like Q) fails",
                      "traffic": NO_COLLECTIVES,
                      "mutation": NOT_APPLICABLE + "each call gets its own copy of w, and a view of w is a right "
                                                   "answer",
                      "output": "a bfloat16 weight must give a bfloat16 shard, and the rows' count is compared with "
                                "the heads the rank needs",
                      "memory": NOT_APPLICABLE + "a view and a copy of the rows are both right: no memory is released",
                      "bits": NOT_APPLICABLE + "rows are taken, not computed, and compared with torch.equal; the "
                                               "random weights hold no -0.0 to tell apart",
                  }))
register(Exercise("kv_heads_for_rank", "05", "kv_heads_for_rank",
                  "GQA: which KV heads a rank must hold, split or replicated",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      "non-finite": "every KV head number must be a whole int: NaN or infinity is refused by name",
                      "order": NO_GRADIENTS,
                      "sizes": "KV heads that tp divides and that it does not (8 query heads over 1 or 2 KV heads at "
                               "tp 4): replicated heads go to the ranks whose query heads read them",
                      "ragged": WHOLE_HEADS,
                      "layouts": "five head configurations at tp 2 and 4: a rule true of kv_heads == tp alone (one "
                                 "head per rank) fails",
                      "traffic": NOT_APPLICABLE + "a list of head numbers: no collective runs",
                      "mutation": NOT_APPLICABLE + "the inputs are Python ints, which a function cannot change",
                      "output": "each head number must be an int (it indexes heads): floats such as 0.0 are refused",
                      "memory": NOT_APPLICABLE + "a list of head numbers: nothing is allocated or freed",
                      "bits": NOT_APPLICABLE + "whole numbers: no floating-point bits to tell apart",
                  }))
