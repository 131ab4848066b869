"""Reject what a learner can get wrong before any process starts, in one sentence that says what to change.

Generic checks come from the worker's ``main(ctx, **params)`` signature (unknown names, missing values,
wrong types); a worker adds its own rules with ``check_params(world_size, **params) -> str | None``
(for example "n_heads=6 is not divisible by world_size=4: pick a world size that divides 6").
"""
from __future__ import annotations

import difflib
import importlib.util
import inspect
import os

from course_utils.results import InvalidParameter
from workers import pool

CPU_MAX_WORLD_SIZE = 8


def max_world_size() -> int:
    """8 ranks on CPU (gloo, shared cores); on a machine with more GPUs than that, one rank per GPU."""
    env = os.environ.get("COURSE_MAX_WORLD_SIZE")
    if env:
        return int(env)
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    return max(CPU_MAX_WORLD_SIZE, gpus)


def load_worker(worker: str):
    """The worker module, loaded as the ranks load it (``workers/pool.py: load_worker``, which re-imports a file
    that changed); a name or path that leads nowhere is an ``InvalidParameter`` that says what to check."""
    if worker.endswith(".py"):
        if not os.path.exists(worker):
            raise InvalidParameter(f"there is no worker file {worker!r}: check the path (relative to the notebook)")
        return pool.load_worker(worker)
    try:
        spec = importlib.util.find_spec(worker)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        raise InvalidParameter(f"there is no worker module {worker!r}: use a name like 'workers.ch01_collectives'")
    return pool.load_worker(worker)


def _type_ok(value, default) -> bool:
    if default is None or default is inspect.Parameter.empty:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def check_world_size(world_size, nnodes: int = 1) -> None:
    limit = max_world_size()
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise InvalidParameter(f"world_size must be a whole number of ranks, not {world_size!r}")
    if world_size < 1:
        raise InvalidParameter(f"world_size={world_size} starts no rank: use a world size from 1 to {limit}")
    if world_size > limit:
        raise InvalidParameter(
            f"world_size={world_size} is more ranks than this machine runs (at most {limit}): use 1 to {limit}")
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1 or world_size % nnodes:
        raise InvalidParameter(f"nnodes={nnodes!r} must be a whole number that divides world_size={world_size}")


def takes_param(worker: str, name: str) -> bool:
    """Whether the worker's ``main`` has a parameter ``name`` (False for an unknown worker: check_params says why)."""
    try:
        main = getattr(load_worker(worker), "main", None)
    except InvalidParameter:
        return False
    return main is not None and name in inspect.signature(main).parameters


def current_names(worker: str, params: dict) -> dict:
    """``params`` with the old names a worker no longer takes (``workers.runtime.RENAMED``: ``tp_size``, ``n_heads``,
    ...) replaced by their new ones, each with a warning, so a saved notebook keeps running for one release."""
    from workers.runtime import RENAMED, renamed

    return {(renamed(k) if k in RENAMED and not takes_param(worker, k) and takes_param(worker, RENAMED[k]) else k): v
            for k, v in params.items()}


def check_params(worker: str, world_size, params: dict, *, nnodes: int = 1) -> None:
    check_world_size(world_size, nnodes)
    module = load_worker(worker)
    main = getattr(module, "main", None)
    if main is None:
        raise InvalidParameter(f"{worker} has no main(ctx, **params) function, so it cannot run as a worker")
    sig = list(inspect.signature(main).parameters.values())[1:]
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in sig)
    named = {p.name: p for p in sig if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for name, value in params.items():
        if name not in named:
            if accepts_any:
                continue
            close = difflib.get_close_matches(name, named, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(named) or 'no parameters'}"
            raise InvalidParameter(f"{worker} has no parameter {name!r}: {hint}")
        default = named[name].default
        if callable(value) and not isinstance(value, type):
            continue
        if not _type_ok(value, default):
            raise InvalidParameter(
                f"{name}={value!r} should be a {type(default).__name__} like the default {default!r}")
    for name, p in named.items():
        if p.default is inspect.Parameter.empty and name not in params:
            raise InvalidParameter(f"{worker} needs a value for {name!r}: pass {name}=...")
    rule = getattr(module, "check_params", None)
    if rule is not None:
        full = {n: p.default for n, p in named.items() if p.default is not inspect.Parameter.empty}
        full.update(params)
        message = rule(world_size, **full)
        if message:
            raise InvalidParameter(message)
