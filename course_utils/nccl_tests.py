"""Read and write NVIDIA/nccl-tests' result tables (``all_reduce_perf -b 8 -e 8G -f 2 -g 8``).

A table looks like this (nccl-tests 2.x; the published runs the course quotes use it)::

    #                                                              out-of-place                       in-place
    #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
    #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
         4218900       1054725     float     sum      -1   1011.4    4.17    6.26      0    993.6    4.25    6.37      0
    # Out of bounds values : 0 OK
    # Avg bus bandwidth    : 6.31306

Everything else is a ``#`` comment (the command line, the ``Rank N ... device`` lines, the footer). The
columns vary across versions: older releases have no ``root`` column and an ``error`` column (``0e+00``)
instead of ``#wrong``; ``-c 0`` prints ``N/A`` for the check; all_gather prints ``none`` as its redop. The
parser therefore reads the column names from the header line and falls back to counting from the right.

What the numbers mean (NVIDIA/nccl-tests, doc/PERFORMANCE.md): ``time`` is microseconds per call,
``algbw = S / t`` in GB/s (1e9 bytes/s) with S the ``size`` column, and ``busbw = algbw x factor`` with the
factor of ``course_utils.ledger.bus_bandwidth_factor`` (2(n-1)/n for all_reduce), so that busbw can be
compared with a link's bandwidth whatever the rank count.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

GBPS = 1e9  # nccl-tests divides by 1.0E9: its "GB/s" is decimal
_RANK_LINE = re.compile(r"^#\s*Rank\s+\d+\b")
_AVG = re.compile(r"Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_OOB = re.compile(r"Out of bounds values\s*:\s*(\d+)")


@dataclass(frozen=True)
class Measurement:
    """One half of a row (out-of-place or in-place): microseconds, GB/s, GB/s and the check column."""

    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: float | None  # number of wrong elements (or the old max error); None for "N/A" (-c 0)


@dataclass(frozen=True)
class NcclTestsRow:
    size_bytes: int
    count: int
    dtype: str
    redop: str | None
    root: int | None
    out_of_place: Measurement
    in_place: Measurement | None = None


@dataclass
class NcclTestsReport:
    rows: list[NcclTestsRow]
    n_ranks: int | None = None  # from the "# Rank N ..." lines, else nThread x nGpus
    avg_busbw_GBps: float | None = None
    out_of_bounds: int | None = None
    comments: list[str] = field(default_factory=list)


class NcclTestsParseError(ValueError):
    pass


def _number(token: str) -> float | None:
    return None if token.upper() in ("N/A", "NA", "-") else float(token)


def _columns(line: str) -> list[str] | None:
    """The column names of a header line ("# size count type ... time algbw busbw #wrong ..."), else None."""
    tokens = line.lstrip("#").split()
    if len(tokens) < 5 or tokens[0] != "size" or "count" not in tokens or "time" not in tokens:
        return None
    return tokens


def _measurements(values: list[str], n_groups: int) -> list[Measurement]:
    out = []
    for g in range(n_groups):
        t, alg, bus, wrong = values[4 * g: 4 * g + 4]
        out.append(Measurement(float(t), float(alg), float(bus), _number(wrong)))
    return out


def _row(tokens: list[str], leading: list[str], n_groups: int) -> NcclTestsRow:
    head = dict(zip(leading, tokens[:len(leading)]))
    halves = _measurements(tokens[len(leading):], n_groups)
    redop = head.get("redop")
    root = head.get("root")
    return NcclTestsRow(size_bytes=int(head["size"]), count=int(head["count"]), dtype=head.get("type", "?"),
                        redop=None if redop in (None, "none") else redop,
                        root=None if root in (None, "-1") else int(root),
                        out_of_place=halves[0], in_place=halves[1] if n_groups > 1 else None)


def parse(text: str) -> NcclTestsReport:
    """Every result row of an nccl-tests output (stdout as printed, ``NCCL INFO`` lines may be mixed in)."""
    leading, n_groups = None, 2
    report = NcclTestsReport(rows=[])
    threads = gpus = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            report.comments.append(line)
            cols = _columns(line)
            if cols:
                first_time = cols.index("time")
                leading, n_groups = cols[:first_time], cols.count("time")
            if _RANK_LINE.match(line):
                report.n_ranks = (report.n_ranks or 0) + 1
            if m := _AVG.search(line):
                report.avg_busbw_GBps = float(m.group(1))
            if m := _OOB.search(line):
                report.out_of_bounds = int(m.group(1))
            if m := re.search(r"nThread\s+(\d+)\s+nGpus\s+(\d+)", line):
                threads, gpus = int(m.group(1)), int(m.group(2))
            continue
        tokens = line.split()
        if not tokens[0].isdigit():  # an NCCL INFO/WARN line, or anything else a rank printed
            continue
        cols = leading or _guess_leading(tokens)
        if len(tokens) != len(cols) + 4 * n_groups:
            raise NcclTestsParseError(f"row {line!r} has {len(tokens)} fields; the header announces "
                                      f"{len(cols) + 4 * n_groups} ({' '.join(cols)} + {n_groups} x time/algbw/busbw/wrong)")
        report.rows.append(_row(tokens, cols, n_groups))
    if report.n_ranks is None and threads is not None:
        report.n_ranks = threads * gpus  # single process, -t threads x -g GPUs each (multi-process adds Rank lines)
    if not report.rows:
        raise NcclTestsParseError("no result rows found: is this the output of an nccl-tests *_perf binary?")
    return report


def _guess_leading(tokens: list[str]) -> list[str]:
    """No header seen: two groups of four on the right, the rest size/count/type[/redop[/root]]."""
    names = ["size", "count", "type", "redop", "root"]
    n_lead = len(tokens) - 8
    if not 3 <= n_lead <= 5:
        raise NcclTestsParseError(f"cannot tell the columns of {' '.join(tokens)!r} without a header line")
    return names[:n_lead]


# -- writing: the course's own numbers in the same format -------------------------------------------------------

def measurement(collective: str, size_bytes: int, seconds: float, n_ranks: int, wrong: float | None = 0) -> Measurement:
    """time (us), algbw and busbw (GB/s) of one timing, nccl-tests' definitions and the ledger's factor."""
    from course_utils.ledger import bus_bandwidth_factor

    algbw = size_bytes / seconds / GBPS
    return Measurement(seconds * 1e6, algbw, algbw * bus_bandwidth_factor(collective, n_ranks), wrong)


def rows_from_timings(collective: str, sizes: list[int], seconds: list[float], n_ranks: int,
                      dtype: str = "float") -> list[NcclTestsRow]:
    """Rows for a ``workers.ch01_bandwidth`` result (float32: count = bytes / 4); out-of-place only."""
    redop = "sum" if collective in ("all_reduce", "reduce_scatter", "reduce") else "none"
    root = 0 if collective in ("broadcast", "reduce") else None
    return [NcclTestsRow(size_bytes=int(s), count=int(s) // 4, dtype=dtype, redop=redop, root=root,
                         out_of_place=measurement(collective, int(s), t, n_ranks))
            for s, t in zip(sizes, seconds)]


def _time_str(us: float) -> str:
    # nccl-tests' own precision: fewer decimals as the time grows (src/common.cu)
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def _half(m: Measurement) -> str:
    wrong = "N/A" if m.wrong is None else f"{m.wrong:g}"
    return f" {_time_str(m.time_us)} {m.algbw_GBps:7.2f} {m.busbw_GBps:7.2f} {wrong:>6}"


def format_table(rows: list[NcclTestsRow], *, comments: tuple[str, ...] = ()) -> str:
    """nccl-tests' table for ``rows`` (the in-place half only if every row has one), with its footer."""
    both = all(r.in_place is not None for r in rows)
    groups = ("out-of-place", "in-place") if both else ("out-of-place",)
    half_cols = "     time   algbw   busbw #wrong"
    half_units = "     (us)  (GB/s)  (GB/s)       "
    lines = [f"# {c}" for c in comments] + ["#"]
    lines.append("#" + " " * 58 + "".join(f"{g:<32}" for g in groups).rstrip())
    lines.append(f"# {'size':>10} {'count':>13} {'type':>9} {'redop':>7} {'root':>7}" + half_cols * len(groups))
    lines.append(f"# {'(B)':>10} {'(elements)':>13} {'':>9} {'':>7} {'':>7}" + (half_units * len(groups)).rstrip())
    for r in rows:
        root = -1 if r.root is None else r.root
        line = f"  {r.size_bytes:>10} {r.count:>13} {r.dtype:>9} {r.redop or 'none':>7} {root:>7}" + _half(r.out_of_place)
        if both:
            line += _half(r.in_place)
        lines.append(line)
    values = [m.busbw_GBps for r in rows for m in ((r.out_of_place, r.in_place) if both else (r.out_of_place,))]
    lines.append("# Out of bounds values : 0 OK")
    lines.append(f"# Avg bus bandwidth    : {sum(values) / len(values):g}")
    lines.append("#")
    return "\n".join(lines)


def decimals(token: str) -> int:
    """Digits after the point in a printed number: the table's rounding is half a unit of the last one."""
    return len(token.split(".")[1]) if "." in token else 0


def parse_tuning_table(text: str) -> dict[str, dict[str, tuple[float, float]]]:
    """Read the table NCCL prints with ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`` (NCCL 2.19 and later).

    Returns ``{collective: {"Algorithm/Protocol": (latency us, algbw GB/s)}}`` from lines such as::

        ... NCCL INFO   Algorithm   |        Tree        |        Ring        | ...
        ... NCCL INFO   Protocol    |  LL | LL128 | Simple |  LL | LL128 | Simple | ...
        ... NCCL INFO     AllReduce | 16.8/ 0.5 | 31.0/ 0.0 | 36.4/ 1.9 | 16.6/ 1.2 | ...

    The table comes in blocks of three algorithms; each ``Algorithm`` line starts a block. These are the numbers
    NCCL's cost model (``src/graph/tuning.cc``) computed for this communicator, not measurements.
    """
    table: dict[str, dict[str, tuple[float, float]]] = {}
    columns: list[str] = []
    algorithms: list[str] = []
    for line in text.splitlines():
        body = line.split("NCCL INFO", 1)[1] if "NCCL INFO" in line else line
        if "|" not in body:
            continue
        name, *cells = [c.strip() for c in body.split("|")]
        cells = [c for c in cells if c]
        if name == "Algorithm":
            algorithms = cells
        elif name == "Protocol":
            per_algo = len(cells) // max(len(algorithms), 1)
            columns = [f"{a}/{q}" for i, a in enumerate(algorithms) for q in cells[i * per_algo:(i + 1) * per_algo]]
        elif columns and cells and all("/" in c for c in cells):
            row = table.setdefault(name, {})
            for col, cell in zip(columns, cells):
                lat, bw = (float(v) for v in cell.split("/"))
                row[col] = (lat, bw)
    if not table:
        raise NcclTestsParseError("no NCCL tuning table found: run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING")
    return table
