"""Notebook-side helpers for chapter 01: plain torchrun runs, collective grids, bandwidth and alpha-beta.

Everything here runs in the notebook process. The ranks' side lives in ``workers/ch01_*.py``.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from course_utils import scratch
from course_utils.paths import ROOT
from course_utils.tables import Table


# -- 1. a plain torchrun, from the notebook ---------------------------------------------------------


@dataclass
class ScriptRun:
    """What a plain ``torchrun`` printed, split by rank."""

    command: list[str]
    nproc: int
    returncode: int | None
    seconds: float
    timed_out: bool
    by_rank: dict[int, list[str]] = field(default_factory=dict)
    agent: list[str] = field(default_factory=list)  # torchrun's own lines (warnings, errors)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def lines(self, rank: int) -> list[str]:
        return self.by_rank.get(rank, [])

    def __str__(self) -> str:
        out = []
        for rank in range(self.nproc):
            for line in self.lines(rank) or ["(printed nothing)"]:
                out.append(f"[rank {rank}] {line}")
        if self.timed_out:
            out.append(f"timed out after {self.seconds:.0f} s: the whole process group was killed")
        elif self.returncode != 0:
            out.append(f"torchrun exited with code {self.returncode}")
        return "\n".join(out)


_RANK_PREFIX = re.compile(r"\[default(\d+)\]:")


def parse_tee(output: str) -> tuple[dict[int, list[str]], list[str]]:
    """Each rank's lines and torchrun's own, from ``--tee`` output.

    torchrun copies each rank's log file to its stdout as it grows, a prefix ``[defaultN]:`` per piece it reads.
    On a busy machine it can read a line before the rank finished writing it: the piece ends without a newline,
    the next rank's prefix follows on the same line, and the line's end comes later as a piece of its own. So the
    pieces are joined per rank before splitting into lines, instead of reading the output line by line."""
    texts: dict[int, str] = {}
    agent: list[str] = []
    i = 0
    while i < len(output):
        m = _RANK_PREFIX.match(output, i)
        newline = output.find("\n", m.end() if m else i)
        end = len(output) if newline < 0 else newline + 1
        following = _RANK_PREFIX.search(output, m.end() if m else i + 1, end)
        if following:  # another rank's piece starts before this line ends
            end = following.start()
        if m:
            rank = int(m.group(1))
            texts[rank] = texts.get(rank, "") + output[m.end():end]
        else:
            line = output[i:end].rstrip("\n")
            if line.strip() and not set(line.strip()) <= {"*"}:
                agent.append(line)
        i = end
    return {rank: text.splitlines() for rank, text in sorted(texts.items())}, agent


def run_script(script: str | os.PathLike, nproc: int, *, timeout: float = 60.0, args: tuple = (),
               env: dict | None = None) -> ScriptRun:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N script`` and collect each rank's output.

    ``--standalone`` picks a free rendezvous port, so two notebooks never collide. The agent gets a process
    group of its own; on timeout it and all its descendants are killed (SIGKILL), so a hung script leaves
    nothing behind.
    """
    from course_utils import reaper

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc={nproc!r} must be a whole number of processes, 1 or more")
    script = Path(script)
    if not script.is_absolute():
        script = ROOT / script
    if not script.exists():
        raise FileNotFoundError(f"there is no script {script}: give a path relative to the repository root")
    # --tee needs log files: in the course's scratch area, removed below (torchrun's default is a torchelastic_*
    # folder in the system temp directory that nothing removes)
    log_dir = scratch.job_log_dir(f"script-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--tee=3", f"--log-dir={log_dir}", str(script), *map(str, args)]
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"})
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    start = time.perf_counter()
    proc = reaper.spawn(cmd, cwd=str(ROOT), env=full_env, stdin=subprocess.DEVNULL,  # own session, dies with the notebook
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        output, _ = proc.communicate()
    except BaseException:  # a kernel interrupt: take the job down with us
        _kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        scratch.remove_job_log_dir(log_dir)
    run = ScriptRun(cmd, nproc, proc.returncode, time.perf_counter() - start, timed_out)
    run.by_rank, run.agent = parse_tee(output)
    return run


def _kill_group(pid: int) -> None:
    """Kill the agent, its process group, and every descendant.

    The process group alone is not enough: torchrun starts each worker in a session of its own, so a
    worker blocked in a collective would outlive its killed agent. ``kill_tree`` walks the children first.
    """
    from course_utils import reaper

    reaper.kill_tree([pid])
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# -- 2. tables -----------------------------------------------------------------------------------------

TORCHRUN_ENV = [
    ("RANK", "global rank of this process, 0 .. WORLD_SIZE-1, unique in the whole job"),
    ("LOCAL_RANK", "rank on this node, 0 .. LOCAL_WORLD_SIZE-1: use it to pick the GPU"),
    ("WORLD_SIZE", "number of processes in the job, all nodes together"),
    ("LOCAL_WORLD_SIZE", "processes on this node (--nproc-per-node)"),
    ("GROUP_RANK", "rank of this node's agent, 0 .. nnodes-1 (the node rank)"),
    ("GROUP_WORLD_SIZE", "number of agents (nodes)"),
    ("ROLE_RANK / ROLE_WORLD_SIZE", "rank and size among workers of the same role (one role here: same as RANK)"),
    ("MASTER_ADDR / MASTER_PORT", "where rank 0's TCP store listens: every rank meets there to exchange addresses"),
    ("TORCHELASTIC_RESTART_COUNT", "how many times the agent has restarted the workers (--max-restarts)"),
    ("TORCHELASTIC_RUN_ID", "the job id shared by every agent (--rdzv-id)"),
    ("OMP_NUM_THREADS", "set to 1 by torchrun when you start several processes per node, unless you set it"),
]


def env_table(result) -> str:
    """rank / node / local_rank / world_size per rank of a ``workers.ch01_env`` run."""
    rows = [{"RANK": d["env"]["RANK"], "GROUP_RANK (node)": d["env"]["GROUP_RANK"],
             "LOCAL_RANK": d["env"]["LOCAL_RANK"], "WORLD_SIZE": d["env"]["WORLD_SIZE"],
             "LOCAL_WORLD_SIZE": d["env"]["LOCAL_WORLD_SIZE"],
             "same MASTER_PORT": d["env"]["MASTER_PORT"] == result[0]["env"]["MASTER_PORT"]} for d in result.ranks]
    return str(Table.of(rows))


def device_table(result) -> str:
    """Which GPU each rank of a ``workers.ch01_env`` run would pick by local_rank, and by (wrongly) rank."""
    rows = []
    for d in result.ranks:
        rows.append({"rank": d["rank"], "node": d["node_rank"], "local_rank": d["local_rank"],
                     "cuda:local_rank": d["device_by_local_rank"],
                     "cuda:rank": d["device_by_rank"] + ("" if d["device_by_rank_exists"] else "  <- no such GPU on the node")})
    return str(Table.of(rows))


def fault_outcome(job):
    """Wait for a run with an injected fault (a ``Job``) and return the exception it ended with, or None if it succeeded."""
    from course_utils.results import WorkerFailed

    try:
        job.wait()
    except WorkerFailed as exc:  # JobTimeout is a WorkerFailed too
        return exc
    return None


def traceback_from(traceback_text: str, filename: str) -> str:
    """The end of a rank's traceback, from the last frame in ``filename`` (e.g. "rank_faults.py") on: the line of
    the worker that made the call, then the library frames under it, then the error. Paths under the
    repository are shown relative to it. The whole traceback if no frame is in ``filename``."""
    lines = traceback_text.strip().splitlines()
    frames = [i for i, line in enumerate(lines)
              if line.lstrip().startswith("File ") and re.search(rf'[/\\]{re.escape(filename)}"', line)]
    tail = lines[frames[-1]:] if frames else lines
    return "\n".join(line.replace(f"{ROOT}{os.sep}", "") for line in tail)


# -- 3. collectives: before/after grids ---------------------------------------------------------------

_UNDEFINED = "#f0f0f0"
_REDUCED = "#d9d9d9"


def _origin(value: float, n: int, width: int) -> int | None:
    """Source rank of a value built as 10 * (r + 1) + j, or None (a reduction, or ambiguous)."""
    if width >= 10 or value != int(value):
        return None
    v = int(value)
    r, j = v // 10 - 1, v % 10
    return r if 0 <= r < n and 0 <= j < width else None


def draw_tensors(ax, rows: list, *, title: str, n: int, width: int, defined: list[bool] | None = None,
                 fmt: str = "{:g}", colour_by_origin: bool = True) -> None:
    """One panel: row r is rank r's 1-D tensor, one cell per element, coloured by the rank the value came from."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colours = plt.get_cmap("tab10")
    defined = defined or [True] * n
    for r in range(n):
        t = rows[r]
        values = [] if t is None else [float(v) for v in t.flatten().tolist()]
        for j in range(width):
            if j >= len(values):
                ax.add_patch(Rectangle((j, r), 1, 1, facecolor="white", edgecolor="#cccccc", lw=0.5))
                continue
            v = values[j]
            if not defined[r]:
                face, colour = _UNDEFINED, "#999999"
            else:
                src = _origin(v, n, width) if colour_by_origin else None
                face, colour = ((colours(src % 10), "white") if src is not None else (_REDUCED, "black"))
            ax.add_patch(Rectangle((j, r), 1, 1, facecolor=face, edgecolor="white", lw=1.5,
                                   hatch="//" if not defined[r] else None))
            text = fmt.format(v)
            ax.text(j + 0.5, r + 0.5, text, ha="center", va="center", color=colour,
                    fontsize=8 if len(text) <= 4 else 6)
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(n, 0)
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
    ax.set_xticks([])
    ax.grid(False)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=9)


def collective_width(collective: str, n: int, chunk: int = 1) -> int:
    return 1 if collective == "barrier" else n * chunk


def draw_collective(ax_before, ax_after, result, collective: str, *, chunk: int = 1, label: str | None = None) -> None:
    """Before and after panels for one run of ``workers.ch01_collectives``."""
    n = result.world_size
    width = collective_width(collective, n, chunk)
    first = result[0]
    if "unsupported" in first:
        for ax in (ax_before, ax_after):
            ax.axis("off")
        ax_before.text(0, 0.5, f"{collective}: {first['unsupported']}", fontsize=8, wrap=True)
        return
    fmt = "{:.0f}" if collective == "barrier" else "{:g}"
    name = label or collective
    barrier = collective == "barrier"
    draw_tensors(ax_before, result.gather("before"), title=f"{name}: before" if not barrier else "barrier: late by (ms)",
                 n=n, width=width, fmt=fmt, colour_by_origin=not barrier)
    draw_tensors(ax_after, result.gather("after"), title="after" if not barrier else "waited inside (ms)", n=n, width=width,
                 fmt=fmt, defined=result.gather("defined"), colour_by_origin=not barrier)
    ax_after.set_yticks([])
    ax_before.text(0, n + 0.25, first["call"], fontsize=7.5, family="monospace", va="top", ha="left", clip_on=False)


def collective_panel(result, params: dict):
    """The widget's drawing: before/after for one collective (``params`` holds the run's settings)."""
    import matplotlib.pyplot as plt

    n = result.world_size
    fig, (ax_before, ax_after) = plt.subplots(1, 2, figsize=(2 + 1.1 * max(n, 2), 0.45 * n + 1.4))
    collective = params.get("collective", "all_reduce")
    draw_collective(ax_before, ax_after, result, collective, chunk=params.get("chunk", 1))
    if collective == "barrier":
        ok, margin = barrier_check(result)
        fig.suptitle(f"world {n}: no data to compare; {'nobody' if ok else 'a rank'} left before the last rank "
                     f"arrived (earliest exit - last arrival: {margin:+.0f} ms)", fontsize=9)
    elif "unsupported" not in result[0]:
        ok, err = compare_with_reference(result, collective, op=params.get("op", "sum"),
                                         chunk=params.get("chunk", 1), root=params.get("root", 0))
        fig.suptitle(f"world {n}: {'equal to' if ok else 'DIFFERENT from'} the single-process reference "
                     f"(max rel. error {err:.1e})", fontsize=9)
    fig.tight_layout()
    return fig


def collectives_figure(results: dict, *, chunk: int = 1, columns: int = 3):
    """A grid of before/after panel pairs, one pair per collective (``results``: name -> RunResult)."""
    import matplotlib.pyplot as plt

    names = list(results)
    rows = -(-len(names) // columns)
    n = next(iter(results.values())).world_size
    fig = plt.figure(figsize=(4.4 * columns, (0.42 * n + 1.0) * rows))
    ratios = ([1, 1, 0.36] * columns)[:-1]
    grid = fig.add_gridspec(rows, len(ratios), width_ratios=ratios, wspace=0.08, hspace=0.75)
    for i, name in enumerate(names):
        row, col = divmod(i, columns)
        ax_before, ax_after = fig.add_subplot(grid[row, 3 * col]), fig.add_subplot(grid[row, 3 * col + 1])
        draw_collective(ax_before, ax_after, results[name], name.split(" ")[0], chunk=chunk, label=name)
    fig.suptitle(f"Every collective on {n} real ranks (gloo). Colour = the rank a value came from; grey = reduced; "
                 "hatched = unspecified on that rank", fontsize=10)
    return fig


def compare_with_reference(result, collective: str, *, op: str = "sum", chunk: int = 1, root: int = 0,
                           rtol: float = 1e-6) -> tuple[bool, float]:
    """Do the ranks hold what a single process computes? Returns (all equal within rtol, max relative error).

    Ranks whose output is unspecified (reduce/gather away from the root) are skipped; float32 ranks are
    compared with a float64 reference, so ``rtol`` covers float32 rounding (products reach about 2e13 at
    world 8, past float32's exact integers). A barrier moves no data and has nothing to compare: it is
    refused here (use ``barrier_check``), so that no one reads "equal" for a comparison that was not made.
    """
    from workers.collectives.reference import reference

    if collective == "barrier":
        raise ValueError("a barrier moves no data, so there is no reference to compare with: "
                         "use barrier_check(result) for what a barrier promises")
    want = reference(collective, result.world_size, op, chunk, root)
    worst = 0.0
    for r in range(result.world_size):
        if want[r] is None or not result[r].get("defined", True):
            continue
        got = result[r]["after"].double()
        if got.shape != want[r].shape:
            return False, float("inf")
        rel = ((got - want[r]).abs() / want[r].abs().clamp_min(1e-30)).max().item()
        worst = max(worst, rel)
    return worst <= rtol, worst


BARRIER_TOL_MS = 50.0  # half the per-rank delay of the barrier demo: a rank leaving one step early fails


def barrier_check(result, tol_ms: float = BARRIER_TOL_MS) -> tuple[bool, float]:
    """A barrier's promise, measured: nobody leaves before the last rank has arrived.

    Each rank of the ``barrier`` demo reports how late it arrived (``before``, ms) and how long it then waited
    inside (``after``, ms), both on its own clock, counted from a first barrier. Rank r left at late_r +
    waited_r; the last arrival was at max(late). Returns (every rank left no earlier than max(late) - tol_ms,
    the earliest departure minus the last arrival in ms). ``tol_ms`` absorbs the skew with which ranks left
    the first barrier; it must stay below the demo's per-rank delay, or a barrier that waited for nobody
    would pass.
    """
    late = [float(d["before"][0]) for d in result.ranks]
    left = [a + float(d["after"][0]) for a, d in zip(late, result.ranks)]
    margin = min(left) - max(late)
    return margin >= -tol_ms, margin


# -- 4. bandwidth: nccl-tests definitions, the published curve, alpha-beta -----------------------------

def bandwidth_rows(result) -> list[dict]:
    """algbw and busbw (bytes/s) for each size of a ``workers.ch01_bandwidth`` run (nccl-tests' definitions)."""
    from course_utils.ledger import bus_bandwidth_factor

    d = result[0]
    n, collective = d["world_size"], d["collective"]
    factor = bus_bandwidth_factor(collective, n)
    rows = []
    for nbytes, seconds in zip(d["bytes"], d["seconds"]):
        algbw = nbytes / seconds
        rows.append({"collective": collective, "world_size": n, "bytes": nbytes, "seconds": seconds,
                     "algbw": algbw, "busbw": algbw * factor, "factor": factor})
    return rows


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Fit t = alpha + S / B; returns (alpha seconds, B bytes/s).

    Least squares on the *relative* error (each equation divided by its measured t), so a 4 KB point
    counts as much as a 16 MB point; alpha is clipped at 0 (a negative latency means the small sizes
    are noise), and then B is refitted alone.
    """
    import numpy as np

    S, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if len(S) < 2 or np.any(t <= 0):
        raise ValueError("alpha-beta needs at least two sizes with positive times")
    A = np.stack([1.0 / t, S / t], axis=1)
    (alpha, inv_b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if alpha < 0 or inv_b <= 0:
        alpha = 0.0
        inv_b = float(np.sum(S / t) / np.sum((S / t) ** 2))  # min sum (S/(B t) - 1)^2
    return float(alpha), float(1.0 / inv_b)


def bandwidth_figure(measured: dict[str, list[dict]], published: list[dict] | None = None,
                     fits: dict[str, tuple[float, float]] | None = None, *, published_label: str = ""):
    """Left: busbw vs size (measured curves and the published one). Right: time vs size with alpha-beta fits."""
    import matplotlib.pyplot as plt
    import numpy as np

    from course_utils.plots import CPU_NOTE, log2_axis

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in measured.items():
        S = [r["bytes"] for r in rows]
        ax_bw.plot(S, [r["busbw"] / 1e9 for r in rows], "o-", label=label)
        line, = ax_t.plot(S, [r["seconds"] * 1e6 for r in rows], "o", label=label)
        if fits and label in fits:
            alpha, B = fits[label]
            grid = np.geomspace(min(S), max(S), 50)
            ax_t.plot(grid, (alpha + grid / B) * 1e6, "-", color=line.get_color(), alpha=0.6,
                      label=f"fit: {alpha * 1e6:.0f} us + S / {B / 1e9:.2f} GB/s")
    if published:
        S = [r["bytes"] for r in published]
        ax_bw.plot(S, [r["busbw"] / 1e9 for r in published], "s-", color="black", label=published_label or "published")
        line, = ax_t.plot(S, [r["bytes"] / r["algbw"] * 1e6 for r in published], "s", color="black",
                          label=published_label or "published")
        if fits and "published" in fits:
            alpha, B = fits["published"]
            grid = np.geomspace(min(S), max(S), 50)
            ax_t.plot(grid, (alpha + grid / B) * 1e6, "-", color="black", alpha=0.5,
                      label=f"fit: {alpha * 1e6:.0f} us + S / {B / 1e9:.0f} GB/s")
    for ax in (ax_bw, ax_t):
        log2_axis(ax, label="message size S (bytes)")
        ax.set_yscale("log")
    ax_bw.set_ylabel("busbw (GB/s)")
    ax_bw.set_title("all_reduce bus bandwidth")
    ax_t.set_ylabel("time per all_reduce (us)")
    ax_t.set_title("time and the alpha-beta fit t = alpha + S/B")
    fig.tight_layout()
    for ax in (ax_bw, ax_t):  # below the plots: the curves span the whole axes
        ax.legend(fontsize=8.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.text(0.01, 1.0, f"gloo curves: {CPU_NOTE}. Black: published, not measured here.", fontsize=8.5)
    return fig


# -- 5. async timing -------------------------------------------------------------------------------------

def async_table(result) -> str:
    """Median milliseconds per measurement of a ``workers.ch01_async`` run: slowest rank, and the rank spread."""
    names = list(result[0]["ms"])
    rows = []
    for name in names:
        per_rank = [d["ms"][name] for d in result.ranks]
        rows.append({"measurement": name, "ms (slowest rank)": max(per_rank), "ms (fastest rank)": min(per_rank)})
    return str(Table.of(rows))
