"""Chapter 09's loss-spike experiments: the course's GPT (``workers/model/gpt.py``) trained on one CPU core in seconds,
with telemetry, injected faults, detection and recovery (nanoGPT style).

- ``config``: ``MODEL`` (the course's ``GPTConfig`` with its attention written out, so every step can read the
  largest pre-softmax logit) and ``TrainConfig`` (the run), two dataclasses instead of flags;
- ``data``: a seeded first-order Markov chain (token t+1 depends on token t alone), generated in code and
  addressed by sample id;
- ``telemetry``: the loss with its z-loss, per-layer groups, grad norms, update/param ratio, zero and newly
  nonzero gradient elements, bitwise checksums;
- ``reduce``: the hand-rolled gradient all-reduce, the communication fault, and the reduction check;
- ``train``: the training loop with snapshots, rewind-and-skip, dynamic loss scaling and deterministic replay;
- ``detect``: the detectors (loss spike, the checksum verdict, first divergence of two traces).
"""
