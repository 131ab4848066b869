"""Chapter 03's problems: the unsharded tensors a worker splits over its ranks and the notebook and the tests
feed to the single-process reference, drawn from a seed so that both sides hold the same numbers.

- ``row_parallel_problem``: a row-parallel linear or Megatron's MLP (``workers/ch03_row_parallel.py``);
- ``scaling_trap_problem``: the row-parallel layer behind a replicated loss (``workers/ch03_scaling_trap.py``).
"""
import torch


def row_parallel_problem(mode: str, seed: int, batch: int, hidden: int, out: int, ffn: int):
    """Unsharded tensors, the same on every rank and in the notebook: (x, weights..., bias, grad_output)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    x = draw(batch, hidden)
    if mode == "row":
        return {"x": x, "weight": draw(hidden, out, scale=hidden ** -0.5), "bias": draw(out),
                "grad_output": draw(batch, out)}
    return {"x": x, "w_in": draw(hidden, ffn, scale=hidden ** -0.5), "w_out": draw(ffn, hidden, scale=ffn ** -0.5),
            "bias": draw(hidden), "grad_output": draw(batch, hidden)}


def scaling_trap_problem(seed: int, batch: int, hidden: int, out: int):
    """The unsharded X and W, the same on every rank (and in the notebook's reference)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, hidden), generator=gen, dtype=torch.float64)
    w = torch.randn((hidden, out), generator=gen, dtype=torch.float64) / hidden ** 0.5
    return x, w
