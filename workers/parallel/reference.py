"""Ground truth for ``mappings.py``: all ranks simulated in one process, gradients from plain autograd.

No collective and no hand-written backward appears here. Each mapping's forward is written with explicit
``torch.cat``, ``sum`` and slicing over a list that holds every rank's tensor, and its gradients come
from ``torch.autograd.grad`` through those ops. The only modelling choice is the *layout* of each input
and output, which is what makes a distributed gradient well defined:

* ``replicated``: one logical tensor, identical on every rank (the output of ``g``, a model input that
  every rank reads). The loss computed from it on every rank is one logical loss, counted once; its
  gradient is one tensor, which every rank holds.
* ``per_rank``: rank r's tensor is its own logical tensor (an addend of a partial sum, or a copy that
  feeds rank r's own part of the model); each has its own gradient.
* ``shard_first`` / ``shard_last``: rank r holds block r of one logical tensor, cut along the first /
  last dimension; its gradient is block r of the logical gradient.

``reference(name, inputs, grad_outputs)`` then returns, for every rank, the output and the gradient of
the input that a correct distributed implementation must produce.
"""
from __future__ import annotations

import torch

REPLICATED, PER_RANK, SHARD_FIRST, SHARD_LAST = "replicated", "per_rank", "shard_first", "shard_last"

# mapping -> (layout of its input, layout of its output)
LAYOUTS = {
    "copy_to_tensor_model_parallel_region": (REPLICATED, PER_RANK),
    "reduce_from_tensor_model_parallel_region": (PER_RANK, REPLICATED),
    "scatter_to_tensor_model_parallel_region": (REPLICATED, SHARD_LAST),
    "gather_from_tensor_model_parallel_region": (SHARD_LAST, REPLICATED),
    "scatter_to_sequence_parallel_region": (REPLICATED, SHARD_FIRST),
    # the gathered sequence feeds a tensor-parallel region: every rank's copy gets its own gradient
    "gather_from_sequence_parallel_region": (SHARD_FIRST, PER_RANK),
    "reduce_scatter_to_sequence_parallel_region": (PER_RANK, SHARD_FIRST),
    "all_to_all": (PER_RANK, PER_RANK),
}
MAPPING_NAMES = tuple(LAYOUTS)


def layouts(name: str, tensor_parallel_output_grad: bool = True) -> tuple[str, str]:
    if name not in LAYOUTS:
        raise KeyError(f"no mapping named {name!r}: choose one of {', '.join(LAYOUTS)}")
    if name == "gather_from_sequence_parallel_region" and not tensor_parallel_output_grad:
        return SHARD_FIRST, REPLICATED  # the gathered sequence is used identically on every rank
    return LAYOUTS[name]


# -- forward of every mapping, over the list of all ranks' tensors --------------------------------------

def _blocks(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    size = t.shape[dim]
    if size % n:
        raise ValueError(f"dimension {dim} has size {size}, which is not divisible by {n} ranks")
    return list(torch.split(t, size // n, dim=dim))


def _sum(ts: list[torch.Tensor]) -> torch.Tensor:
    total = ts[0]
    for t in ts[1:]:
        total = total + t
    return total


def forward(name: str, xs: list[torch.Tensor], *, input_split_sizes=None, **_) -> list[torch.Tensor]:
    """What each rank's output is, written with explicit concatenation and sums over all ranks."""
    n = len(xs)
    if name == "copy_to_tensor_model_parallel_region":
        return [xs[r] for r in range(n)]
    if name == "reduce_from_tensor_model_parallel_region":
        total = _sum(xs)
        return [total] * n
    if name == "scatter_to_tensor_model_parallel_region":
        return [_blocks(xs[r], n, -1)[r] for r in range(n)]
    if name == "gather_from_tensor_model_parallel_region":
        whole = torch.cat(xs, dim=-1)
        return [whole] * n
    if name == "scatter_to_sequence_parallel_region":
        return [_blocks(xs[r], n, 0)[r] for r in range(n)]
    if name == "gather_from_sequence_parallel_region":
        whole = torch.cat(xs, dim=0)
        return [whole] * n
    if name == "reduce_scatter_to_sequence_parallel_region":
        return _blocks(_sum(xs), n, 0)
    if name == "all_to_all":
        # input_split_sizes[s][r]: rows that rank s sends to rank r (None: equal blocks)
        sent = [list(torch.split(xs[s], input_split_sizes[s])) if input_split_sizes else _blocks(xs[s], n, 0)
                for s in range(n)]
        return [torch.cat([sent[s][r] for s in range(n)], dim=0) for r in range(n)]
    raise KeyError(f"no mapping named {name!r}: choose one of {', '.join(LAYOUTS)}")


def _require_equal(ts: list[torch.Tensor], what: str, name: str) -> None:
    for r, t in enumerate(ts[1:], start=1):
        if t.shape != ts[0].shape or not torch.equal(t, ts[0]):
            raise ValueError(f"{name}: the {what} must be replicated (identical on every rank), "
                             f"but rank {r} differs from rank 0")


def reference(name: str, inputs: list[torch.Tensor], grad_outputs: list[torch.Tensor], **options):
    """(outputs per rank, input gradients per rank) of mapping ``name``, derived by single-process autograd.

    ``inputs[r]`` / ``grad_outputs[r]``: rank r's input and the gradient arriving at rank r's output.
    ``options``: ``tensor_parallel_output_grad`` (gather_from_sequence_parallel_region),
    ``input_split_sizes`` (all_to_all: one list per rank).
    """
    n = len(inputs)
    in_layout, out_layout = layouts(name, options.get("tensor_parallel_output_grad", True))
    if in_layout == REPLICATED:
        _require_equal(inputs, "input", name)
        leaf = inputs[0].detach().to(torch.float64).clone().requires_grad_()
        leaves, xs = [leaf], [leaf] * n
    else:
        leaves = [t.detach().to(torch.float64).clone().requires_grad_() for t in inputs]
        xs = leaves
    outputs = forward(name, xs, **options)
    grads = [g.detach().to(torch.float64) for g in grad_outputs]
    if out_layout == REPLICATED:
        _require_equal(grads, "gradient of the output", name)
        loss = (outputs[0] * grads[0]).sum()  # one logical output, one logical loss: counted once
    else:
        loss = _sum([(o * g).sum() for o, g in zip(outputs, grads)])
    input_grads = torch.autograd.grad(loss, leaves)
    if in_layout == REPLICATED:
        input_grads = list(input_grads) * n
    return [o.detach() for o in outputs], [g.detach() for g in input_grads]


# -- inputs for a test: small integers in float64, so every sum is exact in any order ----------------

def example(name: str, world_size: int, rows: int = 2, cols: int = 3, seed: int = 0,
            dtype: torch.dtype = torch.float64, **options):
    """Inputs and output gradients for every rank, with the layouts the mapping expects.

    Values are integers in [-4, 4], so sums over up to 8 ranks are exact in float32 and float64 and a
    correct implementation matches the reference bit for bit, whatever order the collective adds in.
    Returns ``(inputs, grad_outputs)``, lists indexed by rank.
    """
    n = world_size
    gen = torch.Generator().manual_seed(seed)

    def draw(shape):
        return torch.randint(-4, 5, shape, generator=gen).to(dtype)

    in_layout, out_layout = layouts(name, options.get("tensor_parallel_output_grad", True))
    full = (n * rows, n * cols)
    if in_layout == REPLICATED:
        inputs = [draw(full)] * n
    elif in_layout == SHARD_FIRST:
        inputs = [draw((rows, n * cols)) for _ in range(n)]
    elif in_layout == SHARD_LAST:
        inputs = [draw((n * rows, cols)) for _ in range(n)]
    else:
        inputs = [draw(full) for _ in range(n)]
    if name == "all_to_all" and options.get("input_split_sizes"):
        inputs = [draw((sum(options["input_split_sizes"][r]), n * cols)) for r in range(n)]
    shapes = [o.shape for o in forward(name, [t.clone() for t in inputs], **options)]
    if out_layout == REPLICATED:
        grad_outputs = [draw(shapes[0])] * n
    else:
        grad_outputs = [draw(s) for s in shapes]
    return [t.clone() for t in inputs], [g.clone() for g in grad_outputs]


def uneven_splits(world_size: int) -> list[list[int]]:
    """An all-to-all with unequal blocks (as in expert parallelism): rank s sends s + r + 1 rows to rank r."""
    return [[s + r + 1 for r in range(world_size)] for s in range(world_size)]


# -- compare what the ranks sent back with the reference --------------------------------------------

def compare(name: str, records: list[dict], **options) -> dict:
    """``records[r]``: rank r's ``{"input", "grad_output", "output", "grad_input"}``.

    Returns the largest absolute error of the outputs and of the input gradients over all ranks, whether
    both are exactly equal, and, for a failed check, the ratio of the gradient norms (got / expected),
    which tells a gradient that is n times too large at a glance.
    """
    want_out, want_grad = reference(name, [r["input"] for r in records], [r["grad_output"] for r in records],
                                    **options)
    err_out = err_grad = 0.0
    exact = True
    got_norm = want_norm = 0.0
    for rank, rec in enumerate(records):
        out, grad = rec["output"].to(torch.float64), rec["grad_input"].to(torch.float64)
        if out.shape != want_out[rank].shape or grad.shape != want_grad[rank].shape:
            return {"mapping": name, "output_error": float("inf"), "grad_error": float("inf"), "exact": False,
                    "grad_ratio": float("nan"),
                    "why": f"rank {rank}: shapes output {tuple(out.shape)} grad {tuple(grad.shape)}, expected "
                           f"{tuple(want_out[rank].shape)} and {tuple(want_grad[rank].shape)}"}
        err_out = max(err_out, (out - want_out[rank]).abs().max().item())
        err_grad = max(err_grad, (grad - want_grad[rank]).abs().max().item())
        exact &= torch.equal(out, want_out[rank]) and torch.equal(grad, want_grad[rank])
        got_norm += grad.square().sum().item()
        want_norm += want_grad[rank].square().sum().item()
    ratio = (got_norm / want_norm) ** 0.5 if want_norm else float("nan")
    return {"mapping": name, "output_error": err_out, "grad_error": err_grad, "exact": exact, "grad_ratio": ratio,
            "why": ""}


# -- the composite experiments of chapter 03, unsharded ------------------------------------------------

def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad_output: torch.Tensor):
    """Y = X W + b on one process (W stored [in, out], as the chapter writes the math); returns Y and every gradient."""
    x = x.detach().to(torch.float64).clone().requires_grad_()
    w = weight.detach().to(torch.float64).clone().requires_grad_()
    leaves = [x, w]
    y = x @ w
    if bias is not None:
        b = bias.detach().to(torch.float64).clone().requires_grad_()
        leaves.append(b)
        y = y + b
    grads = torch.autograd.grad(y, leaves, grad_output.detach().to(torch.float64))
    out = {"output": y.detach(), "grad_input": grads[0], "grad_weight": grads[1]}
    if bias is not None:
        out["grad_bias"] = grads[2]
    return out


def mlp_reference(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, bias: torch.Tensor,
                  grad_output: torch.Tensor):
    """Y = GeLU(X A) B + b on one process (Megatron's MLP unsharded); returns Y and every gradient."""
    leaves = [t.detach().to(torch.float64).clone().requires_grad_() for t in (x, w_in, w_out, bias)]
    xx, a, b, c = leaves
    y = torch.nn.functional.gelu(xx @ a) @ b + c
    grads = torch.autograd.grad(y, leaves, grad_output.detach().to(torch.float64))
    return {"output": y.detach(), "grad_input": grads[0], "grad_w_in": grads[1], "grad_w_out": grads[2],
            "grad_bias": grads[3]}


def replicated_loss_reference(x: torch.Tensor, weight: torch.Tensor):
    """L = 0.5 * ||X W||^2 on one process, the loss of the scaling-trap experiment; returns L and its gradients."""
    xx = x.detach().to(torch.float64).clone().requires_grad_()
    w = weight.detach().to(torch.float64).clone().requires_grad_()
    loss = 0.5 * (xx @ w).square().sum()
    gx, gw = torch.autograd.grad(loss, [xx, w])
    return {"loss": loss.item(), "grad_input": gx, "grad_weight": gw}
