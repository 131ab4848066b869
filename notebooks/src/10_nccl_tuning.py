# %% [markdown]
# # 10 · NCCL tuning in practice
#
# Chapter 01 measured bandwidth the way NVIDIA's `nccl-tests` does. This chapter is about using those
# numbers on a real cluster: reading an `nccl-tests` table, knowing which `NCCL_*` variables belong in a job
# script and which are for one debugging run, predicting how ring and tree all-reduce scale to 32 and 1024
# nodes, why hash collisions in the fabric cost bandwidth, and the order in which to triage a slow 32-node job.
#
# **Honest labelling.** This machine has no GPU and no fabric. Every multi-node number below is either
# *published* (a real run, with its source) or *modelled* (NCCL's own cost model with its published constants,
# an alpha-beta formula, or a simulation, each with its assumptions stated);
# the only measurement is this machine's CPU ranks talking through gloo, and it is labelled so.

# %%
import matplotlib.pyplot as plt
import numpy as np

import course_utils as cu
from course_utils import collective_models as cm, ecmp, nccl_env, nccl_tests, plots, reference_data, runbook
from course_utils.exercises import check
from course_utils.ledger import bus_bandwidth_factor
from course_utils.tables import Table

plots.style()

# %% [markdown]
# ## 1. What nccl-tests measures: time, algbw, busbw
#
# `all_reduce_perf -b 8 -e 8G -f 2 -g 8` times an all-reduce at every size from 8 bytes to 8 GB, doubling.
# Each row gives the time per call in microseconds, **algbw = S / t**, and **busbw = algbw × factor**
# (NVIDIA/nccl-tests, `doc/PERFORMANCE.md`). The factor converts "bytes of message per second" into "bytes each
# rank moves per second", which can be compared with a link's bandwidth whatever the rank count: a
# bandwidth-optimal all-reduce must move 2(n−1)/n bytes per byte of message through each rank.
# The course's ledger holds the factors:

# %%
print(Table.of([[c] + [f"{bus_bandwidth_factor(c, n):.4f}" for n in (2, 8, 256, 8192)]
                for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")],
               ["collective", "n=2", "n=8", "n=256", "n=8192"]))

# %% [markdown]
# The parser (`course_utils.nccl_tests.parse`) reads the tables nccl-tests prints, column variants included.
# Here is the published 8×H200 sweep from chapter 01, written out in nccl-tests' format and read back:
# the time column is S / algbw, and the parsed busbw must equal algbw × 1.75 (n = 8) to the printed rounding.

# %%
published, header = reference_data.published_allreduce()
pub_rows = [nccl_tests.NcclTestsRow(size_bytes=r["bytes"], count=r["bytes"] // 4, dtype="float", redop="sum", root=None,
                                    out_of_place=nccl_tests.Measurement(r["bytes"] / r["algbw"] * 1e6, r["algbw"] / 1e9,
                                                                        r["busbw"] / 1e9, 0)) for r in published]
table = nccl_tests.format_table(pub_rows, comments=("PUBLISHED: " + header[0], header[1]))
print("\n".join(table.splitlines()[:9] + ["..."] + table.splitlines()[-4:]))
report = nccl_tests.parse(table)
ratio = [m.out_of_place.busbw_GBps / m.out_of_place.algbw_GBps for m in report.rows]
print(f"parsed {len(report.rows)} rows; busbw/algbw from {min(ratio):.3f} to {max(ratio):.3f}, "
      f"ledger factor {bus_bandwidth_factor('all_reduce', 8)}")

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots()
ax.plot([r.size_bytes for r in report.rows], [r.out_of_place.busbw_GBps for r in report.rows], "s-", color="black",
        label="8xH200 NVLink, NCCL (published: stas00/ml-engineering), parsed back")
plots.log2_axis(ax, label="message size S (bytes)")
ax.set_ylabel("busbw (GB/s)")
ax.set_title("published all_reduce busbw, read through course_utils.nccl_tests")
ax.legend(fontsize=8)
plots.savefig(fig, "10_published_busbw");

# %% [markdown]
# ## 2. The course's own benchmark, in nccl-tests' format
#
# `workers/ch01_bandwidth.py` is the course's small nccl-tests. **Predict**: at 16 MB, will the CPU ranks' busbw
# be closer to 0.5 GB/s, 5 GB/s or 50 GB/s? Then measure (4 ranks, gloo, this machine's CPU):

# %% tags=["nbval-ignore-output"]
SIZES = [4096, 65536, 1 << 20, 16 << 20]
res = cu.run("workers.ch01_bandwidth", world_size=4, collective="all_reduce", sizes=SIZES, timeout=60)
gloo_rows = nccl_tests.rows_from_timings("all_reduce", res[0]["bytes"], res[0]["seconds"], n_ranks=4)
print(nccl_tests.format_table(gloo_rows, comments=("CPU/gloo on this machine, 4 ranks: NOT GPU numbers",)))

# %% tags=["nbval-ignore-output"]
fig, ax = plt.subplots()
ax.plot([r.size_bytes for r in gloo_rows], [r.out_of_place.busbw_GBps for r in gloo_rows], "o-",
        label="CPU, gloo, this machine, 4 ranks")
plots.log2_axis(ax, label="message size S (bytes)")
ax.set_yscale("log")
ax.set_ylabel("busbw (GB/s)")
ax.set_title(f"all_reduce busbw: {plots.CPU_NOTE}", fontsize=9)
ax.legend(fontsize=8)
plots.savefig(fig, "10_gloo_busbw");

# %% [markdown]
# The parser reads our own table back, so the same tooling works on a real cluster's logs:

# %% tags=["nbval-ignore-output"]
back = nccl_tests.parse(nccl_tests.format_table(gloo_rows))
print([r.size_bytes for r in back.rows] == SIZES, f"{back.avg_busbw_GBps:.3f} GB/s average busbw")

# %% [markdown]
# ## 3. NCCL_* and TORCH_NCCL_* variables
#
# NCCL's documentation splits its variables in two: **system configuration** (which interfaces and adapters,
# GPUDirect distance: keep them in the job script) and **debugging** ("should not be used in production nor
# retained in scripts"). The course adds **tuning: measure first** (the default is usually right) and
# **deprecated** (PyTorch's old names). Each row cites the page it was checked against
# (`course_utils.nccl_env.VARIABLES[i].source`).

# %%
for kind in nccl_env.KINDS:
    print(f"== {kind}")
    print(Table.of([[v["variable"], v["what it does"]] for v in nccl_env.table_rows(kind)]))

# %% [markdown]
# One PyTorch entry needs its version. The flight recorder (a ring buffer of recent collectives that
# `TORCH_NCCL_DUMP_ON_TIMEOUT=1` writes out after a hang) takes its size from `TORCH_FR_BUFFER_SIZE` in torch 2.13,
# falling back, with a deprecation warning, to the old `TORCH_NCCL_TRACE_BUFFER_SIZE`, and keeps **2000 entries when
# neither is set** (`torch/csrc/distributed/c10d/FlightRecorder.hpp`, lines 110-111 of the installed torch). So the
# dump needs no buffer setting; only an explicit 0 turns the recorder off. Older releases read only the old name and
# defaulted to 0, which is why older advice says to set it.
#
# `validate_env` reads a proposed environment and says what to change. **Predict** which lines of this
# (realistic) script it objects to, then run it:

# %%
for name, value in nccl_env.BAD_ENV.items():
    print(f"export {name}={value}")
print()
for finding in nccl_env.validate_env(nccl_env.BAD_ENV):
    print(finding)

# %% [markdown]
# ### Exercise 1: a production environment
# Write `fix_nccl_env(env)` returning a corrected copy of that environment: keep the system configuration, drop
# what is only for debugging, fix the typo and the deprecated names, and make the flight-recorder dump work (keep
# the dump). The check runs `validate_env` on your answer.

# %% tags=["exercise"]
def fix_nccl_env(env):
    raise NotImplementedError


# %% tags=["check"]
check("fix_nccl_env", fix_nccl_env)

# %% [markdown]
# ## 4. Ring vs tree at 32 and 1024 nodes (NCCL's own model)
#
# A ring all-reduce over N ranks takes 2(N−1) sequential steps, so its latency grows linearly with N; NCCL 2.4
# added double binary trees (NVIDIA developer blog, "Massively Scale Your Deep Learning Training with NCCL 2.4"):
# a reduce up a tree of nodes and a broadcast down, whose latency grows with log2 of the node count. Which one
# NCCL runs is decided, call by call, by a cost model written in its source, `src/graph/tuning.cc`:
# time = latency + S / bandwidth for every algorithm (Ring, Tree, ...) and protocol (LL, LL128, Simple), with
# latencies and bandwidth factors that NVIDIA publishes as constants in that file.
#
# `course_utils.collective_models` re-implements that model for Ring and Tree all-reduce and takes every constant
# from a published `tuning.cc`: **NCCL 2.28.3** (the default; `ncclTunerConstantsDefaults` of `NVIDIA/nccl` tag
# `v2.28.3-1`, whose values were read from the copy `zhanglin496/nccl-2.28.3-1` at commit `850a18f`, because the
# course's source index could not serve the official file at that tag) and **NCCL 2.20.3** (`NVIDIA/nccl` at commit
# `b647562`). What is *not* in NCCL's source is the machine, so `ModelParams` states it as assumptions: 8 GPUs and
# 8 × 400 Gb/s NICs per node, NVLink bus bandwidth 450 GB/s (chapter 01's published sweep), 16 channels, an Intel
# host CPU (NCCL charges 1 µs of network overhead per ring step on Intel, 2 µs on AMD, ×3 for Simple), and a
# balanced tree.

# %%
print(cm.ModelParams())
for c in (cm.NCCL_2_28_3, cm.NCCL_2_20_3):
    print(f"\nNCCL {c.version}: {c.source}")
    print(Table.of(cm.constants_table(c)))

# %% [markdown]
# **Is the re-implementation NCCL's model?** NCCL prints its model's numbers with
# `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`. Here is a table a real NCCL 2.29.7 printed for 2 ranks on 2 "nodes"
# of one GPU each (a public log, `eunomia-bpf/nccl-eBPF`; the tests keep a copy), read by
# `course_utils.nccl_tests.parse_tuning_table`, next to the model with each set of constants:

# %%
from pathlib import Path

log = Path(cm.__file__).resolve().parents[1] / "tests" / "data" / "nccl_2_29_7_tuning_2nodes_1gpu.txt"
printed = nccl_tests.parse_tuning_table(log.read_text())["AllReduce"]
new, old = (cm.tuning_table(2, cm.ModelParams(gpus_per_node=1, nccl=c)) for c in (cm.NCCL_2_28_3, cm.NCCL_2_20_3))
print(Table.of([[col, f"{printed[col][0]:.1f}", f"{new[col][0]:.1f}", f"{old[col][0]:.1f}"] for col in new],
               ["AllReduce", "NCCL 2.29.7 printed (us)", "model, 2.28.3 constants", "model, 2.20.3 constants"]))

# %% [markdown]
# The 2.28.3 constants give all six latencies to the printed 0.1 µs; the 2.20.3 ones do not (their Tree/Simple
# latency is 0 + 2 × 28 µs): the constants moved between releases, so a model's latencies belong to one release
# (the sensitivity table below also prints the crossovers under 2.20.3).
#
# **What this check covers, exactly.** With one GPU on each of 2 nodes, every printed latency is
# baseLat + 2 × hwLat[NET][Tree] (the ring has 2 steps, both across the network, and with one GPU per node NCCL
# charges it the tree's network latency; the tree climbs log2(2) = 1 level). So the log confirms the six base
# latencies and the tree's three network latencies, that rule, and that the socket transport adds no latency of its
# own; its bandwidths confirm two protocol ratios (ring LL = ½ ring Simple, tree LL = tree Simple / 3.8). It does
# **not** exercise the ring's own network latency, any NVLink latency, the per-step network overhead, the ring's
# intra-node steps, the plateau ×1.4, the tree correction, or any absolute bandwidth: at 8 GPUs per node all of those
# rest on reading `tuning.cc` (`tests/test_ch10_models.py` changes each of them and the log's latencies do not move).
# The log even contradicts one assumption for its own box: its tree/ring bandwidths (1.9 against 2.4 GB/s) mean the
# tree's graph had 1.6 to 2.1 times the ring's bandwidth there, where the model gives both the same. No published
# TUNING table from a multi-GPU-per-node run with these constants was found to check the rest.
#
# Now 8 GPUs per node, scaled out. "ring always wins from" is the size from which the ring is faster at every larger
# size; "ring also wins" lists earlier windows where it is faster and then loses again. The last three columns are
# what the model would pick, algorithm/protocol, for a 1 MiB, 64 MiB and 1 GiB all-reduce:

# %%
print(Table.of(cm.scaling_table()))

# %% [markdown]
# The 8-node window is the tree correction at work: NCCL scales the tree's Simple bandwidth by 0.9 from 256 to
# 512 MiB (its table's last entry) and not at all from 512 MiB, so the tree gets faster at 512 MiB and wins back
# the sizes up to 1.22 GiB (at 4 nodes the step from 0.8 to 0.9 at 128 MiB does the same). A single "crossover"
# number hides such reversals; `cm.winner_intervals` lists every one.

# %%
for nodes in (4, 8):
    print(nodes, "nodes:", ", ".join(f"{w} from {cm.human_bytes(s)}" for s, w in cm.winner_intervals(nodes)))

# %% [markdown]
# **Predict** before the figure: at 1024 nodes (8192 GPUs), how many milliseconds does the ring's latency alone
# cost per all-reduce (the table's LL column is its *smallest* latency), and does that matter for a 64 MB
# gradient bucket?

# %% tags=["nbval-ignore-output"]
sizes = np.geomspace(2**10, 2**36, 53)
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, nodes in zip(axes, (32, 1024)):
    for algo in ("ring", "tree"):
        ax.plot(sizes, [cm.busbw(algo, int(s), nodes) / 1e9 for s in sizes], label=f"{algo} (best protocol)")
    cross = cm.crossover_bytes(nodes)
    if cross and cross <= sizes[-1]:
        ax.axvline(cross, color="grey", ls=":", label="crossover")
    plots.log2_axis(ax, label="message size S (bytes)")
    ax.set_title(f"MODELLED (NCCL {cm.ModelParams().nccl.version} constants): {nodes} nodes x 8 GPUs", fontsize=9)
    ax.legend(fontsize=8)
axes[0].set_ylabel("modelled busbw (GB/s)")
plots.savefig(fig, "10_ring_vs_tree_model");

# %% [markdown]
# ### What is still assumed, and how much it matters
#
# The crossover is where the ring's per-byte advantage pays back its extra latency. Both latencies are NCCL's
# published constants; the per-byte advantage comes from the tree's bus bandwidth relative to the ring's, and that
# ratio is where published sources disagree. NCCL's model uses **0.92** (and 0.92 × 0.85 ≈ 0.78 when its topology
# search settles on a plain TREE pattern instead of a balanced one); one published measurement, NVIDIA/nccl issue
# 1368 (5 nodes of 8 H100, 4 × 400 Gb/s RoCE, NCCL 2.20), reports 150 GB/s for the tree against 190 GB/s for the
# ring: **0.79**. The model also **assumes** the tree's graph gets the ring's bandwidth, and leaves out NCCL's 2-node
# special case (there the tree can exceed the NIC limit by putting more traffic on NVLink, NVIDIA/nccl issue 946,
# so the table's 2-node row is the least trustworthy) and the NVLS/NVLSTree algorithms of NVSwitch nodes. The
# crossover against that one ratio, everything else fixed:

# %%
ratios = [0.75, *sorted(cm.TREE_RING_RATIOS.values()), 0.92, 0.96, 0.99]
ratios = sorted(set(round(r, 3) for r in ratios))
rows = cm.crossover_sensitivity(ratios, nodes_list=(32, 1024))
cell = lambda s: "tree up to 1 TiB" if s is None else cm.human_bytes(s)  # noqa: E731
print(Table.of([[r["tree/ring ratio"], cell(r[32]), cell(r[1024])] for r in rows],
               ["tree/ring bandwidth ratio", "crossover, 32 nodes", "crossover, 1024 nodes"]))
for name, ratio in cm.TREE_RING_RATIOS.items():
    print(f"{ratio:.3f}  {name}")
print("\nsame model, NCCL 2.20.3 constants:",
      {n: cm.human_bytes(cm.crossover_bytes(n, cm.ModelParams(nccl=cm.NCCL_2_20_3))) for n in (32, 1024)})

# %% tags=["nbval-ignore-output"]
grid = np.linspace(0.72, 0.99, 28)
fig, ax = plt.subplots()
for nodes in (32, 1024):
    cross = [cm.crossover_bytes(nodes, cm.with_tree_bw_factor(float(f))) for f in grid]
    ax.plot([f for f, c in zip(grid, cross) if c], [c for c in cross if c], "o-", ms=3, label=f"{nodes} nodes")
for (name, ratio), ls in zip(cm.TREE_RING_RATIOS.items(), ("-", "--", ":")):
    ax.axvline(ratio, color="grey", ls=ls, lw=1, label=name.split(":")[0])
plots.log2_axis(ax, axis="y")
ax.set_xlabel("tree/ring bus-bandwidth ratio (the model's one disputed input)")
ax.set_ylabel("crossover: ring always wins from (bytes)")
ax.set_title("MODELLED: sensitivity of the ring/tree crossover", fontsize=9)
ax.legend(fontsize=7)
plots.savefig(fig, "10_crossover_sensitivity");

# %% [markdown]
# ### Exercise 2: the ring's time
# Write `ring_allreduce_time(n, size_bytes, alpha, bandwidth)`: the alpha-beta time of a ring all-reduce on n
# ranks, alpha seconds per step, bandwidth B bytes/s per rank (the model's ring term, and the ledger's).

# %% tags=["exercise"]
def ring_allreduce_time(n, size_bytes, alpha, bandwidth):
    raise NotImplementedError


# %% tags=["check"]
check("ring_allreduce_time", ring_allreduce_time)

# %% [markdown]
# Explore: nodes (as a power of two) and message size; the model prints both times and what NCCL's model would pick.

# %% tags=["nbval-ignore-output"]
import ipywidgets as W

from course_utils.widgets import slider

nodes_exp, size_exp = slider("log2(nodes)", 5, 1, 10), slider("log2(message bytes)", 26, 10, 34)
out = W.Output()


def show_model(change=None):
    nodes, size = 2 ** nodes_exp.value, 2 ** size_exp.value
    out.clear_output()
    with out:
        r, t = cm.allreduce_time("ring", size, nodes), cm.allreduce_time("tree", size, nodes)
        algo, proto = cm.nccl_choice(size, nodes)
        print(f"MODELLED {nodes} nodes, {size} bytes: ring {r * 1e3:.3f} ms, tree {t * 1e3:.3f} ms -> "
              f"{algo}/{proto}")


for w in (nodes_exp, size_exp):
    w.observe(show_model, names="value")
show_model()
W.VBox([nodes_exp, size_exp, out])

# %% [markdown]
# ## 5. ECMP hash collisions and QPs (simulated)
#
# Between leaf and spine switches there are several equal-cost paths; ECMP picks one per flow by hashing its
# header. Hashing is blind to load, so two big flows can share one uplink while another idles, and a collective
# runs at the pace of its slowest flow. This is *balls into bins*: F flows on L links; the fullest link carries
# max_load flows. `NCCL_IB_QPS_PER_CONNECTION=q` splits each connection over q queue pairs (q flows of 1/q of
# the data each), so the loads average out. Exact expectation next to a seeded simulation, 16 connections on
# 16 uplinks (the mean load, flows / links, is then the QP count; efficiency = mean load / busiest link's load):

# %%
rows = ecmp.qp_sweep(pairs=16, links=16)
print(Table.of([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]))

# %% tags=["nbval-ignore-output"]
loads = {q: ecmp.simulate_link_loads(16 * q, 16, trials=4000).max(axis=1) / q for q in (1, 4, 8)}
fig, ax = plt.subplots()
for q, m in loads.items():
    ax.hist(m, bins=np.arange(0.5, 8, 0.25), alpha=0.5, label=f"{q} QP(s) per connection")
ax.set_xlabel("busiest uplink's load, in connections' worth of data (1 = perfect spread)")
ax.set_ylabel("trials")
ax.set_title("SIMULATED: 16 connections hashed onto 16 uplinks", fontsize=9)
ax.legend(fontsize=8)
plots.savefig(fig, "10_ecmp_collisions");

# %% [markdown]
# More QPs help slowly (the spread shrinks like 1/sqrt(q)); fabrics that avoid the lottery altogether use
# adaptive routing or rail-optimised designs. Whether q = 4 is worth it on *your* fabric is a measurement,
# which is why the table calls it "tuning: measure first".
#
# ## 6. PFC and ECN, in words
#
# RDMA over Converged Ethernet assumes a network that does not drop packets, because RoCE's recovery from loss
# is slow. **PFC** (priority flow control, IEEE 802.1Qbb) gets there by back-pressure: when a switch queue for
# one traffic class fills past a threshold, the switch sends the upstream port a **pause frame** for that class,
# and the upstream stops sending it until the pause expires or is lifted. Pauses propagate hop by hop. The cost
# is **head-of-line blocking**: a paused port stops *every* flow of that class, including flows headed to
# uncongested destinations, and in bad cases pause storms spread across the fabric (or deadlock it).
#
# **ECN** (explicit congestion notification) acts earlier and end to end: a switch whose queue is building
# *marks* packets instead of dropping or pausing; the receiver's NIC returns a congestion notification packet
# (CNP) to the sender, and **DCQCN**, the congestion control of RoCE NICs, cuts that sender's rate and then
# recovers it gradually. Well tuned, ECN keeps queues short so that PFC rarely fires and remains a safety net.
# The symptoms in the runbook follow from this: many pauses with few ECN marks mean the thresholds are wrong.
# This notebook shows no PFC/ECN numbers: there is no fabric here to measure and none is modelled.
#
# ## 7. The 32-node triage runbook
#
# Smallest unit first: one node, then pairs, then everyone; read what NCCL chose before changing it; the fabric
# after the nodes; bisection for stragglers. (`course_utils.runbook.RUNBOOK`, as data.)

# %%
print(runbook.render())

# %% [markdown]
# ## Summary
# - busbw = algbw × 2(n−1)/n for all-reduce: compare it with the link, not algbw.
# - Keep system configuration in scripts; remove debug variables (NCCL_DEBUG=INFO, forced NCCL_ALGO/PROTO) after use.
# - Ring latency grows with N, tree latency with log2(nodes): in NCCL's own cost model (its published constants) the
#   tree wins every practical gradient bucket at 1024 nodes; where the ring takes over hangs on the tree/ring
#   bandwidth ratio, which NCCL puts at 0.92 and one published measurement at 0.79.
# - ECMP hashing leaves the busiest uplink with several flows; more QPs even the load, slowly (simulated).
# - Triage from one node outwards; change NCCL settings last, and only after a measurement.

# %% [markdown]
# ### Before you close this chapter
# This chapter's warm ranks are still running, so the widgets above answer at once when you come back to them.
# Closing the tab leaves the kernel running, and the ranks with it: they stop by themselves after 10 idle minutes
# (`COURSE_POOL_IDLE_S`) and when the kernel stops. To free them now, run `cu.shutdown_pools()` in a cell; the
# next chapter starts its own.
