"""Chapter 05's graded exercises: the head-aware split of a fused QKV weight, and GQA's KV heads per rank (real ranks)."""
from course_utils.exercises import Exercise, register

CHECKER = "workers.exercises.ch05"

register(Exercise("split_fused_qkv", "05", "split_fused_qkv",
                  "Split a fused [Q; K; V] weight by heads (MHA, GQA split, GQA replicated)",
                  worker=CHECKER, world_sizes=(4, 2)))
register(Exercise("kv_heads_for_rank", "05", "kv_heads_for_rank",
                  "GQA: which KV heads a rank must hold, split or replicated",
                  worker=CHECKER, world_sizes=(4, 2)))
