"""Mixture of experts and expert parallelism (chapter 16): the router, the experts, the all-to-all dispatcher,
the one-process reference that loops token by token, the equivalence check and the tiny MoE GPT."""
