"""A tiny GPT that trains on one CPU core in seconds, for chapter 09's loss-spike experiments (nanoGPT style).

- ``config``: ``GPTConfig`` (the model) and ``TrainConfig`` (the run), two dataclasses instead of flags;
- ``model``: causal self-attention with optional qk-layernorm, MLP, blocks, the GPT; each attention layer
  records its largest pre-softmax logit of the last forward (telemetry, not state that outlives a run);
- ``data``: a seeded second-order Markov chain generated in code, addressed by sample id;
- ``telemetry``: grad norms, update/param ratio, log Z, bitwise checksums and per-step fingerprints;
- ``reduce``: the hand-rolled gradient all-reduce, with the communication faults injected there;
- ``train``: the training loop with snapshots, rewind-and-skip, dynamic loss scaling and deterministic replay;
- ``detect``: the detectors (loss spike, cross-rank checksum, first divergence of two traces).
"""
