"""The tensor-parallel plan as data, and the bookkeeping that puts shards back together.

``BLOCK_PLAN`` says, for every parameter of the dense block, how tensor parallelism cuts it (the table
Picotron and torch's ``parallelize_module`` use instead of if-statements spread through the model):

    "column"        rows of the weight ``[out, in]`` (output features), contiguous block per rank
    "column/heads"  rows of the fused [Q; K; V] weight, this rank's heads from each of Q, K and V
    "column/swiglu" rows of the fused [gate; up] weight, the same block of gate and of up
    "row"           columns of the weight (input features), contiguous block per rank
    "replicated"    the whole parameter on every rank (LayerNorm, the row-parallel bias)

Each sharded parameter of a parallel module carries ``partition_dim`` and ``partition_index``.
``shard_record`` sends them with the values (or gradients) to the notebook; ``assemble`` puts the
shards of all ranks back into full tensors, checking that replicated values (and replicated KV heads)
agree across ranks.
"""
from __future__ import annotations

import torch
from torch import nn

COLUMN, HEADS, SWIGLU, ROW, REPLICATED = "column", "column/heads", "column/swiglu", "row", "replicated"

# (module, parameter, how it is split), for a block with a GeLU MLP; SwiGLU changes mlp.fc1 to "column/swiglu".
BLOCK_PLAN = (
    ("ln1", "weight", REPLICATED), ("ln1", "bias", REPLICATED),
    ("attention.qkv", "weight", HEADS), ("attention.qkv", "bias", HEADS),
    ("attention.proj", "weight", ROW), ("attention.proj", "bias", REPLICATED),
    ("ln2", "weight", REPLICATED), ("ln2", "bias", REPLICATED),
    ("mlp.fc1", "weight", COLUMN), ("mlp.fc1", "bias", COLUMN),
    ("mlp.fc2", "weight", ROW), ("mlp.fc2", "bias", REPLICATED),
)


def block_plan(activation: str = "gelu", bias: bool = True) -> list[tuple[str, str, str]]:
    plan = [(m, p, SWIGLU if (m == "mlp.fc1" and activation == "swiglu") else how) for m, p, how in BLOCK_PLAN]
    return [row for row in plan if bias or row[1] != "bias" or row[0].startswith("ln")]


def split_of(param: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """(dim, index) of a parameter's shard; dim -1 and index None when it is replicated."""
    if hasattr(param, "partition_dim"):
        return param.partition_dim, param.partition_index
    return -1, None


def shard_record(module: nn.Module, what: str = "grad") -> dict:
    """``{name: {"dim", "index", "value"}}`` for every parameter: its gradient (``what="grad"``) or its value."""
    out = {}
    for name, p in module.named_parameters():
        dim, index = split_of(p)
        value = p.grad if what == "grad" else p.data
        out[name] = {"dim": dim, "index": index if index is not None else torch.empty(0, dtype=torch.long),
                     "value": value.detach() if value is not None else torch.zeros_like(p)}
    return out


def assemble(records: list[dict], full_shapes: dict[str, tuple]) -> tuple[dict, list[str]]:
    """Put every rank's shards back into full tensors; returns ``(tensors by name, problems)``.

    ``records[r]`` is rank r's ``shard_record``. A position held by several ranks (a replicated parameter,
    a replicated KV head) must hold the same value on all of them; a position held by none is a problem.
    """
    full, problems = {}, []
    for name, shape in full_shapes.items():
        if any(name not in rec for rec in records):
            problems.append(f"{name}: missing on some rank")
            continue
        out = torch.zeros(shape, dtype=torch.float64)
        seen = torch.zeros(shape, dtype=torch.bool)
        for rank, rec in enumerate(records):
            item = rec[name]
            value = item["value"].to(torch.float64)
            if item["dim"] < 0:
                where = (slice(None),) * len(shape)
            else:
                where = (slice(None),) * item["dim"] + (item["index"],)
            expected = list(shape) if item["dim"] < 0 else [len(item["index"]) if d == item["dim"] else n
                                                             for d, n in enumerate(shape)]
            if (item["dim"] >= 0 and len(item["index"]) and int(item["index"].max()) >= shape[item["dim"]]) \
                    or list(value.shape) != expected:
                problems.append(f"{name}: rank {rank}'s part {tuple(value.shape)} does not fit the dense shape {shape} "
                                "(compared with the configuration the ranks ran?)")
                continue
            held = seen[where]
            if held.any():
                earlier, mine = out[where][held], value[held]
                # torch.equal, not "max difference > 0": NaN > 0 is False, and the later copy would overwrite a NaN
                if not torch.equal(earlier, mine):
                    if not (torch.isfinite(earlier).all() and torch.isfinite(mine).all()):
                        problems.append(f"{name}: a replicated part is not finite (NaN or inf) on rank {rank} or "
                                        "an earlier rank")
                    else:
                        diff = (earlier - mine).abs().max().item()
                        problems.append(f"{name}: rank {rank} disagrees with an earlier rank on a replicated part "
                                        f"(max difference {diff:.3g})")
            out[where] = value
            seen[where] = True
        if not seen.all():
            problems.append(f"{name}: {int((~seen).sum())} entries held by no rank")
        full[name] = out
    return full, problems
