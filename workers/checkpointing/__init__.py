"""Checkpointing, rank side: what a checkpoint must hold, and how to write one that a crash cannot corrupt.

- ``training``: the small run the chapter checkpoints (a dropout MLP, AdamW, warmup + cosine LambdaLR, input
  augmentation that draws from numpy and python ``random``), one definition for the workers and the checkers;
- ``sampler``: a seeded shuffling data order that knows its position (epoch, batch), so it can be saved;
- ``state``: capture and restore of the full training state, every RNG stream included;
- ``atomic``: temporary name, fsync, ``os.replace``, a manifest written last, the newest *complete* checkpoint;
- ``sharded``: the small MLP the DCP demo shards with FSDP2 (uneven rows, so the shards differ in size);
- ``faults``: how saves die in the demos: a writer that kills its own process after N bytes, and the naive
  writer (``torch.save`` straight to the final names) it is compared with.

Nothing here needs a process group: every function takes paths and objects, so a single process (a test,
a notebook, a conversion script) can use it as well as a rank.
"""
