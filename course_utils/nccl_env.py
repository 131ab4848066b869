"""The NCCL_* and TORCH_NCCL_* variables a practitioner meets, as data, and a validator for a proposed environment.

NCCL's documentation sorts its variables into two kinds (Environment Variables page, introduction): those
that make NCCL follow the system's configuration, which can stay in scripts, and those in its "Debugging"
section, which "should not be used in production nor retained in scripts, or only as workaround" because
keeping them "may result in sub-optimal behavior, crashes, or hangs". The course adds a third kind for knobs
whose default is usually right and whose change must be measured (channels, buffers, QPs), and a fourth for
names PyTorch has renamed. Every entry cites the page its meaning and values were checked against.

Defaults quoted here were also read off NCCL's own source, where each variable is an ``NCCL_PARAM(name,
"VAR", default)`` declaration: IB_QPS_PER_CONNECTION 1 and IB_SPLIT_DATA_ON_QPS 0 (1 in older releases;
src/transport/net_ib), CROSS_NIC 2 (src/graph/search.cc), BUFFSIZE ``DEFAULT_BUFFSIZE (1 << 22) /* 4MiB */``
(src/init.cc), NTHREADS a multiple of the warp size up to the maximum (src/graph/tuning.cc), and the algorithm
names of ``ncclAlgoStr`` (Tree, Ring, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

NCCL_ENV_DOC = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
NCCL_LOGGING_DOC = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/logging.html"
TORCH_NCCL_DOC = "https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html"
TORCH_RENAME = "https://github.com/pytorch/pytorch/pull/114077"  # the warning: "... is deprecated; use TORCH_NCCL_..."

SYSTEM, DEBUG, TUNING, DEPRECATED = "system configuration", "debug only", "tuning: measure first", "deprecated"
KINDS = (SYSTEM, DEBUG, TUNING, DEPRECATED)

BOOL = ("0", "1")
PATH_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")  # GPU-to-GPU / GPU-to-NIC distances, nearest first


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str
    what: str
    values: str  # in words, as the documentation gives them
    source: str
    allowed: tuple[str, ...] | None = None  # exact values (case-insensitive), None when free-form
    integer: bool = False  # a whole number (>= minimum)
    minimum: int = 0
    replaced_by: str | None = None


VARIABLES = [
    EnvVar("NCCL_DEBUG", DEBUG, "how much NCCL prints: the version, warnings, or every init decision (INFO)",
           "VERSION, WARN, INFO, TRACE (TRACE needs a build with TRACE=1)", NCCL_LOGGING_DOC,
           allowed=("VERSION", "WARN", "INFO", "TRACE")),
    EnvVar("NCCL_DEBUG_SUBSYS", DEBUG, "which subsystems' INFO lines are printed (INIT, COLL, P2P, SHM, NET, GRAPH, TUNING, ENV, ALL...)",
           "a comma-separated list of subsystems, ^ to exclude", NCCL_LOGGING_DOC),
    EnvVar("NCCL_SOCKET_IFNAME", SYSTEM, "which IP interfaces NCCL uses for its sockets (bootstrap, and data when there is no IB)",
           "prefixes separated by ',' ('eth'), '=' for an exact name ('=eth0'), '^' to exclude ('^docker')", NCCL_ENV_DOC),
    EnvVar("NCCL_IB_HCA", SYSTEM, "which InfiniBand/RoCE adapters (and ports) NCCL uses",
           "adapter name prefixes, optionally :port, ',' separated; '=' exact, '^' exclude (e.g. '=mlx5_0:1,mlx5_1:1')", NCCL_ENV_DOC),
    EnvVar("NCCL_IB_GID_INDEX", SYSTEM, "the GID index for RoCE (which address/RoCE version the adapter uses); the fabric decides it",
           "a whole number: the index of the GID the fabric uses (read it from the adapter, e.g. show_gids)", NCCL_ENV_DOC,
           integer=True),
    EnvVar("NCCL_IB_QPS_PER_CONNECTION", TUNING, "queue pairs per connection: more QPs are more flows for ECMP to spread over the fabric",
           "a whole number >= 1 (default 1)", NCCL_ENV_DOC, integer=True, minimum=1),
    EnvVar("NCCL_IB_SPLIT_DATA_ON_QPS", TUNING, "whether each message is split over all the QPs of a connection or QPs are used in turn",
           "0 or 1 (default 0 in recent releases, 1 in older ones)", NCCL_ENV_DOC, allowed=BOOL),
    EnvVar("NCCL_NET_GDR_LEVEL", SYSTEM, "the farthest GPU-to-NIC distance at which NCCL still uses GPUDirect RDMA (formerly NCCL_IB_GDR_LEVEL)",
           "LOC, PIX, PXB, PHB, SYS (or the older integers)", NCCL_ENV_DOC, allowed=PATH_LEVELS + tuple("012345")),
    EnvVar("NCCL_P2P_LEVEL", DEBUG, "the farthest GPU-to-GPU distance at which NCCL still uses the P2P transport",
           "LOC (never), NVL, PIX, PXB, PHB, SYS (or the older integers)", NCCL_ENV_DOC, allowed=PATH_LEVELS + tuple("012345")),
    EnvVar("NCCL_P2P_DISABLE", DEBUG, "turns off direct GPU-to-GPU (NVLink/PCI) transfers: traffic falls back to shared memory or the network",
           "1 to disable", NCCL_ENV_DOC, allowed=BOOL),
    EnvVar("NCCL_SHM_DISABLE", DEBUG, "turns off the shared-memory transport between processes on a node",
           "1 to disable", NCCL_ENV_DOC, allowed=BOOL),
    EnvVar("NCCL_ALGO", DEBUG, "restricts the algorithms NCCL's tuner may choose (Ring, Tree, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT)",
           "a comma-separated list, '^' to exclude; newer releases also take per-collective lists", NCCL_ENV_DOC,
           allowed=("RING", "TREE", "COLLNET", "COLLNETDIRECT", "COLLNETCHAIN", "NVLS", "NVLSTREE", "PAT")),
    EnvVar("NCCL_PROTO", DEBUG, "restricts the protocols NCCL may use (LL, LL128, Simple)",
           "a comma-separated list, '^' to exclude", NCCL_ENV_DOC, allowed=("LL", "LL128", "SIMPLE")),
    EnvVar("NCCL_MIN_NCHANNELS", TUNING, "the fewest channels (parallel rings/trees, each a CUDA block) NCCL uses",
           "a whole number >= 1", NCCL_ENV_DOC, integer=True, minimum=1),
    EnvVar("NCCL_MAX_NCHANNELS", TUNING, "the most channels NCCL uses: fewer channels leave SMs to compute, at a bandwidth cost",
           "a whole number >= 1", NCCL_ENV_DOC, integer=True, minimum=1),
    EnvVar("NCCL_BUFFSIZE", TUNING, "bytes of buffer per connection and protocol (default 4 MiB)",
           "a whole number of bytes", NCCL_ENV_DOC, integer=True, minimum=1),
    EnvVar("NCCL_NTHREADS", TUNING, "CUDA threads per channel block", "64, 128, 256 or 512", NCCL_ENV_DOC,
           allowed=("64", "128", "256", "512")),
    EnvVar("NCCL_CROSS_NIC", SYSTEM, "whether a ring/tree may leave a node through one NIC and arrive through another (rail-optimised fabrics say no)",
           "0, 1, or 2 (the default: let NCCL decide)", NCCL_ENV_DOC, allowed=("0", "1", "2")),
    EnvVar("NCCL_COLLNET_ENABLE", SYSTEM, "enables CollNet (in-network reduction, e.g. SHARP through the plugin)",
           "0 or 1", NCCL_ENV_DOC, allowed=BOOL),
    EnvVar("NCCL_TOPO_FILE", SYSTEM, "an XML topology file NCCL loads before detecting (for VMs whose PCI tree is hidden)",
           "a path", NCCL_ENV_DOC),
    EnvVar("NCCL_TOPO_DUMP_FILE", DEBUG, "writes the topology NCCL detected to this XML file", "a path", NCCL_ENV_DOC),
    EnvVar("TORCH_NCCL_ASYNC_ERROR_HANDLING", SYSTEM, "what the watchdog does on a NCCL error or timeout",
           "0 nothing, 1 abort the communicator and tear the process down, 2 abort only, 3 tear down only (default 3)",
           TORCH_NCCL_DOC, allowed=("0", "1", "2", "3")),
    EnvVar("TORCH_NCCL_BLOCKING_WAIT", DEBUG, "makes work.wait() block (and raise on timeout) instead of returning at once",
           "0 or 1", TORCH_NCCL_DOC, allowed=BOOL),
    EnvVar("TORCH_NCCL_TRACE_BUFFER_SIZE", SYSTEM, "events kept in the flight recorder's ring buffer (0 disables it)",
           "a whole number", TORCH_NCCL_DOC, integer=True),
    EnvVar("TORCH_NCCL_DUMP_ON_TIMEOUT", SYSTEM, "dumps the flight recorder when the watchdog sees a timeout or an error",
           "0 or 1; needs TORCH_NCCL_TRACE_BUFFER_SIZE > 0", TORCH_NCCL_DOC, allowed=BOOL),
    EnvVar("TORCH_NCCL_ENABLE_MONITORING", SYSTEM, "a thread that kills the process when the watchdog itself stops beating",
           "0 or 1", TORCH_NCCL_DOC, allowed=BOOL),
    EnvVar("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", SYSTEM, "how long the monitoring thread waits for a watchdog heartbeat before aborting",
           "a whole number of seconds", TORCH_NCCL_DOC, integer=True, minimum=1),
    EnvVar("TORCH_NCCL_HIGH_PRIORITY", TUNING, "puts NCCL's communicator on a high-priority CUDA stream",
           "0 or 1", TORCH_NCCL_DOC, allowed=BOOL),
    EnvVar("TORCH_NCCL_DESYNC_DEBUG", DEBUG, "reports which rank left a collective out (desync), at a cost", "0 or 1",
           TORCH_NCCL_DOC, allowed=BOOL),
    EnvVar("NCCL_ASYNC_ERROR_HANDLING", DEPRECATED, "the old PyTorch name of TORCH_NCCL_ASYNC_ERROR_HANDLING (torch >= 2.2 warns)",
           "as TORCH_NCCL_ASYNC_ERROR_HANDLING", TORCH_RENAME, allowed=("0", "1", "2", "3"),
           replaced_by="TORCH_NCCL_ASYNC_ERROR_HANDLING"),
]
BY_NAME = {v.name: v for v in VARIABLES}

# Real names from the same documentation index that the table does not describe: never flagged as typos.
OTHER_KNOWN = frozenset("""
NCCL_CONF_FILE NCCL_DEBUG_FILE NCCL_DEBUG_TIMESTAMP_FORMAT NCCL_DEBUG_TIMESTAMP_LEVELS NCCL_SOCKET_FAMILY
NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD NCCL_P2P_DIRECT_DISABLE NCCL_CHECKS_DISABLE NCCL_CHECK_POINTERS
NCCL_LAUNCH_MODE NCCL_IB_DISABLE NCCL_IB_TIMEOUT NCCL_IB_RETRY_CNT NCCL_IB_ADDR_FAMILY NCCL_IB_ADDR_RANGE
NCCL_IB_ROCE_VERSION_NUM NCCL_IB_SL NCCL_IB_TC NCCL_IB_AR_THRESHOLD NCCL_IB_CUDA_SUPPORT NCCL_IB_PCI_RELAXED_ORDERING
NCCL_IB_ADAPTIVE_ROUTING NCCL_MEM_SYNC_DOMAIN NCCL_NET NCCL_NET_PLUGIN NCCL_NET_GDR_READ NCCL_NET_SHARED_BUFFERS
NCCL_NET_SHARED_COMMS NCCL_SINGLE_RING_THRESHOLD NCCL_LL_THRESHOLD NCCL_TREE_THRESHOLD NCCL_IGNORE_CPU_AFFINITY
NCCL_COLLNET_NODE_THRESHOLD NCCL_NVB_DISABLE NCCL_PXN_DISABLE NCCL_P2P_PXN_LEVEL NCCL_GRAPH_REGISTER
NCCL_SET_STACK_SIZE NCCL_SET_THREAD_NAME NCCL_GRAPH_MIXING_SUPPORT NCCL_DMABUF_ENABLE NCCL_P2P_NET_CHUNKSIZE
NCCL_P2P_LL_THRESHOLD NCCL_ALLOC_P2P_NET_LL_BUFFERS NCCL_COMM_BLOCKING NCCL_NVLS_ENABLE NCCL_IB_GDR_LEVEL
NCCL_BLOCKING_WAIT TORCH_NCCL_ENABLE_TIMING TORCH_NCCL_AVOID_RECORD_STREAMS TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC
TORCH_NCCL_COORD_CHECK_MILSEC TORCH_NCCL_ABORT_IN_DESTROY_PG TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK
TORCH_NCCL_DEBUG_INFO_PIPE_FILE TORCH_NCCL_DEBUG_INFO_TEMP_FILE TORCH_NCCL_TRACE_CPP_STACK
""".split())
KNOWN = frozenset(BY_NAME) | OTHER_KNOWN

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Finding:
    severity: str  # "error": NCCL will reject or misread it; "warning": it works, and should not stay
    variable: str
    problem: str
    fix: str  # one sentence: what to change

    def __str__(self) -> str:
        return f"[{self.severity}] {self.variable}: {self.problem}. {self.fix}"


def _tokens(value: str) -> list[str]:
    """NCCL_ALGO/NCCL_PROTO lists: '^' exclusion and 'allreduce:ring,tree;...' per-collective forms included."""
    out = []
    for part in value.lstrip("^").split(";"):
        part = part.split(":", 1)[-1]
        out += [t.strip().lstrip("^").upper() for t in part.split(",") if t.strip()]
    return out


def _check_value(var: EnvVar, value: str) -> Finding | None:
    v = value.strip()
    if var.integer:
        try:
            number = int(v, 0)
        except ValueError:
            return Finding(ERROR, var.name, f"{value!r} is not a whole number", f"Set it to {var.values}.")
        if number < var.minimum:
            return Finding(ERROR, var.name, f"{number} is below the minimum {var.minimum}", f"Set it to {var.values}.")
        return None
    if var.allowed is None:
        return None if v else Finding(ERROR, var.name, "it is set but empty", f"Unset it, or set it to {var.values}.")
    words = _tokens(v) if var.name in ("NCCL_ALGO", "NCCL_PROTO") else [v.upper()]
    bad = [w for w in words if w not in var.allowed]
    if bad or not words:
        return Finding(ERROR, var.name, f"{value!r} is not a value it accepts", f"Use {var.values}.")
    return None


def _production_findings(env: dict[str, str]) -> list[Finding]:
    out = []
    debug = env.get("NCCL_DEBUG", "").strip().upper()
    if debug in ("INFO", "TRACE"):
        out.append(Finding(WARNING, "NCCL_DEBUG", f"{debug} logs every init decision on every rank (and TRACE every call)",
                           "Use NCCL_DEBUG=WARN in production, and INFO only for the run you are debugging."))
    for name in ("NCCL_ALGO", "NCCL_PROTO"):
        if name in env:
            out.append(Finding(WARNING, name, "it overrides NCCL's tuner for every size and node count, including the ones where the "
                               "choice is wrong", f"Remove {name} once the issue it worked around is fixed; use it in nccl-tests to compare, not in jobs."))
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"):
        if env.get(name, "").strip() == "1":
            out.append(Finding(WARNING, name, "it turns off a fast intra-node transport, so NVLink traffic goes the slow way",
                               f"Unset {name} unless a broken driver or container forces it, and file that as a bug."))
    for name in ("NCCL_P2P_LEVEL", "NCCL_TOPO_DUMP_FILE", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DESYNC_DEBUG"):
        if name in env and not (name.startswith("TORCH") and env[name].strip() == "0"):
            out.append(Finding(WARNING, name, "it is a debugging setting (NCCL's or PyTorch's docs list it for diagnosis)",
                               f"Remove {name} from the job script once the diagnosis is done."))
    return out


def _contradictions(env: dict[str, str]) -> list[Finding]:
    out = []

    def as_int(name):
        try:
            return int(env[name], 0)
        except (KeyError, ValueError):
            return None

    lo, hi = as_int("NCCL_MIN_NCHANNELS"), as_int("NCCL_MAX_NCHANNELS")
    if lo is not None and hi is not None and lo > hi:
        out.append(Finding(ERROR, "NCCL_MIN_NCHANNELS", f"the minimum {lo} exceeds NCCL_MAX_NCHANNELS={hi}",
                           "Lower NCCL_MIN_NCHANNELS to at most NCCL_MAX_NCHANNELS, or unset both."))
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1" and "NCCL_P2P_LEVEL" in env:
        out.append(Finding(WARNING, "NCCL_P2P_LEVEL", "P2P is disabled by NCCL_P2P_DISABLE=1, so its level means nothing",
                           "Keep one of the two: unset NCCL_P2P_LEVEL (or NCCL_P2P_DISABLE)."))
    if env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip() == "1" and as_int("TORCH_NCCL_TRACE_BUFFER_SIZE") in (None, 0):
        out.append(Finding(ERROR, "TORCH_NCCL_DUMP_ON_TIMEOUT", "a dump needs the flight recorder, and "
                           "TORCH_NCCL_TRACE_BUFFER_SIZE is unset or 0", "Set TORCH_NCCL_TRACE_BUFFER_SIZE to a positive "
                           "number of events, such as 2000, alongside TORCH_NCCL_DUMP_ON_TIMEOUT=1."))
    if env.get("TORCH_NCCL_ENABLE_MONITORING", "").strip() == "0" and "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in env:
        out.append(Finding(WARNING, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "the heartbeat is read by the monitoring thread, "
                           "which TORCH_NCCL_ENABLE_MONITORING=0 turns off", "Enable monitoring, or drop the heartbeat timeout."))
    if "NCCL_DEBUG_SUBSYS" in env and env.get("NCCL_DEBUG", "").strip().upper() not in ("INFO", "TRACE"):
        out.append(Finding(WARNING, "NCCL_DEBUG_SUBSYS", "it filters INFO lines, and NCCL_DEBUG is not INFO, so it does nothing",
                           "Unset NCCL_DEBUG_SUBSYS, or set NCCL_DEBUG=INFO for the debugging run."))
    old, new = "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    if old in env and new in env and env[old].strip() != env[new].strip():
        out.append(Finding(ERROR, old, f"it says {env[old]!r} and {new} says {env[new]!r}",
                           f"Delete {old} and keep the value you mean in {new}."))
    return out


def validate_env(env: dict[str, str]) -> list[Finding]:
    """Every problem with a proposed NCCL/PyTorch environment, each with one sentence on what to change.

    Only ``NCCL_*`` and ``TORCH_NCCL_*`` names are examined; others (``CUDA_VISIBLE_DEVICES``...) pass silently.
    """
    findings: list[Finding] = []
    for name, value in env.items():
        if not (name.startswith("NCCL_") or name.startswith("TORCH_NCCL_")):
            continue
        var = BY_NAME.get(name)
        if var is None:
            if name not in KNOWN:
                close = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.75)
                hint = f"Did you mean {close[0]}? Rename it" if close else "Check the spelling against the NCCL/PyTorch docs"
                findings.append(Finding(ERROR, name, "NCCL and PyTorch do not read this name, so it has no effect",
                                        f"{hint}, or delete it."))
            continue
        if var.kind == DEPRECATED:
            findings.append(Finding(WARNING, name, f"it is deprecated in favour of {var.replaced_by}",
                                    f"Rename it to {var.replaced_by} (same value)."))
        bad = _check_value(var, str(value))
        if bad:
            findings.append(bad)
    findings += _production_findings(env) + _contradictions(env)
    return findings


def table_rows(kind: str | None = None) -> list[dict]:
    """The table for display: name, kind, what it does, values, source."""
    return [{"variable": v.name, "kind": v.kind, "what it does": v.what, "values": v.values}
            for v in VARIABLES if kind is None or v.kind == kind]
