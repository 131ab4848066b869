"""Chapter 12's post-training toolkit, on the tiny GPT of ``workers/gpt`` (reused, not copied).

- ``task``: the verifiable toy task "a+b=" -> two answer digits, its tokenizer and its programmatic reward;
- ``lora``: ``LoRALinear`` (frozen W, trainable A and B, B = 0 at init), ``merge()``, ``apply_lora``, ``merge_lora``;
- ``losses``: SFT cross-entropy with the prompt masked out, the DPO loss, GRPO advantages and surrogate;
- ``sampling``: answer log-probabilities under a model, and sampling answers from it;
- ``train``: the SFT, DPO and GRPO loops, each a few seconds on one CPU core;
- ``state``: the weights, gradients and optimizer state a rank holds, counted from its tensors.
"""
