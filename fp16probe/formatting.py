"""One way to write each kind of number fp16probe shows: shares, scales, counts, magnitudes.

Shared by the analysis text and every presentation, so that a number reads the same in
the recommendation, the terminal, the notebook and the figures.
"""

from __future__ import annotations

import math

__all__ = ["bits", "count", "magnitude", "percent", "power_of_two", "scale", "share"]


def percent(fraction: float | None) -> str:
    """Write a fraction as a percentage with three significant digits ("n/a" for None)."""
    if fraction is None:
        return "n/a"
    if fraction == 0:
        return "0%"
    return f"{100 * fraction:.3g}%"


def share(part: int, whole: int) -> str:
    """Write ``part`` of ``whole`` as a percentage ("n/a" when ``whole`` is 0)."""
    return percent(part / whole) if whole else "n/a"


def power_of_two(log2: int | float | None) -> str:
    """Write 2^k ("none" for None); a fractional exponent keeps one decimal."""
    if log2 is None:
        return "none"
    if float(log2).is_integer():
        return f"2^{int(log2)}"
    return f"2^{log2:.1f}"


def scale(value: float | None) -> str:
    """Write a loss scale: 2^k for a power of two, else the number ("none" for None)."""
    if value is None:
        return "none"
    if value > 0 and math.isfinite(value):
        mantissa, exp = math.frexp(value)
        if mantissa == 0.5:
            return f"2^{exp - 1}"
    return f"{value:g}"


def count(n: int) -> str:
    """Write a count with thousands separators."""
    return f"{int(n):,}"


def magnitude(x: float | None) -> str:
    """Write a gradient magnitude with four significant digits ("n/a" for None)."""
    if x is None:
        return "n/a"
    return f"{x:.4g}"


def bits(x: float | None) -> str:
    """Write a span in bits (log2 units) with three significant digits."""
    if x is None:
        return "n/a"
    return f"{x:.3g}"
