"""Plausible wrong answers for chapter 08, each with a fragment of the message the check must give."""

# -- precision ---------------------------------------------------------------------------------------------

def round_to_bf16_truncates(x):
    import torch

    return (x.view(torch.int32) & -65536).view(torch.float32)  # drops the low 16 bits: rounds toward zero


def round_to_bf16_half_up(x):
    import torch

    bits = x.view(torch.int32)
    rounded = ((bits + 0x8000) & -65536).view(torch.float32)  # halfway always goes up in magnitude
    return torch.where(torch.isnan(x), x, rounded)


def round_to_bf16_nan_unguarded(x):
    import torch

    bits = x.view(torch.int32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)  # a NaN can round into inf


def update_scale_no_reset(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, good_steps  # keeps counting across the skipped step
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps


def update_scale_grows_late(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    if good_steps == growth_interval:  # compares before counting this step: grows one good step too late
        return scale * growth_factor, 0
    return scale, good_steps + 1


def update_scale_keeps_count(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5,
                             growth_interval=2000):
    if found_inf:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps % growth_interval == 0:
        return scale * growth_factor, good_steps  # the count is not restarted after growing
    return scale, good_steps


# -- checkpointing -----------------------------------------------------------------------------------------

def training_state_no_rng(model, optimizer, scheduler, sampler, scaler):
    # Weights, optimizer, schedule, data position and loss scale, but no RNG: the resumed run draws other masks.
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "scaler": scaler.state_dict()}


def training_state_torch_rng_only(model, optimizer, scheduler, sampler, scaler):
    # torch's generator only: dropout matches, but the augmentation draws from numpy and python's random too.
    import torch

    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "scaler": scaler.state_dict(), "rng": {"torch": torch.get_rng_state()}}


def training_state_no_scheduler(model, optimizer, scheduler, sampler, scaler):
    import random

    import numpy as np
    import torch

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng}


def training_state_no_sampler(model, optimizer, scheduler, sampler, scaler):
    # The data order restarts at position 0: the first batches are read twice.
    import random

    import numpy as np
    import torch

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng}


def training_state_no_optimizer(model, optimizer, scheduler, sampler, scaler):
    # "The weights are the model": AdamW's moments restart at zero.
    import random

    import numpy as np
    import torch

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": model.state_dict(), "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng}


def training_state_no_scaler(model, optimizer, scheduler, sampler, scaler):
    # "The scaler is not training state": the loss scale restarts at 65536, other steps overflow and are skipped.
    import random

    import numpy as np
    import torch

    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "rng": rng}


def atomic_save_direct(obj, path):
    import torch

    torch.save(obj, path)  # opens path with O_TRUNC: the old checkpoint is gone before the new one exists


def atomic_save_copy_over(obj, path):
    # A temporary file, but then copied over the old one: the copy rewrites path in place.
    import os
    import shutil

    import torch

    tmp = path + ".tmp"
    torch.save(obj, tmp)
    shutil.copyfile(tmp, path)
    os.remove(tmp)


def atomic_save_remove_first(obj, path):
    # Right order of writing, but the old checkpoint is deleted before the rename: a window with none.
    import os

    import torch

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.remove(path)
    os.rename(tmp, path)


def atomic_save_no_fsync(obj, path):
    # Atomic for readers, not for a power cut: the rename can reach the disk before the data.
    import os

    import torch

    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_save_tmp_elsewhere(obj, path):
    # The temporary file in the system's temp directory: on a cluster that is another file system.
    import os
    import tempfile

    import torch

    fd, tmp = tempfile.mkstemp(suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.remove(tmp)
        raise
    os.replace(tmp, path)


def atomic_save_leaves_tmp_on_failure(obj, path):
    # Right when the save succeeds; when it fails, the partial temporary file stays on disk.
    import os

    import torch

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_save_swallows_errors(obj, path):
    # Atomic, but a failed save is silently ignored: the training loop believes it has a checkpoint.
    import os

    import torch

    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:
        if os.path.exists(tmp):
            os.remove(tmp)

# -- checkpoint interval -----------------------------------------------------------------------------------

def interval_without_the_two(checkpoint_s, gpu_mtbf_s, n_gpus):
    return (checkpoint_s * gpu_mtbf_s / n_gpus) ** 0.5


def interval_with_one_gpus_mtbf(checkpoint_s, gpu_mtbf_s, n_gpus):
    return (2 * checkpoint_s * gpu_mtbf_s) ** 0.5


def interval_in_minutes(checkpoint_s, gpu_mtbf_s, n_gpus):
    return (2 * checkpoint_s * gpu_mtbf_s / n_gpus) ** 0.5 / 60


WRONG = [
    # precision
    ("round_to_bf16", round_to_bf16_truncates, "rounds toward zero (truncates)"),
    ("round_to_bf16", round_to_bf16_half_up, "ties must go to the even neighbour"),
    ("round_to_bf16", round_to_bf16_nan_unguarded, "NaN must stay NaN"),
    ("update_scale", update_scale_no_reset, "resets the count of good steps to 0"),
    ("update_scale", update_scale_grows_late, "off-by-one"),
    ("update_scale", update_scale_keeps_count, "restarts the count at 0 after growing"),
    # checkpointing
    ("training_state", training_state_no_rng, "dropout masks differ from step 4"),
    ("training_state", training_state_torch_rng_only, "numpy's input noise and python's random feature choice"),
    ("training_state", training_state_no_scheduler, "the scheduler's position was not restored"),
    ("training_state", training_state_no_sampler, "the sampler's position was not restored"),
    ("training_state", training_state_no_optimizer, "AdamW's moments"),
    ("training_state", training_state_no_scaler, "Save scaler.state_dict()"),
    ("atomic_save", atomic_save_direct, "a crash midway left a truncated file at path"),
    ("atomic_save", atomic_save_copy_over, "copied the new checkpoint over the old file"),
    ("atomic_save", atomic_save_remove_first, "deleted the old checkpoint before the new one was in place"),
    ("atomic_save", atomic_save_no_fsync, "without os.fsync first"),
    ("atomic_save", atomic_save_tmp_elsewhere, "not next to path"),
    ("atomic_save", atomic_save_swallows_errors, "let the error propagate"),
    ("atomic_save", atomic_save_leaves_tmp_on_failure, "Remove the temporary file when the write fails"),
    # checkpoint interval
    ("checkpoint_every", interval_without_the_two, "the factor 2 is missing"),
    ("checkpoint_every", interval_with_one_gpus_mtbf, "any of its"),
    ("checkpoint_every", interval_in_minutes, "return seconds"),
]
