"""Chapter 02's graded exercises: DDP by hand, then its buckets, the sampler's shards, and the buckets' all-reduces
overlapping backward (all on real ranks)."""
from course_utils.exercises import NOT_APPLICABLE, Exercise, register

CHECKER = "workers.exercises.ch02"
NO_MEMORY = NOT_APPLICABLE + "nothing is allocated for long or released: gradients are averaged where they are"

register(Exercise("ddp_by_hand", "02", "ddp_by_hand",
                  "DDP by hand: broadcast the starting weights, then average every gradient from a hook",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "every gradient after backward, three steps: NaN or inf in any one is named",
                      "order": NOT_APPLICABLE + "each parameter's hook averages its own gradient whatever order they "
                                                "land in, and every step starts from .grad = None",
                      "sizes": NOT_APPLICABLE + "DDP's mean is the single-process mean only for equal shards: the "
                                                "16-row batch splits evenly over 2 and 4 ranks",
                      "ragged": NOT_APPLICABLE + "every rank holds the same number of rows (equal shards, as above)",
                      "layouts": NOT_APPLICABLE + "one hook per parameter is the same rule for any model: there is no "
                                                  "layout for it to depend on",
                      "traffic": NOT_APPLICABLE + "one all-reduce per gradient is given by the exercise (counting "
                                                  "them is bucketed_average's check); the values are compared",
                      "mutation": NOT_APPLICABLE + "changing the model (its weights, its hooks) is the answer's job",
                      "output": NOT_APPLICABLE + "what the answer returns is not used (the hook handles, if any)",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "the ranks add in another order than one process: equal to fp32 "
                                               "rounding, not bit for bit",
                  }))
register(Exercise("bucketed_average", "02", "bucketed_average",
                  "Buckets: one all_reduce per bucket of gradients, with DDP's packing rule",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "every averaged gradient: NaN or inf in any one is named",
                      "order": NOT_APPLICABLE + "the gradients come as a list, already in the order to pack them",
                      "sizes": "bucket_bytes that a bucket fills exactly (256, 2304 bytes: that bucket is full) and "
                               "ones that fall inside a gradient: the all_reduce sizes follow DDP's >= rule",
                      "ragged": "limits that leave a last, partly filled bucket with fewer gradients than the others: "
                                "it is all-reduced too",
                      "layouts": "float32, float64 and bfloat16 gradients: bucket bytes counted with each dtype's "
                                 "element size, not 4",
                      "traffic": "counts the all_reduce calls and the elements of each: one per bucket, of the "
                                 "bucket's size",
                      "mutation": NOT_APPLICABLE + "averaging the gradients in place is the answer's job",
                      "output": NOT_APPLICABLE + "the answer returns nothing: it averages its inputs in place",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "the ranks add in another order than one process: equal to rounding, "
                                               "not bit for bit",
                  }))
register(Exercise("shard_indices", "02", "shard_indices",
                  "DistributedSampler by hand: the same shuffle on every rank, a different slice each, a new order each epoch",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": NOT_APPLICABLE + "the answer returns integer indices: no floating-point value",
                      "order": NOT_APPLICABLE + "no gradients: a list of sample indices",
                      "sizes": "datasets of 12 samples (dividing 2 and 4 ranks) and of 10 and 7 (not): every rank "
                               "gets ceil(size / world) indices, padded by repetition",
                      "ragged": "a dataset of 1 sample on 4 ranks: three ranks would hold none without repeating the "
                                "dataset more than once",
                      "layouts": NOT_APPLICABLE + "one formula of (size, rank, world, epoch, seed), already tried at "
                                                  "each size and world size above",
                      "traffic": NOT_APPLICABLE + "the answer communicates nothing: every rank computes its own slice",
                      "mutation": "torch's, Python's and NumPy's global random states are left as they were",
                      "output": "every rank returns a list of ints from range(dataset_size), not a tensor",
                      "memory": NOT_APPLICABLE + "a list of a few indices: nothing to release",
                      "bits": NOT_APPLICABLE + "integer indices: no floating-point bits",
                  }))
register(Exercise("overlapped_hooks", "02", "overlapped_hooks",
                  "Overlap: launch each bucket's all-reduce asynchronously from inside backward, wait after it",
                  worker=CHECKER, world_sizes=(2, 4), tries={
                      "non-finite": "every .grad after finish(): NaN or inf in any one is named",
                      "order": "a LayerNorm whose weight's gradient lands before its bias's (out of the bucket's "
                               "listed order) and a second micro-batch accumulating into .grad: each bucket's "
                               "all-reduce is launched when its last gradient lands, before later ones are computed, "
                               "and averages the accumulated .grad",
                      "sizes": NOT_APPLICABLE + "the buckets are handed to the answer: it packs and divides nothing",
                      "ragged": "buckets of 4 and 2 parameters: each bucket's own count fires it",
                      "layouts": NOT_APPLICABLE + "the two models above differ in order and bucket lengths, which are "
                                                  "the order and ragged classes",
                      "traffic": "counts the all-reduces launched during backward: one per bucket, not one per "
                                 "gradient",
                      "mutation": NOT_APPLICABLE + "writing the averages into .grad is the answer's job",
                      "output": NOT_APPLICABLE + "the answer returns finish(), a function; its effect is the .grad "
                                                 "checked above",
                      "memory": NO_MEMORY,
                      "bits": NOT_APPLICABLE + "the ranks add in another order than one process: equal to rounding, "
                                               "not bit for bit",
                  }))
