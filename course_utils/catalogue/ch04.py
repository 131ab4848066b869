"""Chapter 04's graded exercises: column-parallel, row-parallel with the bias once, and SwiGLU's split (real ranks)."""
from course_utils.exercises import Exercise, register

CHECKER = "workers.exercises.ch04"

register(Exercise("column_parallel_forward", "04", "column_parallel_forward",
                  "Column-parallel linear: this rank's output columns, and f so that the input gradient is whole",
                  worker=CHECKER, world_sizes=(4, 2)))
register(Exercise("row_parallel_forward", "04", "row_parallel_forward",
                  "Row-parallel linear: sum the partial products with g, then add the bias once",
                  worker=CHECKER, world_sizes=(4, 2)))
register(Exercise("swiglu_shard", "04", "swiglu_shard",
                  "SwiGLU's fused [gate; up] weight: the rows each rank must hold",
                  worker=CHECKER, world_sizes=(4, 2)))
