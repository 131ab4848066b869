"""The verifiable toy task: "a+b=" followed by the two digits of the sum, zero-padded ("7+5=12", "3+4=07").

A reward a program can compute is what makes RL on it honest (the DeepSeekMath / R1 recipe of rule-based
rewards): the answer is right or it is not. The tokenizer is a table in code, one character per token.
Anything but a digit in the answer span is a *forbidden* output (a format violation), what the safety
gate counts.
"""
from __future__ import annotations

import torch

CHARS = "0123456789+=#"  # '#' pads; never a valid answer token
STOI = {c: i for i, c in enumerate(CHARS)}
PROMPT_LEN = 4  # "a+b="
ANSWER_LEN = 2  # two digits, zero-padded
SEQ_LEN = PROMPT_LEN + ANSWER_LEN  # 6 tokens; the model reads the first 5
MAX_DIGIT = 9
def encode(text: str) -> list[int]:
    return [STOI[c] for c in text]


def decode(ids) -> str:
    return "".join(CHARS[int(i)] for i in ids)


def all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(MAX_DIGIT + 1) for b in range(MAX_DIGIT + 1)]


def is_held_out(a: int, b: int) -> bool:
    """The 20 held-out pairs: (a + 2b) % 5 == 0, two per value of a and two per value of b.

    Every digit is still seen as a first and as a second operand in the 80 training pairs, so the held-out
    prompts test whether the model learned to add, not whether it can guess a digit it never read in that
    place. (Holding out every fifth pair in order, as this task first did, holds out exactly b = 0 and b = 5:
    held-out accuracy after the same SFT then ranged from 0.25 to 0.65 over seeds, luck rather than skill.)"""
    return (a + 2 * b) % 5 == 0


def split_pairs() -> tuple[list, list]:
    """Train / held-out pairs (fixed, no randomness): 80 and 20."""
    pairs = all_pairs()
    return [p for p in pairs if not is_held_out(*p)], [p for p in pairs if is_held_out(*p)]


def prompts(pairs) -> torch.Tensor:
    return torch.tensor([encode(f"{a}+{b}=") for a, b in pairs], dtype=torch.long)  # [n, 4]


def sequences(pairs) -> torch.Tensor:
    """Prompt and correct answer: [n, 6]."""
    return torch.tensor([encode(f"{a}+{b}={a + b:02d}") for a, b in pairs], dtype=torch.long)


def reward(prompt_ids: torch.Tensor, answer_ids: torch.Tensor) -> torch.Tensor:
    """1.0 where the two answer tokens spell a + b exactly, else 0.0. [n, 4], [n, 2] -> [n]."""
    a, b = prompt_ids[:, 0], prompt_ids[:, 2]
    want = torch.stack([(a + b) // 10, (a + b) % 10], dim=1)  # digit tokens are their own values
    return (answer_ids == want).all(dim=1).float()


def forbidden(answer_ids: torch.Tensor) -> torch.Tensor:
    """1.0 where an answer holds a token that is not a digit ('+', '=', '#'). [n, 2] -> [n]."""
    return (answer_ids > MAX_DIGIT).any(dim=1).float()


def batch_pairs(pairs: list, batch: int, generator: torch.Generator) -> list:
    idx = torch.randint(0, len(pairs), (batch,), generator=generator)
    return [pairs[int(i)] for i in idx]
