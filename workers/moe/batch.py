"""The batches chapter 16's layer checks run on, and the sweep of cases (shared by the worker and the reference).

Every rank draws the whole batch from ``data_seed`` and keeps its rows; ``reference`` draws it again.
"""
import torch

from workers.moe.config import MoEConfig

SWEEP = [(experts, top_k, capacity) for experts in (4, 8) for top_k in (1, 2) for capacity in (0.0, 1.0)]
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def batch(cfg: MoEConfig, tokens: int, data_seed: int, skew: float, dtype, weights: dict, balanced: bool = False):
    """The whole batch ``x`` ``[T, h]`` and the loss's directions ``g`` ``[T, h]`` (every rank draws all of it).

    ``balanced``: a batch the layer routes perfectly evenly (``balance`` must have set the router): token t's
    first choice is expert t mod E, its second (t + 1) mod E.
    """
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    g = torch.randn(tokens, cfg.hidden, generator=gen, dtype=torch.float64)
    if balanced:
        t = torch.arange(tokens)
        x = torch.zeros(tokens, cfg.hidden, dtype=torch.float64)
        x[t, t % cfg.experts] = 4.0
        x[t, (t + 1) % cfg.experts] += 2.0
    elif skew:
        hot = weights["router.weight"][0].double()
        x = x + skew * hot / hot.norm()  # every token leans towards expert 0's router row
    return x.to(dtype), g.to(dtype)


def balance(cfg: MoEConfig, weights: dict) -> dict:
    """The router that reads expert i's score off coordinate i (``hidden >= experts``): with ``batch(balanced=True)``
    every expert gets exactly T k / E token choices."""
    router = torch.zeros_like(weights["router.weight"])
    router[:, :cfg.experts] = torch.eye(cfg.experts, dtype=router.dtype)
    return {**weights, "router.weight": router}


def cases(sweep: bool, **one) -> list[MoEConfig]:
    if not sweep:
        return [MoEConfig(**one)]
    base = {k: v for k, v in one.items() if k not in ("experts", "top_k", "capacity_factor", "shared_experts")}
    return [MoEConfig(experts=e, top_k=k, capacity_factor=c, shared_experts=int(e == 8), **base) for e, k, c in SWEEP]
