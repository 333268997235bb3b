"""A fused, branch-free CPU histogram kernel, compiled with numba when it is installed.

It reads each value once and adds it straight into a module's preallocated row of
canonical bins (the layout of :mod:`fp16probe.histogram`), with the same bin rule as the
torch path in :mod:`fp16probe.capture.engine`, so every engine gives identical counts.

The pass over the data counts each value into one of 512 cells, ``2 f + (M == 0)`` for
exponent field ``f`` and mantissa ``M`` (a shift, two masks, a compare), and keeps the
largest ``|bits|``; no data-dependent branch, and eight interleaved sub-histograms break
the store-to-load chain when neighbours share a cell (ReLU-masked gradients are runs of
zeros), so the cost per element does not depend on the data. The cells map onto the
canonical bins once per tensor. Only two cases need more, and a second pass runs only
when they occur: fp32 subnormals (binned by ``ceil(log2 M)``) and an inf or NaN (the key
is the largest *finite* magnitude). Only for CPU tensors; accelerators take the torch or
Triton path.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NUM_BINS = 281  # fp16probe.histogram.NUM_BINS (kept literal: numba compiles the constant in)
_KEY_OFFSET = 1 << 23  # engine._KEY_OFFSET: a finite |bits| becomes a positive key
SPLIT_AT = 1 << 21  # tensors this large are split across threads
_THREADS = max(1, min(os.cpu_count() or 1, 8))
_LANES = 8  # interleaved sub-histograms in the counting loop
_pool: ThreadPoolExecutor | None = None

try:  # numba is optional: ``pip install "fp16probe[fast]"``
    from numba import carray, njit, types
    from numba.cpython.unsafe.numbers import leading_zeros
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised where numba is absent
    njit = None


def available() -> bool:
    """Say whether the compiled kernel can run here (numba is installed)."""
    return njit is not None


if njit is not None:

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count(bits, local):  # pragma: no cover - compiled
        """Count int32 bit patterns into cells ``2 f + (M == 0)`` of ``local`` ([_LANES, 512]); return max |bits|.

        Eight interleaved sub-histograms break the store-to-load chain when neighbours
        share a cell (runs of zeros in ReLU-masked gradients). The maximum is a second,
        vectorised pass over the data: kept out of the counting loop, both are faster.
        """
        n = bits.shape[0]
        n8 = n - (n & 7)
        for i in range(0, n8, 8):
            a0 = bits[i] & 0x7FFFFFFF
            a1 = bits[i + 1] & 0x7FFFFFFF
            a2 = bits[i + 2] & 0x7FFFFFFF
            a3 = bits[i + 3] & 0x7FFFFFFF
            a4 = bits[i + 4] & 0x7FFFFFFF
            a5 = bits[i + 5] & 0x7FFFFFFF
            a6 = bits[i + 6] & 0x7FFFFFFF
            a7 = bits[i + 7] & 0x7FFFFFFF
            local[0, ((a0 >> 22) | 1) - ((a0 & 0x7FFFFF) != 0)] += 1
            local[1, ((a1 >> 22) | 1) - ((a1 & 0x7FFFFF) != 0)] += 1
            local[2, ((a2 >> 22) | 1) - ((a2 & 0x7FFFFF) != 0)] += 1
            local[3, ((a3 >> 22) | 1) - ((a3 & 0x7FFFFF) != 0)] += 1
            local[4, ((a4 >> 22) | 1) - ((a4 & 0x7FFFFF) != 0)] += 1
            local[5, ((a5 >> 22) | 1) - ((a5 & 0x7FFFFF) != 0)] += 1
            local[6, ((a6 >> 22) | 1) - ((a6 & 0x7FFFFF) != 0)] += 1
            local[7, ((a7 >> 22) | 1) - ((a7 & 0x7FFFFF) != 0)] += 1
        for i in range(n8, n):
            a0 = bits[i] & 0x7FFFFFFF
            local[0, ((a0 >> 22) | 1) - ((a0 & 0x7FFFFF) != 0)] += 1
        largest = -1
        for i in range(n):
            largest = max(largest, bits[i] & 0x7FFFFFFF)
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _rare(bits, sub, do_sub, largest):  # pragma: no cover - compiled
        """Second pass, only when needed: fp32 subnormals by ceil(log2 M), and the max finite |bits|."""
        fix_key = largest >= 0x7F800000
        if fix_key:
            largest = -1
        for i in range(bits.shape[0]):
            a = bits[i] & 0x7FFFFFFF
            if do_sub and 0 < a < 0x800000:
                sub[32 - leading_zeros(np.uint32(a - 1))] += 1
            if fix_key and a < 0x7F800000 and a > largest:
                largest = a
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _fold(local, sub, largest, counts, keys, row, replace):  # pragma: no cover - compiled
        """Map cells onto canonical bins in ``counts[row]``, the key into ``keys[row]``."""
        key = largest + _KEY_OFFSET if largest >= 0 else -1
        if replace:
            for j in range(NUM_BINS):
                counts[row, j] = 0
            keys[row] = -1
        for t in range(local.shape[0]):
            for f in range(1, 255):  # normal: bin f + 22 (power of two, M = 0) or f + 23
                counts[row, f + 22] += local[t, 2 * f + 1]
                counts[row, f + 23] += local[t, 2 * f]
            counts[row, 278] += local[t, 1]  # exact zeros
            counts[row, 279] += local[t, 511]  # inf
            counts[row, 280] += local[t, 510]  # NaN
        for j in range(24):  # subnormals, counted by the second pass
            counts[row, j] += sub[j]
        if key > keys[row]:
            keys[row] = key

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_into(bits, counts, keys, row, replace):  # pragma: no cover - compiled
        local = np.zeros((_LANES, 512), dtype=np.int64)
        largest = _count(bits, local)
        sub = np.zeros(24, dtype=np.int64)
        subnormals = local[:, 0].sum()
        if subnormals > 0 or largest >= 0x7F800000:
            largest = _rare(bits, sub, subnormals > 0, largest)
        _fold(local, sub, largest, counts, keys, row, replace)


    @intrinsic
    def _int32_pointer(typingctx, address):  # pragma: no cover - compiled
        """An int64 address as an ``int32*`` (the caller keeps the memory alive)."""
        sig = types.CPointer(types.int32)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int32)))

        return sig, codegen

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_many(addresses, lengths, rows, counts, keys, replace):  # pragma: no cover - compiled
        for t in range(addresses.shape[0]):
            _count_into(carray(_int32_pointer(addresses[t]), (lengths[t],)), counts, keys, rows[t], replace)


def count_many(
    addresses: np.ndarray, lengths: np.ndarray, rows: np.ndarray, counts: np.ndarray, keys: np.ndarray, replace: bool
) -> None:
    """:func:`count_into` for several buffers in one call: contiguous fp32 at ``addresses[t]``, ``lengths[t]``
    elements (each below ``SPLIT_AT``), into ``rows[t]``. The caller keeps the buffers alive."""
    _count_many(addresses, lengths, rows, counts, keys, replace)


def count_into(bits: np.ndarray, counts: np.ndarray, keys: np.ndarray, row: int, replace: bool) -> None:
    """Add the int32 bit patterns ``bits`` into ``counts[row]`` / ``keys[row]`` (replacing them when ``replace``)."""
    n = bits.shape[0]
    if n < SPLIT_AT or _THREADS < 2:
        _count_into(bits, counts, keys, row, replace)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_THREADS - 1, thread_name_prefix="fp16probe")
    parts = np.array_split(bits, _THREADS)
    local = np.zeros((_THREADS, _LANES, 512), dtype=np.int64)
    futures = [_pool.submit(_count, parts[t], local[t]) for t in range(1, _THREADS)]
    largest = int(_count(parts[0], local[0]))  # the kernel releases the GIL
    for f in futures:
        largest = max(largest, int(f.result()))
    local = local.reshape(-1, 512)
    sub = np.zeros(24, dtype=np.int64)
    subnormals = int(local[:, 0].sum())
    if subnormals > 0 or largest >= 0x7F800000:
        largest = int(_rare(bits, sub, subnormals > 0, largest))
    _fold(local, sub, largest, counts, keys, row, replace)
