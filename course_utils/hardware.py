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


# A large device-to-device copy on the course's H200 ran at 4.27 TB/s of the datasheet's 4.8 (0.89;
# shared/reference/README.md, h200_attention_baseline.json "copy_TBps"); the same share is assumed for A100 and H100.
STREAM_EFFICIENCY = 4.27 / 4.8
# The shortest time an eager CUDA kernel occupies: launch overhead of a few microseconds per kernel (PyTorch's
# "Accelerating PyTorch with CUDA Graphs" post: launches cost "a few microseconds" each); an assumed order of
# magnitude. It matters only when kernels are tiny; for every published run it moves the step by under 1%.
GPU_KERNEL_OVERHEAD_S = 4e-6


@dataclass(frozen=True)
class GPU:
    """One device as the planner prices it: memory, peaks, and where its measured rates come from.

    ``gemm`` names the device's rows in ``data/reference/gemm_throughput.csv`` (``device_rates.gemm_table``): the
    step-time model reads matmul throughput by shape there, ``peak_flops`` is only MFU's denominator.
    ``memory_bandwidth`` is the datasheet's; ``stream_efficiency`` the share of it a large copy reaches.
    ``kernel_overhead_s`` is the shortest time one kernel (one eager op) takes; ``overhead_serial`` says whether it
    adds to the work (a CPU rank dispatching op after op) or only bounds it from below (a GPU, whose launches run
    ahead of the work). ``cores``: compute units the ranks on one machine share (0: each rank has its own device).
    """

    name: str
    memory_bytes: float
    peak_flops: float  # dense BF16 tensor-core FLOP/s
    source: str
    memory_bandwidth: float = 0.0  # bytes/s, datasheet
    fp8_flops: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores)
    gemm: str = ""  # key of the device's rows in the GEMM table
    stream_efficiency: float = STREAM_EFFICIENCY
    kernel_overhead_s: float = GPU_KERNEL_OVERHEAD_S
    overhead_serial: bool = False
    cores: int = 0
    gemm_rows: tuple = ()  # measured (dtype, m, n, k, FLOP/s) rows instead of the committed table (a calibrated CPU)
    # a calibrated CPU's fused causal attention, (dtype, batch x heads, seq, head_dim, forward_s, forward_backward_s),
    # and activation function, (dtype, elements, forward_s, forward_backward_s), timed instead of priced by FLOPs/bytes
    attention_rows: tuple = ()
    activation_rows: tuple = ()


@dataclass(frozen=True)
class Link:
    """One network tier as the alpha-beta model sees it.

    ``bandwidth`` is the line rate; ``efficiency`` the share of it a large collective's bus bandwidth reaches in a
    published nccl-tests sweep (the step-time model uses ``achieved``). ``fitted``: per (collective, ranks) an
    (alpha, beta) measured on this tier (a calibrated machine's gloo), used instead of the ring formula.
    """

    name: str
    bandwidth: float  # bytes/s per GPU, one direction: what nccl-tests' busbw approaches
    latency: float  # seconds per ring step (alpha)
    source: str
    efficiency: float = 1.0
    fitted: tuple = ()  # ((collective, ranks, alpha_s, beta_s_per_byte), ...)

    @property
    def achieved(self) -> float:
        return self.bandwidth * self.efficiency


GPUS: dict[str, GPU] = {
    # NVIDIA H100 datasheet (SXM5): BF16 tensor core 1,979 TFLOPS "with sparsity", so 989.5e12 dense;
    # 80 GB HBM3. The planner counts 80 GiB (85.9e9 bytes); nvidia-smi reports slightly less,
    # H100_80GB_NVIDIA_SMI_BYTES below (0.4% less), so fits within ~0.3 GB are optimistic.
    # 3.35 TB/s HBM3; FP8 tensor core 3,958 TFLOPS with sparsity, so 1,979e12 dense.
    "h100": GPU("H100 SXM 80GB", 80 * GiB, 989.5e12, "NVIDIA H100 datasheet", memory_bandwidth=3.35e12,
                fp8_flops=1979e12, gemm="h100-sxm"),
    # NVIDIA H200 datasheet: 141 GB HBM3e, same BF16 tensor-core peak as H100 SXM.
    # 4.8 TB/s HBM3e; FP8 as H100.
    "h200": GPU("H200 SXM 141GB", 141 * GB, 989.5e12, "NVIDIA H200 datasheet", memory_bandwidth=4.8e12,
                fp8_flops=1979e12, gemm="h200-sxm"),
    # NVIDIA A100 datasheet: 312 TFLOPS BF16 dense (Narayanan et al. 2021, sec 5: "312 teraFLOP/s").
    # DeepSeek-V3 report sec 3.1: H800 SXM, H100's GH100 die with NVLink cut to 400 GB/s; same tensor-core peaks
    # and HBM3 as H100 SXM (secondary sources: no NVIDIA datasheet for the export part).
    "h800": GPU("H800 SXM 80GB", 80 * GiB, 989.5e12, "DeepSeek-V3 report sec 3.1; H100 SXM peaks",
                memory_bandwidth=3.35e12, fp8_flops=1979e12, gemm="h100-sxm"),
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "Hardware": H100 with 96 GB HBM2e at 2.4 TB/s, 500 W;
    # its peak is "between SXM and NVL" (footnote 2): the SXM figure here, as torchtitan divides by it for MFU.
    "h100-96gb": GPU("H100 96GB HBM2e (Grand Teton)", 96 * GB, 989.5e12, "torchtitan H100 benchmark, Hardware",
                     memory_bandwidth=2.4e12, fp8_flops=1979e12, gemm="h100-sxm"),
    # 2,039 GB/s HBM2e (80GB SXM); no FP8.
    "a100": GPU("A100 SXM 80GB", 80 * GiB, 312e12, "NVIDIA A100 datasheet", memory_bandwidth=2.039e12,
                gemm="a100-sxm-80gb"),
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
                    "H100 datasheet 900 GB/s bidirectional; NCCL tuning.cc hwLat; achieved: the 8x H200 sweep",
                    efficiency=367.6 / 450),
    # A100 datasheet: 600 GB/s NVLink per GPU (12 links), 300 GB/s each way; alpha as above.
    # achieved: 8x A100 all_reduce busbw 231.4 GB/s at 2 GiB (data/reference/network_busbw.csv, stas00/ml-engineering)
    "nvlink3": Link("NVLink 3 + NVSwitch (A100)", 300e9, 3.4e-6,
                    "A100 datasheet 600 GB/s bidirectional; NCCL tuning.cc hwLat; achieved: the 8x A100 sweep",
                    efficiency=231.4 / 300),
    # PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding / 8 = 31.5e9 B/s each way (PCI-SIG 4.0
    # spec rates); alpha: NCCL tuning.cc hwLat[PCI][Ring][Simple] = 5.7 us.
    "pcie4": Link("PCIe 4.0 x16", 31.5e9, 5.7e-6, "PCI-SIG PCIe 4.0 rates; NCCL tuning.cc hwLat"),
    # One 400 Gb/s NDR ConnectX-7 per GPU (DGX H100: 8 per node) = 50e9 B/s each way;
    # alpha: NCCL tuning.cc hwLat[NET][Ring][Simple] = 9.6 us.
    # achieved: 46 GB/s per NIC, the low end of what NCCL's engineers quote for NDR 400 (network_busbw.csv)
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s per GPU", 50e9, 9.6e-6,
                      "400 Gb/s per GPU (DGX H100); NCCL tuning.cc hwLat; achieved: NVIDIA/nccl issues",
                      efficiency=46 / 50),
    # Selene: "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs" per 8-GPU node (Narayanan et al.
    # 2021, sec 5; Korthikanti et al. 2022, sec 6) = 25e9 B/s per GPU each way.
    # achieved: 24 GB/s per NIC (network_busbw.csv, NCCL engineers' figure for HDR 200)
    "ib-hdr200": Link("InfiniBand HDR 200 Gb/s per GPU", 25e9, 9.6e-6,
                      "Narayanan et al. 2021 sec 5; NCCL tuning.cc hwLat; achieved: NVIDIA/nccl issues",
                      efficiency=24 / 25),
    # Llama 3, sec 3.3.1: RoCE and InfiniBand clusters "leverage 400 Gbps interconnects between GPUs".
    # achieved: 48 GB/s per NIC, the low end of NCCL engineers' "up to 48-49" (network_busbw.csv)
    "roce400": Link("RoCE 400 Gb/s per GPU", 50e9, 9.6e-6, "Llama 3 paper sec 3.3.1; NCCL tuning.cc hwLat",
                    efficiency=48 / 50),
    # DeepSeek-V3 report sec 3.2.2: H800's NVLink 400 GB/s total, 200 each way, of which "160 GB/s" is achieved.
    "nvlink-h800": Link("NVLink (H800, 400 GB/s total)", 200e9, 3.4e-6, "DeepSeek-V3 report sec 3.2.2; NCCL hwLat",
                        efficiency=160 / 200),
    # BLOOM's Jean Zay nodes: "4 OmniPath links" per 8 A100s (bigscience tr11 README); Omni-Path 100: 100 Gb/s per
    # link, so 4 x 12.5e9 B/s shared by 8 GPUs = 6.25e9 per GPU (the link rate is not printed there: assumed).
    "opa100x4": Link("Omni-Path 4 x 100 Gb/s per 8 GPUs", 6.25e9, 9.6e-6,
                     "bigscience tr11-176B-ml README, Hardware; Omni-Path 100 link rate"),
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
    # DeepSeek-V3 (report sec 3.1, 3.2.2): 8 H800 per node, NVLink, one 400 Gb/s InfiniBand NIC (50 GB/s) per GPU.
    "h800-ib": Cluster("8x H800 per node, NVLink (400 GB/s), InfiniBand 400 (DeepSeek-V3)", GPUS["h800"], 8,
                       NETWORK_TIERS["nvlink-h800"], NETWORK_TIERS["ib-ndr400"]),
    # torchtitan's Grand Teton hosts: 8 H100 96GB on NVLink, 400 Gb/s RDMA per GPU (its H100 benchmark, Hardware).
    "h100-96gb-rdma": Cluster("8x H100 96GB per host, NVLink, RDMA 400 (torchtitan)", GPUS["h100-96gb"], 8,
                              NETWORK_TIERS["nvlink4"], NETWORK_TIERS["roce400"]),
    # BLOOM (bigscience tr11-176B-ml README, Hardware): Jean Zay, 8 A100 80GB per node, NVLink, 4 Omni-Path links.
    "a100-opa": Cluster("8x A100 per node, NVLink 3, Omni-Path 4 x 100 (BLOOM, Jean Zay)", GPUS["a100"], 8,
                        NETWORK_TIERS["nvlink3"], NETWORK_TIERS["opa100x4"]),
    # Selene (Narayanan et al. 2021 sec 5, Korthikanti et al. 2022 sec 6): DGX A100 80GB, HDR 200.
    "a100-ib": Cluster("8x A100 per node, NVLink 3, InfiniBand HDR 200 (Selene)", GPUS["a100"], 8,
                       NETWORK_TIERS["nvlink3"], NETWORK_TIERS["ib-hdr200"]),
}


# The share of its isolated benchmark rate (the GEMM table) a matmul keeps inside a long training step, per GPU
# generation: clocks under sustained power, caches shared with communication kernels, the gaps between kernels that
# no term names. Fitted on the published runs of that generation (course_utils.planner_runs.fit_sustained, the rows
# that count); tests/test_planner_runs.py refits it, checks these rounded values, and prices each paper's rows with
# a fit that left that paper out. A calibrated CPU measures its own steps' matmuls: 1.
SUSTAINED_GEMM_SHARE = {"a100": 0.76, "h100": 0.69}


def generation(gpu: GPU) -> str:
    """The GPU generation a device belongs to (H200 and H800 are Hopper, priced with H100's share)."""
    name = gpu.name.lower()
    for key, gen in (("a100", "a100"), ("h100", "h100"), ("h200", "h100"), ("h800", "h100")):
        if key in name:
            return gen
    return name


def sustained_share(gpu: GPU) -> float:
    return SUSTAINED_GEMM_SHARE.get(generation(gpu), 1.0)


def cluster(name: str | Cluster) -> Cluster:
    if isinstance(name, Cluster):
        return name
    if name not in CLUSTERS:
        raise LayoutError(f"unknown cluster {name!r}; use one of {', '.join(CLUSTERS)} or a Cluster.")
    return CLUSTERS[name]
