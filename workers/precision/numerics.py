"""The two parts of ``workers/ch08_precision.py`` that need no communication: each rank measures on its own.

``underflow``: the argument of Micikevicius et al. 2018 ("Mixed Precision Training", ICLR, sec 3.2 and
    Fig. 3): activation gradients are small, and in fp16 most of them fall below the smallest subnormal,
    2^-24, and flush to zero. Multiplying the loss by S shifts every gradient's exponent up by log2(S)
    into fp16's range; dividing the fp32 weight gradients by S afterwards is exact for a power of two.
    The model is a one-block language model whose loss, as in LLM pre-training, is the summed token loss
    divided by every token of the global step (``tokens_per_step``; Llama 3 used 4M-16M tokens per step,
    "The Llama 3 Herd of Models" sec 3.4.1), of which this rank computes ``tokens_per_rank``. The same
    weights and tokens run three ways: fp32 (the reference), fp16 autocast unscaled, fp16 autocast scaled.
``master_weights``: a linear regression trained three ways for the same steps and learning rate: fp32;
    bf16 compute (autocast) with fp32 master weights; pure bf16 parameters and SGD arithmetic. When
    lr * |grad| is below half an ulp of |w|, bf16(w - lr * grad) == w: the update vanishes. The fp32
    master copy keeps every update, and its bf16 copy changes whenever the sum of them crosses a rounding
    boundary (Micikevicius et al. 2018, sec 3.1).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPONENT_RANGE = (-60, 20)  # floor(log2 |g|) histogram bins: fp16's subnormals start at 2^-24, its max is < 2^16


# -- gradient underflow --------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """Embedding -> one residual MLP block -> vocabulary head: logits' gradients are (p - onehot) / tokens."""

    def __init__(self, vocab: int = 512, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):  # [t] -> [t, vocab]
        h = self.embed(tokens)  # [t, d]
        h = h + self.down(F.gelu(self.up(h)))  # [t, 4d] inside, [t, d] out
        return self.head(h)  # [t, vocab]


ACTIVATIONS = ("up", "down", "head")  # the outputs whose gradients we histogram (fp16 under autocast)


def exponent_histogram(g: torch.Tensor) -> list[int]:
    """Counts of floor(log2 |g|) per integer exponent in EXPONENT_RANGE (clamped into the end bins); zeros excluded."""
    lo, hi = EXPONENT_RANGE
    nonzero = g[g != 0].float().abs()
    e = torch.floor(torch.log2(nonzero)).clamp(lo, hi - 1).long() - lo
    return torch.bincount(e, minlength=hi - lo).tolist()


def _backward(model, tokens, targets, tokens_per_step: int, fp16: bool, scale: float, device):
    grads: dict[str, torch.Tensor] = {}

    def keep_output_grad(name):
        def forward_hook(_module, _inputs, output):  # returns None: the output itself is left alone
            output.register_hook(lambda g: grads.__setitem__(name, g.detach().clone()))
        return forward_hook

    hooks = [getattr(model, name).register_forward_hook(keep_output_grad(name)) for name in ACTIVATIONS]
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
        logits = model(tokens)  # [t, vocab], fp16 under autocast
        loss = F.cross_entropy(logits.float(), targets, reduction="sum") / tokens_per_step
    (loss * scale).backward()  # the scaled loss is fp32; its gradient enters the fp16 graph at the logits
    for h in hooks:
        h.remove()
    weight_grads = torch.cat([p.grad.reshape(-1).float() / scale for p in model.parameters()])  # fp32, unscaled
    return grads, weight_grads


def underflow(ctx, loss_scale: float, tokens_per_rank: int, tokens_per_step: int, seed: int) -> dict:
    device = ctx.device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyLM().to(device)
    vocab = model.head.out_features
    g = torch.Generator().manual_seed(1000 * seed + ctx.rank)
    tokens = torch.randint(0, vocab, (tokens_per_rank,), generator=g).to(device)  # [t]
    targets = (7 * tokens + 3) % vocab  # a fixed next-token rule; at initialisation p is near 1/vocab anyway

    ref_acts, ref_wgrad = _backward(model, tokens, targets, tokens_per_step, fp16=False, scale=1.0, device=device)
    fp16 = torch.finfo(torch.float16)
    out = {"reference": {"exponents": {n: exponent_histogram(ref_acts[n]) for n in ACTIVATIONS}},
           "exponent_range": list(EXPONENT_RANGE), "loss_scale": loss_scale, "tokens_per_step": tokens_per_step,
           "tokens_per_rank": tokens_per_rank,
           "fp16": {"max": fp16.max, "smallest_normal": fp16.smallest_normal,
                    "smallest_subnormal": fp16.smallest_normal * fp16.eps}}
    for label, scale in (("unscaled", 1.0), ("scaled", loss_scale)):
        acts, wgrad = _backward(model, tokens, targets, tokens_per_step, fp16=True, scale=scale, device=device)
        per = {}
        for n in ACTIVATIONS:
            a, ref = acts[n], ref_acts[n]
            nonzero = ref != 0
            per[n] = {"dtype": str(a.dtype).removeprefix("torch."),
                      "flushed": float(((a == 0) & nonzero).sum() / nonzero.sum()),  # lost entirely
                      "subnormal": float(((a != 0) & (a.abs() < fp16.smallest_normal)).float().mean()),
                      "overflowed": float((~torch.isfinite(a)).float().mean()),
                      "exponents": exponent_histogram(a)}  # as stored: scaled by S
        all_ref = torch.cat([ref_acts[n].reshape(-1) for n in ACTIVATIONS])
        all_got = torch.cat([acts[n].reshape(-1) for n in ACTIVATIONS])
        out[label] = {"scale": scale, "activations": per,
                      "flushed": float(((all_got == 0) & (all_ref != 0)).sum() / (all_ref != 0).sum()),
                      "weight_grad_rel_error": float((wgrad - ref_wgrad).norm() / ref_wgrad.norm())}
    return out


# -- fp32 master weights vs pure bf16 ----------------------------------------------------------------------

MASTER_WEIGHT_RUNS = ("fp32", "bf16_master_fp32", "pure_bf16")


def regression_data(d_in: int = 32, d_out: int = 8, rows: int = 256, noise: float = 0.01, seed: int = 0):
    """x ~ N(0, 1), y = x W*^T + noise, and a starting point W0 near W*: weights of O(1/sqrt(d_in))."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d_out, d_in, generator=g) / d_in**0.5  # [d_out, d_in]
    x = torch.randn(rows, d_in, generator=g)  # [rows, d_in]
    y = x @ w_true.T + noise * torch.randn(rows, d_out, generator=g)  # [rows, d_out]
    w0 = w_true + 0.5 * torch.randn(d_out, d_in, generator=g) / d_in**0.5
    return x, y, w0


def train_regression(how: str, x, y, w0, steps: int, lr: float, device) -> dict:
    """Full-batch SGD on the mean squared error; ``how`` is one of MASTER_WEIGHT_RUNS."""
    model = nn.Linear(x.shape[1], y.shape[1], bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    dtype = torch.bfloat16 if how == "pure_bf16" else torch.float32
    model = model.to(device, dtype)  # pure bf16: the parameters, their gradients and the SGD update are bf16
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    w = model.weight
    losses, vanished, bf16_unchanged = [], [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=how == "bf16_master_fp32"):
            pred = model(x.to(dtype))  # [rows, d_out]; bf16 matmul under autocast or in pure bf16
        F.mse_loss(pred.float(), y).backward()
        before = w.detach().clone()
        opt.step()
        moved = w.grad != 0  # an update was asked for ...
        vanished.append(float(((w.detach() == before) & moved).sum() / moved.sum().clamp(min=1)))  # ... and lost
        bf16_unchanged.append(float((w.detach().bfloat16() == before.bfloat16()).float().mean()))
        with torch.no_grad():  # every run's weights judged the same way: fp32 loss of the stored weights
            losses.append(float(F.mse_loss(x @ w.detach().float().T, y)))
    return {"loss": losses, "vanished": vanished, "bf16_copy_unchanged": bf16_unchanged,
            "param_dtype": str(w.dtype).removeprefix("torch.")}


def master_weights(ctx, steps: int, lr: float, seed: int) -> dict:
    x, y, w0 = regression_data(seed=seed)
    runs = {how: train_regression(how, x, y, w0, steps, lr, ctx.device) for how in MASTER_WEIGHT_RUNS}
    for step in range(steps):  # after the fact (the runs are sequential): one point per step, all three losses
        ctx.metric(step=step, **{how: runs[how]["loss"][step] for how in MASTER_WEIGHT_RUNS})
    return {"runs": runs, "steps": steps, "lr": lr, "initial_loss": float(F.mse_loss(x @ w0.T, y))}
