"""Data parallelism by hand (chapter 02), rank side.

- ``model``: the tiny MLP, its data, the row split per rank and the single-process baseline, one definition for
  the ranks, the notebook and the tests;
- ``buckets``: DDP's rule for packing gradients into buckets, and what it predicts for a chain of layers;
- ``overlap``: ``OverlappedDDP``, DDP's mechanism by hand: one asynchronous all-reduce per bucket, launched from the
  post-accumulate-grad hooks as each bucket fills, waited in ``finish_gradient_synchronization()`` before the step.
"""
