"""Rank-side checks for chapter 08's checkpointing exercises, on real ranks.

``training_state(model, optimizer, scheduler, sampler, scaler) -> dict``: the learner captures the training
state; the checker restores it with the course's own ``restore_training_state`` (keys ``model``, ``optimizer``,
``scheduler``, ``sampler``, ``scaler``, and ``rng`` holding ``torch``, ``numpy``, ``python`` and on a GPU
``cuda``). Every rank trains the chapter's run (``checkpointing/training.py``, under DDP, fp16 autocast with a
``GradScaler``) straight for N steps; then again for K steps, captures, serialises with ``torch.save`` (what a
checkpoint is), *scrambles everything* (new model initialised from another seed, new optimizer, scheduler,
sampler and scaler, every RNG re-seeded elsewhere, as in a new process), loads and restores, and trains the
N - K remaining steps. Everything must match the straight run bit for bit; the first difference names the part
that was missed: weights after the restore (model), AdamW's state (optimizer), the loss scale and its count of
good steps (scaler), the batch read (sampler), dropout masks / numpy noise / python's random choice (the RNG
streams), the learning rate (scheduler), the weights after a step. The capture itself must change nothing of
the live run (its mode, RNG streams, weights, optimizer, scheduler, sampler and scaler are compared around it).

``atomic_save(obj, path)``: four stages, each on a fresh directory. (1) A save over an old checkpoint fails
midway (every write past half the new file's size fails, as on a full disk): the call must raise, and ``path``
must still load as the old checkpoint. (2) A normal save over an old checkpoint, with ``os.replace``,
``os.rename``, ``os.remove``, ``os.fsync`` and ``shutil.copyfile`` watched: ``path`` must get a new inode (it
was replaced, not rewritten in place), never be deleted first, come from a file in the same directory whose
own data was fsync-ed before the rename (fsyncs are told apart by inode: the directory's does not count), the
directory must be fsync-ed after the rename, and nothing may be left beside it. (3) The failing save of (1)
again: the temporary file must be removed, not left beside path. (4) A first save and a second one over it.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import stat
import tempfile

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from workers.checkpointing.faults import watch_file_ops, writes_fail_beyond
from workers.checkpointing.state import restore_training_state
from workers.checkpointing.training import (RunConfig, flat_params, make_dataset, make_model, make_optimizer,
                                            make_sampler, make_scaler, make_scheduler, next_batch, rank_seed,
                                            seed_rngs, train_step)
from workers.exercises.support import Wrong, agree, run_exercise

# 4 steps per epoch (an epoch boundary after step 4), warmup to step 4, save after step 3: every part matters.
# fp16 with growth_interval=2: the scale has grown by the save (131072 after step 3), and a real overflow-skipped
# step follows it (step 4 at world 2, step 6 at world 1), so a scaler left out changes what the resumed run does.
CFG = RunConfig(n_samples=32, global_batch=8, warmup_steps=4, total_steps=8, precision="fp16")
SAVE_AT = 3


# -- training_state --------------------------------------------------------------------------------------

def _build(ctx, init_seed: int):
    model = make_model(CFG, seed=init_seed).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    optimizer = make_optimizer(model, CFG)
    return {"model": model, "ddp": ddp, "optimizer": optimizer, "scheduler": make_scheduler(optimizer, CFG),
            "sampler": make_sampler(CFG, ctx.rank, ctx.world_size), "scaler": make_scaler(CFG, ctx.device.type)}


def _train(ctx, objs, data, first: int, last: int) -> list[dict]:
    masks = []
    hook = objs["model"].dropout.register_forward_hook(lambda m, inp, out: masks.append((out != 0).cpu()))
    records = []
    try:
        for step in range(first, last + 1):
            batch = next_batch(data, objs["sampler"], CFG, ctx.device)
            lr, scale = objs["optimizer"].param_groups[0]["lr"], objs["scaler"].get_scale()
            loss = train_step(objs["ddp"], objs["optimizer"], objs["scheduler"], batch, objs["scaler"])
            records.append({"step": step, "indices": batch["indices"], "dropped": batch["dropped"],
                            "x": batch["x"].cpu(), "mask": masks[-1], "lr": lr, "scale": scale, "loss": loss.cpu(),
                            "weights": flat_params(objs["model"])})
    finally:
        hook.remove()
    return records


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state_dict()["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]


def _first_difference(got: dict, want: dict) -> None:
    s = got["step"]
    if not torch.equal(got["indices"], want["indices"]):
        raise Wrong(f"the batch read at step {s} is not the one the uninterrupted run read (rows "
                    f"{got['indices'][:4].tolist()}... instead of {want['indices'][:4].tolist()}...): the sampler's "
                    "position was not restored. Save sampler.state_dict() (its epoch and position) as state['sampler']")
    torch_rng, numpy_rng = not torch.equal(got["mask"], want["mask"]), not torch.equal(got["x"], want["x"])
    python_rng = got["dropped"] != want["dropped"]
    others = [what for what, bad in (("numpy's input noise", numpy_rng), ("python's random feature choice", python_rng))
              if bad]
    fix = ("capture every RNG stream in state['rng']: 'torch': torch.get_rng_state(), 'numpy': np.random.get_state(), "
           "'python': random.getstate() (and 'cuda': torch.cuda.get_rng_state_all() on a GPU)")
    if torch_rng:
        also = f", and so do {' and '.join(others)}" if others else ""
        raise Wrong(f"dropout masks differ from step {s} on{also}: torch's RNG state was not restored; {fix}")
    if others:
        raise Wrong(f"{' and '.join(others)} differ from step {s} on (dropout masks match): {fix}")
    if got["scale"] != want["scale"]:
        raise Wrong(f"the loss scale at step {s} is {got['scale']:g}, the uninterrupted run's {want['scale']:g}: the "
                    "scaler's state was not restored. Save scaler.state_dict() as state['scaler']")
    if got["lr"] != want["lr"]:
        raise Wrong(f"the learning rate at step {s} is {got['lr']:.4g}, the uninterrupted run's {want['lr']:.4g}: the "
                    "scheduler's position was not restored (the warmup started again). Save scheduler.state_dict()")
    if not torch.equal(got["weights"], want["weights"]):
        err = (got["weights"] - want["weights"]).abs().max().item()
        raise Wrong(f"the weights after step {s} differ from the uninterrupted run's by up to {err:.3g} although the "
                    "batch, the random draws and the learning rate match; every part of the state must be restored "
                    "exactly (torch.equal, not allclose)")


def _live_run(objs) -> dict:
    """What a capture must leave as it was: the live run goes on training after every checkpoint."""
    return {"weights": flat_params(objs["model"]), "training": objs["model"].training,
            "torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "optimizer": [t.clone() for t in _optimizer_tensors(objs["optimizer"])],
            "scheduler": repr(objs["scheduler"].state_dict()), "sampler": repr(objs["sampler"].state_dict()),
            "scaler": repr(objs["scaler"].state_dict())}


def _same_live_run(before: dict, after: dict) -> None:
    capture = "a capture must only read: the run goes on training after every checkpoint"
    if before["training"] != after["training"]:
        mode = "eval" if not after["training"] else "train"
        raise Wrong(f"training_state switched the model to {mode} mode: the live run would go on "
                    f"{'without dropout' if mode == 'eval' else 'with dropout'} after the checkpoint; {capture}")
    rng = [name for name, same in (("torch", torch.equal(before["torch"], after["torch"])),
                                   ("numpy", before["numpy"][0] == after["numpy"][0]
                                    and np.array_equal(before["numpy"][1], after["numpy"][1])
                                    and before["numpy"][2:] == after["numpy"][2:]),
                                   ("python", before["python"] == after["python"])) if not same]
    if rng:
        raise Wrong(f"training_state moved {' and '.join(rng)}'s RNG (a draw, or a re-seed): the live run now draws "
                    "other numbers than a run resumed from this checkpoint; read the states (torch.get_rng_state() "
                    f"and the like), never seed or draw; {capture}")
    if not torch.equal(before["weights"], after["weights"]):
        raise Wrong(f"training_state changed the model's weights; {capture}")
    changed = [name for name in ("scheduler", "sampler", "scaler") if before[name] != after[name]]
    if len(before["optimizer"]) != len(after["optimizer"]) or not all(
            torch.equal(a, b) for a, b in zip(before["optimizer"], after["optimizer"])):
        changed.insert(0, "optimizer")
    if changed:
        raise Wrong(f"training_state changed the live {', '.join(changed)} (a step, or a reset?); {capture}")


def _restored_weights(got: torch.Tensor, saved: torch.Tensor) -> None:
    if torch.equal(got, saved):
        return
    if not torch.isfinite(got).all():
        raise Wrong(f"after the restore the model's weights hold {int((~torch.isfinite(got)).sum())} nan or inf "
                    "values the saved run did not have: the state handed back is not the live one. Save "
                    "model.state_dict() as state['model']")
    err = ((got.double() - saved.double()).abs() / saved.double().abs().clamp_min(1e-30)).max().item()
    if err <= 1e-2:
        raise Wrong(f"after the restore the model's weights differ from the saved ones by rounding only (up to "
                    f"{err:.1e} relative): saved in a narrower dtype (bfloat16, float16)? A checkpoint must keep "
                    "every bit: save model.state_dict() as it is")
    raise Wrong("after the restore the model's weights are not the saved ones: save model.state_dict() as "
                "state['model']")


def check_training_state(ctx, answer) -> None:
    data = make_dataset(CFG)
    seed_rngs(rank_seed(CFG, ctx.rank))
    want = _train(ctx, _build(ctx, CFG.seed), data, 1, CFG.total_steps)

    seed_rngs(rank_seed(CFG, ctx.rank))
    objs = _build(ctx, CFG.seed)
    _train(ctx, objs, data, 1, SAVE_AT)
    saved_optimizer = [t.clone() for t in _optimizer_tensors(objs["optimizer"])]
    saved_scaler = dict(objs["scaler"].state_dict())
    live_before = _live_run(objs)
    state = answer(objs["model"], objs["optimizer"], objs["scheduler"], objs["sampler"], objs["scaler"])
    live_after = _live_run(objs)
    box = {}

    def serialised():
        _same_live_run(live_before, live_after)
        if not isinstance(state, dict):
            raise Wrong(f"training_state must return a dict (keys 'model', 'optimizer', 'scheduler', 'sampler', "
                        f"'scaler', 'rng'), not {type(state).__name__}")
        try:
            torch.save(state, buf := io.BytesIO())
        except Exception as exc:  # noqa: BLE001 - the learner's object could not be written
            raise Wrong(f"torch.save could not write what training_state returned ({type(exc).__name__}: {exc}): "
                        "return state_dicts, tensors, numbers, tuples, lists and dicts") from None
        box["blob"] = buf.getvalue()
    agree(serialised)

    # A new process, as far as this rank can tell: other weights, fresh objects, every RNG somewhere else.
    seed_rngs(rank_seed(CFG, ctx.rank) + 7919)
    random.random(), np.random.rand(), torch.rand(1)
    fresh = _build(ctx, init_seed=CFG.seed + 4242)

    def restored():
        loaded = torch.load(io.BytesIO(box["blob"]), weights_only=False)  # the learner's own checkpoint
        try:
            restore_training_state(loaded, fresh["model"], fresh["optimizer"], fresh["scheduler"], fresh["sampler"],
                                   scaler=fresh["scaler"])
        except Exception as exc:  # noqa: BLE001 - a malformed state is the learner's to fix
            raise Wrong(f"restoring your state failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): the "
                        "checker calls model.load_state_dict(state['model']) and likewise for 'optimizer', "
                        "'scheduler', 'sampler' and 'scaler', and sets each RNG in state['rng']") from None
        _restored_weights(flat_params(fresh["model"]), want[SAVE_AT - 1]["weights"])
        now = _optimizer_tensors(fresh["optimizer"])
        if len(now) != len(saved_optimizer) or not all(torch.equal(a, b) for a, b in zip(now, saved_optimizer)):
            raise Wrong("after the restore AdamW's moments (exp_avg, exp_avg_sq) and step counts are not the saved "
                        "ones: the next update would be another one. Save optimizer.state_dict() as state['optimizer']")
        now = fresh["scaler"].state_dict()
        if (now["scale"], now["_growth_tracker"]) != (saved_scaler["scale"], saved_scaler["_growth_tracker"]):
            raise Wrong(f"after the restore the loss scale is {now['scale']:g} with {now['_growth_tracker']} good steps "
                        f"counted (a fresh GradScaler's), the saved run's was {saved_scaler['scale']:g} with "
                        f"{saved_scaler['_growth_tracker']}: the scale would grow, overflow and skip at other steps. Save "
                        "scaler.state_dict() as state['scaler']")
    agree(restored)

    got = _train(ctx, fresh, data, SAVE_AT + 1, CFG.total_steps)
    for g, w in zip(got, want[SAVE_AT:]):
        agree(lambda: _first_difference(g, w))


# -- atomic_save -----------------------------------------------------------------------------------------

def _checkpoint(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "weights": torch.randn(50_000, generator=g)}  # ~200 KB on disk


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and a["step"] == b["step"] and torch.equal(a["weights"], b["weights"])


def _load(path: str):
    try:
        return torch.load(path, weights_only=True), ""
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


def _stage_crash(answer, root: str) -> None:
    path = os.path.join(root, "ckpt.pt")
    old, new = _checkpoint(1), _checkpoint(2)
    torch.save(old, path)
    torch.save(new, buf := io.BytesIO())
    raised = False
    with writes_fail_beyond(len(buf.getvalue()) // 2) as limit:
        try:
            answer(new, path)
        except NotImplementedError:
            raise
        except Exception:  # noqa: BLE001 - the failure we caused
            raised = True
    if not os.path.exists(path):
        raise Wrong("after a save that failed midway there is no file at path: the old checkpoint was deleted before "
                    "the new one was complete")
    got, error = _load(path)
    if got is None:
        raise Wrong(f"a crash midway left a truncated file at path ({os.path.getsize(path)} bytes; torch.load: "
                    f"{error}): the old checkpoint is gone. Write to a temporary file in the same directory, then os.replace it "
                    "onto path once it is complete")
    if not _same(got, old):
        raise Wrong("after a save that failed midway, path no longer holds the old checkpoint")
    if not raised:
        raise Wrong(f"atomic_save returned normally although every write past {limit} bytes failed: let the error "
                    "propagate, so the training loop knows this checkpoint was not written")


@contextlib.contextmanager
def _watch_syncs():
    """Record, in order, which file each fsync made durable and which file each rename moved, by inode: an
    fsync takes a file descriptor, not a name, so only the inode tells the temporary file from its directory.
    Entries: ("fsync", inode, is_directory), ("sync", None, None) for os.sync(), ("rename", inode, destination)."""
    log = []
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "sync", "replace", "rename") if hasattr(os, name)}

    def synced(name):
        def call(fd, *args, **kwargs):
            with contextlib.suppress(OSError, AttributeError, TypeError, ValueError):
                st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
                log.append(("fsync", st.st_ino, stat.S_ISDIR(st.st_mode)))
            return real[name](fd, *args, **kwargs)
        return call

    def synced_all(*args, **kwargs):
        log.append(("sync", None, None))
        return real["sync"](*args, **kwargs)

    def renamed(name):
        def call(src, dst, *args, **kwargs):
            with contextlib.suppress(OSError, TypeError, ValueError):
                log.append(("rename", os.stat(src).st_ino, os.path.abspath(os.fspath(dst))))
            return real[name](src, dst, *args, **kwargs)
        return call

    spies = {"fsync": synced("fsync"), "fdatasync": synced("fdatasync"), "sync": synced_all,
             "replace": renamed("replace"), "rename": renamed("rename")}
    for name in real:
        setattr(os, name, spies[name])
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


def _durability(syncs: list, target: str) -> None:
    """The temporary file's own data is fsynced before the rename onto ``target``, and the directory after it."""
    last = max((i for i, (kind, _, dst) in enumerate(syncs) if kind == "rename" and dst == target), default=None)
    if last is None:
        return  # watch_file_ops saw the rename, but its source could not be stat-ed: nothing to judge
    moved, directory = syncs[last][1], os.stat(os.path.dirname(target)).st_ino
    before, after = syncs[:last], syncs[last + 1:]
    covers = lambda e, inode: e[0] == "sync" or (e[0] == "fsync" and e[1] == inode)  # noqa: E731
    if not any(covers(e, moved) for e in before):
        if any(covers(e, moved) for e in after):
            raise Wrong("atomic_save fsynced the new file only after renaming it onto path: after a power cut the "
                        "rename can be on disk before the data, an empty file under the final name. Call f.flush() "
                        "and os.fsync(f.fileno()) before os.replace")
        if any(e[0] == "fsync" and e[2] for e in syncs):
            raise Wrong("atomic_save fsynced the directory but never the temporary file itself: a directory's fsync "
                        "makes its entries durable, not a file's data, so after a power cut path can name an empty "
                        "or partial file. Call f.flush() and os.fsync(f.fileno()) on the temporary file before "
                        "os.replace, and fsync the directory after it")
        raise Wrong("atomic_save renamed the new file onto path without os.fsync first: after a power cut the rename "
                    "can reach the disk before the data, leaving an empty file under the final name. Call f.flush() "
                    "and os.fsync(f.fileno()) before os.replace")
    if not any(covers(e, directory) for e in after):
        raise Wrong("atomic_save never fsynced the directory after the rename: the rename is a change to the "
                    "directory, and until the directory is fsynced a power cut can undo it (path would name the "
                    "old checkpoint again, or nothing after a first save). Open it with os.open(dirname, "
                    "os.O_RDONLY), os.fsync that descriptor and close it, after os.replace")


def _stage_replace(answer, root: str) -> None:
    path = os.path.join(root, "ckpt.pt")
    torch.save(_checkpoint(1), path)
    inode = os.stat(path).st_ino
    with watch_file_ops(path) as (target, events), _watch_syncs() as syncs:
        answer(_checkpoint(2), path)
    got, error = _load(path)
    if got is None or not _same(got, _checkpoint(2)):
        raise Wrong(f"after atomic_save(obj, path) returned, path does not hold obj ({error or 'another object'})")
    copies = [p for name, p in events if name == "copyfile" and p[1:] == [target]]
    renames = [(i, p) for i, (name, p) in enumerate(events) if name in ("replace", "rename") and p[1:] == [target]]
    if copies or os.stat(path).st_ino == inode:
        how = "copied the new checkpoint over the old file" if copies else "rewrote the old file in place"
        raise Wrong(f"atomic_save {how} (path kept its inode): a crash during that write leaves a truncated file at "
                    "path. Write a temporary file next to it and os.replace(tmp, path): one rename, old or new, "
                    "never half")
    removed = [i for i, (name, p) in enumerate(events) if name in ("remove", "unlink") and p == [target]]
    if removed and (not renames or removed[0] < renames[-1][0]):
        raise Wrong("atomic_save deleted the old checkpoint before the new one was in place: a crash between the two "
                    "leaves no checkpoint at all. os.replace(tmp, path) swaps them in one step; no remove needed")
    if renames and os.path.dirname(renames[-1][1][0]) != os.path.dirname(target):
        raise Wrong(f"the temporary file was in {os.path.dirname(renames[-1][1][0])}, not next to path: os.replace "
                    "across file systems fails, and shutil.move then copies, which is not atomic. Use the same "
                    "directory")
    if not renames:
        raise Wrong("path holds the new object, but no os.replace / os.rename put it there: write a temporary file "
                    "next to path, fsync it, then os.replace(tmp, path)")
    _durability(syncs, target)
    stray = sorted(set(os.listdir(root)) - {"ckpt.pt"})
    if stray:
        raise Wrong(f"atomic_save left {stray} next to path after a successful save: rename the temporary file, "
                    "do not copy it")


def _stage_failed_save_cleans_up(answer, root: str) -> None:
    """A save that fails midway must raise and leave nothing but the old checkpoint: a temporary file left behind
    by every failed save is a full checkpoint's worth of disk each time (run after _stage_replace, so that a
    rename without fsync is named first)."""
    path = os.path.join(root, "ckpt.pt")
    torch.save(_checkpoint(1), path)
    torch.save(_checkpoint(2), buf := io.BytesIO())
    with writes_fail_beyond(len(buf.getvalue()) // 2):
        try:
            answer(_checkpoint(2), path)
        except NotImplementedError:
            raise
        except Exception:  # noqa: BLE001 - the failure we caused
            pass
    stray = sorted(set(os.listdir(root)) - {"ckpt.pt"})
    if stray:
        sizes = ", ".join(f"{name} ({os.path.getsize(os.path.join(root, name))} bytes)" for name in stray)
        raise Wrong(f"a save that failed midway left {sizes} next to path: the old checkpoint is safe, but every "
                    "failed save leaves a partial checkpoint behind (a full-size one at scale) until the disk fills. "
                    "Remove the temporary file when the write fails (try: ... except BaseException: os.remove(tmp); "
                    "raise), then let the error propagate")


def _stage_first_save(answer, root: str) -> None:
    path = os.path.join(root, "sub", "first.pt")
    os.makedirs(os.path.dirname(path))
    for step in (3, 4):
        answer(_checkpoint(step), path)
        got, error = _load(path)
        if got is None or not _same(got, _checkpoint(step)):
            which = "a first save (no old file at path)" if step == 3 else "a second save over the first"
            raise Wrong(f"after {which}, path does not hold the object saved ({error or 'another object'})")


def check_atomic_save(ctx, answer) -> None:
    root = tempfile.mkdtemp(prefix=f"ch08_atomic_rank{ctx.rank}_")
    try:
        for stage in (_stage_crash, _stage_replace, _stage_failed_save_cleans_up, _stage_first_save):
            where = os.path.join(root, stage.__name__)
            os.makedirs(where)
            agree(lambda: stage(answer, where))
    finally:
        shutil.rmtree(root, ignore_errors=True)


CHECKS = {"training_state": check_training_state, "atomic_save": check_atomic_save}


def main(ctx, exercise: str = "", answer=None):
    return run_exercise(ctx, CHECKS, exercise, answer)
