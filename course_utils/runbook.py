"""The 32-node triage runbook, as data: ordered steps from "the job is slow" to the rank or link at fault.

Each step has a symptom that sends you there, the command or check, what good looks like, and where to go
next. The order is the principle: measure the smallest unit first (one node), then pairs, then everyone, so a
bad node or link is found before the whole fabric is blamed; change NCCL settings last, and only after a
measurement says why. Commands are nccl-tests' (github.com/NVIDIA/nccl-tests), NCCL's logging
(NCCL_DEBUG=INFO), and the standard RDMA/Linux tools; counters' names differ by NIC vendor and driver.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    title: str
    symptom: str
    check: str
    good: str
    next_step: str


RUNBOOK = [
    Step("Each node alone",
         "training step time is worse than planned, or varies from step to step",
         "on every node: all_reduce_perf -b 8 -e 8G -f 2 -g 8 (one process per node, 8 GPUs)",
         "large-size busbw close to the node's published NVLink figure on every node, and #wrong 0",
         "a node far below the others: take it out (GPU, NVLink, NVSwitch, clocks) and re-test; all good: go to pairs"),
    Step("Nodes in pairs",
         "every node is good alone, but the job is slow",
         "all_reduce_perf between pairs of nodes (16 ranks), NCCL_ALGO=Ring to measure the network and not the tree",
         "every pair within a few percent of the others, busbw near the NICs' line rate x 8 per node",
         "one pair slow: the shared node or its links are suspects, pair it with a known-good node; all alike: go to all"),
    Step("All nodes",
         "pairs are fine, 32 nodes together are slow",
         "all_reduce_perf on all 32 nodes (256 ranks); compare with the pair numbers and the model's scaling",
         "busbw close to the pairs' (bandwidth should not fall much with node count for large messages)",
         "a large drop only at scale: read what NCCL chose (next step), then the fabric (ECMP, congestion)"),
    Step("What NCCL chose",
         "numbers differ from expectations, or from another cluster",
         "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,GRAPH,TUNING and read the log of rank 0",
         "NET/IB on the right adapters (not NET/Socket), GDRDMA in the transport lines, the expected number of "
         "channels, Ring/Tree as the tuner would pick",
         "a socket transport or missing GDR: fix NCCL_IB_HCA / NCCL_SOCKET_IFNAME / drivers; then unset the debug variables"),
    Step("NICs and links",
         "one node or pair is slow, or the log shows fewer adapters than installed",
         "ibstat / ibv_devinfo (state Active, expected rate), ib_write_bw between the two nodes per NIC, "
         "and the port error counters (symbol errors, link downed)",
         "every port Active at full rate, ib_write_bw near line rate, error counters not increasing",
         "a degraded or flapping port: reseat or replace the cable/transceiver, re-test the pair"),
    Step("ECMP and QPs",
         "all links are healthy but busbw at scale is well below the pairs' and varies run to run",
         "switch uplink utilisation during the test (uneven?), then all_reduce_perf with NCCL_IB_QPS_PER_CONNECTION=2 or 4",
         "uplinks evenly loaded; more QPs change little",
         "uneven uplinks that more QPs even out: hash collisions; keep the QP setting only if the measurement says so"),
    Step("Congestion: PFC and ECN",
         "throughput collapses under load, or tail latency spikes, on a RoCE fabric",
         "pause-frame (PFC) counters on NICs and switch ports, ECN-marked / CNP counters, per priority (ethtool -S, switch CLI)",
         "PFC pauses rare and short; ECN marks present under load and CNPs answering them (DCQCN working)",
         "storms of pauses with few ECN marks: the ECN/DCQCN thresholds or the lossless class are misconfigured; fix the fabric, not NCCL"),
    Step("Stragglers by bisection",
         "the fabric is clean, yet some runs are slow",
         "split the nodes into halves and run all_reduce_perf on each half; keep halving the slow half",
         "both halves equally fast: the cause is global (fabric, scheduler), not one node",
         "a slow half: recurse until one node (or link) remains, log(32) = 5 rounds; drain it and re-run step 1 on it"),
]


def render(steps: list[Step] = RUNBOOK) -> str:
    lines = []
    for i, s in enumerate(steps, 1):
        lines += [f"{i}. {s.title}", f"   symptom: {s.symptom}", f"   check:   {s.check}",
                  f"   good:    {s.good}", f"   next:    {s.next_step}", ""]
    return "\n".join(lines).rstrip()
