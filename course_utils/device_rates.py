"""How fast a device does one piece of a training step: a matmul of a given shape, and bytes moved through memory.

A GPU's matmul rate depends on the shape: a 16384-wide square product reaches most of the peak, the narrow products
of a small model split over many GPUs a fraction of it. ``GemmTable`` holds measured throughputs by (m, n, k) and
dtype, each row with its source, and interpolates between them; ``gemm_table(device)`` loads the committed table
(``data/reference/gemm_throughput.csv``, published sweeps and the course's own H200 runs) for one device, and the
calibration of the learner's machine (``course_utils/calibration.py``) builds one from its own measurements, so the
planner prices a CPU rank with the same code that prices an H100.

Interpolation: inverse-distance weighting in log2(m), log2(n), log2(k) over the nearest measured shapes (an exact
match returns its own row), clamped to the table's range: throughput varies smoothly with the logarithm of the
sizes, and a query outside the table takes its nearest edge rather than an extrapolation.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import lru_cache

from .paths import DATA

GEMM_CSV = DATA / "reference" / "gemm_throughput.csv"


@dataclass(frozen=True)
class GemmRow:
    m: int
    n: int
    k: int
    flops: float  # FLOP/s measured: 2 m n k / seconds
    source: str = ""


@dataclass(frozen=True)
class GemmTable:
    """Measured matmul throughput of one device and dtype by shape; ``rate(m, n, k)`` interpolates (FLOP/s)."""

    device: str
    dtype: str
    rows: tuple[GemmRow, ...]
    neighbours: int = 4

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError(f"no measured matmul for {self.device} in {self.dtype}: the table needs at least one row.")

    @property
    def best(self) -> float:
        return max(r.flops for r in self.rows)

    def rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s for an (m x k) @ (k x n) product, interpolated in log2 sizes between measured shapes."""
        if min(m, n, k) <= 0:
            return self.best
        lo = [min(math.log2(getattr(r, d)) for r in self.rows) for d in "mnk"]
        hi = [max(math.log2(getattr(r, d)) for r in self.rows) for d in "mnk"]
        q = [min(max(math.log2(x), a), b) for x, a, b in zip((m, n, k), lo, hi)]
        dist = []
        for r in self.rows:
            d = math.sqrt(sum((qi - math.log2(ri)) ** 2 for qi, ri in zip(q, (r.m, r.n, r.k))))
            if d < 1e-9:
                return r.flops
            dist.append((d, r.flops))
        dist.sort()
        near = dist[: self.neighbours]
        weights = [1.0 / d**2 for d, _ in near]
        # interpolate log throughput: a rate two shapes away from two measurements is their geometric blend
        return math.exp(sum(w * math.log(f) for w, (_, f) in zip(weights, near)) / sum(weights))

    def seconds(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        """Time of ``count`` products of this shape."""
        return count * 2.0 * m * n * k / self.rate(m, n, k)


def _rows_from_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if line.strip() and not line.startswith("#")))


@lru_cache(maxsize=None)
def gemm_table(device: str, dtype: str = "bf16") -> GemmTable:
    """The committed measurements of ``device`` (a ``device`` column value, e.g. "h100-sxm") in ``dtype``."""
    rows = [GemmRow(int(r["m"]), int(r["n"]), int(r["k"]), float(r["tflops"]) * 1e12, r.get("source_key", ""))
            for r in _rows_from_csv(GEMM_CSV) if r["device"] == device and r["dtype"] == dtype]
    if not rows:
        known = sorted({(r["device"], r["dtype"]) for r in _rows_from_csv(GEMM_CSV)})
        raise ValueError(f"no matmul measurements for {device} in {dtype} in {GEMM_CSV.name}; it has {known}.")
    return GemmTable(device, dtype, tuple(rows))
