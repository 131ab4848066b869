"""Hardware for the planner: GPUs, network tiers and the clusters built from them, each with its source.

``GPUS`` holds each GPU's memory and dense BF16 peak; ``NETWORK_TIERS`` each tier's bandwidth per GPU, one way (what
nccl-tests' busbw approaches), and its alpha, the latency per ring step of the alpha-beta model (NCCL's own tuning
model, ``src/graph/tuning.cc``); ``CLUSTERS`` a GPU, its GPUs per node, the tier inside a node and the tier between
nodes; ``cluster`` looks one up. Published figures, not measured here. The planner counts an "80 GB" H100 as 80 GiB;
``H100_80GB_NVIDIA_SMI_BYTES`` is what nvidia-smi reports, to see how tight a fit is. ``course_utils.planner``
re-exports every name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ledger import GB, GiB
from .model_shapes import LayoutError


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float
    peak_flops: float  # dense BF16 tensor-core FLOP/s
    source: str


@dataclass(frozen=True)
class Link:
    """One network tier as the alpha-beta model sees it."""

    name: str
    bandwidth: float  # bytes/s per GPU, one direction: what nccl-tests' busbw approaches
    latency: float  # seconds per ring step (alpha)
    source: str


GPUS: dict[str, GPU] = {
    # NVIDIA H100 datasheet (SXM5): BF16 tensor core 1,979 TFLOPS "with sparsity", so 989.5e12 dense;
    # 80 GB HBM3. The planner counts 80 GiB (85.9e9 bytes); nvidia-smi reports slightly less,
    # H100_80GB_NVIDIA_SMI_BYTES below (0.4% less), so fits within ~0.3 GB are optimistic.
    "h100": GPU("H100 SXM 80GB", 80 * GiB, 989.5e12, "NVIDIA H100 datasheet"),
    # NVIDIA H200 datasheet: 141 GB HBM3e, same BF16 tensor-core peak as H100 SXM.
    "h200": GPU("H200 SXM 141GB", 141 * GB, 989.5e12, "NVIDIA H200 datasheet"),
    # NVIDIA A100 datasheet: 312 TFLOPS BF16 dense (Narayanan et al. 2021, sec 5: "312 teraFLOP/s").
    "a100": GPU("A100 SXM 80GB", 80 * GiB, 312e12, "NVIDIA A100 datasheet"),
}

# What nvidia-smi / NVML report for an "NVIDIA H100 80GB HBM3": 81,559 MiB = 79.65 GiB = 85.52e9 bytes
# (Modal's table of NVML capacities, thundergolfer.com/blog/nvidia-gpu-memory-capacity; the same total
# appears in published nvidia-smi outputs). Pass it as ``gpu_memory_bytes`` to see how tight a fit is.
H100_80GB_NVIDIA_SMI_BYTES = 81_559 * 2**20

NETWORK_TIERS: dict[str, Link] = {
    # 900 GB/s total NVLink bandwidth per GPU (18 links; NVIDIA H100/H200 datasheets) = 450 GB/s each
    # way. Measured all_reduce busbw on 8x H200 (shared/reference/allreduce_8xH200_published.csv,
    # from stas00/ml-engineering): 367.6 GB/s with NVLS/SHARP off, up to 482 GB/s with NVLS.
    # alpha: NCCL's own cost model (src/graph/tuning.cc, 2020 version), hwLat[NVLink][Ring][Simple] = 3.4 us.
    "nvlink4": Link("NVLink 4 + NVSwitch (H100/H200)", 450e9, 3.4e-6,
                    "H100 datasheet 900 GB/s bidirectional; NCCL tuning.cc hwLat"),
    # A100 datasheet: 600 GB/s NVLink per GPU (12 links), 300 GB/s each way; alpha as above.
    "nvlink3": Link("NVLink 3 + NVSwitch (A100)", 300e9, 3.4e-6,
                    "A100 datasheet 600 GB/s bidirectional; NCCL tuning.cc hwLat"),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding / 8 = 31.5e9 B/s each way (PCI-SIG 4.0
    # spec rates); alpha: NCCL tuning.cc hwLat[PCI][Ring][Simple] = 5.7 us.
    "pcie4": Link("PCIe 4.0 x16", 31.5e9, 5.7e-6, "PCI-SIG PCIe 4.0 rates; NCCL tuning.cc hwLat"),
    # One 400 Gb/s NDR ConnectX-7 per GPU (DGX H100: 8 per node) = 50e9 B/s each way;
    # alpha: NCCL tuning.cc hwLat[NET][Ring][Simple] = 9.6 us.
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s per GPU", 50e9, 9.6e-6,
                      "400 Gb/s per GPU (DGX H100); NCCL tuning.cc hwLat"),
    # Selene: "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs" per 8-GPU node (Narayanan et al.
    # 2021, sec 5; Korthikanti et al. 2022, sec 6) = 25e9 B/s per GPU each way.
    "ib-hdr200": Link("InfiniBand HDR 200 Gb/s per GPU", 25e9, 9.6e-6,
                      "Narayanan et al. 2021 sec 5; NCCL tuning.cc hwLat"),
    # Llama 3, sec 3.3.1: RoCE and InfiniBand clusters "leverage 400 Gbps interconnects between GPUs".
    "roce400": Link("RoCE 400 Gb/s per GPU", 50e9, 9.6e-6, "Llama 3 paper sec 3.3.1; NCCL tuning.cc hwLat"),
    # 100 Gb/s Ethernet (IEEE 802.3) = 12.5e9 B/s; alpha is NCCL's network floor, TCP sockets are slower.
    "ethernet100": Link("Ethernet 100 Gb/s", 12.5e9, 9.6e-6, "IEEE 802.3 100GbE; NCCL tuning.cc hwLat"),
}


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    intra_node: Link
    inter_node: Link


CLUSTERS: dict[str, Cluster] = {
    # DGX H100: 8 GPUs on NVSwitch, one 400 Gb/s NIC per GPU (NVIDIA DGX H100 datasheet).
    "h100-ib": Cluster("8x H100 per node, NVLink 4, InfiniBand NDR 400", GPUS["h100"], 8,
                       NETWORK_TIERS["nvlink4"], NETWORK_TIERS["ib-ndr400"]),
    "h200-ib": Cluster("8x H200 per node, NVLink 4, InfiniBand NDR 400", GPUS["h200"], 8,
                       NETWORK_TIERS["nvlink4"], NETWORK_TIERS["ib-ndr400"]),
    # Llama 3 405B: 8 GPUs per Grand Teton server on NVLink, RoCE 400 Gb/s between GPUs (sec 3.3.1).
    "h100-roce": Cluster("8x H100 per node, NVLink 4, RoCE 400 (Llama 3)", GPUS["h100"], 8,
                         NETWORK_TIERS["nvlink4"], NETWORK_TIERS["roce400"]),
    # Selene (Narayanan et al. 2021 sec 5, Korthikanti et al. 2022 sec 6): DGX A100 80GB, HDR 200.
    "a100-ib": Cluster("8x A100 per node, NVLink 3, InfiniBand HDR 200 (Selene)", GPUS["a100"], 8,
                       NETWORK_TIERS["nvlink3"], NETWORK_TIERS["ib-hdr200"]),
}


def cluster(name: str | Cluster) -> Cluster:
    if isinstance(name, Cluster):
        return name
    if name not in CLUSTERS:
        raise LayoutError(f"unknown cluster {name!r}; use one of {', '.join(CLUSTERS)} or a Cluster.")
    return CLUSTERS[name]
