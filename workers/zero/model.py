"""Chapter 11's model and data: the course's GPT (``workers/model/gpt.py``) with its LM head tied to the embedding.

One definition for the ranks (``workers/ch11_*.py``, ``workers/exercises/ch11.py``) and the tests. The block is
Megatron's GPT block (Narayanan et al. 2021, sec 5.1): LayerNorm, fused QKV, causal attention, output projection,
LayerNorm, h -> 4h GeLU MLP, each with a residual. Megatron's eq. (2) counts 12h^2 + 13h parameters per layer;
this model has no QKV bias (as Llama), so 12h^2 + 10h, and with the final LayerNorm:

    P = 12 l h^2 + 10 l h + (V + s) h + 2h     (word embedding tied to the LM head; learned positions)

Why no QKV bias: the key bias adds q.b_k to every score of a row, which softmax ignores, so its gradient is
exactly zero in exact arithmetic and pure rounding noise in fp32. Adam divides by sqrt(v) + eps, which turns
that noise into updates of about +-lr whose sign depends on the order of the additions: two correct
implementations that add in a different order (one process vs n ranks) then disagree by ~lr on those
elements. Without the bias every gradient is a real signal and the comparisons stay at fp32 rounding.

The tied weight matters for ZeRO: the embedding and the head are one Parameter with one gradient (autograd
adds both uses), so a sharded optimizer must step it exactly once. ``model.parameters()`` lists it once;
``named_parameters(remove_duplicate=False)`` lists it twice, which is the trap.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from workers.model import GPTConfig, make_model as make_gpt
from workers.runtime import at_least, batch_over_world, divides, refusal

# fp32 weights of O(0.1) after a few steps; reordered fp32 sums differ by a few ulp.
FP32_TOL = {"atol": 1e-6, "rtol": 1e-5}

# The chapter's model: a tied head (what the ZeRO ledger's parameter count assumes) and no QKV bias (see above).
MODEL = GPTConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, tied=True, qkv_bias=False)


def model_config(vocab: int = 64, seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2) -> GPTConfig:
    """The chapter's model at a worker's shape."""
    return MODEL.replace(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers)


def make_model(cfg: GPTConfig = MODEL, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """The model, initialised from ``seed`` without touching the global RNG."""
    return make_gpt(cfg, seed, dtype=dtype, device=device)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over this batch's tokens (the average DDP and ZeRO reproduce)."""
    logits = model(tokens[:, :-1])  # [b, s-1, V]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_batches(cfg: GPTConfig, global_batch: int, steps: int, seed: int = 1) -> list[torch.Tensor]:
    """``steps`` global batches of token ids [global_batch, seq + 1]: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (global_batch, cfg.seq + 1), generator=g) for _ in range(steps)]


def run_problem(world_size: int, global_batch: int, steps: int, hidden: int, heads: int) -> str | None:
    """Why a chapter 11 run of the tied GPT cannot start (one sentence naming what to change), or None: the refusal
    the ZeRO-3, FSDP2 and stages workers share."""
    return refusal(batch_over_world(global_batch, world_size), at_least("steps", steps),
                   at_least("hidden", hidden) or divides("heads", heads, "hidden", hidden))


def shard_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous B/n rows of the global batch."""
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows]


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter once (tied ones once), flattened, as float64 on the CPU, for comparisons."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in model.parameters()])


# The optimizers the chapter compares: AdamW (8 bytes of fp32 state per parameter: exp_avg, exp_avg_sq)
# and SGD with momentum (4 bytes: momentum_buffer), with the hyperparameters every run uses.
OPTIMIZER_CLASSES = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}),
                     "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def make_optimizer(name: str, params):
    if name not in OPTIMIZER_CLASSES:
        raise ValueError(f"optimizer={name!r} is not known; use 'adamw' or 'sgd'.")
    cls, hyper = OPTIMIZER_CLASSES[name]
    return cls(params, **hyper)


STATE_BYTES_PER_PARAM = {"adamw": 8, "sgd": 4}  # fp32 exp_avg + exp_avg_sq; fp32 momentum_buffer


def train_reference(cfg: GPTConfig, optimizer: str, batches, seed: int = 0, dtype=torch.float32,
                    master_weights: bool = False) -> list[torch.Tensor]:
    """Single process, unsharded optimizer, the whole global batch: weights after each step (index 0 = start).

    ``master_weights=True``: the model in ``dtype`` (bf16), the optimizer stepping an fp32 copy of every
    parameter that is rounded back into the model after each step (mixed precision, unsharded).
    """
    model = make_model(cfg, seed=seed, dtype=dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params] if master_weights else params
    opt = make_optimizer(optimizer, masters)
    weights = [flat_params(model)]
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        if master_weights:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
        opt.step()
        if master_weights:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        weights.append(flat_params(model))
    return weights


def train_reference_mixed(cfg: GPTConfig, optimizer: str, batches, seed: int = 0, param_dtype=torch.bfloat16,
                          keep=None) -> tuple[list[torch.Tensor], list[float]]:
    """Single process, FSDP2's mixed precision without the sharding: fp32 master weights, the optimizer steps
    them; every step computes forward and backward with a copy of them cast to ``param_dtype`` (the parameters
    ``keep(name)`` picks stay fp32, as replicated ones do), on the whole batch, and the copy's gradients cast to
    fp32 are the masters' gradients. Weights after each step (index 0 = start, fp32 masters) and the losses.

    A cast of the parameters, not ``torch.autocast``: autocast casts each op's inputs and runs some ops
    (LayerNorm, softmax) in fp32, so its numbers differ from FSDP's by bf16 rounding.
    """
    master = make_model(cfg, seed=seed)
    compute = make_model(cfg, seed=seed)  # the same modules (the tie included); weights set from the masters
    named = list(master.named_parameters())
    opt = make_optimizer(optimizer, [p for _, p in named])
    weights, losses = [flat_params(master)], []
    for batch in batches:
        with torch.no_grad():
            for (name, p), q in zip(named, compute.parameters()):
                q.data = p.detach().to(torch.float32 if keep is not None and keep(name) else param_dtype)
                q.grad = None
        loss = loss_fn(compute, batch)
        loss.backward()
        for (_, p), q in zip(named, compute.parameters()):
            p.grad = q.grad.float()
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.append(flat_params(master))
        losses.append(loss.item())
    return weights, losses
