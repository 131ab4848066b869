"""Chapter 03's graded exercises: Megatron's f and g, then split and gather, as autograd Functions on real ranks.

Checked at world 4 first (the chapter's ranks are already warm there), then at world 2.
"""
from course_utils.exercises import NOT_APPLICABLE, Exercise, register

CHECKER = "workers.exercises.ch03"
COMMON = {
    "order": NOT_APPLICABLE + "one input's gradient through one Function: there is no order of arrival to vary",
    "ragged": NOT_APPLICABLE + "every rank of a group holds a tensor of the same shape, as the collectives require",
    "memory": NOT_APPLICABLE + "a Function keeps nothing beyond the group between forward and backward",
    "bits": NOT_APPLICABLE + "the inputs are small integers in float64: a right answer is exact, and a wrong sum or "
                             "slice is off by whole numbers, compared exactly",
}

register(Exercise("f_and_g", "03", "f_and_g",
                  "f and g: identity forward / all_reduce backward, and all_reduce forward / identity backward",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      **COMMON,
                      "non-finite": "the forward output and the input gradient of f and of g: NaN or inf is named",
                      "sizes": NOT_APPLICABLE + "f and g keep their input's shape: nothing is divided among the ranks",
                      "layouts": "the whole world as the group, then at world 4 two groups of 2, consecutive and "
                                 "non-contiguous, with different data: sums stay inside the group given",
                      "traffic": NOT_APPLICABLE + "one all-reduce each, fixed by the exercise; a missing or extra one "
                                                  "changes the values, which are compared exactly",
                      "mutation": "the input x is unchanged after g's forward (no all-reduce on x itself)",
                      "output": NOT_APPLICABLE + "f and g return a tensor of their input's shape, compared exactly; "
                                                 "no dtype or device of their own to choose",
                  }))
register(Exercise("split_and_gather", "03", "split_and_gather",
                  "Split and gather along the last dimension, each the other's backward",
                  worker=CHECKER, world_sizes=(4, 2), tries={
                      **COMMON,
                      "non-finite": "the forward output and the input gradient of split and of gather: NaN or inf is "
                                    "named",
                      "sizes": NOT_APPLICABLE + "Megatron's split needs the last dimension to be a multiple of the "
                                                "group's size, as the chapter's widths are",
                      "layouts": "the whole world as the group, then at world 4 two groups of 2, consecutive and "
                                 "non-contiguous: each rank keeps the slice of its place in its group",
                      "traffic": NOT_APPLICABLE + "one all-gather in gather's forward and split's backward, fixed by the "
                                                  "exercise; a missing one changes the shape or values compared",
                      "mutation": NOT_APPLICABLE + "split returns a slice and gather a new tensor: neither has a "
                                                   "collective that could write into its input",
                      "output": "the shape of each output: 1/n of the last dimension for split, n times it for gather",
                  }))
