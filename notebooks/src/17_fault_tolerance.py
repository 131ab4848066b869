# %% [markdown]
# # 17 · Training that survives failures
#
# At the scale chapter 00 prices, a failure is not an accident but the weather. Llama 3 405B's 54-day pre-training
# on up to 16,384 H100s saw **419 unexpected interruptions**, about 78% of them hardware (faulty GPUs, their HBM,
# network switches and cables), one every three hours (Llama Team 2024, *The Llama 3 Herd of Models*, section
# 3.3.4 and Table 5). The same section reports over **90% effective training time**: what decided how long the run
# took was its *goodput*, the share of wall time spent on steps the final model is made of, not its MFU.
#
# Three ways to survive, each run here on real ranks:
#
# 1. **Restart and roll back.** torchrun's elastic agent notices a dead or failed rank, stops the others and starts
#    every rank again (`--max-restarts`); the job reloads its newest complete checkpoint (chapter 08's DCP) and
#    redoes the steps since. Everything since that checkpoint is lost work, and every restart costs the start of
#    the whole job. When a whole node is lost, an elastic job (`--nnodes=min:max`) restarts in the smaller world
#    that is left.
# 2. **Quorum and heal** (torchft): the job is several *replica groups* that agree, step by step, on who is alive
#    (a *quorum*, kept by a *lighthouse*). A group that dies drops out of the next step's quorum and the others go on
#    with fewer batches; its replacement copies the weights from a live peer (*heals*) and rejoins. No step is lost;
#    the batch shrinks while it is away.
# 3. **DiLoCo**: replica groups that synchronise only every H steps, so that a slow link between them (or a group
#    coming and going) costs H times less.
#
# And one way to count: the **goodput ledger**, wall time split into productive steps, checkpoints, lost work,
# recovery, waiting for a slow rank, degraded capacity and healing, measured on the runs here and modelled at the
# scale of a cluster.
#
# Built here: `workers/resilience/` (`trainer.py`: chapter 08's run with DCP checkpoints and a journal; `faults.py`:
# a rank killed, hung or slowed mid-step, or its whole node lost; `journal.py`: the ledger; `quorum.py`, `ft.py`, `replicas.py`: the torchft
# replicas and their one-process reference), the workers `workers/ch17_restart.py` and `workers/ch17_quorum.py`, and
# `course_utils/goodput.py` (the ledger as a model).

# %%
import re
import textwrap

from course_utils import ch17
from course_utils import ch17_quorum as ft
from course_utils import goodput as gp
from course_utils import plots
from course_utils.checkpoint_interval import HOUR, daly_interval, job_mtbf
from course_utils.exercises import check
from course_utils.tables import Table

plots.style()

# %% [markdown]
# ## 1. A rank dies: restart and roll back
#
# The run is chapter 08's (a small MLP trained with dropout, AdamW, warmup and a cosine schedule, a shuffled data
# order, augmentation drawing from numpy and Python's RNGs), in float64 on two ranks with DDP, checkpointed with DCP
# after steps 4, 8 and 12: the model, the optimizer, the schedule, the data position and every RNG of every rank.
#
# First the run without a fault, the reference. Then the same run where rank 1 is killed (SIGKILL: no Python
# exception, no cleanup, as when a GPU falls off the bus) in the middle of step 7. torchrun's agent sees the dead
# process, stops rank 0, and starts both ranks again (`max_restarts=1`); they find the newest *complete* checkpoint
# (one whose DCP metadata was written: a save cut short is never chosen) and go on from there.
#
# **Predict**: which steps are done twice? And does the restarted run end with the same weights as the
# uninterrupted one: approximately, or bit for bit?

# %%
straight = ch17.restart_run("none", name="ch17-straight")
killed = ch17.restart_run("kill", fault_step=7, fault_rank=1, name="ch17-killed")
print(ch17.structure_table(killed[0]))
print("the restarted run against the uninterrupted one:", ch17.same_run(killed, straight))

# %% [markdown]
# Steps 5 and 6 were done, streamed to this notebook, and thrown away: the checkpoint after step 4 is the newest one
# that was complete when rank 1 died. The restarted run then did them again and ended **bit for bit** on the
# uninterrupted run's losses and weights: every input of the next step was in the checkpoint (the data position,
# every generator's state, the optimizer's moments and step count, the schedule's position), so the same float64
# operations ran on the same bits in the same order. Equal to the last bit is the test a resume must pass; "the loss
# curve looks continuous" passes with a lost RNG state.

# %% tags=["nbval-ignore-output"]
costs = ch17.measured_costs(straight)
plots.savefig(ch17.run_figure(killed, ch17.predicted(costs, killed[0]),
                              title="rank 1 killed in step 7: restarted, steps 5 and 6 redone"), "17_restart");

# %% [markdown]
# The losses of the lost steps (crossed) sit exactly under the restarted attempt's: the same steps, the same numbers.
# On the right, where the run's wall time went, from the journal every rank keeps next to the checkpoints (one line
# per event, flushed at once, so a SIGKILL loses nothing written before it): productive steps, checkpoints, the lost
# steps, and the recovery (torchrun stopping the survivors, new processes, `import torch`, the rendezvous, the model
# built again, the checkpoint read). Twelve steps of a few milliseconds next to a recovery of seconds: on this
# machine one restart costs hundreds of steps. CPU wall times: they vary with the machine and its load.
#
# ## 2. A rank hangs
#
# A dead process is the easy failure: the agent sees it exit. A rank stuck in a kernel, a deadlocked data loader or
# a cable that drops packets leaves every process alive, and the other ranks wait in their next collective forever.
# Only the collective's **timeout** ends it (`init_process_group(timeout=...)`; NCCL's default is 10 minutes, here
# 3 s). Then the waiting rank raises, the agent restarts the job, and the job rolls back as before.
#
# Here rank 0 stops after the forward pass of step 10 and never calls the gradient all-reduce that rank 1 waits in.
# Which rank raises, and what can it tell you? Each rank writes which collective it is entering on a small board in
# the job's store, so the error names the collective and the rank that never arrived.

# %%
hung = ch17.restart_run("hang", fault_step=10, fault_rank=0, name="ch17-hung", hang_s=300.0)
(failure,) = hung[0]["failures"]
# the seconds it waited vary with the load (the timeout is 3 s): shown as "N s" here, printed in the next cell
print(textwrap.fill(re.sub(r"after [0-9.]+ s", "after N s", failure["message"].split("; gloo said")[0]) + ".", 110))
print(ch17.structure_table(hung[0]))
print("the restarted run against the uninterrupted one:", ch17.same_run(hung, straight))

# %% [markdown]
# A third failure strikes the checkpoint itself. DCP writes a checkpoint in phases: every rank writes its own files,
# then the coordinator collects what each wrote and writes `.metadata` last, under a temporary name it renames. A
# rank that dies in between leaves a folder that looks like a checkpoint and is not one. Here rank 1 is killed inside
# the save after step 8, its own shard already on disk:

# %%
torn = ch17.restart_run("torn", fault_step=8, fault_rank=1, name="ch17-torn")
print(ch17.structure_table(torn[0]))
print("torn checkpoints passed over when the job reloaded (steps):", torn[0]["skipped"][0])
print("the restarted run against the uninterrupted one:", ch17.same_run(torn, straight))

# %% [markdown]
# The folder of step 8 was there, without `.metadata`; the restart passed over it and took step 4's, so steps 5 to 8
# were done twice. A job that trusted the newest folder would have tried to load half a checkpoint. (Chapter 08 kills
# a save midway in one process; here the save is cut between its ranks, which is how it happens on a cluster.)
#
# The hang cost what the killed rank did, plus the wait for the timeout: detection is the timeout, by design. That
# is the trade every large job tunes. A short timeout ends a real hang quickly but also kills a job whose collective
# was only slow (a straggler, a congested switch). And the timeout alone says only that *someone* did not arrive:
# Llama 3's team used PyTorch's NCCL flight recorder (a ring buffer of every rank's collectives and their stack
# traces) to find the stuck rank among thousands (section 3.3.4).

# %% [markdown]
# ### A straggler: a rank that is only slow
#
# This fault fails nothing. A GPU that throttles when it runs hot, a node whose NIC renegotiated a slower link,
# a host with a noisy neighbour: the rank still computes the right numbers, only later. Here rank 1 sleeps 0.3 s right
# after its forward pass in steps 5, 6 and 7 (on every attempt: a slow node stays slow), and rank 0 reaches the
# gradient all-reduce first and waits there. Nothing raises and nothing restarts. Each rank writes down, in every
# step, the moment it arrived at that all-reduce.
#
# **Predict**: what does the straggler cost rank 0, and does the run still end on the uninterrupted run's weights?

# %%
slowed = ch17.restart_run("slow", fault_step=5, fault_rank=1, name="ch17-slowed")
print(ch17.structure_table(slowed[0]))
found = ch17.straggler(slowed[0])
slowed_steps = list(range(5, 5 + ch17.SLOW_STEPS))  # found below by their arrival times alone
print(f"last to arrive at the gradient all-reduce, later than the first by over 0.1 s, in each slowed step "
      f"{slowed_steps}:", ch17.last_in(slowed[0], slowed_steps), "-> the straggler is rank", found["rank"])
print("the slowed run against the uninterrupted one:", ch17.same_run(slowed, straight))
print("rank 0 waited at least half of the 3 x 0.3 s the straggler slept:",
      slowed[0]["waiting_s"] >= 0.5 * ch17.SLOW_S * ch17.SLOW_STEPS)

# %% [markdown]
# The same losses and weights, bit for bit: a straggler changes when the numbers arrive, never what they are. What it
# changes is the ledger. The waiting is a share of its own, taken out of the steps it happened in (rank 0 was inside
# step 5 all the while, but not training). The model prices it as the straggler's sleep, 0.3 s in each of three
# steps, less nothing: it assumes the sleep dominates, so that the rank that arrived first waited all of it.

# %% tags=["nbval-ignore-output"]
slow_model = ch17.predicted(costs, slowed[0])
print("CPU seconds, this machine:")
print(ch17.ledger_table(slowed[0], slow_model))
print(ch17.straggler_table(slowed[0]))
plots.savefig(ch17.run_figure(slowed, slow_model, title="rank 1 slowed by 0.3 s in steps 5 to 7"), "17_straggler");

# %% [markdown]
# Rank 0 lost the straggler's whole delay in every slowed step, and so would every other rank of a bigger job: in
# synchronous training every step waits for its last rank, so the job runs at the speed of its slowest one. One GPU
# running 10% slow among 16,384 makes all 16,384 run 10% slow, and nothing in the losses or the weights shows it.
#
# The arrival times show it. Chapter 09 found the rank that went *wrong* by comparing every rank's checksum; a slow
# rank is found the same way, by comparing when every rank reaches the same collective: the one that is last, step
# after step, is the straggler (the table above, per step; Megatron-LM's straggler detector and NCCL's flight
# recorder record the same kind of timings at scale). A straggler that falls behind by more than the collective's
# timeout is no longer slow but hung, and ends as section 2's hang.
#
# What real jobs then do is **evict** the slow node: stop the job, take the node out, and start again from the last
# checkpoint on a spare node (the same world size) or without it (a smaller world, if the job can reshard its
# checkpoint). A straggler found is handled as a lost node, followed by a restart.

# %% [markdown]
# ### A node lost: going on in a smaller world
#
# On a cluster the unit that fails is often a whole node: a power supply, a network card or a kernel panic takes its
# eight GPUs at once, and the node may not come back for hours. Waiting for a replacement leaves every other GPU
# idle; an **elastic** job goes on without it. torchrun runs one agent per node, and `--nnodes=1:2` tells the
# rendezvous where the agents meet that the job may run on one node or two: after a failure, the agents that are left
# meet again, wait a short while for the lost one (`last_call_timeout`, here 5 s, after its heartbeats stop: 2 s)
# and start their ranks in the world that is left.
#
# Here two agents on this machine play two nodes of two ranks each, meeting in a c10d rendezvous as they would on a
# cluster. In step 7 rank 2's node is lost: its agent and both of its ranks are SIGKILLed at once. The two ranks of
# node 0 lose their peers in the all-reduce, their agent restarts them in a world of two, and they load step 4's
# checkpoint, which four ranks wrote. DDP's weights and AdamW's moments are replicated, so DCP wrote them once and
# reads them into any number of ranks; the data position is global, so the next global batch is split over two ranks
# instead of four.
#
# **Predict**: can the two-rank run end on the four-rank run's weights, bit for bit?

# %%
lost = ch17.lost_node_run(fault_step=7, fault_rank=2)
four = ch17.restart_run("none", world_size=4, name="ch17-four")
print(ch17.structure_table(lost[0]))
print("ranks in each attempt:", lost[0]["world_sizes"])
print("every step read the four-rank run's samples (none skipped, none twice):", ch17.same_rows(lost, four))
print("final losses equal to the four-rank run's:", bool((lost[0]["losses"] == four[0]["losses"]).all()))
by_hand = ch17.resumed_by_hand(lost)
print("against a two-rank job resumed by hand from step 4's checkpoint:", ch17.same_continuation(lost, by_hand))

# %% [markdown]
# Every step read exactly the samples the uninterrupted four-rank run read, but from step 5 on the losses differ:
# dropout masks and input noise are drawn by each rank from its own generators, and two ranks now draw for rows that
# four drew for before. A smaller world cannot continue the same trajectory; it continues the same data. What it can
# be held to is the job you would have run by hand: two new ranks started on a copy of step 4's checkpoint. The
# elastic restart equals that job bit for bit. The global batch stayed 8 (4 rows per rank instead of 2), so the
# learning rate and the schedule still fit; a job that kept the rows per rank instead would have halved its batch.
#
# What the survivors waited for, measured here: (CPU wall times)

# %% tags=["nbval-ignore-output"]
print(ch17.ledger_table(lost[0]))
print(f"recovery: {lost[0]['restart_s']:.1f} s from the lost node to the reload, of which the rendezvous waited "
      f"{ch17.ELASTIC_WAIT_S:.0f} s for the lost node (heartbeats, then the last call)")

# %% [markdown]
# The recovery is longer than the killed rank's: the survivors' agent gives the lost node time to come back before it
# closes the rendezvous without it. Real jobs set that wait from how long a node takes to reboot or be replaced, and
# keep spare nodes so the world does not shrink at all: the replacement joins the rendezvous and the restart is back
# to full size. torchft (section 5) avoids the restart altogether.

# %% [markdown]
# ### Exercise 1: where to resume
#
# The restarted run read, in step 5, exactly the rows the uninterrupted run read there: chapter 08's sampler saves
# its position (the epoch, the batches read) in the checkpoint. torch's `DistributedSampler` keeps no position, and a
# job resumed with it must work out where it was from the step it reloaded. Do that by hand.
#
# Write `resume_position(checkpoint, failed_step, rank, world_size)`: the rows of the dataset (a list of ints, or a
# 1-D integer tensor) that rank `rank` reads in the first step after a restart. `checkpoint` is what the newest
# complete checkpoint holds besides tensors: `checkpoint["step"]`, the step it was saved after, and
# `checkpoint["config"]`, the run's settings (`n_samples`, `global_batch`, `seed`, ...); `failed_step` is the step
# the job was in when a rank died. The data order is the sampler's (`workers/checkpointing/sampler.py`): steps count
# from 1; epoch `e` reads the rows in the order
# `torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed + e))`, `global_batch` rows a step; an
# epoch is `n_samples // global_batch` steps (an incomplete last batch is dropped); rank r reads the
# `b = global_batch // world_size` consecutive rows `[r * b, (r + 1) * b)` of each global batch. Leave `checkpoint` as
# it is, and put the imports inside the function: it runs on the ranks.
#
# The check runs inside the real restart path on 2 and 4 ranks. This section's trainer runs uninterrupted; then
# again, with a checkpoint every few steps, until a rank dies in `failed_step`; then the job restarts from its newest
# complete checkpoint, the real code restores everything, and the first step reads **your** rows. They must be the
# rows the restored sampler gives, on every rank, and the restarted job must end on the uninterrupted job's weights.
# Three checkpoints of 60 rows in batches of 8: in the middle of epoch 0, in epoch 2, and at the end of epoch 1.

# %% tags=["exercise"]
def resume_position(checkpoint, failed_step, rank, world_size):
    """The rows (a list of ints) this rank reads in the first step after the restart."""
    import torch  # noqa: F401

    raise NotImplementedError


# %% tags=["check"]
check("resume_position", resume_position)

# %% [markdown]
# ## 3. The ledger, measured and predicted
#
# The model of the ledger (`course_utils/goodput.py: predict_run`) takes what a step and a checkpoint cost (the
# uninterrupted run's median step and mean save), what a recovery costs, and when the faults strike, and returns
# the wall time by share. The recovery it charges is the launcher's own estimate of starting these two ranks and
# this worker from nothing (`launcher.expected_cold_s`, from this machine's recent cold starts); the hang adds the
# 3 s timeout to it. **Predict**: is a torchrun restart cheaper or dearer than starting the job from nothing?

# %% tags=["nbval-ignore-output"]
print(f"the hang was detected after {hung[0]['detect_s']:.2f} s (the timeout: {ch17.COLLECTIVE_TIMEOUT_S:g} s)")
hang_costs = ch17.measured_costs(straight, detect_s=ch17.COLLECTIVE_TIMEOUT_S)
for name, res, c in (("killed", killed, costs), ("hung", hung, hang_costs)):
    print(f"{name} (CPU seconds, this machine):")
    print(ch17.ledger_table(res[0], ch17.predicted(c, res[0])))

# %% [markdown]
# The steps, the checkpoints and the lost work land near their prediction: they are the uninterrupted run's own
# numbers, counted again for the steps the fault made the job redo. The recovery is where a model must be told what
# it costs: here the model charged a cold start of the whole job, and torchrun's restart is usually cheaper: its
# agent stays up, so there is no new `torchrun`, and only the ranks start again. At a cluster, recovery is the one
# number that moves goodput most, and the one no paper prints (section 4).

# %% [markdown]
# ### Exercise 2: the goodput of a timeline
#
# Write `timeline_goodput(segments)`: the goodput of a timeline given as a list of `(kind, seconds)` in the order
# they happened, the share of its wall time spent on work the final weights are made of. The kinds: `"work"`
# (training steps), `"checkpoint"` (the steps wait for a save), `"recovery"` (detecting a failure, restarting,
# reloading), `"degraded"` and `"heal"` (a quorum run training without a replica group, then the group copying the
# state back from a peer), and `"rollback"`: the job went back to its last checkpoint, and the last `seconds` of work
# before the failure are thrown away, to be done again. A rollback takes no time itself: its cost in time is the
# recovery next to it. Return a number between 0 and 1. The check compares it with this section's ledger
# (`goodput.timeline_ledger`) on five timelines: a restart, two failures between the same checkpoints (one right
# after a checkpoint), a quorum run, a run that lost all its work, and this section's run as `predict_run` models it.

# %% tags=["exercise"]
def timeline_goodput(segments):
    """segments: [(kind, seconds), ...] in order -> productive seconds / wall seconds."""
    raise NotImplementedError


# %% tags=["check"]
check("timeline_goodput", timeline_goodput)

# %% [markdown]
# ## 4. At the scale of a cluster
#
# The same ledger for a job whose GPUs fail independently: a job of N GPUs fails N times as often as one GPU
# (chapter 08's `job_mtbf`). For restart and roll back the ledger is Daly's model of chapter 08 split into its parts:
# each segment of `tau` seconds of training and its checkpoint survives with probability $e^{-(\tau+\delta)/M}$,
# each failure throws away the part of a segment done before it and costs a recovery (restarted if a failure hits it
# too). For quorum and heal, a failure costs every replica group the step in flight and a new quorum, and the failed
# group's share of the capacity while it restarts and heals; nothing rolls back.
#
# With Llama 3's failure rate (one every 3.1 hours at 16,384 GPUs), a 20-second checkpoint stall and 3 minutes to
# detect, restart and reload (both assumed: the paper prints neither), at Daly's interval:

# %%
mtbf = job_mtbf(gp.LLAMA3_GPU_MTBF_S, 16_384)
print(f"a failure every {mtbf / HOUR:.2f} h; Daly's interval for a 20 s stall: {daly_interval(20.0, mtbf) / 60:.1f} min")
Table.of([{"method": kind, **{share: f"{v:.2%}" for share, v in shares.items()}}
          for kind, shares in ch17.cluster_ledgers().items()])

# %% [markdown]
# The restart model lands above the 90% Llama 3 reports with these costs; with a one-minute stall or an hour-long
# recovery it falls below (`tests/test_goodput.py` checks both): the published figure says how cheap checkpointing and
# recovery must have been. Quorum and heal keeps more, because a failure takes one group in eight away for a few
# minutes instead of rolling every GPU back. Its checkpoints guard only against losing every group at once, which
# this model leaves out: that is why its curve keeps rising with the interval.

# %% tags=["nbval-ignore-output"]
plots.savefig(ch17.cluster_figure(), "17_goodput_cluster");

# %% [markdown]
# Move the cluster size, the checkpoint stall, the recovery time and the replica groups; the figure is the model
# (pure Python, it redraws at once).

# %% tags=["nbval-ignore-output"]
ch17.cluster_widget()

# %% [markdown]
# ## 5. Quorum and heal, with torchft
#
# torchft (PyTorch's fault-tolerance library) turns data parallelism's replicas into groups that can come and go.
# A **lighthouse** (a small server, started here inside this notebook's process on a port the OS picks) tells the
# replica groups, at each step, who is in the quorum. Each group's **Manager** asks it at the start of a step,
# all-reduces the gradients over the groups present, and commits the step only if every collective of it succeeded.
#
# Three replica groups (one rank each here) train the same float64 model on their own batches. Replica 2 is killed
# after its forward in step 5. The survivors' all-reduce fails, nobody commits step 5, the lighthouse drops the
# silent replica after its heartbeat timeout (1 s here), and the two survivors redo step 5 as a quorum of two. A
# replacement process for replica 2 starts, asks to join, and **heals**: it copies the weights and the optimizer
# state from a live peer, then takes part again from step 9.
#
# The quorum's minimum is a majority (2 of 3). With a minimum of 1, two replicas that happen to ask at different
# moments can each form a quorum of one and train apart without any error.
#
# **Predict**: in the steps where only two replicas are present, what should the gradient be divided by, so that the
# run equals one process training on the two present replicas' batches?

# %%
quorum = ft.quorum_run(replicas=3, steps=12, fault_replica=2, fault_step=5, rejoin_step=9)
Table.of([{"step": k, "replicas present": ", ".join(map(str, quorum.participation[k])),
           "quorum": len(quorum.participation[k])} for k in sorted(quorum.participation)])

# %% [markdown]
# ### Exercise 3: the gradient of a shrunken quorum
#
# Write `quorum_grad_scale(grads, participants, replicas)`: the gradient every replica of a step's quorum steps
# with. `grads` maps each replica of the plan (0 to `replicas - 1`) to its gradient buffers, a list of float64
# tensors, one per parameter: for a replica in the quorum, its gradient of this step on its own batch; for one outside
# it, whatever its buffer still holds (the gradient of the last step it took or, for a replica that died in the middle
# of an all-reduce, garbage). `participants` lists the replicas in this step's quorum, `replicas` how many the run is
# planned for. Return one tensor per parameter, in new tensors (the buffers are the replicas' own `.grad`: leave them
# as they are). The check trains this section's model step by step with your function in place of the all-reduce,
# through quorums of 3 of 3, 2 of 3, 2 of 4 and 1 of 4, and compares every step's gradient, and the final weights,
# with one process trained on only the present replicas' batches (`replicas.reference`).

# %% tags=["exercise"]
def quorum_grad_scale(grads, participants, replicas):
    """grads {replica: [tensor per parameter]}, participants [replica ids], replicas: int -> [tensor per parameter]."""
    raise NotImplementedError


# %% tags=["check"]
check("quorum_grad_scale", quorum_grad_scale)

# %%
print("tries that never committed (replica, step):", sorted({(r["replica"], r["step"]) for r in quorum.retried}))
print(f"heal: {quorum.timings['heal_bytes']:,} bytes from a live peer "
      f"(weights and AdamW's two moments, float64, and the step counts)")
print("every live process ends with the same weights, bit for bit:", quorum.replicas_identical)
print("equal to one process on the present replicas' batches, weights and losses within 1e-12 (float64):",
      quorum.weight_error < 1e-12 and quorum.loss_error < 1e-12)

# %% [markdown]
# While replica 2 was away the batch was two replicas' batches, and the gradient was their mean: the all-reduce
# divides by the number of replicas *in the quorum*, not by the number configured. Divide by three and the steps
# without replica 2 take two-thirds of a step; add its last gradient and a dead process still steers the model.
# The run equals one process that trained each step on exactly the batches present, to float64 rounding (the sum of
# two or three gradients taken in another order).

# %% tags=["nbval-ignore-output"]
plots.savefig(ft.quorum_figure(quorum), "17_quorum")
print(f"largest differences from one process: weights {quorum.weight_error:.0e}, losses {quorum.loss_error:.0e}")
print(f"CPU seconds, this machine: kill to the survivors' new quorum {quorum.timings['shrink_s']:.2f} s; "
      f"the replacement's first quorum, heal included, {quorum.timings['heal_s']:.2f} s; "
      f"from launching the replacement to its first committed step {quorum.timings['replacement_s']:.1f} s")

# %% [markdown]
# The survivors lost one step's try and about a second (the heartbeat timeout), not the work since a checkpoint.
# What the quorum lost instead is capacity: three replicas' batches per step became two for four steps.
#
# ## 6. DiLoCo: synchronising every H steps
#
# Between data centres, or over a slow link, an all-reduce of every gradient at every step is the bottleneck.
# **DiLoCo** (Douillard et al. 2023, *DiLoCo: Distributed Low-Communication Training of Language Models*) lets each
# replica group take H steps with its own inner optimizer (AdamW here), then all-reduces the *pseudo-gradient* (the
# parameters' change over those H steps) and applies it with an outer optimizer (SGD with Nesterov momentum). torchft
# implements it (`torchft.local_sgd.DiLoCo`); the same two replica groups, the same batches, trained both ways:

# %%
diloco = ft.diloco_vs_ddp(sync_every=4, steps=24, replicas=2)
syncs = {"ddp": diloco.steps, "diloco": diloco.steps // diloco.sync_every}
Table.of([{"method": mode, "synchronisations": syncs[mode], "bytes per replica": f"{diloco.bytes[mode]:,}"}
          for mode in ("ddp", "diloco")])

# %% [markdown]
# Every 4 steps instead of every step: a quarter of the bytes, to the byte (each all-reduce carries every parameter,
# 676 of them, in float64). Does the model pay for it? The final loss of each, on the whole dataset:

# %% tags=["nbval-ignore-output"]
print(f"start {diloco.initial_eval_loss:.3f}; after {diloco.steps} steps: "
      + ", ".join(f"{mode} {loss:.3f}" for mode, loss in diloco.eval_loss.items()) + " (CPU run; varies by machine)")

# %% [markdown]
# On this small problem the two end close (DiLoCo's paper trains language models at 8 workers and H = 500 to a
# perplexity near synchronous training's). What DiLoCo buys for fault tolerance: a group that fails or falls behind
# holds the others up only at a synchronisation, once every H steps.
#
# ## 7. Explore on real ranks
#
# Choose the fault (a rank killed, hung, killed inside a save, or slowed for three steps from that step on: `torn`
# needs a step that saves a checkpoint, and `slow` a step no later than 10, or it is refused), the step it strikes in
# and the checkpoint interval; each change runs the job on two new ranks (a job that torchrun may restart always gets
# ranks of its own, so every run is a cold start: the status line says how long), and draws the run with the model's
# ledger beside the measured one.

# %% tags=["nbval-ignore-output"]
explore = ch17.restart_widget()
explore.wait(180)
explore

# %% [markdown]
# ## Summary
#
# * Failures are the normal case at scale: Llama 3 405B lost its job every three hours on average, and over 90% of
#   its wall time still went to training.
# * **Restart and roll back** (torchrun `--max-restarts`, DCP): a resumed run must equal the uninterrupted one bit
#   for bit; that needs every input of the next step in the checkpoint (data position and every RNG included). It
#   loses the work since the last checkpoint and pays a whole job's restart per failure.
# * A **hang** ends only at the collective's timeout; naming the collective and the missing rank is what makes it
#   debuggable. A **save cut short** between ranks leaves a folder without `.metadata`: resume from the newest
#   *complete* checkpoint.
# * A **lost node** (`torchrun --nnodes=min:max`): the agents left meet again, wait a little for the lost one, and
#   restart the ranks in the smaller world from the last checkpoint. It reads the same data, not the same trajectory
#   (per-rank randomness); it equals a job resumed by hand in that world, bit for bit.
# * A **straggler** fails nothing and costs every rank its delay in every step it is late: synchronous training runs
#   at the speed of the slowest rank. The ranks' arrival times at a collective name it; real jobs evict the slow node
#   and restart, as after a lost one.
# * **Goodput** = productive share of wall time. Daly's model, split into shares, says what checkpoint stall and
#   recovery time a published goodput allows.
# * **Quorum and heal** (torchft): a dead replica group drops out of the next step's quorum, the others average the
#   gradients of the replicas present (divide by the quorum, not the configured count), and the replacement heals
#   from a live peer. Nothing rolls back; capacity shrinks while it is away. The quorum's minimum must be a majority.
# * **DiLoCo**: synchronise every H steps, H times fewer bytes, and a group's absence matters only at synchronisation.
#
# | here | torchtitan / torchft | Megatron-LM |
# |---|---|---|
# | `ch17.restart_run(..., max_restarts=1)` | `torchrun --max-restarts`, `--checkpoint.enable` (DCP) | `--exit-signal-handler`, in-process restart (`nvidia_resiliency_ext`) |
# | `ch17.lost_node_run` (`nnodes=2, min_nodes=1`) | `torchrun --nnodes=1:2 --rdzv-backend=c10d` | `ft_launcher` (`nvidia_resiliency_ext`, torchrun's elastic agent underneath) |
# | the journal's ledger | torchft's metrics, goodput dashboards | straggler detection, `--log-straggler` |
# | `ft.quorum_run` | `torchft.Manager`, `LighthouseServer`, `--fault_tolerance.enable` | - |
# | `ft.diloco_vs_ddp` | `torchft.local_sgd.DiLoCo` | - |

# %% [markdown]
# ### Before you close this chapter
# This chapter's runs start ranks of their own and stop them when each run ends; the lighthouses stop with their
# runs. Nothing of this chapter keeps running after its cells.
