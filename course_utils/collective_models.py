"""Ring vs double-binary-tree all-reduce over 1 to 1024 nodes of 8 GPUs: NCCL's own cost model. MODELLED, not measured.

NCCL picks an algorithm (Ring, Tree, ...) and a protocol (LL, LL128, Simple) for every call by evaluating a cost
model, ``time = latency + S / bandwidth``, whose constants are written in its source, ``src/graph/tuning.cc``
(``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``). This module re-implements that model for all-reduce with
Ring and Tree, and takes every constant from a published version of that file (``NCCL_2_28_3``, the default, and
``NCCL_2_20_3``; each says where it was read). The formulas, with N ranks on ``nodes`` nodes of g = N / nodes:

- Ring: 2(N-1) steps, of which ``2 (nodes - 1)`` cross the network (``2 nodes`` in 2.20.3):
  ``lat = baseLat + (steps - inter) x max(hwLat[intra], netOverhead) + inter x hwLat[NET]``; its bus bandwidth
  is the graph's, converted to algorithm bandwidth by N / 2(N-1) (nccl-tests' busbw factor, PERFORMANCE.md).
- Tree (NCCL 2.4's double binary tree between nodes, a chain inside each node; nccl issue 545):
  ``lat = baseLat + 2 ((g - 1) hwLat[intra] + log2(nodes) hwLat[NET])``; its bandwidth is 0.92 of the graph's
  (capped per channel) and half of that is algorithm bandwidth: a reduce up then a broadcast down move 2 S.
- ``ncclTopoGetAlgoTime`` then scales the tree's bandwidth by ``treeCorrectionFactor[size]`` (0.5 to 1.0 between
  64 B and 256 MB: "trees are not perfectly sticking to the model for medium sizes") and the ring's Simple latency
  by 1.4 once each channel carries 64 B per rank ("plateau effect of ring").

What a real NCCL printout confirms, and what rests on reading the source: the one public
``NCCL_DEBUG_SUBSYS=TUNING`` table the tests hold (NCCL 2.29.7, 2 nodes of 1 GPU, socket transport) checks six
latency sums, baseLat[algo][proto] + 2 x hwLat[NET][Tree][proto] for both algorithms (with one GPU per node the
ring pays the tree's network latency, and both of its 2 steps cross the network; log2i(2) = 1), that the socket
transport adds no graph latency, and two bandwidth ratios (ring LL = ring Simple / 2, tree LL = tree Simple / 3.8).
It exercises none of the ring's own hwLat[NET], any NVLink hwLat (g - 1 = 0), the network-overhead floor or the
intra-node step count of the ring (it has no intra-node steps), the plateau x1.4 and the tree correction (applied
per call, never printed), nor any absolute bandwidth, per-channel cap or LL128 factor: for 8 GPUs per node those
rest on the source alone (``tests/test_ch10_models.py`` changes those latency terms, the plateau, the tree
correction and the tree's bandwidth factor, and that table's latencies do not move).
Its bandwidths also show the tree's graph getting about 1.6 to 2.1 times the ring's on that 2-node box, where this
module assumes the two equal.

What is *not* published, and so is a stated assumption (``ModelParams``): the hardware (8 GPUs and 8 x 400 Gb/s
NICs per node, NVLink bus bandwidth 450 GB/s from chapter 01's published sweep), the channel count (16), an
Intel host CPU (NCCL's per-step network overhead is 1 us on Intel, 2 us on AMD), that NCCL's topology search gives
the tree graph the same bandwidth as the ring's (the ring's is min(NVLink, g x NIC)) and a balanced tree (on Hopper
the search may fall back to a plain TREE pattern, which NCCL's model charges another x0.85), and that only Ring and Tree
compete (H100/H200 nodes with NVSwitch also have NVLS/NVLSTree, and NCCL's 2-node tree uses intra-node bandwidth
and can exceed the NIC limit, nccl issue 946: neither is modelled here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from course_utils.ledger import bus_bandwidth_factor

GBIT = 1e9 / 8  # bytes per second in one Gb/s
ALGORITHMS = ("tree", "ring")
PROTOCOLS = ("LL", "LL128", "Simple")
MAX_BYTES = 1 << 40  # sizes the crossover search looks at: 64 B to 1 TiB


def _table(rows: dict[str, tuple[float, float, float]]) -> dict[tuple[str, str], float]:
    return {(key, proto): v for key, vals in rows.items() for proto, v in zip(PROTOCOLS, vals)}


# treeCorrectionFactor[protocol][log2(S / 64 B)], identical in 2.20.3 and 2.28.3: powers of two, 64 B to 256 MB
_TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}


@dataclass(frozen=True)
class NcclConstants:
    """The published constants of ``src/graph/tuning.cc`` (us and GB/s) for Ring/Tree all-reduce on Hopper."""

    version: str
    source: str = field(repr=False)
    base_lat: dict = field(repr=False)  # baseLat[(algorithm, protocol)], us
    hw_lat: dict = field(repr=False)  # hwLat[(nvlink|net, algorithm, protocol)], us per step
    ring_inter_steps_per_node_pair: bool = field(repr=False)  # 2.28.3: 2(nodes-1) network steps; 2.20.3: 2 nodes
    ppn1_uses_tree_net_latency: bool = field(repr=False)  # 2.28.3: with 1 GPU per node the ring pays Tree's NET lat
    ring_ll_factor: float = field(repr=False)  # LL's share of the ring's bandwidth (2.20.3: 1/4, 2.28.3: 1/2)
    ll_max_bw: dict = field(repr=False)  # llMaxBws rows (N1, N2, N4): "hopper" (one node), "intel"/"amd" host CPU
    tree_bw_factor: float = 0.92  # the tree's bus bandwidth is 0.92 of the graph's, in both versions
    simple_tree_pattern_factor: float = field(default=0.85, repr=False)  # x0.85 more if the search fell back to TREE
    per_channel_max_tree_bw: tuple = field(default=(38.7, 41.4, 36.0), repr=False)  # Hopper, N1/N2/N4
    per_channel_max_ring_ll128_bw: tuple = field(default=(36.7, 36.7, 36.7), repr=False)
    per_channel_max_tree_ll128_bw: tuple = field(default=(36.7, 36.7, 29.0), repr=False)
    ll128_factor: float = field(default=0.92, repr=False)  # "120.0/128.0" in a comment; 0.92 in the code
    ring_ll128_factor_ppn1: float = field(default=0.92, repr=False)  # 2.20.3: 0.7 with one GPU per node
    tree_ll128_factor_multinode: float = field(default=120.0 / 128.0, repr=False)
    tree_ll_factor: float = field(default=1.0 / 3.8, repr=False)
    net_overhead_us: dict = field(default_factory=lambda: {"intel": 1.0, "amd": 2.0}, repr=False)  # x3 for Simple
    ring_plateau: float = field(default=1.4, repr=False)  # compute capability >= 80 (1.9 before Ampere)
    tree_correction: dict = field(default_factory=lambda: dict(_TREE_CORRECTION), repr=False)


NCCL_2_20_3 = NcclConstants(
    version="2.20.3-1",
    source="NVIDIA/nccl src/graph/tuning.cc at commit b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2 (makefiles/version.mk "
           "2.20.3, PKG_REVISION 1)",
    base_lat=_table({"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}),
    hw_lat={**{("nvlink",) + k: v for k, v in _table({"tree": (.6, 1.25, 28), "ring": (.6, 1.9, 3.4)}).items()},
            **{("net",) + k: v for k, v in _table({"tree": (5.0, 8.5, 28), "ring": (2.7, 4.0, 14.0)}).items()}},
    ring_inter_steps_per_node_pair=False, ppn1_uses_tree_net_latency=False, ring_ll_factor=1.0 / 4.0,
    ring_ll128_factor_ppn1=0.7,
    ll_max_bw={"hopper": (87.7, 22.5, 19.0), "intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0)},
)
NCCL_2_28_3 = NcclConstants(
    version="2.28.3-1",
    source="NVIDIA/nccl tag v2.28.3-1, src/graph/tuning.cc (ncclTunerConstantsDefaults). Read from the copy "
           "zhanglin496/nccl-2.28.3-1 at commit 850a18f5a2d15a77525bb671b12ee03bc1d4b951 (that release with Chinese "
           "comments added): the course's source index holds NVIDIA/nccl's tuning.cc but could not serve it at that "
           "tag, so the official file was not compared line by line. Its latencies reproduce the TUNING table NCCL "
           "2.29.7 printed in eunomia-bpf/nccl-eBPF docs/tmp/default-suboptimal-search.md",
    base_lat=_table({"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}),
    hw_lat={**{("nvlink",) + k: v for k, v in _table({"tree": (.6, 1.25, 4.0), "ring": (.6, 1.9, 3.4)}).items()},
            **{("net",) + k: v for k, v in _table({"tree": (5.0, 8.5, 14), "ring": (2.7, 4.0, 14.0)}).items()}},
    ring_inter_steps_per_node_pair=True, ppn1_uses_tree_net_latency=True, ring_ll_factor=0.5,
    ll_max_bw={"hopper": (141.0, 45.0, 35.0), "intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0)},
)


@dataclass(frozen=True)
class ModelParams:
    """What the model assumes about the machine (defaults: 8 x H200 nodes, 8 x 400 Gb/s NICs) and which NCCL."""

    gpus_per_node: int = 8
    nic_bandwidth_per_gpu: float = 400 * GBIT  # one 400 Gb/s NIC per GPU: 50e9 bytes/s each way
    nvlink_bus_bandwidth: float = 450e9  # intra-node busbw per GPU (ch01's published sweep tops out near 480 GB/s)
    channels: int = 16  # NCCL channels (assumed; only the per-channel caps use it)
    cpu: str = "intel"  # host CPU vendor: NCCL's network overhead per ring step (assumed)
    simple_tree_pattern: bool = False  # True: NCCL's search settled on the plain TREE pattern, not BALANCED_TREE
    nccl: NcclConstants = NCCL_2_28_3

    @property
    def node_network_bandwidth(self) -> float:
        return self.gpus_per_node * self.nic_bandwidth_per_gpu


def _ranks(nodes: int, p: ModelParams) -> int:
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
    if p.cpu not in p.nccl.net_overhead_us:
        raise ValueError(f"cpu={p.cpu!r}: choose one of {sorted(p.nccl.net_overhead_us)}")
    return nodes * p.gpus_per_node


def _check(algorithm: str, protocol: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: choose 'ring' or 'tree'")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}: choose one of {PROTOCOLS}")


def graph_bus_bandwidth(nodes: int, p: ModelParams = ModelParams()) -> float:
    """Per-GPU bus bandwidth of the topology graph (bytes/s): NVLink in one node; beyond, the node's NICs if slower."""
    _ranks(nodes, p)
    return p.nvlink_bus_bandwidth if nodes == 1 else min(p.nvlink_bus_bandwidth, p.node_network_bandwidth)


def latency_us(algorithm: str, protocol: str, nodes: int, p: ModelParams = ModelParams()) -> float:
    """NCCL's all-reduce latency for one algorithm and protocol, in microseconds (ncclTopoTuneModel)."""
    _check(algorithm, protocol)
    n, c, g = _ranks(nodes, p), p.nccl, p.gpus_per_node
    if n == 1:
        return 0.0
    lat = c.base_lat[(algorithm, protocol)]
    # hwLat[NET] + graph->latencyInter (twice for Simple): the IB and socket transports report latency 0, "Not set"
    # (src/transport/net_ib.cc, net_socket.cc), so the graph adds nothing to the published constants
    intra = c.hw_lat[("nvlink", algorithm, protocol)]
    inter = c.hw_lat[("net", "tree" if c.ppn1_uses_tree_net_latency and g == 1 else algorithm, protocol)]
    if algorithm == "tree":
        return lat + 2 * ((g - 1) * intra + (nodes.bit_length() - 1) * inter)  # log2i(nNodes): floor
    steps = 2 * (n - 1)
    inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if c.ring_inter_steps_per_node_pair else 2 * nodes
    if nodes > 1:  # inter-node rings still launch every step through the network proxy
        intra = max(intra, c.net_overhead_us[p.cpu] * (3 if protocol == "Simple" else 1))
    return lat + (steps - inter_steps) * intra + inter_steps * inter


def algbw_GBps(algorithm: str, protocol: str, nodes: int, p: ModelParams = ModelParams()) -> float:
    """NCCL's algorithm bandwidth (GB/s, S / (t - latency)) before the size-dependent tree correction."""
    _check(algorithm, protocol)
    n, c, ch = _ranks(nodes, p), p.nccl, p.channels
    if n == 1:
        return math.inf
    col = nodes - 1 if nodes <= 2 else 2  # NCCL's N1 / N2 / N4 columns
    ll_max = c.ll_max_bw["hopper" if nodes == 1 else p.cpu][col]
    bus = graph_bus_bandwidth(nodes, p) / 1e9
    if algorithm == "ring":
        if protocol == "LL":
            bus = min(ll_max, bus * c.ring_ll_factor)
        elif protocol == "LL128":
            factor = c.ring_ll128_factor_ppn1 if p.gpus_per_node == 1 else c.ll128_factor
            bus = min(bus * factor, ch * c.per_channel_max_ring_ll128_bw[col])
        return bus * n / (2 * (n - 1))
    bus = min(bus * c.tree_bw_factor, ch * c.per_channel_max_tree_bw[col])
    if protocol == "LL":
        bus = min(bus * c.tree_ll_factor, ll_max)
    elif protocol == "LL128":
        bus = min(bus * (7.0 / 9.0 if nodes == 1 else c.tree_ll128_factor_multinode),
                  ch * c.per_channel_max_tree_ll128_bw[col])
    if p.simple_tree_pattern:
        bus *= c.simple_tree_pattern_factor
    return bus * 0.5


def time_us(algorithm: str, protocol: str, nbytes: int, nodes: int, p: ModelParams = ModelParams()) -> float:
    """ncclTopoGetAlgoTime for one all-reduce of ``nbytes``: latency + S / bandwidth, both size-corrected."""
    n = _ranks(nodes, p)
    nbytes = int(nbytes)
    if n == 1:
        return 0.0
    lat, bw = latency_us(algorithm, protocol, nodes, p), algbw_GBps(algorithm, protocol, nodes, p)
    log_size = (nbytes >> 6).bit_length() - 1  # log2i(nBytes >> 6); -1 below 64 B: no correction
    table = p.nccl.tree_correction[protocol]
    if algorithm == "tree" and 0 <= log_size < len(table):
        bw *= table[log_size]
    if algorithm == "ring" and protocol == "Simple" and nodes > 1 and nbytes // (p.channels * n) >= 64:
        lat *= p.nccl.ring_plateau
    return lat + nbytes / (1000 * bw)


def best_protocol(algorithm: str, nbytes: int, nodes: int, p: ModelParams = ModelParams()) -> str:
    return min(PROTOCOLS, key=lambda proto: time_us(algorithm, proto, nbytes, nodes, p))


def allreduce_time(algorithm: str, nbytes: int, nodes: int, p: ModelParams = ModelParams(),
                   protocol: str | None = None) -> float:
    """Seconds for one all-reduce; ``protocol=None`` takes the protocol NCCL's model would pick for the algorithm."""
    if protocol is None:
        _check(algorithm, "Simple")
        protocol = best_protocol(algorithm, nbytes, nodes, p)
    return time_us(algorithm, protocol, nbytes, nodes, p) * 1e-6


def nccl_choice(nbytes: int, nodes: int, p: ModelParams = ModelParams()) -> tuple[str, str]:
    """The (algorithm, protocol) with the smallest modelled time, as NCCL's tuner picks among Ring and Tree."""
    return min(((a, q) for a in ALGORITHMS for q in PROTOCOLS), key=lambda aq: time_us(*aq, nbytes, nodes, p))


def winner(nbytes: int, nodes: int, p: ModelParams = ModelParams()) -> str:
    return "ring" if allreduce_time("ring", nbytes, nodes, p) < allreduce_time("tree", nbytes, nodes, p) else "tree"


def winner_intervals(nodes: int, p: ModelParams = ModelParams()) -> list[tuple[int, str]]:
    """Which algorithm is faster at every size from 64 B to ``MAX_BYTES``: ``[(first byte, winner), ...]``.

    Each entry holds from its size up to the next entry's. Between the model's breakpoints (the powers of two,
    where the tree correction steps, and 64 B per channel and rank, where the ring's plateau factor starts) every
    algorithm/protocol time is linear in S, so the winner can only change at a breakpoint or where a ring line
    crosses a tree line: those candidates are evaluated and each change is bisected to the byte. The list can
    alternate more than once (at 8 nodes the ring wins a window below 512 MiB, loses it when the tree's
    correction ends, and wins for good above 1 GiB).
    """
    n = _ranks(nodes, p)
    breaks = sorted({1 << k for k in range(6, MAX_BYTES.bit_length())} | {64 * p.channels * n})
    candidates = set(breaks)
    for lo, hi in zip(breaks, breaks[1:]):
        if hi - lo < 2:
            continue
        lines = {}
        for a in ALGORITHMS:
            for q in PROTOCOLS:
                t0, t1 = time_us(a, q, lo, nodes, p), time_us(a, q, hi - 1, nodes, p)
                slope = (t1 - t0) / (hi - 1 - lo)
                lines[a, q] = (t0 - slope * lo, slope)
        for (r0, r1) in (lines["ring", q] for q in PROTOCOLS):
            for (c0, c1) in (lines["tree", q] for q in PROTOCOLS):
                if r1 != c1 and lo < (x := (c0 - r0) / (r1 - c1)) < hi:
                    candidates.update((math.floor(x), math.floor(x) + 1))
    points = sorted(c for c in candidates if 64 <= c <= MAX_BYTES)
    intervals = [(points[0], winner(points[0], nodes, p))]
    prev = points[0]
    for point in points[1:]:
        w = winner(point, nodes, p)
        if w != intervals[-1][1]:
            lo, hi = prev, point  # the old winner at lo, the new one at hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if winner(mid, nodes, p) != w else (lo, mid)
            intervals.append((hi, w))
        prev = point
    return intervals


def crossover_bytes(nodes: int, p: ModelParams = ModelParams()) -> int | None:
    """The smallest size from which the ring (best protocol) beats the tree at every size up to ``MAX_BYTES``.

    64 if the ring wins from 64 B on; None if the tree wins at ``MAX_BYTES``. Earlier windows where the ring
    wins and then loses again are in ``winner_intervals``.
    """
    start, last = winner_intervals(nodes, p)[-1]
    return start if last == "ring" else None


def ring_windows(nodes: int, p: ModelParams = ModelParams()) -> list[tuple[int, int]]:
    """The ranges [first byte, end) where the ring wins and then loses again, below ``crossover_bytes``."""
    iv = winner_intervals(nodes, p)
    return [(start, end) for (start, w), (end, _) in zip(iv, iv[1:]) if w == "ring"]


def busbw(algorithm: str, nbytes: int, nodes: int, p: ModelParams = ModelParams()) -> float:
    """What nccl-tests would print as busbw for this model (bytes/s): S / t x 2(N-1)/N."""
    n = _ranks(nodes, p)
    return nbytes / allreduce_time(algorithm, nbytes, nodes, p) * bus_bandwidth_factor("all_reduce", n)


def tuning_table(nodes: int, p: ModelParams = ModelParams()) -> dict[str, tuple[float, float]]:
    """The AllReduce row NCCL prints with NCCL_DEBUG_SUBSYS=TUNING: (latency us, algbw GB/s) per Algo/Proto."""
    return {f"{a.capitalize()}/{q}": (latency_us(a, q, nodes, p), algbw_GBps(a, q, nodes, p))
            for a in ALGORITHMS for q in PROTOCOLS}


def constants_table(c: NcclConstants = NCCL_2_28_3) -> list[dict]:
    """The published latency constants of one NCCL version, one row per algorithm/protocol (us)."""
    return [{"algo/proto": f"{a}/{q}", "baseLat (us)": f"{c.base_lat[(a, q)]:g}",
             "hwLat NVLink (us/step)": f"{c.hw_lat[('nvlink', a, q)]:g}",
             "hwLat NET (us/step)": f"{c.hw_lat[('net', a, q)]:g}"} for a in ALGORITHMS for q in PROTOCOLS]


def with_tree_bw_factor(factor: float, p: ModelParams = ModelParams()) -> ModelParams:
    """The same model with another tree/ring bandwidth ratio (NCCL's is 0.92): for sensitivity studies."""
    if not 0 < factor <= 2:
        raise ValueError(f"factor={factor!r}: a tree/ring bandwidth ratio between 0 and 2")
    return replace(p, nccl=replace(p.nccl, tree_bw_factor=factor))


# The tree/ring large-message bus-bandwidth ratio: NCCL's model (this file's constants) and one published measurement
TREE_RING_RATIOS = {
    "NCCL model, balanced tree (0.92)": 0.92,
    "NCCL model, plain TREE pattern (0.92 x 0.85)": 0.92 * 0.85,
    "measured, NVIDIA/nccl#1368: 150 / 190 GB/s (5 x 8 H100, 4 x 400G RoCE, NCCL 2.20)": 150 / 190,
}


def crossover_sensitivity(factors, nodes_list=(32, 1024), p: ModelParams = ModelParams()) -> list[dict]:
    """The crossover (bytes, None = tree up to MAX_BYTES) for each tree/ring bandwidth ratio and node count."""
    return [{"tree/ring ratio": f, **{nodes: crossover_bytes(nodes, with_tree_bw_factor(f, p)) for nodes in nodes_list}}
            for f in factors]


def scaling_table(nodes_list=(2, 8, 32, 128, 1024), sizes=(1 << 20, 64 << 20, 1 << 30), p: ModelParams = ModelParams()):
    """Rows for the notebook: each algorithm's smallest latency, where the ring wins, and NCCL's pick per size.

    "ring always wins from" is ``crossover_bytes``; "ring also wins" lists the earlier windows where the ring
    wins and the tree takes over again (``ring_windows``), so that the first column hides no reversal.
    """
    rows = []
    for nodes in nodes_list:
        cross = crossover_bytes(nodes, p)
        windows = ring_windows(nodes, p)
        row = {"nodes": nodes, "GPUs": nodes * p.gpus_per_node,
               "ring LL latency (us)": f"{latency_us('ring', 'LL', nodes, p):.1f}",
               "tree LL latency (us)": f"{latency_us('tree', 'LL', nodes, p):.1f}",
               "ring always wins from": "never" if cross is None else "all sizes" if cross <= 64 else human_bytes(cross),
               "ring also wins": ", ".join(f"{human_bytes(a)} to {human_bytes(b)}" for a, b in windows) or "-"}
        row.update({human_bytes(s): "/".join(nccl_choice(s, nodes, p)) for s in sizes})
        rows.append(row)
    return rows


def human_bytes(nbytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
