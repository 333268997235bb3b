"""Histograms of log2 magnitudes: the bin layout every stage shares, and the Histogram data.

Bin ``e`` holds the magnitudes in ``(2^(e-1), 2^e]``, for ``e`` from -149 (the fp32
minimum subnormal) to 128 (the largest finite fp32 values). Exact zeros, infinities and
NaNs are counted apart. Every format's flush-to-zero threshold ``min_subnormal / 2`` is a
bin's upper edge for every power-of-two scale, so "how many values flush at S = 2^k" is a
sum of whole bins: exact, ties included.

Plain host-side data: nothing here touches a model or a device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from fp16probe.formats import Format, get_format
from fp16probe.validation import check_histogram

__all__ = [
    "MAX_EXP",
    "MIN_EXP",
    "NUM_BINS",
    "NUM_EXP_BINS",
    "SLOT_INF",
    "SLOT_NAN",
    "SLOT_ZERO",
    "Histogram",
]

MIN_EXP = -149
MAX_EXP = 128
NUM_EXP_BINS = MAX_EXP - MIN_EXP + 1  # 278
SLOT_ZERO = NUM_EXP_BINS  # 278
SLOT_INF = NUM_EXP_BINS + 1  # 279
SLOT_NAN = NUM_EXP_BINS + 2  # 280
NUM_BINS = NUM_EXP_BINS + 3  # 281: the length of a canonical count vector


@dataclass(frozen=True)
class Histogram:
    """Counts of values per power-of-two magnitude bin, as measured.

    ``counts[i]`` counts magnitudes in ``(2^(e-1), 2^e]`` for ``e = MIN_EXP + i``
    (-149 to 128, the whole fp32 range). Zeros, infinities and NaNs are counted apart.
    ``max_abs`` is the largest finite magnitude (0.0 when there is none).
    """

    counts: tuple[int, ...] = (0,) * NUM_EXP_BINS
    zero: int = 0
    inf: int = 0
    nan: int = 0
    max_abs: float = 0.0

    def __post_init__(self) -> None:
        if len(self.counts) != NUM_EXP_BINS:
            raise ValueError(f"expected {NUM_EXP_BINS} bin counts, got {len(self.counts)}")

    # -- totals --------------------------------------------------------------------
    @property
    def total(self) -> int:
        """Return the number of values counted, zeros and inf/NaN included."""
        return sum(self.counts) + self.zero + self.inf + self.nan

    @property
    def nonzero_finite(self) -> int:
        """Return the number of nonzero finite values."""
        return sum(self.counts)

    @property
    def nonfinite(self) -> int:
        """Return the number of inf and NaN values."""
        return self.inf + self.nan

    def count(self, e: int) -> int:
        """Values with magnitude in ``(2^(e-1), 2^e]``."""
        if e < MIN_EXP or e > MAX_EXP:
            return 0
        return self.counts[e - MIN_EXP]

    def at_most(self, log2_bound: int) -> int:
        """Nonzero finite values with magnitude ``<= 2^log2_bound`` (exact)."""
        hi = min(log2_bound, MAX_EXP) - MIN_EXP
        if hi < 0:
            return 0
        return sum(self.counts[: hi + 1])

    def between(self, log2_lo: int, log2_hi: int) -> int:
        """Nonzero finite values with magnitude in ``(2^log2_lo, 2^log2_hi]`` (exact)."""
        if log2_hi <= log2_lo:
            return 0
        return self.at_most(log2_hi) - self.at_most(log2_lo)

    @property
    def lowest_exp(self) -> int | None:
        """The lowest occupied bin, or None when there are no nonzero finite values."""
        for i, c in enumerate(self.counts):
            if c:
                return MIN_EXP + i
        return None

    @property
    def highest_exp(self) -> int | None:
        """Return the highest occupied bin, or None when there are no nonzero finite values."""
        for i in range(NUM_EXP_BINS - 1, -1, -1):
            if self.counts[i]:
                return MIN_EXP + i
        return None

    # -- what-if at S = 2^k --------------------------------------------------------
    def flushed(self, fmt: str | Format, log2_scale: int = 0) -> int:
        """Nonzero finite values that become 0 when ``x * 2^log2_scale`` is cast to ``fmt``.

        Exact: the cast rounds to nearest even, so ``|x S| <= min_subnormal / 2`` flushes,
        and that bound is a bin edge for every power-of-two S.
        """
        fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
        return self.at_most(fmt.log2_flush_threshold - log2_scale)

    def subnormal(self, fmt: str | Format, log2_scale: int = 0) -> int:
        """Values that survive the cast but sit at or below the format's min normal.

        Counts ``|x S|`` in ``(min_subnormal / 2, min_normal]``: the boundary bin holds
        exactly ``min_normal`` too, which is normal, and values just below min normal
        may round up to it; so this is an upper bound, tight in practice.
        """
        fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
        return self.between(fmt.log2_flush_threshold - log2_scale, fmt.log2_min_normal - log2_scale)

    def overflows(self, fmt: str | Format, log2_scale: int = 0) -> bool:
        """Whether any value would land beyond the format's max at S = 2^log2_scale.

        Exact for finite values (from ``max_abs``); an inf or NaN already present
        overflows at any scale.
        """
        fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
        if self.inf or self.nan:
            return True
        if self.max_abs == 0.0:
            return False
        return fmt.overflows(math.ldexp(self.max_abs, log2_scale))

    # -- combining -----------------------------------------------------------------
    def __add__(self, other: "Histogram") -> "Histogram":
        if not isinstance(other, Histogram):
            return NotImplemented
        return Histogram(
            counts=tuple(a + b for a, b in zip(self.counts, other.counts)),
            zero=self.zero + other.zero,
            inf=self.inf + other.inf,
            nan=self.nan + other.nan,
            max_abs=max(self.max_abs, other.max_abs),
        )

    @staticmethod
    def sum(histograms: Iterable["Histogram"]) -> "Histogram":
        """Return the bin-wise sum of ``histograms`` (an empty Histogram for none)."""
        out = Histogram()
        for h in histograms:
            out = out + h
        return out

    # -- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "bins": {str(MIN_EXP + i): c for i, c in enumerate(self.counts) if c},
            "zero": self.zero,
            "inf": self.inf,
            "nan": self.nan,
            "max_abs": self.max_abs,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "histogram") -> "Histogram":
        """Build a histogram from its JSON; a bad field raises ReportFieldError naming ``path``."""
        check_histogram(d, path, MIN_EXP, MAX_EXP)
        counts = [0] * NUM_EXP_BINS
        for key, c in d["bins"].items():
            counts[int(key) - MIN_EXP] = c
        return cls(counts=tuple(counts), zero=d["zero"], inf=d["inf"], nan=d["nan"], max_abs=float(d["max_abs"]))

    @classmethod
    def from_values(cls, counts_by_exp: Mapping[int, int], *, zero: int = 0, inf: int = 0,
                    nan: int = 0, max_abs: float | None = None) -> "Histogram":
        """Build a histogram by hand: ``{e: count}`` for bins ``(2^(e-1), 2^e]``.

        ``max_abs`` defaults to the top occupied bin's upper edge, ``2^e``.
        """
        counts = [0] * NUM_EXP_BINS
        for e, c in counts_by_exp.items():
            if not MIN_EXP <= int(e) <= MAX_EXP:  # a negative index would wrap to the top bins
                raise ValueError(f"bin {e} outside [{MIN_EXP}, {MAX_EXP}]")
            counts[int(e) - MIN_EXP] += _count(int(c))
        if max_abs is None:
            occupied = [e for e, c in counts_by_exp.items() if c]
            max_abs = math.ldexp(1.0, max(occupied)) if occupied else 0.0
        return cls(tuple(counts), zero, inf, nan, float(max_abs))


def _count(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"a count must be a non-negative integer, got {v!r}")
    return v
