"""FP8 quantisation in plain torch: E4M3 and E5M2, per-tensor, per-tile and per-block scales.

Formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", Table 1):

- E4M3: 4 exponent bits, 3 mantissa bits, no infinities; largest normal 448, smallest normal 2^-6,
  smallest subnormal 2^-9. torch.float8_e4m3fn. Used for weights and activations.
- E5M2: 5 exponent bits, 2 mantissa bits, IEEE-like; largest normal 57344, smallest normal 2^-14,
  smallest subnormal 2^-16. torch.float8_e5m2. Used for gradients (more range, less precision).

Rounding is torch's own cast (round to nearest even); values are scaled first so that the group's
largest magnitude lands on the format's largest value, ``scale = fp8_max / amax`` (Transformer
Engine's recipe; a ``margin`` divides the scale by 2^margin), and saturated to +-fp8_max before the
cast: a plain cast is not guaranteed to saturate (E5M2 overflows to inf; what E4M3, which has no
inf, does with out-of-range values has differed between torch versions and devices).

Scaling granularity (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 3.3.2,
"Fine-Grained Quantization"):

- ``"tensor"``: one scale for the whole tensor;
- ``"tile"``: one scale per 1 x 128 group along the last dimension (DeepSeek-V3's activations: per
  token, per 128 channels);
- ``"block"``: one scale per 128 x 128 block (DeepSeek-V3's weights).

A single outlier channel forces a small per-tensor scale on every value; finer groups confine the
damage to the groups that contain it.

Scaling in time (Transformer Engine user guide, "FP8 Current Scaling" and "FP8 Delayed Scaling"):
*current* scaling takes amax from the tensor being cast (two reads of the tensor: amax, then cast);
*delayed* scaling takes it from a history of earlier steps' amaxes (``DelayedScaling`` below),
which saves the first read but clips when the tensor suddenly grows.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite value
    min_normal: float
    min_subnormal: float
    mantissa_bits: int


# Micikevicius et al. 2022, Table 1; torch.finfo agrees on max and min_normal.
E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9, 3)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16, 2)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}

GRANULARITIES = ("tensor", "tile", "block")
BLOCK = 128  # DeepSeek-V3 sec 3.3.2: 1 x 128 tiles and 128 x 128 blocks


def fp8_format(fmt: str | Fp8Format) -> Fp8Format:
    if isinstance(fmt, Fp8Format):
        return fmt
    key = str(fmt).lower()
    if key not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; use 'e4m3' or 'e5m2'.")
    return FORMATS[key]


def round_to_fp8(x: torch.Tensor, fmt: str | Fp8Format = "e4m3") -> torch.Tensor:
    """Round ``x`` (already scaled) to the nearest FP8 value, saturating at +-max; returns float32."""
    f = fp8_format(fmt)
    return x.float().clamp(-f.max, f.max).to(f.dtype).float()


def compute_scale(amax: torch.Tensor | float, fmt: str | Fp8Format = "e4m3", *, margin: int = 0,
                  power_of_two: bool = False) -> torch.Tensor:
    """scale = fp8_max / amax / 2^margin, so that amax maps to the format's largest value.

    Zero or non-finite amax gives scale 1 (nothing to scale; Transformer Engine keeps the previous
    scale in that case). ``power_of_two=True`` rounds the scale down to a power of two, so scaling is
    exact and amax still cannot overflow (the shared-exponent scales of the OCP Microscaling spec).
    """
    f = fp8_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    scale = f.max / amax / (2.0**margin)
    scale = torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


@dataclass(frozen=True)
class Fp8Tensor:
    """FP8 data with its float32 scales; ``data.float() / scale`` recovers the values."""

    data: torch.Tensor  # float8 dtype, same shape as the original
    # float32 scales: shape () per tensor, (rows, ceil(cols/128)) per tile, (ceil(rows/128), ceil(cols/128)) per block
    scale: torch.Tensor
    fmt: Fp8Format
    granularity: str

    def dequantize(self) -> torch.Tensor:
        return self.data.float() / _expand(self.scale, self.data.shape, self.granularity)

    @property
    def nbytes(self) -> int:
        """Bytes of FP8 data plus float32 scales: what FP8 storage costs in the memory ledger."""
        return self.data.numel() * 1 + self.scale.numel() * 4


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """View x as a matrix (rows, last dim); a vector is one row."""
    return x.reshape(1, -1) if x.dim() == 1 else x.reshape(-1, x.shape[-1])


def _group_amax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity == "tensor":
        return x.abs().max()
    rows = _as_rows(x).abs().float()
    r, c = rows.shape
    cols_padded = math.ceil(c / BLOCK) * BLOCK
    rows = torch.nn.functional.pad(rows, (0, cols_padded - c))  # zeros never raise an amax
    if granularity == "tile":
        return rows.reshape(r, cols_padded // BLOCK, BLOCK).amax(dim=-1)
    rows_padded = math.ceil(r / BLOCK) * BLOCK
    rows = torch.nn.functional.pad(rows, (0, 0, 0, rows_padded - r))
    blocks = rows.reshape(rows_padded // BLOCK, BLOCK, cols_padded // BLOCK, BLOCK)
    return blocks.amax(dim=(1, 3))


def _expand(scale: torch.Tensor, shape: torch.Size, granularity: str) -> torch.Tensor:
    """Broadcast group scales back to the tensor's shape."""
    if granularity == "tensor":
        return scale
    c = shape[-1]
    r = math.prod(shape[:-1]) if len(shape) > 1 else 1
    full = scale.repeat_interleave(BLOCK, dim=-1)[..., :c]
    if granularity == "block":
        full = full.repeat_interleave(BLOCK, dim=0)[:r]
    return full.reshape(shape)


def quantize(x: torch.Tensor, fmt: str | Fp8Format = "e4m3", granularity: str = "tensor", *,
             scale: torch.Tensor | float | None = None, margin: int = 0, power_of_two: bool = False) -> Fp8Tensor:
    """Quantize ``x`` to FP8 with one scale per tensor, per 1 x 128 tile or per 128 x 128 block.

    Without ``scale`` this is current scaling: amax is taken from ``x`` itself. Passing ``scale``
    (delayed scaling) uses it as given; values beyond the format's range then saturate. ``"tile"``
    groups run along the last dimension; ``"block"`` needs at least two dimensions (leading ones
    are flattened into rows).
    """
    f = fp8_format(fmt)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}.")
    if not torch.is_floating_point(x):
        raise ValueError(f"quantize needs a floating-point tensor, got {x.dtype}.")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError("quantize needs a non-empty tensor with at least one dimension.")
    if granularity == "block" and x.dim() < 2:
        raise ValueError("block (128 x 128) scaling needs a tensor with at least two dimensions; use 'tile'.")
    if not torch.isfinite(x).all():
        raise ValueError("x contains inf or NaN; FP8 scaling needs finite values (check for an overflow upstream).")
    if scale is None:
        scale = compute_scale(_group_amax(x, granularity), f, margin=margin, power_of_two=power_of_two)
    else:
        scale = torch.as_tensor(scale, dtype=torch.float32)
    scaled = x.float() * _expand(scale, x.shape, granularity)
    data = scaled.clamp(-f.max, f.max).to(f.dtype)
    return Fp8Tensor(data=data, scale=scale, fmt=f, granularity=granularity)


def fake_quantize(x: torch.Tensor, fmt: str | Fp8Format = "e4m3", granularity: str = "tensor",
                  **kwargs) -> torch.Tensor:
    """quantize then dequantize: the float32 values an FP8 GEMM would actually see."""
    return quantize(x, fmt, granularity, **kwargs).dequantize()


def relative_error(x: torch.Tensor, approx: torch.Tensor) -> float:
    """||x - approx|| / ||x|| (Frobenius)."""
    return float((x.float() - approx.float()).norm() / x.float().norm())


def saturated_fraction(x: torch.Tensor, scale: torch.Tensor | float, fmt: str | Fp8Format = "e4m3") -> float:
    """Fraction of elements a per-tensor ``scale`` pushes beyond the format's range (they get clipped)."""
    f = fp8_format(fmt)
    return float(((x.float().abs() * torch.as_tensor(scale, dtype=torch.float32)) > f.max).float().mean())


def current_scale(x: torch.Tensor, fmt: str | Fp8Format = "e4m3", *, margin: int = 0) -> torch.Tensor:
    """Current (just-in-time) per-tensor scale: amax of ``x`` itself."""
    return compute_scale(x.abs().max(), fmt, margin=margin)


class DelayedScaling:
    """Per-tensor delayed scaling with an amax history (Transformer Engine's ``DelayedScaling``).

    As in TE's recipe: compute scale = fp8_max / amax / 2^margin from the history, cast (values
    beyond range are clipped), then record this tensor's amax. So the scale used at step k only
    knows steps < k. ``amax_compute_algo`` is "max" (largest amax in the window, TE's default) or
    "most_recent". TE's default window is 1024 steps; the short default here makes a demo visible.
    With an empty history the scale is 1.
    """

    def __init__(self, fmt: str | Fp8Format = "e4m3", *, history_len: int = 16,
                 amax_compute_algo: str = "max", margin: int = 0) -> None:
        if history_len < 1:
            raise ValueError(f"history_len must be at least 1, got {history_len}.")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}.")
        self.fmt = fp8_format(fmt)
        self.history: deque[float] = deque(maxlen=history_len)
        self.amax_compute_algo = amax_compute_algo
        self.margin = margin

    @property
    def scale(self) -> torch.Tensor:
        if not self.history:
            return torch.tensor(1.0)
        amax = max(self.history) if self.amax_compute_algo == "max" else self.history[-1]
        return compute_scale(amax, self.fmt, margin=self.margin)

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        q = quantize(x, self.fmt, "tensor", scale=self.scale)
        self.history.append(float(x.abs().max()))
        return q
