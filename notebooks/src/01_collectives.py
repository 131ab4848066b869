# %% [markdown]
# # 01 · `init_process_group` → `all_reduce`
#
# Every technique in this course (data, tensor, pipeline, sequence and expert parallelism, ZeRO, FSDP) is
# the same three ideas arranged differently: **several processes**, each holding **part of the data**, and a
# handful of **collective operations** that move or combine tensors among them. This chapter is about those
# three ideas alone, on real processes started by `torchrun`.
#
# By the end you will have:
# 1. run the 18-line script that every distributed program grows from, at world size 1, 2, 4 and 8;
# 2. seen `rank`, `local_rank` and `world_size` on a two-node job (two `torchrun` agents on this machine);
# 3. watched every collective move data between ranks, and compared each with a single-process answer;
# 4. timed an asynchronous collective correctly, and learnt why GPU timings lie without a synchronise;
# 5. broken a job three ways on purpose, and read the error each time (a timeout, never a hang);
# 6. measured bandwidth the way NVIDIA's `nccl-tests` does, next to a published 8×H200 NVLink node;
# 7. built an all-reduce from point-to-point messages yourself (graded on real ranks).
#
# There is no GPU needed: the ranks here are CPU processes talking through **gloo**. The same code runs
# with **NCCL** on GPUs; where the two differ, the notebook says so.

# %%
import course_utils as cu
from course_utils import ch01, plots, progress, reference_data
from course_utils.exercises import check
from course_utils.paths import ROOT
from course_utils.tables import Table

plots.style()
RUN = dict(timeout=30)  # 30 s per run, counted once every rank has loaded the worker; past it: JobTimeout, no hang

# %% [markdown]
# ## 1. The minimal script
#
# A distributed job is N copies of the same program. `torchrun` starts them and tells each one who it is
# through environment variables; `init_process_group` makes them meet (at `MASTER_ADDR:MASTER_PORT`) and
# agree on a communication backend; from then on they can run collectives. Here is the whole thing, the
# script you would run unchanged on a cluster:

# %%
print((ROOT / "workers" / "ch01_minimal.py").read_text())

# %% [markdown]
# Three things to notice before running it:
# - **Rank r holds `r + 1`**, and `all_reduce` with `SUM` leaves the same value on *every* rank:
#   1 + 2 + … + n = n(n+1)/2. No rank is special; nobody "sends to" anybody.
# - **The device comes from `local_rank`**, not from `rank` (section 2 shows why).
# - **The backend follows the hardware**: NCCL when every process has a GPU of its own, gloo otherwise.
#
# **Predict.** At world size 8, what does rank 5 print? What does rank 0 print at world size 1: does an
# all-reduce over one process do anything?
#
# The cell below starts four independent jobs at once, each a plain
# `python -m torch.distributed.run --standalone --nproc-per-node N workers/ch01_minimal.py`.
# `--standalone` picks a free port for each, so they cannot collide; a job that ran past the timeout would be
# killed together with every process it started.

# %%
from concurrent.futures import ThreadPoolExecutor

WORLDS = (1, 2, 4, 8)
progress.say("four torchrun jobs at once, 15 ranks starting from scratch: about 15 s on an idle 2-core machine")
with ThreadPoolExecutor(len(WORLDS)) as pool:
    minimal_runs = dict(zip(WORLDS, pool.map(
        lambda n: ch01.run_script("workers/ch01_minimal.py", n, timeout=120), WORLDS)))
for n, script_run in minimal_runs.items():
    print(f"--- world size {n}: {'ok' if script_run.ok else 'FAILED'}")
    print(script_run)

# %% [markdown]
# Every rank of every job printed n(n+1)/2 (1, 3, 10, 36), and the `assert` in the script held on each.
# The cost of starting them is not small, though:

# %% tags=["nbval-ignore-output"]
for n, script_run in minimal_runs.items():
    print(f"world {n}: {script_run.seconds:.1f} s from launch to exit (CPU, four jobs sharing this machine)")

# %% [markdown]
# Seconds, for one addition. Most of it is starting Python, importing torch and the rendezvous; the
# all-reduce itself takes microseconds to milliseconds. That is why the rest of this notebook uses
# `course_utils.run`, which keeps a set of `torchrun` ranks **warm** between runs: each run is still a new
# execution of the worker on real processes (fresh seed, fresh tensors), without paying for the start again.
# The workers it runs (`workers/ch01_*.py`) are also plain scripts you can start with `torchrun` yourself.

# %% [markdown]
# ## 2. `rank`, `local_rank`, `world_size`: two nodes, two processes each
#
# On a cluster, one `torchrun` **agent** runs per node and starts that node's processes. To see the
# variables as they really are on a multi-node job, we start two agents on this one machine
# (`--nnodes 2 --node-rank 0|1`, a static rendezvous at a free port) with two processes each.
#
# **Predict.** The process with `RANK=3`: what is its `LOCAL_RANK`? Its node (`GROUP_RANK`)?

# %%
two_nodes = cu.run("workers.ch01_env", world_size=4, nnodes=2, warm=False, gpus_per_node=2, **RUN)
print(ch01.env_table(two_nodes))

# %% [markdown]
# `rank` is unique in the job; `local_rank` restarts at 0 on every node; `world_size` counts every process
# everywhere. Each rank also all-gathered `(rank, node, local_rank)` from every other rank, so all four agree
# on the layout (this is how a job discovers its own topology):

# %%
print("rows: (rank, node, local_rank), as seen by rank 0:\n", two_nodes[0]["everyone"].tolist())
print("every rank sees the same table:",
      all(d["everyone"].tolist() == two_nodes[0]["everyone"].tolist() for d in two_nodes.ranks))

# %% [markdown]
# The variables `torchrun` sets for every process, with their values on rank 3 (node 1):

# %%
rank3 = two_nodes[3]["env"]
rows = []
for name, meaning in ch01.TORCHRUN_ENV:
    value = " / ".join(str(rank3.get(part.strip())) for part in name.split("/"))
    if "MASTER_PORT" in name:
        value = f"{rank3['MASTER_ADDR']} / (a free port, the same on every rank)"
    rows.append([name, value, meaning])
print(Table.of(rows, ["variable", "rank 3", "meaning"]))

# %% [markdown]
# ### Wrong device mapping
# Why `local_rank` and not `rank` for the GPU? Suppose each node has 2 GPUs. Here is what each rank of the
# job above would pick:

# %%
print(ch01.device_table(two_nodes))

# %% [markdown]
# With `cuda:{rank}`, ranks 2 and 3 ask for GPUs 2 and 3 on a node that only has 0 and 1:
# `torch.cuda.set_device` fails with **`CUDA error: invalid device ordinal`**. The quieter variant is worse:
# forgetting `set_device` altogether puts every process of a node on `cuda:0`. NCCL refuses that when it builds
# its communicator:
#
# ```
# torch.distributed.DistBackendError: NCCL error in: .../ProcessGroupNCCL.cpp:..., invalid usage ...
# ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
# Last error:
# Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000
# ```
#
# (the number is the GPU's PCI bus id). The course's reference run on a single H200 met the same refusal
# with two NCCL ranks on one GPU, while gloo on CUDA tensors worked. gloo does not care which device a rank
# uses, which is why this CPU machine cannot show you the GPU error (there is no GPU, and a printed fake
# would teach nothing), and why the course runtime falls back to gloo on CUDA tensors when a machine has
# fewer GPUs than ranks.

# %% [markdown]
# ## 3. Every collective, before and after
#
# A collective is a call that **every rank of the group makes**, with matching shapes, in the same order.
# Each rank below starts with a tensor whose values name their origin: element *j* of rank *r* is
# `10·(r+1) + j`, so the tens digit is the source rank and the units digit the position.
#
# **Predict** (world size 4): after `all_to_all`, what does rank 1 hold? After `reduce_scatter` with `SUM`?
# After `reduce` to rank 0, what is in rank 2's buffer?

# %%
from workers.collectives.reference import BITWISE, COLLECTIVES, OPS, REDUCING

WORLD = 4
collective_runs = {c: cu.run("workers.ch01_collectives", world_size=WORLD, collective=c, **RUN) for c in COLLECTIVES}
print(f"{'collective':15s} equal to the single-process reference (float64, rtol 1e-6)")
for c, res in collective_runs.items():
    if c == "barrier":  # no data moves, so there is nothing to compare; check what a barrier promises instead
        ok, _ = ch01.barrier_check(res)
        print(f"{c:15s} n/a (moves no data); nobody left before the last rank arrived "
              f"(within {ch01.BARRIER_TOL_MS:g} ms): {ok}")
        continue
    ok, err = ch01.compare_with_reference(res, c)
    print(f"{c:15s} {ok}")

# %% [markdown]
# Each line compares what the ranks hold with `workers.collectives.reference`, which computes the same
# thing in one process from the same inputs, without any communication. A barrier has no output to
# compare; its line checks its promise instead, from each rank's own clock: rank *r* arrives *r*·100 ms
# late, and no rank may leave before the last arrival (`ch01.barrier_check`). (On a machine with one GPU and
# several ranks, the runtime uses gloo on CUDA tensors; gloo implements only `all_reduce` and `broadcast` for
# CUDA tensors, so the worker keeps the other collectives on the CPU: see `comm_device` in `workers/runtime.py`.)
# Now look at the data move:

# %% tags=["nbval-ignore-output"]
fig = ch01.collectives_figure(collective_runs)
plots.savefig(fig, "01_collectives_grid");

# %% [markdown]
# How to read it:
# - **broadcast** copies the root's tensor everywhere; **scatter** deals out the root's chunks, one per rank;
#   **gather** and **all_gather** are their mirror images (to one rank, or to all).
# - **all_to_all** is a transpose: chunk *j* of rank *i* goes to rank *j*, position *i* (rank 1 now holds
#   11, 21, 31, 41: element 1 of everybody).
# - **reduce_scatter** = a reduction, then a scatter: each rank ends with one chunk of the sum. Its mirror is
#   **all_gather**, and the two together are an all-reduce. This identity is the ring algorithm you will write
#   in the exercise, and the basis of ZeRO and FSDP (chapter 11).
# - **reduce** leaves the answer on the root only. The hatched rows are *not* the sum: gloo used those
#   buffers as scratch space, and PyTorch documents their content as unspecified. Never read them.
# - **barrier** moves no data: rank *r* arrived *r*·100 ms late, and nobody left before the last one came.
#
# ### Every reduction operator
# `ReduceOp` has `SUM`, `PRODUCT`, `MIN`, `MAX`, `AVG` and the bitwise `BAND`, `BOR`, `BXOR` (plus
# `PREMUL_SUM`, which only NCCL implements). Which does gloo support? Do not trust a table: ask it.

# %%
op_runs = {(op, dtype): cu.run("workers.ch01_collectives", world_size=WORLD, collective="all_reduce", op=op,
                               dtype=dtype, **RUN)
           for dtype in ("float32", "int64") for op in (OPS if dtype == "float32" else BITWISE)}
for (op, dtype), res in op_runs.items():
    if "unsupported" in res[0]:
        print(f"{op:7s} {dtype:8s} refused by {res[0]['backend']}: {res[0]['unsupported']}")
        continue
    ok, err = ch01.compare_with_reference(res, "all_reduce", op=op)
    print(f"{op:7s} {dtype:8s} rank 0 holds {res[0]['after'].tolist()}  reference: {ok} (max rel. error {err:.0e})")

# %% [markdown]
# With this PyTorch, gloo computes `AVG` (added to gloo in 2025, pytorch/pytorch#149781; before that it
# raised "Cannot use ReduceOp.AVG with Gloo"), and refuses bitwise ops on floating point tensors: they are
# defined for integers, and on int64 tensors all three run (the values are whole numbers, so the bit
# patterns are easy to check: 10 = 0b01010 and 20 = 0b10100 share no bit, so `BAND` gives 0).
# `PREMUL_SUM` (scale each rank's tensor, then sum) is NCCL-only and is not run here. `PRODUCT` at world 4 reaches 4·10⁵; at world 8 it reaches 2·10¹³, past float32's
# exact integers (2²⁴ ≈ 1.7·10⁷), hence the relative tolerance. `AVG` deserves suspicion in general: a 2025 bug report
# (pytorch/pytorch#162338) found gloo's `reduce_scatter` silently *summing* when asked to average. Check the
# operators your code relies on the same way, on the version you run:

# %%
for c in ("reduce", "reduce_scatter"):
    for op in ("avg", "min", "product"):
        res = cu.run("workers.ch01_collectives", world_size=WORLD, collective=c, op=op, **RUN)
        print(f"{c:15s}{op:8s} equal to the reference: {ch01.compare_with_reference(res, c, op=op)[0]}")

# %% [markdown]
# ### Explore
# Pick a collective and a world size; the widget reruns it on real ranks and redraws before/after. On warm
# ranks a change answers in about 0.1 s; a new world size starts new ranks first, about 4 s for 4 ranks and 7 s
# for 8 on an idle 2-core machine (`make bench`), longer on a busy one; the status line says which, and the time.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import LiveRun, slider

explorer = LiveRun(
    "workers.ch01_collectives",
    {"collective": W.Dropdown(options=COLLECTIVES, value="all_to_all", description="collective"),
     # float32 tensors: the bitwise ops are refused by gloo (the table above), so the explorer offers the others
     "op": W.Dropdown(options=[op for op in OPS if op not in BITWISE], value="sum", description="op"),
     "world_size": slider("world size", WORLD, 1, 8)},
    ch01.collective_panel, applies={"op": lambda s: s["collective"] in REDUCING}, **RUN)
explorer.wait(60)
explorer

# %% [markdown]
# ## 4. Asynchronous collectives, and timing them honestly
#
# `dist.all_reduce(x, async_op=True)` returns a `Work` handle at once; `work.wait()` is the promise that `x`
# holds the result. In between, the rank may compute anything that does not touch `x`: that is how DDP
# overlaps gradient communication with the backward pass (chapter 2).
#
# **Timing rules**, each one a bug we have seen:
# 1. *Warm up* first: the first collective pays for connection setup.
# 2. *Barrier* before starting the clock, or a rank's time includes waiting for a late peer.
# 3. On GPU, *synchronise* before reading a host clock: a collective on CUDA tensors returns once it is
#    **enqueued** on the GPU, not when it has completed (PyTorch's documentation, "Synchronous and
#    asynchronous collective operations" in `torch.distributed`). A host timer around `dist.all_reduce(x)`
#    then measures the launch, not the transfer. Use `torch.cuda.synchronize()` or CUDA events
#    (`ctx.timer` in this course does the former).
# 4. Repeat, take the median, and report the *slowest* rank: a collective is done when its last rank is.
#
# **Predict.** On this CPU, with 8 MB per rank at world 4: how long does the call with `async_op=True` take
# to return, compared with `wait()`? And does the blocking call's host time (`blocking_host`) differ from the
# synchronised one (`blocking_synced`)? The worker also times 16 products of 256×256 matrices alone
# (`compute`), after an all-reduce (`sequential`), and while the all-reduce is in flight (`overlapped`).

# %% tags=["nbval-ignore-output"]
timing = cu.run("workers.ch01_async", world_size=WORLD, size_mb=8.0, iters=5, matmuls=16, **RUN)
on_cpu = timing[0]["device"] == "cpu"
print(f"{timing[0]['backend']} on {timing[0]['device']}, {timing[0]['bytes'] / 2**20:.0f} MiB per rank, "
      f"medians of {timing[0]['iters']} ({plots.CPU_NOTE if on_cpu else 'measured live on this GPU machine'})")
print(ch01.async_table(timing))
if on_cpu:  # on a GPU the worker does not read x before wait(): .item() would synchronise
    print("reads of x right after launching the async all_reduce that saw the input, not the sum:",
          sum(d["stale_at_launch"] for d in timing.ranks), "of", WORLD * timing[0]["iters"])
print("rank 0's async all_reduce unfinished when the call returned, the other ranks held back until then:",
      timing[0]["pending_at_launch"])

# %% [markdown]
# What this shows, and what it cannot:
# - `async_launch` is normally orders of magnitude shorter than `async_wait`, which holds the whole transfer: the
#   call hands the work to gloo's background thread and returns. Reading `x` before `wait()` saw the *input*,
#   which is exactly the race you must never write.
# - Timings move with the load: on a machine whose cores are all busy, the background thread can finish the whole
#   transfer before the calling thread is scheduled again, and the "launch" then holds it all. The last line does
#   not depend on timing: the worker launched rank 0's async all-reduce while every other rank waited for a
#   message that rank 0 sent only once its call had returned. No sum could exist yet, and `work.is_completed()`
#   said so (`True` printed means "unfinished"). A blocking call could never have returned there.
# - On the CPU, `blocking_host` equals `blocking_synced`: gloo's blocking call returns only when the data has
#   arrived, so there is nothing to synchronise.
# - With NCCL on GPUs we *expect* the two to part: `blocking_host` would measure only the launch and stay
#   roughly flat as the message grows, while `blocking_synced` and `cuda_event` grow with it. That is an
#   expectation from the documented behaviour of rule 3, **not a measurement**: this machine has no GPU,
#   and the course has no committed GPU measurement of this cell. To see it, run this cell where every rank
#   has a GPU of its own (4 GPUs here): the runtime then picks NCCL, and the worker adds the `cuda_event`
#   row. On a single GPU the 4 ranks share it through gloo on CUDA tensors (section 2), which goes through
#   host memory; you get a `cuda_event` row there, but not NCCL's behaviour.
# - `overlapped` vs `sequential`: overlap needs free hardware. Here four ranks, their gloo threads and their
#   matrix products share two CPU cores, so hiding communication behind compute gains little, and can even
#   lose (compare the two rows above). On GPUs, NCCL runs on its own CUDA stream, so its kernels can run
#   alongside compute kernels: that is where overlap is meant to pay (again not measured in this notebook).

# %% [markdown]
# ## 5. Injected faults: breaking a job on purpose
#
# The classic distributed failure is not a crash but a **hang**: one rank never reaches a collective, every
# other rank waits in it forever, and nothing prints. Three kinds of failure in four injected faults (the skipped
# collective twice, caught by two different safety nets), each on its own fresh ranks, with short timeouts so
# that every failure arrives as an exception within seconds. They are independent jobs, so we start them all
# now and read them one by one.

# %%
faults = {
    "skip, gloo timeout": cu.launch("workers.rank_faults", world_size=2, mode="skip_collective", bad_rank=1,
                                    seconds=20, collective_timeout=2.0, timeout=40, warm=False),
    "skip, job timeout": cu.launch("workers.rank_faults", world_size=2, mode="skip_collective", bad_rank=1,
                                   seconds=30, collective_timeout=30.0, timeout=5, warm=False),
    "shape mismatch": cu.launch("workers.rank_faults", world_size=2, mode="shape_mismatch", bad_rank=1,
                                collective_timeout=5.0, timeout=40, warm=False),
    "shape mismatch, DETAIL": cu.launch("workers.rank_faults", world_size=2, mode="shape_mismatch", bad_rank=1,
                                        collective_timeout=5.0, timeout=40, warm=False,
                                        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
}


# %% [markdown]
# **Drill 1: a rank skips a collective.** Rank 1 sleeps instead of joining `all_reduce`; rank 0 waits in it.
# The process group was created with a 2-second timeout (`collective_timeout=2.0` above, which the course
# runtime passes to `init_process_group(timeout=...)`), so gloo itself gives up and rank 0 raises:

# %% tags=["nbval-ignore-output"]
err = ch01.fault_outcome(faults["skip, gloo timeout"])
print(type(err).__name__, "from rank", err.rank)
print(err.summary)
print(ch01.traceback_from(err.rank_traceback, "rank_faults.py"))  # from the worker's own frame down to the error

# %% [markdown]
# Read it bottom-up: the error is a gloo **recv timeout** inside `all_reduce`, called from the line of
# `workers/rank_faults.py` printed first (`dist.all_reduce(x, group=group)`). The question to ask is never "why
# is gloo slow" but "which rank did not call this collective?".
#
# Without `timeout=`, `init_process_group` waits 30 minutes for gloo and 10 for NCCL: that is what makes a
# real job look hung. A second line of defence is the job's own deadline. Here the group timeout is long
# (`collective_timeout=30.0`) but the job gets 5 s (`timeout=5`); at the deadline the launcher asks every
# rank where it is, then stops them all:

# %% tags=["nbval-ignore-output"]
err = ch01.fault_outcome(faults["skip, job timeout"])
print(type(err).__name__)
print(err.summary)
for rank, where in err.stuck.items():
    print(f"  rank {rank}: {where}")

# %% [markdown]
# Rank 0 is "waiting in all_reduce"; rank 1 is in `time.sleep`, on the line that skipped it. On a cluster the
# same information comes from `py-spy dump --pid` on each rank, or from the flight recorder
# with NCCL (on by default in torch 2.13, `TORCH_FR_BUFFER_SIZE` entries; chapter 10 has the settings).
#
# **Drill 2: mismatched shapes.** Rank 0 all-reduces 4 elements, rank 1 five. Both called the same
# collective, in the same order, so no one waits; the *sizes* disagree. What does gloo do?

# %% tags=["nbval-ignore-output"]
err = ch01.fault_outcome(faults["shape mismatch"])
print(type(err).__name__, "-", err.summary.splitlines()[0][:220])
print("what the other rank printed before it died:")
print("\n".join(line for line in err.logs if "what()" in line or "EnforceNotMet" in line))

# %% [markdown]
# One rank's gloo aborted the process (`terminate called after throwing gloo::EnforceNotMet`,
# "Received data size doesn't match expected size. Is there a distributed collective mismatch in your
# code?"), and its peer saw the connection drop. Neither message says *which tensor* of *which line* was
# wrong. With NCCL it can be worse: mismatched sizes may run to completion and return garbage, or hang.
#
# **Drill 3: the same bug with `TORCH_DISTRIBUTED_DEBUG=DETAIL`.** In this mode PyTorch wraps the process
# group, and before every collective the ranks exchange a fingerprint of the call (operation, sequence number,
# shapes, dtypes, devices) over a small helper gloo group and compare them. That is an extra collective per
# collective, so it is for debugging, not production.

# %% tags=["nbval-ignore-output"]
err = ch01.fault_outcome(faults["shape mismatch, DETAIL"])
print(type(err).__name__, "from rank", err.rank)
print(err.summary.split(" (ranks")[0].replace("Rank 1 is running", "\nRank 1 is running").replace(
    "Collectives differ", "\nCollectives differ"))

# %% [markdown]
# Now the message names the operation (`ALLREDUCE`), the sequence number, each rank's shape, and the exact
# difference: "Tensor shapes: 4 vs 5". The same mode also reports collectives called in a different order.

# %% [markdown]
# ## 6. Bandwidth, measured the way `nccl-tests` measures it
#
# For a message of S bytes taking t seconds, NVIDIA's `nccl-tests` (doc/PERFORMANCE.md) reports two numbers:
# - **algbw** = S / t: the speed the *application* sees;
# - **busbw** = algbw × factor: the speed of the *links*, comparable across world sizes. For all-reduce the
#   factor is 2(n−1)/n, because a bandwidth-optimal all-reduce must move each byte 2(n−1)/n times over
#   each rank's link (a reduce-scatter then an all-gather, each (n−1)/n). all_gather, reduce_scatter and
#   all_to_all: (n−1)/n; broadcast and reduce: 1.
#
# The factors come from the course's ledger (`course_utils.ledger.bus_bandwidth_factor`):

# %%
from course_utils.ledger import bus_bandwidth_factor

print(Table.of([[c] + [f"{bus_bandwidth_factor(c, n):.3f}" for n in (2, 4, 8)]
                for c in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")],
               ["collective", "n=2", "n=4", "n=8"]))

# %% [markdown]
# **Predict.** An 8×H200 node with NVLink 4 reaches about 480 GB/s of all-reduce busbw on large messages
# (the published sweep below). What will gloo reach on this machine, through loopback TCP on two shared
# cores: 50 GB/s? 5? 0.5? And at the smallest sizes, how far below its own peak is each?
#
# The sweep: message sizes from 4 KB to 16 MB, world sizes 2 and 4, 2 warm-up then 5 timed calls per size,
# the mean per call, the slowest rank's.

# %% tags=["nbval-ignore-output"]
SIZES = [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
sweeps = {}
for n in (2, 4):
    res = cu.run("workers.ch01_bandwidth", world_size=n, collective="all_reduce", sizes=SIZES, **RUN)
    sweeps[f"CPU, gloo, this machine: all_reduce n={n}"] = ch01.bandwidth_rows(res)
for c in ("all_gather", "reduce_scatter"):
    res = cu.run("workers.ch01_bandwidth", world_size=4, collective=c, sizes=SIZES, **RUN)
    sweeps[f"CPU, gloo, this machine: {c} n=4"] = ch01.bandwidth_rows(res)
rows = [r for rs in sweeps.values() for r in rs]
print(Table.of([{"collective": r["collective"], "n": r["world_size"], "S (bytes)": r["bytes"],
                 "t (ms)": r["seconds"] * 1e3, "algbw (GB/s)": r["algbw"] / 1e9,
                 "busbw (GB/s)": r["busbw"] / 1e9} for r in rows]))

# %% [markdown]
# The published curve: one 8×H200 node, NCCL, from the file's own header (the course keeps a copy in
# `data/reference/`):

# %%
published, header = reference_data.published_allreduce()
print("\n".join(header))
print(f"{len(published)} sizes, {published[0]['bytes']} to {published[-1]['bytes']} bytes; "
      f"busbw at 16 GiB: {published[-1]['busbw'] / 1e9:.0f} GB/s")

# %% [markdown]
# ### The alpha-beta model
# A message costs a fixed latency plus its size over a bandwidth: **t = α + S/B**. α dominates small messages
# (launches, handshakes, synchronisation), B large ones. We fit both by least squares on the *relative*
# error, so that a 4 KB point counts as much as a 16 MB one.

# %% tags=["nbval-ignore-output"]
measured = {label: rows_ for label, rows_ in sweeps.items() if "all_reduce" in label}
fits = {label: ch01.fit_alpha_beta([r["bytes"] for r in rows_], [r["seconds"] for r in rows_])
        for label, rows_ in measured.items()}
fits["published"] = ch01.fit_alpha_beta([r["bytes"] for r in published],
                                        [r["bytes"] / r["algbw"] for r in published])
worlds = {label: rows_[0]["world_size"] for label, rows_ in measured.items()} | {"published": 8}
for label, (alpha, B) in fits.items():
    busbw = B * bus_bandwidth_factor("all_reduce", worlds[label])
    print(f"{label:45s} alpha = {alpha * 1e6:8.1f} us   B = {B / 1e9:8.3f} GB/s (algbw) -> busbw {busbw / 1e9:8.3f} GB/s")
    print(f"{'':45s} half of B is reached at S = alpha * B = {alpha * B / 1e3:,.0f} KB")

# %% tags=["nbval-ignore-output"]
fig = ch01.bandwidth_figure(measured, published, fits,
                            published_label="8xH200 NVLink, NCCL (published: stas00/ml-engineering, CC-BY-SA 4.0)")
plots.savefig(fig, "01_allreduce_bandwidth");

# %% [markdown]
# Three lessons in one figure:
# - **Two to three orders of magnitude** separate loopback TCP on this CPU from NVLink. Every tier of a real
#   cluster has such steps (NVLink inside a node is still about ten times a node's InfiniBand link per GPU),
#   which is why tensor parallelism, which all-reduces activations in every layer, stays inside the NVLink
#   domain (chapter 00).
# - **Small messages are latency-bound everywhere.** Even the H200 node reaches only ~1.4 GB/s at 32 KB: α, not
#   B, sets the time. The product α·B is the message size at which half of B is reached; below it, batching
#   many small tensors into one (DDP's gradient buckets, chapter 2) is the fix.
# - **busbw is what you compare** with the hardware's link speed, whatever n is. algbw falls as n grows even
#   on a perfect network.

# %% [markdown]
# ## 7. Exercises
#
# ### Exercise 1: ring all-reduce from send and receive
# Write `ring_all_reduce(x)`: sum `x` over all ranks using only point-to-point messages (`dist.send`,
# `dist.recv`, `dist.isend`, `dist.irecv`), and return the result (updating `x` in place is fine). `x` is a
# 1-D float tensor whose length is a multiple of the world size. Use the ring algorithm:
# 1. split `x` into n chunks; rank r sends to `(r+1) % n` and receives from `(r-1) % n`;
# 2. **reduce-scatter**, n−1 steps: at step s, send chunk `(r − s) % n`, receive chunk `(r − s − 1) % n` and
#    *add* it to yours. Afterwards rank r owns the complete sum of chunk `(r + 1) % n`;
# 3. **all-gather**, n−1 steps: pass the finished chunks around; each received chunk *replaces* yours.
#
# Every rank sends 2(n−1) chunks of S/n bytes: the 2(n−1)/n·S of the busbw factor. The check runs your
# function on 2 and 4 real ranks, compares with a single-process sum (exactly: the inputs are small
# integers), refuses the ready-made collectives, and counts the bytes each rank sends. Hint: if every rank
# calls a blocking `send` first, who is receiving? (`isend` then `recv` avoids the question.)

# %% tags=["exercise"]
def ring_all_reduce(x):
    import torch
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("ring_all_reduce", ring_all_reduce)

# %% [markdown]
# ### Exercise 2: all_gather from broadcasts
# Write `all_gather_from_broadcast(x)`: return a tensor of shape `[n, *x.shape]` whose row k is rank k's `x`,
# using only `dist.broadcast` (one per rank), and without changing `x`. This is how all_gather is built
# where no native one exists, and it shows why a collective needs a buffer of its own per message.

# %% tags=["exercise"]
def all_gather_from_broadcast(x):
    import torch
    import torch.distributed as dist

    raise NotImplementedError


# %% tags=["check"]
check("all_gather_from_broadcast", all_gather_from_broadcast)

# %% [markdown]
# ### Exercise 3: bus bandwidth
# Write `bus_bandwidth(collective, nbytes, seconds, world_size)` returning nccl-tests' busbw in bytes/s, for
# `collective` in all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, reduce (checked in this
# process against the definitions in `nccl-tests/doc/PERFORMANCE.md`).

# %% tags=["exercise"]
def bus_bandwidth(collective, nbytes, seconds, world_size):
    raise NotImplementedError


# %% tags=["check"]
check("bus_bandwidth", bus_bandwidth)

# %% [markdown]
# ## Summary
# - A job is N processes; `torchrun` names them (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, …); `local_rank` picks
#   the GPU; `init_process_group` makes them meet.
# - Collectives are called by every rank, in the same order, with matching shapes. `all_reduce` =
#   `reduce_scatter` + `all_gather`; `reduce` and `gather` leave other ranks' buffers unspecified.
# - `async_op=True` returns at once; the tensor is yours again only after `wait()`. On GPU, time with a
#   synchronise or CUDA events.
# - A missing rank turns into a timeout if you set one; `TORCH_DISTRIBUTED_DEBUG=DETAIL` names mismatched
#   collectives.
# - busbw = algbw × 2(n−1)/n for all-reduce; t ≈ α + S/B; small messages are latency-bound.
#
# Next, chapter 02: data parallelism, where one all-reduce per step (or per bucket) is the whole algorithm.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
