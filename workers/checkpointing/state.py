"""What a checkpoint must hold to resume bit for bit, and how to put it back.

    state = capture_training_state(model, optimizer, scheduler, sampler, step=k, scaler=scaler, config=cfg.as_dict())
    ...                                       # torch.save it (atomically: see atomic.py), new process, torch.load
    step = restore_training_state(state, model, optimizer, scheduler, sampler, scaler=scaler)["step"]

The parts, and what goes wrong without each (chapter 08 leaves out optimizer, scheduler, sampler, rng and, in
its fp16 run, scaler, and measures where the resumed run splits; a config that differs is refused):

    model      the weights                              -> training starts again from the initialisation
    optimizer  AdamW's exp_avg, exp_avg_sq and step     -> moments restart at zero, bias correction restarts
    scheduler  last_epoch (the position in the schedule) -> the warmup runs again, the lr jumps
    sampler    epoch and position in the data order     -> the first batches are read twice, others never
    rng        python, numpy, torch CPU and GPU states  -> other dropout masks and augmentation noise
    scaler     the loss scale and its growth tracker    -> fp16: scale back at 65536, other steps overflow-skipped
    step       the optimizer step count                 -> logging, schedules and checkpoint names drift
    config     every hyperparameter                     -> a resumed run with other settings is another run

Capture returns references to the live tensors (``state_dict`` does not copy): serialise it before the next
step changes them, or clone it first (what DCP's async save does when it "stages" the state).
"""
from __future__ import annotations

import random

import numpy as np
import torch

PARTS = ("model", "optimizer", "scheduler", "sampler", "rng", "scaler", "step", "config")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP (whose state_dict keys carry no ``module.`` prefix, so any world size can load it)."""
    return getattr(model, "module", model)


def rng_state() -> dict:
    """Every RNG stream of this process, in types ``torch.load(weights_only=True)`` accepts.

    numpy's state is a tuple holding a numpy array, which the default ``weights_only=True`` loader of torch >= 2.6
    refuses; stored as a tensor it loads with the default.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()  # one per GPU: dropout on a GPU draws from these
    return state


def set_rng_state(state: dict) -> None:
    """Put back every stream ``state`` holds (a stream it lacks keeps drawing from where it is now)."""
    if "python" in state:
        random.setstate(_as_python_state(state["python"]))
    n = state.get("numpy")
    if isinstance(n, dict):
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    elif n is not None:
        np.random.set_state(n)
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_python_state(s):
    # random.setstate wants (version, tuple_of_ints, gauss_next); a round trip through some formats gives lists
    version, internal, gauss_next = s
    return version, tuple(internal), gauss_next


def capture_training_state(model, optimizer=None, scheduler=None, sampler=None, *, step: int | None = None,
                           scaler=None, config: dict | None = None, omit=()) -> dict:
    """The full training state as a dict of the PARTS present (``omit`` leaves parts out, for the experiments)."""
    unknown = set(omit) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown checkpoint parts {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    state = {"model": unwrap(model).state_dict()}
    sources = {"optimizer": optimizer, "scheduler": scheduler, "sampler": sampler, "scaler": scaler}
    for name, obj in sources.items():
        if obj is not None:
            state[name] = obj.state_dict()
    state["rng"] = rng_state()
    if step is not None:
        state["step"] = int(step)
    if config is not None:
        state["config"] = dict(config)
    for name in omit:
        state.pop(name, None)
    return state


def restore_training_state(state: dict, model, optimizer=None, scheduler=None, sampler=None, *, scaler=None) -> dict:
    """Load every part that ``state`` holds into freshly built objects. Returns ``{"step", "restored"}``.

    A part missing from ``state`` is left as the fresh object has it: that is how a forgotten part shows up
    (the experiments and the exercise checker compare what happens next with an uninterrupted run).
    """
    restored = []
    targets = {"model": unwrap(model), "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
               "scaler": scaler}
    for name, obj in targets.items():
        if name in state and obj is not None:
            obj.load_state_dict(state[name])
            restored.append(name)
    if "rng" in state:
        set_rng_state(state["rng"])  # last: loading the others draws no random numbers, but keep it the final act
        restored.append("rng")
    return {"step": state.get("step"), "restored": restored}
