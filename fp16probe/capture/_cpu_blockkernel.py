"""A fused CPU kernel for the relative-exponent histogram (numba, when installed).

One pass over blocks already laid out as ``[n_blocks, block]`` (see
:func:`fp16probe.capture.blockstats.blocks`): each block's amax from the fp32 bits, then
each element's cell ``(c_B, d, c_x)`` added into the histogram, with the same rule as the
torch path of :func:`fp16probe.capture.blockstats.relative_histograms` (the tests check
both give identical counts). Only for CPU tensors; accelerators take the torch path.
"""

from __future__ import annotations

import numpy as np

try:  # numba is optional: ``pip install "fp16probe[fast]"``
    from numba import njit
except ImportError:  # pragma: no cover - exercised where numba is absent
    njit = None

# Kept literal (numba compiles the constants in); fp16probe.blockscale holds the layout.
NUM_CLASSES = 32
DEPTH = 40
NUM_D = DEPTH + 1
MIN_BLOCK_EXP = -100
SPREAD_BINS = 65


def available() -> bool:
    """Say whether the compiled kernel can run here (numba is installed)."""
    return njit is not None


if njit is not None:

    @njit(nogil=True, cache=True, boundscheck=False)
    def _exp_class(a):  # pragma: no cover - compiled
        """(E, class) of a positive finite magnitude's bits ``a`` (fp32 subnormals normalised)."""
        f = a >> 23
        m = a & 0x7FFFFF
        if f == 0:  # subnormal: shift the mantissa up to the implicit bit
            shift = 0
            while m & 0x800000 == 0:
                m <<= 1
                shift += 1
            m &= 0x7FFFFF
            e = -126 - shift
        else:
            e = f - 127
        c = (m >> 19) * 2 + (1 if (m & 0x7FFFF) != 0 else 0)
        return e, c

    @njit(nogil=True, cache=True, boundscheck=False)
    def count_blocks(bits, out, extra, spread):  # pragma: no cover - compiled
        """Add ``bits`` ([n_blocks, block] int32) into ``out`` (the relative histogram), ``extra``
        ([zeros, nonfinite, out_of_range], padding zeros included) and ``spread``."""
        n_blocks, size = bits.shape
        amaxes = np.zeros(n_blocks, dtype=np.int32)
        top = 0
        for b in range(n_blocks):  # pass 1: each block's amax (-1 when it holds an inf or NaN)
            amax = 0
            bad = False
            for i in range(size):
                a = bits[b, i] & 0x7FFFFFFF
                if a == 0:
                    extra[0] += 1
                elif a >= 0x7F800000:
                    bad = True
                elif a > amax:
                    amax = a
            if amax > top:  # the tensor's amax is over every finite value, as the torch path takes it
                top = amax
            if bad:
                for i in range(size):
                    if bits[b, i] & 0x7FFFFFFF != 0:
                        extra[1] += 1  # inf, NaN, and the finite values of their block
                amax = -1
            amaxes[b] = amax
        e_t = _exp_class(top)[0] if top > 0 else 0
        for b in range(n_blocks):  # pass 2: every element of a finite, nonzero block
            amax = amaxes[b]
            if amax <= 0:
                continue
            e_b, c_b = _exp_class(amax)
            gap = e_t - e_b
            spread[gap if gap < SPREAD_BINS else SPREAD_BINS - 1] += 1
            if e_b < MIN_BLOCK_EXP:
                for i in range(size):
                    if bits[b, i] & 0x7FFFFFFF != 0:
                        extra[2] += 1
                continue
            base = c_b * NUM_D
            for i in range(size):
                a = bits[b, i] & 0x7FFFFFFF
                if a == 0:
                    continue
                e_x, c_x = _exp_class(a)
                d = e_x - e_b
                if d < -DEPTH:
                    d = -DEPTH
                out[(base + d + DEPTH) * NUM_CLASSES + c_x] += 1


def count_into(blocks_fp32: np.ndarray, out: np.ndarray, extra: np.ndarray, spread: np.ndarray) -> None:
    """Run the kernel on a C-contiguous ``[n_blocks, block]`` float32 array (numba must be installed)."""
    count_blocks(blocks_fp32.view(np.int32), out, extra, spread)
