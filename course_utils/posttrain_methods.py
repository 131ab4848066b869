"""PPO, DPO and GRPO side by side, as data, with a renderer.

Sources: PPO for language models, Ouyang et al. 2022 ("InstructGPT", sec. 3.5: policy, reference (SFT)
model for the per-token KL penalty, reward model; value function initialised from the reward model);
DPO, Rafailov et al. 2023 (sec. 4, eq. 7: no reward model, no sampling during training); GRPO, Shao et al.
2024 ("DeepSeekMath", sec. 4.1: the group's mean reward replaces the value model as baseline; KL added to
the loss rather than to the reward).
"""
from __future__ import annotations

ASPECTS = ("models in memory", "trained", "data", "advantage estimate", "knobs", "stability")

METHODS = {
    "PPO": {
        "models in memory": ("policy", "reference", "value", "reward"),
        "trained": ("policy", "value"),
        "data": "prompts; answers sampled online, scored by a learned reward model",
        "advantage estimate": "GAE from the value model's per-token values (learned baseline)",
        "knobs": "clip eps, KL coef, GAE lambda and gamma, value-loss coef, epochs per batch",
        "stability": "most moving parts: value model lag, reward hacking of the learned reward",
    },
    "DPO": {
        "models in memory": ("policy", "reference"),
        "trained": ("policy",),
        "data": "offline preference pairs (prompt, chosen, rejected); no sampling",
        "advantage estimate": "none: a classification loss on the implicit-reward margin",
        "knobs": "beta (how far from the reference), learning rate",
        "stability": "stable as supervised learning; can push both log-probs down, overfits small pair sets",
    },
    "GRPO": {
        "models in memory": ("policy", "reference"),
        "trained": ("policy",),
        "data": "prompts; G answers per prompt sampled online, scored by a rule (verifiable reward)",
        "advantage estimate": "(r - group mean) / group std: the group is the baseline",
        "knobs": "group size G, clip eps, KL coef, temperature, inner steps",
        "stability": "no value model to lag; groups with equal rewards give no signal; KL keeps it close",
    },
}


def models_in_memory(method: str) -> int:
    return len(METHODS[method]["models in memory"])


def render_methods(methods=tuple(METHODS)) -> str:
    lines = []
    for aspect in ASPECTS:
        lines.append(f"{aspect}:")
        for m in methods:
            v = METHODS[m][aspect]
            lines.append(f"  {m:<5} {' + '.join(v) if isinstance(v, tuple) else v}")
    return "\n".join(lines)
