"""A fused, branch-free CPU histogram kernel, compiled with numba when it is installed.

It reads each value once and adds it straight into a module's preallocated row of
canonical bins (the layout of :mod:`fp16probe.histogram`), with the same bin rule as the
torch path in :mod:`fp16probe.capture.engine`, so every engine gives identical counts.

The counting loop is an add and a shift per value: for ``a = |bits|`` (exponent field
``f``, mantissa ``M``) the cell is ``(a + 0x7FFFFF) >> 23 = f + (M != 0)``, one of 257,
counted into eight interleaved ``uint32`` sub-histograms (8 KiB, in L1; interleaving
breaks the store-to-load chain when neighbours share a cell, as ReLU's runs of zeros do),
so the cost per value does not depend on the data. Canonical bin ``f + 22 + (M != 0)`` of
a normal value is ``cell + 22``, so 254 of the 257 cells map onto one bin each:

* cell 0 is exactly the zeros (``a = 0``), slot ``SLOT_ZERO``;
* cells 2..254 are the normal values with ``f + (M != 0)`` = cell, bin ``cell + 22``
  (``f - 1`` with a mantissa and ``f`` without both have top ``2^(f - 127)``);
* cell 256 is exactly the NaNs (``f = 255``, ``M != 0``), slot ``SLOT_NAN``.

Two cells mix values of several bins, and only when one of them is occupied does a second
pass over the tensor run:

* cell 1 holds the fp32 subnormals (``f = 0``, ``M > 0``: bin ``ceil(log2 M)``, 0..23) and
  ``2^-126`` exactly (bin 23): the second pass bins the subnormals, the rest is bin 23;
* cell 255 holds the finite values above ``2^127`` (bin 277) and inf (``SLOT_INF``): the
  second pass counts the infs.

The key (largest finite ``|bits|``) is a vectorised loop of its own, kept out of the
counting loop (both run faster apart). Long tensors go block by block (``_BLOCK`` values,
32 KiB): the vectorised max streams each block into L1, where the counting loop then reads
it, so the data comes from memory once. On gradients fresh from backward (in a training
step of a GPT-style model and of a conv net) that takes the kernel from 0.85-1.0 to
0.65-0.7 ns a value against two whole-tensor passes (``bench/run.py``'s engine row is the
warm-buffer figure). When the largest ``|bits|`` is an inf or a NaN the second pass finds
the largest finite one. ``tests/test_histogram.py`` checks the
counts against the torch engine and the previous kernel on every exponent edge. Only for
CPU tensors; accelerators take the torch or Triton path.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NUM_BINS = 281  # fp16probe.histogram.NUM_BINS (kept literal: numba compiles the constant in)
_KEY_OFFSET = 1 << 23  # engine._KEY_OFFSET: a finite |bits| becomes a positive key
SPLIT_AT = 1 << 21  # tensors this large may be split across threads (count_into's ``threads``)
_THREADS = max(1, min(os.cpu_count() or 1, 8))
_LANES = 8  # interleaved sub-histograms in the counting loop
_CELLS = 264  # 257 cells per lane, padded to a multiple of 8
_SMALL = 1 << 10  # below this many values the lanes cost more to zero and fold than they save
_CHUNK = 1 << 34  # values per counting call: a lane's uint32 cell cannot wrap below 2^32 * 8 values
_BLOCK = 1 << 13  # values the max pass brings into L1 for the counting loop (32 KiB of fp32)
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
    def _largest_bits(bits):  # pragma: no cover - compiled
        """The largest ``|bits|`` of int32 bit patterns (0 for none): one vectorised pass."""
        largest = 0
        for i in range(bits.shape[0]):
            largest = max(largest, bits[i] & 0x7FFFFFFF)
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count(bits, local):  # pragma: no cover - compiled
        """Add int32 bit patterns into cells ``(|bits| + 0x7FFFFF) >> 23`` of ``local``; return max |bits|
        (-1 for none), block by block: each block's max pass brings it into L1 for its counting loop.

        ``local`` is flat uint32 ``[_LANES * _CELLS]``, lane ``t`` at ``t * _CELLS``.
        """
        largest = -1
        for start in range(0, bits.shape[0], _BLOCK):
            block = bits[start : start + _BLOCK]
            largest = max(largest, _largest_bits(block))
            _count_block(block, local)
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_block(bits, local):  # pragma: no cover - compiled
        """The counting loop of :func:`_count`: eight values into the eight lanes per round."""
        n = bits.shape[0]
        n8 = n - (n & 7)
        for i in range(0, n8, 8):
            local[((bits[i] & 0x7FFFFFFF) + 0x7FFFFF) >> 23] += 1
            local[264 + (((bits[i + 1] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
            local[528 + (((bits[i + 2] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
            local[792 + (((bits[i + 3] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
            local[1056 + (((bits[i + 4] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
            local[1320 + (((bits[i + 5] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
            local[1584 + (((bits[i + 6] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
            local[1848 + (((bits[i + 7] & 0x7FFFFFFF) + 0x7FFFFF) >> 23)] += 1
        for i in range(n8, n):
            local[((bits[i] & 0x7FFFFFFF) + 0x7FFFFF) >> 23] += 1

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_small(bits, cells):  # pragma: no cover - compiled
        """:func:`_count` for a short tensor: straight into ``cells``, without the lanes to zero and fold."""
        largest = -1
        for i in range(bits.shape[0]):
            a = bits[i] & 0x7FFFFFFF
            cells[(a + 0x7FFFFF) >> 23] += 1
            largest = max(largest, a)
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _cells(local, cells):  # pragma: no cover - compiled
        """Add the lanes of ``local`` into int64 ``cells`` [257]."""
        for t in range(_LANES):
            for c in range(257):
                cells[c] += local[t * 264 + c]

    @njit(nogil=True, cache=True, boundscheck=False)
    def _rare(bits, sub, do_sub, do_inf, largest):  # pragma: no cover - compiled
        """Second pass, only when needed: subnormals by ceil(log2 M) into ``sub[0:24]``, infs into
        ``sub[24]``, and the max finite |bits| when ``largest`` is an inf or NaN; return that max."""
        fix_key = largest >= 0x7F800000
        if fix_key:
            largest = -1
        for i in range(bits.shape[0]):
            a = bits[i] & 0x7FFFFFFF
            if do_sub and 0 < a < 0x800000:
                sub[32 - leading_zeros(np.uint32(a - 1))] += 1
            if do_inf and a == 0x7F800000:
                sub[24] += 1
            if fix_key and a < 0x7F800000 and a > largest:
                largest = a
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def _fold(cells, sub, largest, counts, keys, row, replace):  # pragma: no cover - compiled
        """Map the cells (and the second pass) onto canonical bins in ``counts[row]``, the key into ``keys[row]``."""
        key = largest + _KEY_OFFSET if largest >= 0 else -1
        if replace:
            for j in range(NUM_BINS):
                counts[row, j] = 0
            keys[row] = -1
        counts[row, 278] += cells[0]  # exact zeros
        subnormals = 0
        for j in range(24):
            counts[row, j] += sub[j]
            subnormals += sub[j]
        counts[row, 23] += cells[1] - subnormals  # 2^-126 exactly
        for c in range(2, 255):
            counts[row, c + 22] += cells[c]
        counts[row, 277] += cells[255] - sub[24]  # finite above 2^127
        counts[row, 279] += sub[24]  # inf
        counts[row, 280] += cells[256]  # NaN
        if key > keys[row]:
            keys[row] = key

    @njit(nogil=True, cache=True, boundscheck=False)
    def _finish(bits, cells, largest, counts, keys, row, replace):  # pragma: no cover - compiled
        """The second pass when a mixed cell is occupied or the largest value is not finite, then the fold."""
        sub = np.zeros(25, dtype=np.int64)
        if cells[1] > 0 or cells[255] > 0 or largest >= 0x7F800000:
            largest = _rare(bits, sub, cells[1] > 0, cells[255] > 0, largest)
        _fold(cells, sub, largest, counts, keys, row, replace)

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_into(bits, counts, keys, row, replace):  # pragma: no cover - compiled
        """Count ``bits`` into ``counts[row]`` / ``keys[row]``; return their largest ``|bits|``, inf and NaN
        included (-1 for none): the weight counts hand it to the per-step history."""
        cells = np.zeros(257, dtype=np.int64)
        n = bits.shape[0]
        if n < _SMALL:
            largest = _count_small(bits, cells)
            _finish(bits, cells, largest, counts, keys, row, replace)
            return largest
        local = np.zeros(_LANES * _CELLS, dtype=np.uint32)
        largest = -1
        for start in range(0, n, _CHUNK):
            if start:
                local[:] = 0
            largest = max(largest, _count(bits[start : start + _CHUNK], local))
            _cells(local, cells)
        _finish(bits, cells, largest, counts, keys, row, replace)
        return largest

    def _pointer_to(item):  # pragma: no cover - compiled
        """An intrinsic that reads an int64 address as an ``item*`` (the caller keeps the memory alive)."""

        @intrinsic
        def pointer(typingctx, address):
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(types.CPointer(item)))

            return types.CPointer(item)(types.int64), codegen

        return pointer

    _int32_pointer = _pointer_to(types.int32)
    _int64_pointer = _pointer_to(types.int64)

    @njit(nogil=True, cache=True, boundscheck=False)
    def _count_many(addresses, lengths, rows, counts, keys, replace):  # pragma: no cover - compiled
        largest = -1
        for t in range(addresses.shape[0]):
            largest = max(largest, _count_into(carray(_int32_pointer(addresses[t]), (lengths[t],)), counts, keys,
                                               rows[t], replace))
        return largest


    @njit(nogil=True, cache=True, boundscheck=False)
    def count_at(address, n, counts, keys, row, replace):  # pragma: no cover - compiled
        """:func:`count_into` for ``n`` contiguous fp32 at ``address``, on this thread, into row ``row`` of
        the table whose int64 counts ``[rows, NUM_BINS]`` and int32 keys ``[rows]`` are at the addresses
        ``counts`` and ``keys`` (the thin per-tensor path: integers only, so the call costs little
        more than the kernel; the caller keeps the table alive). Returns their largest ``|bits|``, inf and
        NaN included."""
        return _count_into(carray(_int32_pointer(address), (n,)), carray(_int64_pointer(counts), (row + 1, NUM_BINS)),
                           carray(_int32_pointer(keys), (row + 1,)), row, replace)

    @njit(nogil=True, cache=True, boundscheck=False)
    def largest_many(addresses, lengths):  # pragma: no cover - compiled
        """The largest ``|bits|`` over contiguous fp32 buffers (0 for none). Magnitudes order like their
        bit patterns, NaN above inf above every finite value, so viewed as fp32 it is the largest |x|,
        or inf, or NaN: what ``torch._foreach_norm(xs, inf)`` gives, at a read's cost on one thread."""
        largest = 0
        for t in range(addresses.shape[0]):
            largest = max(largest, _largest_bits(carray(_int32_pointer(addresses[t]), (lengths[t],))))
        return largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def fold_largest_at(address, n, slots, i):  # pragma: no cover - compiled
        """``slots[i] = max(slots[i], largest |bits| of n fp32 at address)``: ``slots`` is the address of a
        float32 buffer of maxima (>= 0, NaN kept: it orders above everything), read as int32."""
        largest = _largest_bits(carray(_int32_pointer(address), (n,)))
        slot = carray(_int32_pointer(slots), (i + 1,))
        if largest > slot[i]:
            slot[i] = largest

    @njit(nogil=True, cache=True, boundscheck=False)
    def close_maxima(step, run, first, n, over, step_index):  # pragma: no cover - compiled
        """Close a step of forward maxima: three buffers of ``n`` at the addresses ``step`` and ``run``
        (float32 maxima >= 0, read as int32 bits: NaN orders above inf above every finite value) and
        ``first`` (int64, -1: none yet). ``run = max(run, step)``; ``first`` takes ``step_index`` where it
        is -1 and the step's maximum is at least the bits ``over`` (inf and NaN too); ``step`` is zeroed.
        Returns the step's largest bits."""
        s = carray(_int32_pointer(step), (n,))
        r = carray(_int32_pointer(run), (n,))
        f = carray(_int64_pointer(first), (n,))
        largest = 0
        for i in range(n):
            b = s[i] & 0x7FFFFFFF
            largest = max(largest, b)
            if b > (r[i] & 0x7FFFFFFF):
                r[i] = b
            if b >= over and f[i] < 0:
                f[i] = step_index
            s[i] = 0
        return largest


    @njit(nogil=True, cache=True, boundscheck=False)
    def _close_table(counts, keys, totals, total_keys, out, out_keys, spare, spare_keys, step):  # pragma: no cover
        """One pass over a closing step's table (int64 counts ``[rows, NUM_BINS]``, int32 keys ``[rows]``):
        ``out = totals + counts`` (keys: the larger), ``step`` += the counts summed over rows, and the
        spare table zeroed (keys -1) for the next step."""
        for r in range(counts.shape[0]):
            for j in range(counts.shape[1]):
                c = counts[r, j]
                out[r, j] = totals[r, j] + c
                step[j] += c
                spare[r, j] = 0
            out_keys[r] = max(total_keys[r], keys[r])
            spare_keys[r] = -1


def close_table(counts: np.ndarray, keys: np.ndarray, totals: np.ndarray, total_keys: np.ndarray, out: np.ndarray,
                out_keys: np.ndarray, spare: np.ndarray, spare_keys: np.ndarray) -> np.ndarray:
    """Close a step of a CPU table in one compiled pass: ``out``/``out_keys`` take the totals with the step
    added, ``spare``/``spare_keys`` are zeroed (-1) for the next step; returns the step's counts summed
    over rows. Nothing but ``out``, ``spare`` and the result is written."""
    step = np.zeros(counts.shape[1], dtype=np.int64)
    _close_table(counts, keys, totals, total_keys, out, out_keys, spare, spare_keys, step)
    return step


def count_many(
    addresses: np.ndarray, lengths: np.ndarray, rows: np.ndarray, counts: np.ndarray, keys: np.ndarray, replace: bool
) -> int:
    """:func:`count_into` for several buffers in one call: contiguous fp32 at ``addresses[t]``, ``lengths[t]``
    elements, into ``rows[t]``, on this thread. The caller keeps the buffers alive. Returns the largest
    ``|bits|`` of them all, inf and NaN included (-1 for none)."""
    return int(_count_many(addresses, lengths, rows, counts, keys, replace))


def count_into(bits: np.ndarray, counts: np.ndarray, keys: np.ndarray, row: int, replace: bool,
               threads: int = 1) -> None:
    """Add the int32 bit patterns ``bits`` into ``counts[row]`` / ``keys[row]`` (replacing them when ``replace``).

    ``threads`` > 1 splits a tensor of ``SPLIT_AT`` values or more across that many threads
    (at most the machine's cores): less wall time on idle cores, more CPU time (the engine
    passes torch's intra-op thread count, so a run at one thread never splits).
    """
    n = bits.shape[0]
    threads = min(int(threads), _THREADS)
    if n < SPLIT_AT or threads < 2:
        _count_into(bits, counts, keys, row, replace)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_THREADS - 1, thread_name_prefix="fp16probe")
    parts = np.array_split(bits, threads)
    local = np.zeros((threads, _LANES * _CELLS), dtype=np.uint32)  # parts < 2^34 values: no wrap
    futures = [_pool.submit(_count, parts[t], local[t]) for t in range(1, threads)]
    largest = int(_count(parts[0], local[0]))  # the kernel releases the GIL
    for f in futures:
        largest = max(largest, int(f.result()))
    cells = np.zeros(257, dtype=np.int64)
    for t in range(threads):
        _cells(local[t], cells)
    _finish(bits, cells, largest, counts, keys, row, replace)
