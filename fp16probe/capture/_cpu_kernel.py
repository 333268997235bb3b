"""A fused single-pass CPU histogram kernel, compiled with numba when it is installed.

The eager-PyTorch engine in :mod:`fp16probe.capture.engine` needs about ten passes and a
``bincount`` per tensor; this kernel reads each value once and counts it straight into
the same raw cells (row = exponent field + 1, column as documented there), so the two
engines give identical results. Only for CPU tensors; accelerators keep the torch path.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_COLS = 32
_NUM_RAW = 256 * _COLS
_SPLIT_AT = 1 << 21  # tensors this large are split across threads
_THREADS = max(1, min(os.cpu_count() or 1, 8))
_pool: ThreadPoolExecutor | None = None

try:  # numba is optional: ``pip install "fp16probe[fast]"``
    from numba import njit
except ImportError:  # pragma: no cover - exercised where numba is absent
    njit = None


def available() -> bool:
    return njit is not None


if njit is not None:

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count(bits, counts):  # pragma: no cover - compiled
        """Count int32 bit patterns into raw cells; return the largest finite |bits| (-1 if none)."""
        largest = -1
        for i in range(bits.shape[0]):
            a = bits[i] & 0x7FFFFFFF
            m = a & 0x7FFFFF
            if a >= 0x7F800000:  # inf (mantissa 0) or NaN: row 0
                cell = 0 if m == 0 else 1
            else:
                if a > largest:
                    largest = a
                row = (a >> 23) + 1
                if m == 0:
                    col = 0
                elif row == 1:  # fp32 subnormal: column 1 + ceil(log2 m)
                    c = 0
                    v = m - 1
                    while v > 0:
                        v >>= 1
                        c += 1
                    col = 1 + c
                else:  # normal: only whether the mantissa is zero matters
                    col = 1
                cell = row * 32 + col
            counts[cell] += 1
        return largest


def count(bits: np.ndarray) -> tuple[np.ndarray, int]:
    """Raw cell counts and the largest finite |bits| of an int32 array (-1 if none)."""
    n = bits.shape[0]
    threads = _THREADS
    if n < _SPLIT_AT or threads < 2:
        counts = np.zeros(_NUM_RAW, dtype=np.int64)
        return counts, int(_count(bits, counts))
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="fp16probe")
    parts = np.array_split(bits, threads)
    counts = np.zeros((threads, _NUM_RAW), dtype=np.int64)
    futures = [_pool.submit(_count, parts[t], counts[t]) for t in range(1, threads)]
    largest = int(_count(parts[0], counts[0]))  # the kernel releases the GIL
    for f in futures:
        largest = max(largest, int(f.result()))
    return counts.sum(0), largest
