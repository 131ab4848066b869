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
(src/init.cc), and the algorithm names of ``ncclAlgoStr`` (Tree, Ring, CollNetDirect, CollNetChain, NVLS, NVLSTree,
PAT). NCCL_NTHREADS goes through ``getNthreads`` (src/graph/tuning.cc, identical in NVIDIA/nccl 2.20.3 and the
2.28.3 copy ``collective_models`` cites): a positive value must be a multiple of WARP_SIZE 32 between 2 x WARP_SIZE
= 64 and NCCL_SIMPLE_MAX_NTHREADS = NCCL_LL_MAX_NTHREADS = 512 (src/include/device.h); otherwise NCCL logs
"Invalid NCCL_NTHREADS" and uses 512 (not a multiple, or too large) or 64 (too small); 0 or less means the default.

How numbers are read: every ``NCCL_PARAM`` goes through ``ncclLoadParam`` (src/misc/param.cc), which calls
``strtoll(str, nullptr, 0)``: base 0, so ``0x10`` is 16 and a leading 0 means octal (``010`` is 8, ``08`` is 0),
and trailing characters are silently dropped (``4M`` is 4). PyTorch's ``getCvarInt`` (torch/csrc/distributed/c10d/
Utils.hpp) calls ``std::stoi``: base 10, so ``010`` is 10 and ``0x10`` is 0. ``validate_env`` accepts a plain
decimal, or hexadecimal for NCCL, and flags anything each reader would take differently from what it says.

The flight recorder (PyTorch): in torch 2.13 (this course's pin; torch/csrc/distributed/c10d/FlightRecorder.hpp
lines 110-111) its size is ``getCvarInt({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000)``: unset
means 2000 entries, so the recorder is on and TORCH_NCCL_DUMP_ON_TIMEOUT=1 needs nothing else; only an explicit 0
(under either name) turns it off. TORCH_FR_BUFFER_SIZE wins when both are set, and reading the old name prints
"Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE instead" (Utils.hpp,
WARN_ENV_VAR_ONCE), though ProcessGroupNCCL.hpp (lines 115-116) still reads only the old name for its own copy of the
size (ProcessGroupNCCL.cpp defaults it to 2000 as well, says FlightRecorder.hpp:107-109). Older releases read only
TORCH_NCCL_TRACE_BUFFER_SIZE and defaulted to 0 (``NCCLTraceBuffer() { max_entries_ = getCvarInt(
{"TORCH_NCCL_TRACE_BUFFER_SIZE"}, 0); ...`` in pytorch/pytorch's FlightRecorder.hpp at commit 00f0e2f), which is where
the rule "a dump needs a buffer size" comes from (ProcessGroupNCCL.hpp line 73 still says so); on those releases
set TORCH_NCCL_TRACE_BUFFER_SIZE yourself.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

NCCL_ENV_DOC = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
NCCL_LOGGING_DOC = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/logging.html"
TORCH_NCCL_DOC = "https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html"
TORCH_RENAME = "https://github.com/pytorch/pytorch/pull/114077"  # the warning: "... is deprecated; use TORCH_NCCL_..."
TORCH_FR_SOURCE = "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/FlightRecorder.hpp"
FR_DEFAULT_ENTRIES = 2000  # torch 2.13, FlightRecorder.hpp:110-111

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
    maximum: int | None = None
    multiple_of: int = 1
    nonpositive_is_default: bool = False  # NCCL_NTHREADS: 0 or less means "use the default"
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
    EnvVar("NCCL_NTHREADS", TUNING, "CUDA threads per channel block (LL and Simple)",
           "a multiple of 32 from 64 to 512 (0 or unset: NCCL's default)", NCCL_ENV_DOC,
           integer=True, minimum=64, maximum=512, multiple_of=32, nonpositive_is_default=True),
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
    EnvVar("TORCH_FR_BUFFER_SIZE", SYSTEM, "entries kept in PyTorch's flight recorder (the ring buffer of recent collectives)",
           f"a whole number; unset means {FR_DEFAULT_ENTRIES} in torch 2.13 (FlightRecorder.hpp:110-111), 0 turns the recorder off",
           TORCH_FR_SOURCE, integer=True),
    EnvVar("TORCH_NCCL_DUMP_ON_TIMEOUT", SYSTEM, "dumps the flight recorder when the watchdog sees a timeout or an error",
           f"0 or 1; the recorder it dumps is on by default in torch 2.13 ({FR_DEFAULT_ENTRIES} entries), off only if "
           "TORCH_FR_BUFFER_SIZE (or the old TORCH_NCCL_TRACE_BUFFER_SIZE) is 0", TORCH_NCCL_DOC, allowed=BOOL),
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
    EnvVar("TORCH_NCCL_TRACE_BUFFER_SIZE", DEPRECATED, "the old name of TORCH_FR_BUFFER_SIZE: torch 2.13 still reads it "
           "when the new name is unset, and warns that it is deprecated (releases before the new name read only this one)",
           "as TORCH_FR_BUFFER_SIZE", TORCH_FR_SOURCE, integer=True, replaced_by="TORCH_FR_BUFFER_SIZE"),
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
TORCH_FR_CPP_STACK TORCH_FR_DUMP_TEMP_FILE TORCH_FR_DUMP_DYNAMIC_FILE_NAME
""".split())  # the TORCH_FR_ names: torch 2.13's FlightRecorder.hpp and the strings of its libraries
PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_")  # the names validate_env examines
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


_NCCL_STRTOLL = re.compile(r"([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")  # what strtoll(s, 0, 0) consumes
_STOI = re.compile(r"[+-]?[0-9]+")  # what std::stoi consumes


def read_int(name: str, value: str) -> tuple[int | None, str | None, str | None]:
    """What the reader of ``name`` takes from ``value``: (number, problem, fix); problem and fix are None if fine.

    NCCL_* variables: strtoll in base 0 (src/misc/param.cc), so hexadecimal is fine, a leading 0 is octal and
    trailing characters are dropped. TORCH_* variables: std::stoi (c10d/Utils.hpp), base 10, trailing characters
    dropped, and an error if there is no digit. A plain decimal passes whenever the reader takes the number it
    says (``03`` does for both, ``010`` only for PyTorch); so does hexadecimal for NCCL.
    """
    text = value.strip()
    torch = name.startswith("TORCH_")
    if not text:  # ncclLoadParam ignores an empty value (the default); std::stoi("") throws
        reads = "PyTorch stops with an error" if torch else "NCCL uses its default"
        return None, f"it is set but empty, so {reads}", "Unset it, or write a plain decimal number."
    m = (_STOI if torch else _NCCL_STRTOLL).match(text)
    if torch:
        got = int(m.group(0), 10) if m else None
    elif m:
        sign, digits = m.groups()
        base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") and len(digits) > 1 else 10
        got = int(sign + digits, base)
    else:
        got = 0  # strtoll finds no digit: 0
    if re.fullmatch(r"[+-]?[0-9]+", text):
        decimal = int(text, 10)
        if got != decimal:
            problem = f"NCCL reads a leading 0 as octal, so {value!r} is {got}, not {decimal}"
            return got, problem, f"Write {decimal} without the leading zero, or {got} if that is the value you meant."
        return got, None, None
    if not torch and m and m.end() == len(text):
        return got, None, None  # hexadecimal, which strtoll reads
    fix = "Write it as a plain decimal number."
    if got is None:
        return None, f"{value!r} is not a whole number, and PyTorch stops with an error on it", fix
    return got, f"{value!r} is not a whole number ({'PyTorch' if torch else 'NCCL'} would read it as {got})", fix


def _check_value(var: EnvVar, value: str) -> Finding | None:
    v = value.strip()
    if var.integer:
        number, problem, fix = read_int(var.name, v)
        if problem:
            return Finding(ERROR, var.name, problem, fix)
        if var.nonpositive_is_default and number <= 0:
            return None
        nccl_uses = "NCCL_NTHREADS" == var.name  # getNthreads substitutes a value rather than failing
        if number < var.minimum:
            then = f", so NCCL uses {var.minimum}" if nccl_uses else ""
            return Finding(ERROR, var.name, f"{number} is below the minimum {var.minimum}{then}", f"Set it to {var.values}.")
        if var.maximum is not None and number > var.maximum:
            then = f", so NCCL uses {var.maximum}" if nccl_uses else ""
            return Finding(ERROR, var.name, f"{number} is above the maximum {var.maximum}{then}", f"Set it to {var.values}.")
        if number % var.multiple_of:
            then = f", so NCCL uses {var.maximum}" if nccl_uses else ""
            return Finding(ERROR, var.name, f"{number} is not a multiple of {var.multiple_of}{then}",
                           f"Set it to {var.values}.")
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
        return read_int(name, str(env[name]))[0] if name in env else None

    lo, hi = as_int("NCCL_MIN_NCHANNELS"), as_int("NCCL_MAX_NCHANNELS")
    if lo is not None and hi is not None and lo > hi:
        out.append(Finding(ERROR, "NCCL_MIN_NCHANNELS", f"the minimum {lo} exceeds NCCL_MAX_NCHANNELS={hi}",
                           "Lower NCCL_MIN_NCHANNELS to at most NCCL_MAX_NCHANNELS, or unset both."))
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1" and "NCCL_P2P_LEVEL" in env:
        out.append(Finding(WARNING, "NCCL_P2P_LEVEL", "P2P is disabled by NCCL_P2P_DISABLE=1, so its level means nothing",
                           "Keep one of the two: unset NCCL_P2P_LEVEL (or NCCL_P2P_DISABLE)."))
    fr_names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    off = [name for name in fr_names if (n := as_int(name)) is not None and n <= 0]
    if env.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip() == "1" and off:
        out.append(Finding(ERROR, "TORCH_NCCL_DUMP_ON_TIMEOUT", f"the dump writes out the flight recorder, and "
                           f"{off[0]}={env[off[0]].strip()} turns the recorder off",
                           f"Delete {off[0]} (torch 2.13 then keeps {FR_DEFAULT_ENTRIES} entries), or set "
                           "TORCH_FR_BUFFER_SIZE to a positive number of entries."))
    new_fr, old_fr = (as_int(name) for name in fr_names)
    if new_fr is not None and old_fr is not None and new_fr != old_fr:
        out.append(Finding(ERROR, "TORCH_NCCL_TRACE_BUFFER_SIZE", f"it says {old_fr} and TORCH_FR_BUFFER_SIZE says "
                           f"{new_fr}, which torch 2.13's flight recorder uses", "Delete TORCH_NCCL_TRACE_BUFFER_SIZE "
                           "and keep the size you mean in TORCH_FR_BUFFER_SIZE."))
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

    Only ``NCCL_*``, ``TORCH_NCCL_*`` and ``TORCH_FR_*`` names are examined; others (``CUDA_VISIBLE_DEVICES``...)
    pass silently.
    """
    findings: list[Finding] = []
    for name, value in env.items():
        if not name.startswith(PREFIXES):
            continue
        var = BY_NAME.get(name)
        if var is None:
            if name not in KNOWN:
                close = difflib.get_close_matches(name, sorted(KNOWN), n=1, cutoff=0.75)
                fix = (f"Rename it to {close[0]}, the nearest real name, or delete it." if close else
                       "Check the spelling against the NCCL and PyTorch docs, or delete it.")
                findings.append(Finding(ERROR, name, "NCCL and PyTorch do not read this name, so it has no effect", fix))
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


# A realistic script's environment with something wrong on most lines: notebook 10 runs ``validate_env`` on it
# and its exercise asks for the fix (course_utils/catalogue/ch10.py checks the answer).
BAD_ENV = {
    "NCCL_DEBUG": "INFO",
    "NCCL_ALGO": "Tree",
    "NCCL_SOCKET_IFNAME": "=eth0",
    "NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
    "NCCL_IB_QPS_PER_CONECTION": "4",
    "NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",  # someone turned the flight recorder off "for speed"...
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ...and still expects its dump after a hang
}
