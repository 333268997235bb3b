"""Number formats and their exact bounds, derived from ``torch.finfo``.

Every bound is a power of two or is checked against torch's own casts in the tests.
Magnitudes are described by their log2 where they are powers of two, so that the
statistics can answer "what flushes at S = 2^k" with integer arithmetic.
"""

from __future__ import annotations

import math
from typing import Any
from dataclasses import dataclass

import torch

from fp16probe.errors import UnknownFormatError

__all__ = ["FORMATS", "Format", "get_format"]


@dataclass(frozen=True)
class Format:
    """The range of one floating-point format.

    ``flush_threshold`` is the largest magnitude that rounds to zero under
    round-to-nearest-even (half the smallest subnormal: the tie goes to the even zero).
    ``overflow_threshold`` is the smallest magnitude that rounds past ``max`` (half an
    ulp above it); whether a value exactly at the threshold overflows depends on the
    parity of ``max``'s last mantissa bit, recorded in ``overflow_inclusive``.
    """

    name: str
    dtype: torch.dtype
    max: float
    min_normal: float
    min_subnormal: float
    flush_threshold: float
    overflow_threshold: float
    overflow_inclusive: bool
    has_inf: bool
    mantissa_bits: int

    @property
    def log2_min_normal(self) -> int:
        """Return log2 of the smallest normal value."""
        return _exact_log2(self.min_normal)

    @property
    def log2_min_subnormal(self) -> int:
        """Return log2 of the smallest subnormal value."""
        return _exact_log2(self.min_subnormal)

    @property
    def log2_flush_threshold(self) -> int:
        """log2 of the largest magnitude that becomes 0 when cast (round to nearest even)."""
        return self.log2_min_subnormal - 1

    def overflows(self, magnitude: float) -> bool:
        """Whether a value of this magnitude, cast to the format, lands beyond ``max``.

        For formats without inf (fp8 e4m3fn) "beyond max" means NaN or saturation,
        depending on the cast: torch's CPU build saturates, the OCP spec's
        non-saturating mode gives NaN.
        """
        if math.isnan(magnitude):
            return True
        if self.overflow_inclusive:
            return magnitude >= self.overflow_threshold
        return magnitude > self.overflow_threshold

    def to_dict(self) -> dict[str, Any]:
        """Return the format's limits as JSON-ready numbers."""
        return {
            "name": self.name,
            "dtype": str(self.dtype),
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "flush_threshold": self.flush_threshold,
            "overflow_threshold": self.overflow_threshold,
            "overflow_inclusive": self.overflow_inclusive,
        }


def _exact_log2(value: float) -> int:
    mantissa, exponent = math.frexp(value)
    if mantissa != 0.5:
        raise ValueError(f"{value!r} is not a power of two")
    return exponent - 1


def _from_finfo(name: str, dtype: torch.dtype, has_inf: bool) -> Format:
    info = torch.finfo(dtype)
    max_finite = float(info.max)
    min_normal = float(info.smallest_normal)
    eps = float(info.eps)
    min_subnormal = min_normal * eps
    mantissa_bits = -_exact_log2(eps)
    # The ulp at max: max lies in [2^E, 2^(E+1)), its spacing is 2^E * eps.
    ulp_at_max = 2.0 ** math.floor(math.log2(max_finite)) * eps
    last_mantissa_odd = int(max_finite / ulp_at_max) % 2 == 1
    # At the tie max + ulp/2, round-to-nearest-even goes away from max when max is odd.
    return Format(
        name=name,
        dtype=dtype,
        max=max_finite,
        min_normal=min_normal,
        min_subnormal=min_subnormal,
        flush_threshold=min_subnormal / 2,
        overflow_threshold=max_finite + ulp_at_max / 2,
        overflow_inclusive=last_mantissa_odd,
        has_inf=has_inf,
        mantissa_bits=mantissa_bits,
    )


FORMATS: dict[str, Format] = {
    "fp16": _from_finfo("fp16", torch.float16, has_inf=True),
    "bf16": _from_finfo("bf16", torch.bfloat16, has_inf=True),
    "fp8_e4m3": _from_finfo("fp8_e4m3", torch.float8_e4m3fn, has_inf=False),
    "fp8_e5m2": _from_finfo("fp8_e5m2", torch.float8_e5m2, has_inf=True),
}

_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "e4m3": "fp8_e4m3",
    "fp8-e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "fp8-e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


def get_format(name: str | Format) -> Format:
    """Return the Format called ``name`` (``fp16``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``)."""
    if isinstance(name, Format):
        return name
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    try:
        return FORMATS[key]
    except KeyError:
        known = ", ".join(FORMATS)
        raise UnknownFormatError(
            f"unknown format {name!r}: expected one of {known}"
        ) from None
