"""The statistics engine (capture stage): exact log2-magnitude histograms of a tensor, on its own device.

A pure function over tensors: no modules, hooks, I/O or host synchronisation.

Bins
----
Bin ``e`` holds the magnitudes in ``(2^(e-1), 2^e]``, for ``e`` from -149 (the fp32
minimum subnormal, 2^-149) to 128 (the largest finite fp32 values). Exact zeros,
infinities and NaNs are counted apart. With this choice every format's flush-to-zero
threshold ``min_subnormal / 2`` is a bin's upper edge for every power-of-two scale, so
"how many values flush at S = 2^k" is a sum of whole bins: exact, ties included.

How the bin is found (all integer arithmetic on the fp32 bit pattern)
--------------------------------------------------------------------
For ``bits = exponent field f, mantissa M``:

* the *row* is ``f + 1`` for finite values, from ``(|bits| + 2^23) >> 23``; for inf and
  NaN that addition wraps negative, which sends them to row 0;
* the *column* says whether ``M`` is zero (an exact power of two) and, for fp32
  subnormals, ``ceil(log2 M)``; it comes from the exponent of ``float(M)``, which is
  exact because ``M < 2^24``.

A 256 x 32 table of raw counts is filled with one ``bincount`` and mapped onto the
canonical bins once, when a report is made (:func:`canonical_counts`).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from fp16probe.histogram import MAX_EXP, MIN_EXP, NUM_BINS, SLOT_INF, SLOT_NAN, SLOT_ZERO

__all__ = [
    "MAX_EXP",
    "MIN_EXP",
    "NUM_BINS",
    "NUM_RAW",
    "SLOT_INF",
    "SLOT_NAN",
    "SLOT_ZERO",
    "canonical_counts",
    "max_abs_from_key",
    "raw_histogram",
]


_ROWS = 256
_COLS = 32
NUM_RAW = _ROWS * _COLS  # 8192: the length of a raw count vector

_ABS_MASK = 0x7FFFFFFF
_MANTISSA_MASK = 0x007FFFFF
_ROW_OFFSET = 1 << 23  # makes finite values' rows f + 1 and wraps inf/NaN negative
# Added to the bits of float(M) before >> 23: turns floor(log2) into 1 + ceil(log2 M),
# and the -126 in the exponent bias brings M = 0 below zero (clamped to column 0).
_COL_OFFSET = _MANTISSA_MASK - (126 << 23)
_RAW_MASK = NUM_RAW - 1

# CPU work goes in chunks so that the intermediate buffers stay in cache.
_CPU_CHUNK = 1 << 18

_workspaces = threading.local()

# Which CPU engine counts: "numba" (one fused pass, needs numba), "torch" (eager ops),
# or "auto" (numba when installed). Both give identical counts; tests run both.
CPU_ENGINE = os.environ.get("FP16PROBE_CPU_ENGINE", "auto")


def _bin_index_of(row: int, col: int) -> int:
    """Map a raw (row, column) cell onto the canonical slot it counts towards."""
    if row == 0:
        return SLOT_INF if col == 0 else SLOT_NAN
    exponent_field = row - 1
    if exponent_field == 0:  # zero or fp32 subnormal: value = M * 2^-149
        if col == 0:
            return SLOT_ZERO
        return (col - 1 - 149) - MIN_EXP  # ceil(log2 M) = col - 1
    # normal: value = 2^(f-127) * (1 + M / 2^23)
    e = exponent_field - 127 if col == 0 else exponent_field - 126
    return e - MIN_EXP


_RAW_TO_CANONICAL = torch.tensor(
    [_bin_index_of(r, c) for r in range(_ROWS) for c in range(_COLS)], dtype=torch.int64
)
_maps: dict[torch.device, torch.Tensor] = {}


def _raw_map(device: torch.device) -> torch.Tensor:
    m = _maps.get(device)
    if m is None:
        m = _RAW_TO_CANONICAL.to(device, non_blocking=True)  # no host sync on first use
        _maps[device] = m
    return m


def _cpu_workspace(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ws = getattr(_workspaces, "bufs", None)
    if ws is None or ws[0].numel() < n:
        ws = (torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.float32))
        _workspaces.bufs = ws
    return ws


def _fill_raw_index(bits: torch.Tensor, idx: torch.Tensor, fbuf: torch.Tensor) -> torch.Tensor:
    """Write each element's raw cell into ``idx``; return the max key (device scalar)."""
    col = fbuf.view(torch.int32)
    torch.bitwise_and(bits, _MANTISSA_MASK, out=idx)
    fbuf.copy_(idx)  # float(M): exact, M < 2^24
    col.add_(_COL_OFFSET).bitwise_right_shift_(23).clamp_min_(0)
    torch.bitwise_and(bits, _ABS_MASK, out=idx)
    idx.add_(_ROW_OFFSET)  # finite: |bits| + 2^23 > 0; inf/NaN: wraps negative
    key = idx.amax()
    idx.bitwise_right_shift_(23)
    torch.add(col, idx, alpha=_COLS, out=idx)
    idx.bitwise_and_(_RAW_MASK)  # inf/NaN rows (-256) land in row 0
    return key


def _whole_tensor_counts(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accelerator path: whole-tensor kernels, and ``index_add_`` because
    ``bincount`` synchronises with the host to size its output."""
    idx = torch.empty_like(bits)
    key = _fill_raw_index(bits, idx, torch.empty_like(bits, dtype=torch.float32))
    counts = torch.zeros(NUM_RAW, dtype=torch.int64, device=bits.device)
    ones = torch.ones((), dtype=torch.int64, device=bits.device).expand(bits.numel())
    counts.index_add_(0, idx, ones)
    return counts, key


def raw_histogram(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count ``x``'s values into raw log2 cells; return ``(raw_counts, max_key)``.

    ``raw_counts`` is an int64 vector of length :data:`NUM_RAW`, ``max_key`` an int32
    scalar that orders finite magnitudes (see :func:`max_abs_from_key`). Both stay on
    ``x``'s device and merge across calls by addition and ``torch.maximum``. No host
    synchronisation happens here. Non-fp32 inputs are converted to fp32 first (exact for
    fp16, bf16 and fp8; float64 rounds to fp32).
    """
    if x.requires_grad:  # gradients seen in hooks usually do not: skip the dispatch
        x = x.detach()
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    device = flat.device
    n = flat.numel()
    if n == 0:
        return (
            torch.zeros(NUM_RAW, dtype=torch.int64, device=device),
            torch.full((), -1, dtype=torch.int32, device=device),
        )
    bits = flat.view(torch.int32)
    if device.type != "cpu":
        return _whole_tensor_counts(bits)
    if _use_numba():
        from fp16probe.capture import _cpu_kernel

        counts_np, largest = _cpu_kernel.count(bits.numpy())
        key = np.array(largest + _ROW_OFFSET if largest >= 0 else -1, dtype=np.int32)
        return torch.from_numpy(counts_np), torch.from_numpy(key)
    if n <= _CPU_CHUNK:
        # One chunk: fresh small buffers cost less than slicing the workspace (a model
        # has many small gradient tensors, and each dispatched op counts).
        idx = torch.empty_like(bits)
        key = _fill_raw_index(bits, idx, torch.empty_like(flat))
        return torch.bincount(idx, minlength=NUM_RAW), key
    ibuf, fbuf = _cpu_workspace(_CPU_CHUNK)
    counts = None
    key = None
    for start in range(0, n, _CPU_CHUNK):
        chunk = bits[start : start + _CPU_CHUNK]
        m = chunk.numel()
        idx = ibuf[:m]
        chunk_key = _fill_raw_index(chunk, idx, fbuf[:m])
        chunk_counts = torch.bincount(idx, minlength=NUM_RAW)
        if counts is None:
            counts, key = chunk_counts, chunk_key
        else:
            counts += chunk_counts
            key = torch.maximum(key, chunk_key)
    return counts, key


def _use_numba() -> bool:
    if CPU_ENGINE == "torch":
        return False
    from fp16probe.capture import _cpu_kernel

    if CPU_ENGINE == "numba" and not _cpu_kernel.available():
        raise ImportError("FP16PROBE_CPU_ENGINE=numba needs numba: pip install 'fp16probe[fast]'")
    return _cpu_kernel.available()


def canonical_counts(raw: torch.Tensor) -> torch.Tensor:
    """Fold raw cells (``[..., NUM_RAW]``) onto canonical bins (``[..., NUM_BINS]``).

    Canonical slot ``i < 278`` is bin ``e = i - 149``; then zero, inf and NaN.
    Stays on the device.
    """
    out_shape = raw.shape[:-1] + (NUM_BINS,)
    out = torch.zeros(out_shape, dtype=torch.int64, device=raw.device)
    return out.index_add_(-1, _raw_map(raw.device), raw.to(torch.int64))


def max_abs_from_key(key: int) -> float:
    """Turn a max key from :func:`raw_histogram` into the largest finite |x| (0.0 if none)."""
    if key < _ROW_OFFSET:
        return 0.0
    bits = int(key) - _ROW_OFFSET
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()
