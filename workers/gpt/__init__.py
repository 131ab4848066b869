"""A tiny GPT that trains on one CPU core in seconds, for chapter 09's loss-spike experiments (nanoGPT style).

- ``config``: ``GPTConfig`` (the model) and ``TrainConfig`` (the run), two dataclasses instead of flags;
- ``model``: causal self-attention with optional qk-layernorm, MLP, blocks, the GPT; each attention layer
  records its largest pre-softmax logit of the last forward (telemetry, not state that outlives a run);
- ``data``: a seeded first-order Markov chain (token t+1 depends on token t alone), generated in code and
  addressed by sample id;
- ``telemetry``: grad norms, update/param ratio, zero and newly nonzero gradient elements, bitwise checksums;
- ``reduce``: the hand-rolled gradient all-reduce, the communication fault, and the reduction check;
- ``train``: the training loop with snapshots, rewind-and-skip, dynamic loss scaling and deterministic replay;
- ``detect``: the detectors (loss spike, the checksum verdict, first divergence of two traces).
"""
