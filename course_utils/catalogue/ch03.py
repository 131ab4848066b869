"""Chapter 03's graded exercises: Megatron's f and g, then split and gather, as autograd Functions on real ranks.

Checked at world 4 first (the chapter's ranks are already warm there), then at world 2.
"""
from course_utils.exercises import Exercise, register

CHECKER = "workers.exercises.ch03"

register(Exercise("f_and_g", "03", "f_and_g",
                  "f and g: identity forward / all_reduce backward, and all_reduce forward / identity backward",
                  worker=CHECKER, world_sizes=(4, 2)))
register(Exercise("split_and_gather", "03", "split_and_gather",
                  "Split and gather along the last dimension, each the other's backward",
                  worker=CHECKER, world_sizes=(4, 2)))
