"""Plausible wrong answers for chapter 17, each with a fragment of the message the check must give.

``resume_position`` answers travel to the ranks as source: each is self-contained (imports inside)."""
from tests.wrong_answers import tries


# -- resume_position ------------------------------------------------------------------------------------------------

def resume_from_failed_step(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(failed_step - 1, n // batch)  # the step that failed, done again: not the checkpoint's
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_one_batch_early(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"] - 1, n // batch)  # "step S" read as 1-based: step S's batch again
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_one_batch_late(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"] + 1, n // batch)  # "the next step is S + 1", counted once too often
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_whole_global_batch(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return order[position * batch:(position + 1) * batch].tolist()  # every rank reads the whole global batch


def resume_restarts_the_epoch(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch = checkpoint["step"] // (n // batch)  # the right epoch, read from its start (DistributedSampler's resume)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    return order[rank * per_rank:(rank + 1) * per_rank].tolist()


def resume_epoch_zero_order(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # one order for every epoch
    per_rank = batch // world_size
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_counts_the_partial_batch(checkpoint, failed_step, rank, world_size):
    import math

    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], math.ceil(n / batch))  # 8 steps an epoch for 60 rows in 8s
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_strided_split(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return order[position * batch:(position + 1) * batch][rank::world_size].tolist()  # DistributedSampler's split


def resume_saved_position_without_rollover(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    steps = n // batch
    step = checkpoint["step"]
    # the (epoch, position) the sampler saves: position = steps at an epoch's end, rolled over only when it next reads
    epoch, position = (step - 1) // steps, (step - 1) % steps + 1
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_per_rank_batch_in_place(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    cfg["global_batch"] //= world_size  # the rows per rank, written into the caller's checkpoint
    per_rank = cfg["global_batch"]
    batch = per_rank * world_size
    n, seed = cfg["n_samples"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return order[position * batch + rank * per_rank:position * batch + (rank + 1) * per_rank].tolist()


def resume_every_ranks_rows(checkpoint, failed_step, rank, world_size):
    import torch

    cfg = checkpoint["config"]
    n, batch, seed = cfg["n_samples"], cfg["global_batch"], cfg["seed"]
    epoch, position = divmod(checkpoint["step"], n // batch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    return order[position * batch:(position + 1) * batch].view(world_size, -1)  # [world, B/world]: every rank's


# -- quorum_grad_scale ----------------------------------------------------------------------------------------------

def quorum_divides_by_plan(grads, participants, replicas):
    total = [sum(gs) for gs in zip(*(grads[r] for r in participants))]
    return [t / replicas for t in total]  # the plan's count, not the quorum's


def quorum_sum_only(grads, participants, replicas):
    return [sum(gs) for gs in zip(*(grads[r] for r in participants))]  # the allreduce's SUM, never divided


def quorum_includes_stale(grads, participants, replicas):
    total = [sum(gs) for gs in zip(*grads.values())]  # every replica's buffer, the absent ones' too
    return [t / len(grads) for t in total]


def quorum_masks_absent(grads, participants, replicas):
    present = set(participants)
    total = [sum(g * (1.0 if r in present else 0.0) for r, g in zip(grads, gs))
             for gs in zip(*(grads[r] for r in grads))]  # the absent replicas multiplied by 0
    return [t / len(participants) for t in total]


def quorum_highest_id(grads, participants, replicas):
    total = [sum(gs) for gs in zip(*(grads[r] for r in participants))]
    return [t / (max(participants) + 1) for t in total]  # "the replicas are 0 .. P-1"


def quorum_float32_accumulator(grads, participants, replicas):
    import torch

    total = [torch.zeros(g.shape) for g in grads[participants[0]]]  # the default dtype: float32
    for r in participants:
        for t, g in zip(total, grads[r]):
            t += g
    return [t / len(participants) for t in total]


def quorum_adds_in_place(grads, participants, replicas):
    total = grads[participants[0]]  # the first replica's own buffers
    for r in participants[1:]:
        for t, g in zip(total, grads[r]):
            t += g
    return [t / len(participants) for t in total]


# -- timeline_goodput -----------------------------------------------------------------------------------------------

def goodput_keeps_rolled_back_work(segments):
    work = sum(s for kind, s in segments if kind == "work")  # the work a rollback undid still counted
    wall = sum(s for kind, s in segments if kind != "rollback")
    return work / wall


def goodput_checkpoints_productive(segments):
    productive = sum(s for kind, s in segments if kind in ("work", "checkpoint"))
    productive -= sum(s for kind, s in segments if kind == "rollback")
    return productive / sum(s for kind, s in segments if kind != "rollback")


def goodput_over_productive(segments):
    productive = sum(s for kind, s in segments if kind == "work") - sum(s for kind, s in segments if kind == "rollback")
    wall = sum(s for kind, s in segments if kind != "rollback")
    return wall / productive  # divided by the productive time


def goodput_over_work_time(segments):
    work = sum(s for kind, s in segments if kind == "work")
    productive = work - sum(s for kind, s in segments if kind == "rollback")
    return productive / work  # the time spent training, not the wall time


def goodput_rollback_takes_time(segments):
    productive = sum(s for kind, s in segments if kind == "work") - sum(s for kind, s in segments if kind == "rollback")
    return productive / sum(s for kind, s in segments)  # the rollbacks' seconds added to the wall time


def goodput_restart_kinds_only(segments):
    productive = sum(s for kind, s in segments if kind == "work") - sum(s for kind, s in segments if kind == "rollback")
    wall = sum(s for kind, s in segments if kind in ("work", "checkpoint", "recovery"))  # no degraded, no heal
    return productive / wall


def goodput_rollback_takes_last_work(segments):
    productive = wall = last_work = 0.0
    for kind, seconds in segments:
        if kind == "work":
            productive += seconds
            wall += seconds
            last_work = seconds
        elif kind == "rollback":
            productive -= last_work  # "the failure throws away the work before it"
        else:
            wall += seconds
    return productive / wall


def goodput_relabels_in_place(segments):
    for i, (kind, seconds) in enumerate(segments):
        if kind == "rollback":
            segments[i] = ("lost", seconds)  # the rolled-back work marked as lost, in the caller's list
    work = sum(s for kind, s in segments if kind == "work")
    lost = sum(s for kind, s in segments if kind == "lost")
    return (work - lost) / sum(s for kind, s in segments if kind != "lost")


def goodput_percentage(segments):
    productive = sum(s for kind, s in segments if kind == "work") - sum(s for kind, s in segments if kind == "rollback")
    return 100 * productive / sum(s for kind, s in segments if kind != "rollback")


# Marked after their definitions, not with a decorator: an answer travels as its source (to the ranks, and into
# a notebook cell in the browser test), and a decorator line would travel with it.
tries("sizes")(resume_counts_the_partial_batch)
tries("ragged")(resume_saved_position_without_rollover)
tries("layouts")(resume_strided_split)
tries("mutation")(resume_per_rank_batch_in_place)
tries("output")(resume_every_ranks_rows)
tries("non-finite")(quorum_masks_absent)
tries("layouts")(quorum_highest_id)
tries("output")(quorum_float32_accumulator)
tries("mutation")(quorum_adds_in_place)
tries("ragged")(goodput_rollback_takes_last_work)
tries("layouts")(goodput_restart_kinds_only)
tries("mutation")(goodput_relabels_in_place)


WRONG = [
    ("resume_position", resume_from_failed_step, "not from failed_step"),
    ("resume_position", resume_one_batch_early, "which the checkpoint already holds"),
    ("resume_position", resume_one_batch_late, "off by one batch"),
    ("resume_position", resume_whole_global_batch, "a whole global batch"),
    ("resume_position", resume_restarts_the_epoch, "you restarted the epoch"),
    ("resume_position", resume_epoch_zero_order, "seed + epoch"),
    ("resume_position", resume_counts_the_partial_batch, "n_samples // global_batch = 7 steps, not 8"),
    ("resume_position", resume_strided_split, "consecutive rows"),
    ("resume_position", resume_saved_position_without_rollover, "read past its last full batch"),
    ("resume_position", resume_per_rank_batch_in_place, "changed the checkpoint it was given"),
    ("resume_position", resume_every_ranks_rows, "return this rank's rows only"),
    ("quorum_grad_scale", quorum_divides_by_plan, "replicas the run is planned for"),
    ("quorum_grad_scale", quorum_sum_only, "without dividing"),
    ("quorum_grad_scale", quorum_includes_stale, "stale"),
    ("quorum_grad_scale", quorum_masks_absent, "0 x NaN"),
    ("quorum_grad_scale", quorum_highest_id, "the highest replica id + 1"),
    ("quorum_grad_scale", quorum_float32_accumulator, "float32"),
    ("quorum_grad_scale", quorum_adds_in_place, "in place"),
    ("timeline_goodput", goodput_keeps_rolled_back_work, "rolled-back work as productive"),
    ("timeline_goodput", goodput_checkpoints_productive, "checkpoints as productive"),
    ("timeline_goodput", goodput_over_productive, "you divided by the productive time"),
    ("timeline_goodput", goodput_over_work_time, "time spent in work segments"),
    ("timeline_goodput", goodput_rollback_takes_time, "a rollback takes no time itself"),
    ("timeline_goodput", goodput_restart_kinds_only, "'degraded' and 'heal'"),
    ("timeline_goodput", goodput_rollback_takes_last_work, "a rollback of 0 s"),
    ("timeline_goodput", goodput_relabels_in_place, "changed the timeline it was given"),
    ("timeline_goodput", goodput_percentage, "a percentage"),
]
