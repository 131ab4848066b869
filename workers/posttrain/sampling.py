"""Log-probabilities of answers under a model, and sampling answers from it (the rollouts of RL)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def answer_logprobs(model, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """log pi(answer token t | prompt, answer[:t]) for every answer token: [n, P], [n, T] -> [n, T]."""
    tokens = torch.cat([prompt, answer], dim=1)  # [n, P + T]
    logits = model(tokens[:, :-1])  # [n, P + T - 1, V]
    P = prompt.shape[1]
    logp = F.log_softmax(logits[:, P - 1:].float(), dim=-1)  # positions predicting the answer: [n, T, V]
    return logp.gather(-1, answer[..., None]).squeeze(-1)  # [n, T]


@torch.no_grad()
def sample_answers(model, prompt: torch.Tensor, answer_len: int, generator: torch.Generator,
                   temperature: float = 1.0, greedy: bool = False) -> torch.Tensor:
    """Autoregressively sample ``answer_len`` tokens after each prompt: [n, P] -> [n, T]."""
    tokens = prompt
    for _ in range(answer_len):
        logits = model(tokens)[:, -1].float()  # [n, V]
        if greedy:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # [n, 1]
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[:, prompt.shape[1]:]
