"""One way to write each kind of number fp16probe shows: shares, scales, counts, magnitudes.

Shared by the analysis text and every presentation, so that a number (and the few phrases
both use: kinds, the scales in force, the fp16 run) reads the same in the recommendation,
the terminal, the notebook and the figures.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["KIND_WORDS", "bits", "count", "fp16_run", "magnitude", "percent", "power_of_two", "scale",
           "scales_in_force", "share"]

KIND_WORDS = {"all": "gradients", "activation_grad": "activation gradients", "weight_grad": "weight gradients",
              "activation": "activations"}


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


def scales_in_force(scales: Sequence[float]) -> str:
    """Write the loss scales a profile ran at (sorted): one, a range, or none (S = 1)."""
    if not scales:
        return "S = 1 (no loss scaler in the trace)"
    if len(scales) == 1:
        return f"S = {scale(scales[0])}"
    return f"S from {scale(scales[0])} to {scale(scales[-1])}"


def fp16_run(regime: str, target: str) -> str:
    """Write the fp16 run a forward prediction is for, e.g. "fp16 autocast on CUDA"."""
    how = "a model converted with .half() (pure fp16)" if regime == "pure_fp16" else "fp16 autocast"
    return f"{how} on {target.upper() if target == 'cuda' else target}"
