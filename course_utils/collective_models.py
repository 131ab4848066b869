"""Alpha-beta models of ring vs double-binary-tree all-reduce over 2 to 1024 nodes of 8 GPUs. MODELLED, not measured.

Both are ``t = latency + S / bandwidth`` with stated parameters (``ModelParams``); the bandwidth factor of the
ring is ``course_utils.ledger.bus_bandwidth_factor`` and, with one latency for every hop, the ring is exactly
``ledger.collective_time("all_reduce", ...)`` (a test holds the two together).

- Ring over N = nodes x g ranks: 2(N-1) sequential steps (reduce-scatter, then all-gather). Of the N hops of
  the ring, ``nodes`` cross the network and the rest are NVLink, so the latency is
  2(N-1)/N x (nodes x alpha_net + (N - nodes) x alpha_nvlink): linear in N.
- Double binary tree (NCCL 2.4; NVIDIA developer blog, "Massively Scale Your Deep Learning Training with
  NCCL 2.4", and the 2.4.2 release notes: "tree-based algorithms for better All Reduce performance at scale and
  with small and medium size messages"): trees span the nodes, and inside a node the GPUs form a chain
  (NVIDIA/nccl issue 545). A reduce goes up and a broadcast comes down: 2 x (ceil(log2 nodes) x alpha_net +
  (g - 1) x alpha_nvlink): logarithmic in the node count.
- Bandwidth: inter-node, each node's NICs carry the traffic. A ring moves 2(N-1)/N x S through each node's
  network ports, a double binary tree 2 x S (each node is interior in one tree and a leaf in the other), both
  spread over the node's g NICs. ``tree_efficiency`` (< 1) is this model's assumption that the tree reaches
  less of the NIC bandwidth than the ring: NCCL's maintainers note that with 8 NICs per node the tree
  "will struggle to get better performance than ring" (NVIDIA/nccl-tests issue 196). It is not a measured number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from course_utils.ledger import bus_bandwidth_factor, collective_time

GBIT = 1e9 / 8  # bytes per second in one Gb/s


@dataclass(frozen=True)
class ModelParams:
    """The stated, modelled parameters (defaults: an 8 x H200 node, 8 x 400 Gb/s NICs). None is a measurement."""

    gpus_per_node: int = 8
    nic_bandwidth_per_gpu: float = 400 * GBIT  # one 400 Gb/s NIC per GPU: 50e9 bytes/s each way
    nvlink_bus_bandwidth: float = 450e9  # intra-node busbw per GPU (ch01's published sweep tops out near 480 GB/s)
    alpha_nvlink: float = 1.0e-6  # seconds per NVLink hop (assumed)
    alpha_net: float = 5.0e-6  # seconds per network hop: NIC, switches, NIC (assumed)
    tree_efficiency: float = 0.9  # share of the ring's network bandwidth the tree reaches (assumed, see above)

    @property
    def node_network_bandwidth(self) -> float:
        return self.gpus_per_node * self.nic_bandwidth_per_gpu


@dataclass(frozen=True)
class AlphaBeta:
    """t(S) = latency + S / bandwidth: a straight line in S."""

    latency: float
    bandwidth: float  # bytes/s of message, i.e. S / (time minus latency)

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def _ranks(nodes: int, p: ModelParams) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
    return nodes * p.gpus_per_node


def ring_bus_bandwidth(nodes: int, p: ModelParams = ModelParams()) -> float:
    """Per-GPU busbw of the ring: NVLink in one node; beyond, the node's NICs (g x NIC) or NVLink if slower."""
    _ranks(nodes, p)
    return p.nvlink_bus_bandwidth if nodes == 1 else min(p.nvlink_bus_bandwidth, p.node_network_bandwidth)


def ring_allreduce(nodes: int, p: ModelParams = ModelParams()) -> AlphaBeta:
    n = _ranks(nodes, p)
    if n == 1:
        return AlphaBeta(0.0, math.inf)
    hops_per_lap = nodes * p.alpha_net + (n - nodes) * p.alpha_nvlink if nodes > 1 else n * p.alpha_nvlink
    latency = 2 * (n - 1) / n * hops_per_lap
    return AlphaBeta(latency, ring_bus_bandwidth(nodes, p) / bus_bandwidth_factor("all_reduce", n))


def tree_allreduce(nodes: int, p: ModelParams = ModelParams()) -> AlphaBeta:
    """Double binary tree between nodes, chain inside each node; one node is a plain chain (reduce + broadcast)."""
    _ranks(nodes, p)
    depth = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    latency = 2 * (depth * p.alpha_net + (p.gpus_per_node - 1) * p.alpha_nvlink)
    if nodes == 1:
        return AlphaBeta(latency, p.nvlink_bus_bandwidth / 2)
    # 2 S through the node's network ports (up, then down), at tree_efficiency of what the ring gets
    bandwidth = p.tree_efficiency * min(p.nvlink_bus_bandwidth, p.node_network_bandwidth) / 2
    return AlphaBeta(latency, bandwidth)


def allreduce_time(algorithm: str, nbytes: float, nodes: int, p: ModelParams = ModelParams()) -> float:
    model = {"ring": ring_allreduce, "tree": tree_allreduce}.get(algorithm)
    if model is None:
        raise ValueError(f"algorithm={algorithm!r}: choose 'ring' or 'tree'")
    return model(nodes, p).time(nbytes)


def ring_time_uniform(nbytes: float, n_ranks: int, bandwidth: float, alpha: float) -> float:
    """The ring with one latency per hop: ``ledger.collective_time``, the course's formula since chapter 01."""
    return collective_time("all_reduce", nbytes, n_ranks, bandwidth, alpha)


def crossover_bytes(nodes: int, p: ModelParams = ModelParams()) -> float | None:
    """The size above which the ring beats the tree (tree faster below); None if one wins at every size."""
    ring, tree = ring_allreduce(nodes, p), tree_allreduce(nodes, p)
    d_latency = ring.latency - tree.latency  # > 0: the tree starts ahead
    d_per_byte = 1 / tree.bandwidth - 1 / ring.bandwidth  # > 0: the ring gains on it per byte
    if d_latency <= 0 or d_per_byte <= 0:
        return None
    return d_latency / d_per_byte


def winner(nbytes: float, nodes: int, p: ModelParams = ModelParams()) -> str:
    return "ring" if allreduce_time("ring", nbytes, nodes, p) < allreduce_time("tree", nbytes, nodes, p) else "tree"


def busbw(algorithm: str, nbytes: float, nodes: int, p: ModelParams = ModelParams()) -> float:
    """What nccl-tests would print as busbw for this model (bytes/s): S / t x 2(N-1)/N."""
    n = _ranks(nodes, p)
    return nbytes / allreduce_time(algorithm, nbytes, nodes, p) * bus_bandwidth_factor("all_reduce", n)


def scaling_table(nodes_list=(2, 8, 32, 128, 1024), sizes=(1 << 20, 64 << 20, 1 << 30), p: ModelParams = ModelParams()):
    """Rows for the notebook: latency terms, crossover and the faster algorithm per size."""
    rows = []
    for nodes in nodes_list:
        cross = crossover_bytes(nodes, p)
        row = {"nodes": nodes, "GPUs": nodes * p.gpus_per_node,
               "ring latency (us)": round(ring_allreduce(nodes, p).latency * 1e6, 1),
               "tree latency (us)": round(tree_allreduce(nodes, p).latency * 1e6, 1),
               "ring wins above": "never" if cross is None else _human(cross)}
        row.update({f"{_human(s)}": winner(s, nodes, p) for s in sizes})
        rows.append(row)
    return rows


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
