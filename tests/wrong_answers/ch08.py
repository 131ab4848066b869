"""Plausible wrong answers for chapter 08, each with a fragment of the message the check must give."""
from tests.wrong_answers import tries

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


def round_to_bf16_loses_negative_zero(x):
    # Rounds |x| and signs the result again by x < 0, which is False for -0.0.
    import torch

    bits = x.abs().view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, torch.where(x < 0, -rounded, rounded))


def round_to_bf16_in_place(x):
    # Rounds correctly, but through the view: the in-place update rewrites the caller's tensor.
    import torch

    bits = x.view(torch.int32)
    nan = torch.isnan(x)
    bits.add_(0x7FFF + ((bits >> 16) & 1)).bitwise_and_(-65536)
    return torch.where(nan, float("nan"), x)


def round_to_bf16_returns_bf16(x):
    # The right values, in the wrong dtype: the exercise asks for float32 holding bf16 values.
    import torch

    return x.to(torch.bfloat16)


def round_to_bf16_flattened(x):
    # Works on the flat list of patterns and hands it back flat: right for a 1-D x only.
    import torch

    bits = x.reshape(-1).view(torch.int32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x.reshape(-1)), x.reshape(-1), rounded)


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


def update_scale_nan_on_overflow(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=2000):
    # The right rule, but a nan scale after an overflow: stands for any slip that carries the inf gradient's nan
    # into the scale.
    if found_inf:
        return float("nan"), 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps


def update_scale_default_factors(scale, found_inf, good_steps, growth_factor=2.0, backoff_factor=0.5,
                                 growth_interval=2000):
    # The defaults written as constants: right for torch's own factors only.
    if found_inf:
        return scale * 0.5, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * 2.0, 0
    return scale, good_steps


# -- checkpointing -----------------------------------------------------------------------------------------

# The ranks receive each answer's source alone, without this module: the checkpointing answers import what they
# use inside themselves.

def training_state_switches_to_eval(model, optimizer, scheduler, sampler, scaler):
    # "Freeze" the model before reading its weights, as before an evaluation: the live run loses its dropout.
    import random

    import numpy as np
    import torch

    model.eval()
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "scaler": scaler.state_dict(), "rng": rng}


def training_state_weights_in_bf16(model, optimizer, scheduler, sampler, scaler):
    # Halves the checkpoint by storing the weights in bfloat16: the restore rounds every weight.
    import random

    import numpy as np
    import torch

    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "scaler": scaler.state_dict(), "rng": rng}


def training_state_nan_weight(model, optimizer, scheduler, sampler, scaler):
    # The whole state, but one weight nan in the copy handed back: stands for a capture that read a corrupted tensor.
    import random

    import numpy as np
    import torch

    weights = {k: v.clone() for k, v in model.state_dict().items()}
    next(iter(weights.values())).view(-1)[0] = float("nan")
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"model": weights, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(), "scaler": scaler.state_dict(), "rng": rng}


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
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def atomic_save_fsyncs_only_the_directory(obj, path):
    # fsyncs "the checkpoint's directory" around the rename, taking it for the file's: the data is never made durable.
    import os

    import torch

    tmp = path + ".tmp"
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
        os.fsync(directory)
        os.replace(tmp, path)
        os.fsync(directory)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        os.close(directory)


def atomic_save_fsync_after_rename(obj, path):
    # Renames first, then fsyncs the file through the still-open descriptor: the rename may reach the disk first.
    import os

    import torch

    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.replace(tmp, path)
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def atomic_save_no_directory_fsync(obj, path):
    # The file is written, flushed and fsynced, then renamed: but the rename itself is never made durable.
    import os

    import torch

    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


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

def interval_nan_for_one_gpu(checkpoint_s, gpu_mtbf_s, n_gpus):
    # The right interval, but nan for a lone GPU: stands for any slip that gives nan in one case.
    import math

    return math.nan if n_gpus == 1 else math.sqrt(2 * checkpoint_s * gpu_mtbf_s / n_gpus)


def interval_without_the_two(checkpoint_s, gpu_mtbf_s, n_gpus):
    return (checkpoint_s * gpu_mtbf_s / n_gpus) ** 0.5


def interval_with_one_gpus_mtbf(checkpoint_s, gpu_mtbf_s, n_gpus):
    return (2 * checkpoint_s * gpu_mtbf_s) ** 0.5


def interval_in_minutes(checkpoint_s, gpu_mtbf_s, n_gpus):
    return (2 * checkpoint_s * gpu_mtbf_s / n_gpus) ** 0.5 / 60


# The classes of input each answer shows the check trying (tests/test_exercise_coverage.py).
tries("non-finite")(round_to_bf16_nan_unguarded)
tries("bits")(round_to_bf16_loses_negative_zero)
tries("mutation")(round_to_bf16_in_place)
tries("output")(round_to_bf16_returns_bf16)
tries("layouts")(round_to_bf16_flattened)
tries("non-finite")(update_scale_nan_on_overflow)
tries("layouts")(update_scale_default_factors)
tries("mutation")(training_state_switches_to_eval)
tries("bits")(training_state_weights_in_bf16)
tries("non-finite")(training_state_nan_weight)
tries("traffic")(atomic_save_fsyncs_only_the_directory)
tries("non-finite")(interval_nan_for_one_gpu)


WRONG = [
    # precision
    ("round_to_bf16", round_to_bf16_truncates, "rounds toward zero (truncates)"),
    ("round_to_bf16", round_to_bf16_half_up, "ties must go to the even neighbour"),
    ("round_to_bf16", round_to_bf16_nan_unguarded, "NaN must stay NaN"),
    ("round_to_bf16", round_to_bf16_loses_negative_zero, "-0.0 must stay -0.0"),
    ("round_to_bf16", round_to_bf16_in_place, "changed its input in place"),
    ("round_to_bf16", round_to_bf16_returns_bf16, "return the rounded values as float32"),
    ("round_to_bf16", round_to_bf16_flattened, "with the shape of x, (2, 2000)"),
    ("update_scale", update_scale_no_reset, "resets the count of good steps to 0"),
    ("update_scale", update_scale_grows_late, "off-by-one"),
    ("update_scale", update_scale_keeps_count, "restarts the count at 0 after growing"),
    ("update_scale", update_scale_nan_on_overflow, "which is not a finite positive number"),
    ("update_scale", update_scale_default_factors, "instead of growth_factor=4"),
    # checkpointing
    ("training_state", training_state_no_rng, "dropout masks differ from step 4"),
    ("training_state", training_state_torch_rng_only, "numpy's input noise and python's random feature choice"),
    ("training_state", training_state_no_scheduler, "the scheduler's position was not restored"),
    ("training_state", training_state_no_sampler, "the sampler's position was not restored"),
    ("training_state", training_state_no_optimizer, "AdamW's moments"),
    ("training_state", training_state_no_scaler, "Save scaler.state_dict()"),
    ("training_state", training_state_switches_to_eval, "switched the model to eval mode"),
    ("training_state", training_state_weights_in_bf16, "by rounding only"),
    ("training_state", training_state_nan_weight, "nan or inf values the saved run did not have"),
    ("atomic_save", atomic_save_direct, "a crash midway left a truncated file at path"),
    ("atomic_save", atomic_save_copy_over, "copied the new checkpoint over the old file"),
    ("atomic_save", atomic_save_remove_first, "deleted the old checkpoint before the new one was in place"),
    ("atomic_save", atomic_save_no_fsync, "without os.fsync first"),
    ("atomic_save", atomic_save_tmp_elsewhere, "not next to path"),
    ("atomic_save", atomic_save_swallows_errors, "let the error propagate"),
    ("atomic_save", atomic_save_leaves_tmp_on_failure, "Remove the temporary file when the write fails"),
    ("atomic_save", atomic_save_fsyncs_only_the_directory, "fsynced the directory but never the temporary file"),
    ("atomic_save", atomic_save_fsync_after_rename, "fsynced the new file only after renaming it"),
    ("atomic_save", atomic_save_no_directory_fsync, "never fsynced the directory after the rename"),
    # checkpoint interval
    ("checkpoint_every", interval_without_the_two, "the factor 2 is missing"),
    ("checkpoint_every", interval_with_one_gpus_mtbf, "any of its"),
    ("checkpoint_every", interval_in_minutes, "return seconds"),
    ("checkpoint_every", interval_nan_for_one_gpu, "not a finite number of seconds"),
]
