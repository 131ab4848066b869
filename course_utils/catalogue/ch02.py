"""Chapter 02's graded exercises: DDP by hand, then its buckets, the sampler's shards, and the buckets' all-reduces
overlapping backward (all on real ranks)."""
from course_utils.exercises import Exercise, register

CHECKER = "workers.exercises.ch02"

register(Exercise("ddp_by_hand", "02", "ddp_by_hand",
                  "DDP by hand: broadcast the starting weights, then average every gradient from a hook",
                  worker=CHECKER, world_sizes=(2, 4)))
register(Exercise("bucketed_average", "02", "bucketed_average",
                  "Buckets: one all_reduce per bucket of gradients, with DDP's packing rule",
                  worker=CHECKER, world_sizes=(2, 4)))
register(Exercise("shard_indices", "02", "shard_indices",
                  "DistributedSampler by hand: the same shuffle on every rank, a different slice each, a new order each epoch",
                  worker=CHECKER, world_sizes=(2, 4)))
register(Exercise("overlapped_hooks", "02", "overlapped_hooks",
                  "Overlap: launch each bucket's all-reduce asynchronously from inside backward, wait after it",
                  worker=CHECKER, world_sizes=(2, 4)))
