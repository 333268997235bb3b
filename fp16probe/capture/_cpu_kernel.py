"""A fused, branch-free CPU histogram kernel, compiled with numba when it is installed.

It reads each value once and adds it straight into a module's preallocated row of
canonical bins (the layout of :mod:`fp16probe.histogram`), with the same bin rule as the
torch path in :mod:`fp16probe.capture.engine`, so every engine gives identical counts.
The bin is computed with integer arithmetic only (no data-dependent branch), and four
interleaved sub-histograms break the store-to-load chain when neighbours share a bin
(ReLU-masked gradients are runs of zeros), so the cost per element does not depend on
the data. Only for CPU tensors; accelerators take the torch or Triton path.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NUM_BINS = 281  # fp16probe.histogram.NUM_BINS (kept literal: numba compiles the constant in)
_WIDTH = 288  # sub-histogram stride: NUM_BINS rounded up to a multiple of 8
_KEY_OFFSET = 1 << 23  # engine._KEY_OFFSET: a finite |bits| becomes a positive key
_SPLIT_AT = 1 << 21  # tensors this large are split across threads
_THREADS = max(1, min(os.cpu_count() or 1, 8))
_pool: ThreadPoolExecutor | None = None

try:  # numba is optional: ``pip install "fp16probe[fast]"``
    from numba import njit
    from numba.cpython.unsafe.numbers import leading_zeros
except ImportError:  # pragma: no cover - exercised where numba is absent
    njit = None


def available() -> bool:
    """Say whether the compiled kernel can run here (numba is installed)."""
    return njit is not None


if njit is not None:

    @njit(inline="always")
    def _bin(b):  # pragma: no cover - compiled
        """Canonical bin of one fp32 bit pattern, and its key candidate (-1 for inf/NaN)."""
        a = b & 0x7FFFFFFF
        f = a >> 23
        m = a & 0x7FFFFF
        nz = (m + 0x7FFFFF) >> 23  # 1 when the mantissa is nonzero
        is0 = ((f - 1) >> 31) & 1  # exponent field 0: zero or fp32 subnormal
        is255 = (f + 1) >> 8  # exponent field 255: inf or NaN
        # normal: e = f - 127 (+1 when m != 0), bin e + 149; inf/NaN: 279 + nz
        idx = f + 22 + nz + 2 * is255
        # subnormal: ceil(log2 m); exact zero: 278
        c = 32 - leading_zeros(np.uint32(m - 1))
        idx += is0 * (nz * (c - 23) + (1 - nz) * 256)
        return idx, a - is255 * (a + 1)

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count(bits, local):  # pragma: no cover - compiled
        """Count int32 bit patterns into ``local`` ([4, _WIDTH]); return the largest finite |bits| or -1."""
        n = bits.shape[0]
        largest = -1
        n4 = n - (n & 3)
        for i in range(0, n4, 4):
            i0, k0 = _bin(bits[i])
            i1, k1 = _bin(bits[i + 1])
            i2, k2 = _bin(bits[i + 2])
            i3, k3 = _bin(bits[i + 3])
            local[0, i0] += 1
            local[1, i1] += 1
            local[2, i2] += 1
            local[3, i3] += 1
            largest = max(largest, max(max(k0, k1), max(k2, k3)))
        for i in range(n4, n):
            i0, k0 = _bin(bits[i])
            local[0, i0] += 1
            largest = max(largest, k0)
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _fold(local, largest, counts, keys, row, replace):  # pragma: no cover - compiled
        """Add sub-histograms into ``counts[row]`` and the key into ``keys[row]``."""
        key = largest + _KEY_OFFSET if largest >= 0 else -1
        if replace:
            for j in range(NUM_BINS):
                counts[row, j] = 0
            keys[row] = -1
        for t in range(local.shape[0]):
            for j in range(NUM_BINS):
                counts[row, j] += local[t, j]
        if key > keys[row]:
            keys[row] = key

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_into(bits, counts, keys, row, replace):  # pragma: no cover - compiled
        local = np.zeros((4, _WIDTH), dtype=np.int64)
        _fold(local, _count(bits, local), counts, keys, row, replace)


def count_into(bits: np.ndarray, counts: np.ndarray, keys: np.ndarray, row: int, replace: bool) -> None:
    """Add the int32 bit patterns ``bits`` into ``counts[row]`` / ``keys[row]`` (replacing them when ``replace``)."""
    n = bits.shape[0]
    if n < _SPLIT_AT or _THREADS < 2:
        _count_into(bits, counts, keys, row, replace)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_THREADS - 1, thread_name_prefix="fp16probe")
    parts = np.array_split(bits, _THREADS)
    local = np.zeros((_THREADS, 4, _WIDTH), dtype=np.int64)
    futures = [_pool.submit(_count, parts[t], local[t]) for t in range(1, _THREADS)]
    largest = int(_count(parts[0], local[0]))  # the kernel releases the GIL
    for f in futures:
        largest = max(largest, int(f.result()))
    _fold(local.reshape(-1, _WIDTH), largest, counts, keys, row, replace)
