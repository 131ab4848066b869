"""Reference solutions for chapter 08 (mixed precision and checkpointing)."""

# -- precision ---------------------------------------------------------------------------------------------

def round_to_bf16(x):
    """fp32 -> bf16 by hand: keep the top 16 bits of the pattern, rounding to nearest, ties to even; as float32."""
    import torch

    bits = x.view(torch.int32)  # shares x's memory: only read it
    lowest_kept = (bits >> 16) & 1  # 1 when the kept part is odd
    # Adding 0x7FFF rounds the dropped half-range up only when it is above 0x8000; the extra 1 for an odd kept
    # part turns exact ties (0x8000) up to the even neighbour. A carry past the mantissa bumps the exponent,
    # which is correct rounding too (up to inf above the bf16 max). Two's-complement addition makes the sign
    # bit irrelevant: the magnitude bits round the same way for negative numbers.
    rounded = ((bits + 0x7FFF + lowest_kept) & -65536).view(torch.float32)  # -65536 == 0xFFFF0000
    return torch.where(torch.isnan(x), x, rounded)  # NaN's pattern could round into inf: keep NaN as it is


def update_scale(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    """torch.amp.GradScaler.update's rule: returns (new_scale, new_good_steps)."""
    if found_inf:  # the step was skipped: a smaller scale, and the count of good steps starts again
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps == growth_interval:  # growth_interval good steps in a row
        return scale * growth_factor, 0
    return scale, good_steps

# -- checkpointing -----------------------------------------------------------------------------------------

def training_state(model, optimizer, scheduler, sampler, scaler):
    """Everything needed to resume bit for bit: weights, AdamW's moments, the schedule's and the data's position,
    the loss scale, and every RNG stream the run draws from (dropout: torch; augmentation: numpy and python's
    random)."""
    import random

    import numpy as np
    import torch

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()  # dropout on a GPU draws from these
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "scaler": scaler.state_dict(), "rng": rng}


def atomic_save(obj, path):
    """torch.save that a crash cannot tear: temporary file in the same directory, fsync, os.replace, fsync the dir."""
    import os
    import tempfile

    import torch

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pt")  # same directory: same file system
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()  # python's buffer -> the kernel
            os.fsync(f.fileno())  # the kernel -> the disk, before the rename can get there
        os.replace(tmp, path)  # one rename(2): readers see the old file or the new one, never half of either
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)  # the rename is a change to the directory: make it durable too
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)

# -- checkpoint interval -----------------------------------------------------------------------------------

def checkpoint_every(checkpoint_s, gpu_mtbf_s, n_gpus):
    import math

    job_mtbf_s = gpu_mtbf_s / n_gpus  # any one of n independent GPUs stops the job: failure rates add
    return math.sqrt(2.0 * checkpoint_s * job_mtbf_s)  # Young (1974)
