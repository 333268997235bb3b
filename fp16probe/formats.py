"""The one format registry: every format a ``--format`` names, with its exact bounds.

Plain formats (:data:`FORMATS`: fp16, bf16, fp8 e4m3/e5m2) are :class:`Format` entries whose
bounds derive from ``torch.finfo``; scaled formats (:data:`SCALED_FORMATS`: FP8 recipes, MXFP8,
NVFP4) are :class:`ScaledFormat` entries, an :class:`ElementFormat` (:data:`ELEMENTS`) and a
:class:`Family` (:data:`FAMILIES`: its recipes, default first, and the loss a layer may take).
A name is resolved once, at the entry (:func:`get_format`, :func:`get_scaled`); the layers
below take the resolved objects.

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

__all__ = ["ELEMENTS", "FAMILIES", "FORMATS", "SCALED_FORMATS", "ElementFormat", "Family", "Format",
           "ScaledFormat", "get_format", "get_scaled"]


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


@dataclass(frozen=True)
class ElementFormat:
    """One element format's limits as powers of two and sixteenths (every boundary is one).

    ``flush`` is ``min_subnormal / 2`` (round to nearest even sends the tie to zero);
    ``normal`` the smallest magnitude that rounds to ``min_normal`` (``min_normal -
    min_subnormal / 2``; the tie goes to the even ``min_normal``); ``overflow`` the
    magnitude half an ulp past ``max``, ``overflow_inclusive`` when that tie rounds away.
    """

    name: str
    max: float
    log2_min_normal: int
    mantissa_bits: int
    overflow_inclusive: bool

    @property
    def emax(self) -> int:
        """Return floor(log2 max), the exponent OCP subtracts in its FLOOR rule."""
        return math.frexp(self.max)[1] - 1

    @property
    def min_subnormal(self) -> float:
        """Return the smallest subnormal."""
        return math.ldexp(1.0, self.log2_min_normal - self.mantissa_bits)

    @property
    def flush(self) -> float:
        """Return the largest magnitude that rounds to 0."""
        return self.min_subnormal / 2

    @property
    def normal(self) -> float:
        """Return the smallest magnitude that rounds to min_normal or above."""
        return math.ldexp(1.0, self.log2_min_normal) - self.min_subnormal / 2

    @property
    def overflow(self) -> float:
        """Return max plus half its ulp."""
        return self.max + math.ldexp(1.0, self.emax - self.mantissa_bits - 1)



def _element_of(key: str, name: str) -> ElementFormat:
    f = FORMATS[key]
    return ElementFormat(name, f.max, f.log2_min_normal, f.mantissa_bits, f.overflow_inclusive)


# E2M1 has no torch.finfo; its values are ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (OCP MX spec v1.0,
# section 5.3.3), checked in the tests against that list and torchao's cast.
ELEMENTS: dict[str, ElementFormat] = {
    "e4m3": _element_of("fp8_e4m3", "e4m3"),
    "e5m2": _element_of("fp8_e5m2", "e5m2"),
    "e2m1": ElementFormat("e2m1", 6.0, 0, 1, overflow_inclusive=True),
}


@dataclass(frozen=True)
class Family:
    """A family of scaled formats: the statistics the capture counts for it, and how it is judged.

    ``recipes`` are the scaling recipes to judge, the default (what TransformerEngine does out of
    the box) first; ``parametrised`` those that take ``:``-separated parameters (FP8's delayed
    scaling); ``threshold`` the share of a layer's nonzero values it may lose.
    """

    name: str
    recipes: tuple[str, ...]
    threshold: float
    parametrised: tuple[str, ...] = ()


# The loss a layer may take: 0.1% as for fp16 (the project's max_flushed_fraction); for NVFP4 10%,
# since E2M1 flushes what lies more than log2(6 / 0.25) = 4.6 binades below its block's max: a
# block of 16 Gaussian values loses about 6-7% by design, and the NVFP4 paper trains with that.
FAMILIES: dict[str, Family] = {
    "fp8": Family("fp8", ("current", "delayed", "rowwise", "blockwise"), 1e-3, parametrised=("delayed",)),
    "mx": Family("mx", ("rceil", "floor", "ceil", "even"), 1e-3),
    "nvfp4": Family("nvfp4", ("torchao", "cast", "16x16"), 0.1),
}


@dataclass(frozen=True)
class ScaledFormat:
    """A scaled format: each block of values shares one scale and is cast to ``element``."""

    name: str
    element: ElementFormat
    family: Family

    def element_for(self, kind: str) -> ElementFormat:
        """The element a tensor of ``kind`` is cast to: e5m2 formats are TE's HYBRID (forward operands stay e4m3)."""
        if self.element.name == "e5m2" and kind in ("input", "weight"):
            return ELEMENTS["e4m3"]
        return self.element


def _scaled(name: str, element: str, family: str) -> ScaledFormat:
    return ScaledFormat(name, ELEMENTS[element], FAMILIES[family])


# --format names whose analysis needs the scaled-format statistics, and what each counts.
SCALED_FORMATS: dict[str, ScaledFormat] = {
    f.name: f for f in (
        _scaled("fp8_e4m3", "e4m3", "fp8"),
        _scaled("fp8_e5m2", "e5m2", "fp8"),
        _scaled("mxfp8_e4m3", "e4m3", "mx"),
        _scaled("mxfp8_e5m2", "e5m2", "mx"),
        _scaled("nvfp4", "e2m1", "nvfp4"),
    )
}


def get_scaled(name: str | ScaledFormat) -> ScaledFormat | None:
    """Return the scaled format called ``name``, or None when ``name`` is no scaled format's."""
    if isinstance(name, ScaledFormat):
        return name
    return SCALED_FORMATS.get(name)
