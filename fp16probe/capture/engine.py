"""The statistics engine (capture stage): exact log2-magnitude histograms of a tensor, on its own device.

Pure functions over tensors: no modules, hooks, I/O or host synchronisation.

Bins
----
Canonical bin ``i < 278`` holds the magnitudes in ``(2^(e-1), 2^e]`` for ``e = i - 149``
(-149, the fp32 minimum subnormal, to 128); then exact zeros, infinities and NaNs
(:mod:`fp16probe.histogram`). With this choice every format's flush-to-zero threshold
``min_subnormal / 2`` is a bin's upper edge for every power-of-two scale, so "how many
values flush at S = 2^k" is a sum of whole bins: exact, ties included.

How the bin is found (integer arithmetic on the fp32 bit pattern, no branch)
---------------------------------------------------------------------------
For ``|bits| = exponent field f, mantissa M``:

* normal (``1 <= f <= 254``): ``e = f - 127`` when ``M = 0`` (an exact power of two),
  else ``f - 126``; bin ``f + 22 + (M != 0)``;
* ``f = 0``: ``M = 0`` is an exact zero; else an fp32 subnormal ``M * 2^-149``, bin
  ``ceil(log2 M)``, read from the exponent of ``float(M)`` (exact, ``M < 2^24``);
* ``f = 255``: inf when ``M = 0``, else NaN.

The *key* of a tensor is ``max |bits| + 2^23`` over its finite values (-1 when there are
none): finite magnitudes order like their bit patterns, so keys merge by ``max`` on the
device and :func:`max_abs_from_key` turns one back into a float on the host.

Counts go straight into a caller's preallocated row (:func:`count_into`): a module's
row of an ``[M, NUM_BINS]`` int64 table and its slot of an ``[M]`` int32 key vector.
Three implementations give identical counts (the tests run all three):

* ``numba``: one fused branch-free pass on the CPU (:mod:`fp16probe.capture._cpu_kernel`);
* ``torch``: eager torch ops and ``bincount`` on the CPU (when numba is absent);
* ``device``: the accelerator path, ``index_add_`` into the row (``bincount`` would
  synchronise to size its output); on CUDA with Triton installed, one fused Triton kernel
  per tensor (:mod:`fp16probe.capture._triton_kernel`). It runs on CPU tensors too, as the
  reference the tests check the accelerator path against.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from fp16probe.histogram import MAX_EXP, MIN_EXP, NUM_BINS, SLOT_INF, SLOT_NAN, SLOT_ZERO

__all__ = [
    "MAX_EXP",
    "MIN_EXP",
    "NUM_BINS",
    "SLOT_INF",
    "SLOT_NAN",
    "SLOT_ZERO",
    "count_into",
    "count_many",
    "histogram",
    "largest_abs",
    "max_abs_from_key",
    "max_abs_of_keys",
    "new_table",
]

_KEY_OFFSET = 1 << 23  # makes a finite |bits| a positive key and wraps inf/NaN negative
_MANTISSA = 0x007FFFFF

# Which CPU engine counts: "numba" (one fused pass, needs numba), "torch" (eager ops),
# "device" (the accelerator path run on the CPU), or "auto" (numba when installed).
CPU_ENGINE = os.environ.get("FP16PROBE_CPU_ENGINE", "auto")


def new_table(rows: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``rows`` empty count rows and keys: ``([rows, NUM_BINS] int64, [rows] int32)``."""
    return (
        torch.zeros(rows, NUM_BINS, dtype=torch.int64, device=device),
        torch.full((rows,), -1, dtype=torch.int32, device=device),
    )


def _bits_of(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns of ``x`` as a flat int32 tensor (a view when already fp32)."""
    if x.requires_grad:  # gradients seen in hooks usually do not: skip the dispatch
        x = x.detach()
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.int32)


def _bin_index(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each element's canonical bin (int64) and the tensor's key (int32 scalar), in torch ops."""
    a = bits.bitwise_and(0x7FFFFFFF)
    f = a.bitwise_right_shift(23)
    m = a.bitwise_and(_MANTISSA)
    nz = m.ne(0)
    # ceil(log2 M) + 127 from float(M)'s exponent: adding a full mantissa rounds up.
    c = m.float().view(torch.int32).add_(_MANTISSA).bitwise_right_shift_(23).sub_(127)
    finite = torch.where(f.eq(255), nz.int().add_(SLOT_INF), f.add(22).add_(nz))
    idx = torch.where(f.eq(0), torch.where(nz, c, SLOT_ZERO), finite).long()
    # inf and NaN (|bits| >= 0x7F800000) wrap below zero; amax stays on the device.
    key = a.add_(_KEY_OFFSET).amax()
    return idx, key


def count_into(
    x: torch.Tensor,
    counts: torch.Tensor,
    keys: torch.Tensor,
    row: int,
    *,
    replace: bool = False,
    inv: torch.Tensor | None = None,
) -> None:
    """Add ``x``'s values into ``counts[row]`` and its key into ``keys[row]``, on the table's device.

    ``counts``/``keys`` come from :func:`new_table`. With ``replace`` the row is
    overwritten instead of added to (a parameter's gradient: the last value wins).
    ``inv`` (a device scalar) multiplies ``x`` in fp32 first, as ``GradScaler.unscale_``
    does. Non-fp32 inputs are converted to fp32 first (exact for fp16, bf16 and fp8;
    float64 rounds to fp32). No host synchronisation happens here.
    """
    if x.is_cpu:
        if inv is not None:
            x = _unscaled(x, inv)
        kernel = _numba_kernel()
        if kernel is not None and counts.is_cpu:
            # The CPU hot path: numpy views (no torch dispatch), the table's views cached.
            if x.dtype not in _NUMPY_FLOATS:  # bf16, fp8: numpy has no such dtype
                x = x.to(torch.float32)
            arr = (x.detach() if x.requires_grad else x).numpy()
            if arr.dtype != np.float32:
                arr = arr.astype(np.float32)
            host = _host_view(counts, keys)
            kernel.count_into(arr.reshape(-1).view(np.int32), host[1], host[3], row, replace,
                              torch.get_num_threads())
            return
    elif x.device.type == "cuda" and counts.device == x.device and _triton_available():
        from fp16probe.capture import _triton_kernel

        _triton_kernel.count_into(x, counts, keys, row, replace, inv)
        return
    elif inv is not None:
        x = _unscaled(x, inv)
    bits = _bits_of(x)
    if bits.device != counts.device:  # a model split across devices: count at home, add here
        c, k = new_table(1, bits.device)
        count_into(bits.view(torch.float32), c, k, 0)
        c, k = c.to(counts.device, non_blocking=True), k.to(counts.device, non_blocking=True)
        if replace:
            counts[row] = c[0]
            keys[row] = k[0]
        else:
            counts[row] += c[0]
            torch.maximum(keys[row : row + 1], k, out=keys[row : row + 1])
        return
    engine = _engine_for(bits.device)
    out, key_slot = counts[row], keys[row : row + 1]
    if replace:
        out.zero_()
        key_slot.fill_(-1)
    if bits.numel() == 0:
        return
    idx, key = _bin_index(bits)
    if engine == "torch":
        out += torch.bincount(idx, minlength=NUM_BINS)
    else:
        out.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=bits.device).expand(idx.numel()))
    torch.maximum(key_slot, key, out=key_slot)


def count_many(
    xs: Sequence[torch.Tensor],
    counts: torch.Tensor,
    keys: torch.Tensor,
    rows: Sequence[int],
    *,
    replace: bool = False,
    inv: torch.Tensor | None = None,
) -> int | None:
    """:func:`count_into` for ``xs[t]`` into ``rows[t]``; the same counts.

    On the CPU with the numba engine, contiguous fp32 tensors (not unscaled) go to the
    kernel in one call, so a model of many small parameters pays the Python and dispatch
    cost once per backward instead of once per tensor; on CUDA with Triton, one launch per
    element type counts them all. Everything else goes one by one.

    Returns the largest ``|bits|`` of the fp32 values, inf and NaN included (-1 for none), when
    that one compiled call counted them all; None otherwise.
    """
    if counts.device.type == "cuda" and _triton_available() and all(
        type(x) is torch.Tensor and x.device == counts.device and x.is_floating_point() and not x.is_sparse for x in xs
    ):
        from fp16probe.capture import _triton_kernel

        _triton_kernel.count_many(xs, counts, keys, rows, replace, inv)  # one launch per dtype
        return None
    kernel = _numba_kernel() if counts.is_cpu and inv is None else None
    if kernel is None:
        for x, row in zip(xs, rows):
            count_into(x, counts, keys, row, replace=replace, inv=inv)
        return None
    batch: list[torch.Tensor] = []
    batch_rows: list[int] = []
    # Tensors the kernel would split across threads go one by one (one thread: never).
    split_at = kernel.SPLIT_AT if torch.get_num_threads() > 1 else 1 << 62
    for x, row in zip(xs, rows):
        if type(x) is torch.Tensor and x.is_cpu and x.dtype == torch.float32 and 0 < x.numel() < split_at \
                and x.is_contiguous():
            batch.append(x)
            batch_rows.append(row)
        else:
            count_into(x, counts, keys, row, replace=replace)
    if not batch:
        return None if xs else -1
    host = _host_view(counts, keys)
    largest = kernel.count_many(
        np.array([x.data_ptr() for x in batch], dtype=np.int64),
        np.array([x.numel() for x in batch], dtype=np.int64),
        np.array(batch_rows, dtype=np.int64),
        host[1], host[3], replace,
    )  # ``batch`` keeps the tensors alive until the kernel returns
    return largest if len(batch) == len(xs) else None


def largest_abs(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The largest |x| over non-empty floating tensors on one device, as a float32 0-d tensor there:
    inf or NaN when one of them holds one (NaN over inf). No host synchronisation.

    On the CPU with the numba engine, contiguous fp32 tensors are read in one compiled call
    (torch's inf-norm is a scalar loop there, ten times a read); elsewhere one fused
    ``torch._foreach_norm(xs, inf)``.
    """
    bits = _largest_bits_host(xs)
    if bits is not None:
        return torch.tensor(max(bits, 0), dtype=torch.int32).view(torch.float32)
    norms = torch._foreach_norm(list(xs), math.inf)  # one fused pass (per device and dtype)
    return torch.stack([n.float() for n in norms]).max()


def largest_abs_host(xs: Sequence[torch.Tensor | None]) -> float | None:
    """:func:`largest_abs` of contiguous fp32 CPU tensors as a Python float, read by the numba kernel in one
    call (empty tensors and Nones skipped); None when the kernel is absent, there is nothing to read, or a
    tensor is anything else (the caller then takes :func:`largest_abs`)."""
    bits = _largest_bits_host(xs)
    return None if bits is None or bits < 0 else float_of_bits(bits)


def float_of_bits(bits: int) -> float:
    """The fp32 value whose bit pattern is ``bits`` (a largest ``|bits|``: inf and NaN read as themselves)."""
    return float(np.int32(bits).view(np.float32))


def _largest_bits_host(xs: Sequence[torch.Tensor | None]) -> int | None:
    """The largest ``|bits|`` over contiguous fp32 CPU tensors in one compiled call (Nones and empty tensors
    skipped; -1 when nothing is left to read); None when the kernel is absent or a tensor is anything else."""
    kernel = _numba_kernel()
    if kernel is None:
        return None
    addresses, lengths = [], []
    for x in xs:
        if x is None:
            continue
        if type(x) is not torch.Tensor or not x.is_cpu or x.dtype is not torch.float32 or x.is_sparse \
                or not x.is_contiguous():
            return None
        n = x.numel()
        if n:
            addresses.append(x.data_ptr())
            lengths.append(n)
    if not addresses:
        return -1
    return int(kernel.largest_many(np.array(addresses, dtype=np.int64), np.array(lengths, dtype=np.int64)))


def thin_largest() -> object | None:
    """The CPU kernel's ``fold_largest_at(address, numel, slots, i)``, or None when numba does not count here:
    slot ``i`` of the float32 buffer of maxima at the address ``slots`` becomes the larger of itself and
    the largest |x| of ``numel`` contiguous fp32 at ``address`` (NaN kept). The recorder's forward maxima."""
    kernel = _numba_kernel()
    return None if kernel is None else kernel.fold_largest_at


def close_forward_maxima(step: torch.Tensor, run: torch.Tensor, first: torch.Tensor, over: float,
                         step_index: int) -> int:
    """The numba kernel's close of a step of forward maxima (CPU buffers of one length: float32 ``step``
    and ``run``, int64 ``first``): ``run`` takes the larger, ``first`` the step index where it had none
    and the step reached ``over`` (or inf, NaN), ``step`` is zeroed. Returns the step's largest as fp32
    bits. Only where :func:`thin_largest` is not None."""
    kernel = _numba_kernel()
    over_bits = int(np.array(over, dtype=np.float32).view(np.int32))
    return int(kernel.close_maxima(step.data_ptr(), run.data_ptr(), first.data_ptr(), step.numel(), over_bits,
                                   step_index))


def thin_counter() -> tuple[object, int] | None:
    """The CPU kernel's raw entry and the largest size it takes, or None when numba does not count here.

    ``fn(address, numel, counts_address, keys_address, row, replace)`` counts contiguous fp32 CPU data
    at ``address`` into row ``row`` of a CPU table given by its tensors' ``data_ptr()``: the recorder's
    thin per-tensor path. Tensors of the size limit or more go through :func:`count_into` (which may
    split them).
    """
    kernel = _numba_kernel()
    if kernel is None:
        return None
    return kernel.count_at, (kernel.SPLIT_AT if torch.get_num_threads() > 1 else 1 << 62)


def compiled_close(table: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether :func:`close_table` can close a step of ``table``: a CPU table where numba counts."""
    return table[0].is_cpu and _numba_kernel() is not None


def close_table(table: tuple[torch.Tensor, torch.Tensor], totals: tuple[torch.Tensor, torch.Tensor],
                out: tuple[torch.Tensor, torch.Tensor], spare: tuple[torch.Tensor, torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Close a step of a CPU table (counts and keys) in one compiled pass (where :func:`compiled_close`):
    ``out`` takes ``totals`` with the step added, ``spare`` is zeroed (keys -1) for the next step, and
    the step's record comes back: its counts summed over rows and a copy of its keys. The recorder's
    step close, which takes torch ops, out of place, elsewhere."""
    step = _numba_kernel().close_table(*(t.numpy() for pair in (table, totals, out, spare) for t in pair))
    return torch.from_numpy(step), table[1].clone()


def _host_view(counts: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray]:
    """numpy views of a CPU table, cached (no torch dispatch on the hot path)."""
    host = _host_views.get(id(counts))
    if host is None or host[0] is not counts or host[2] is not keys:
        if len(_host_views) > 64:
            _host_views.clear()
        host = _host_views[id(counts)] = (counts, counts.numpy(), keys, keys.numpy())
    return host


def _unscaled(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 times ``inv``; on the CPU in a reused buffer (no allocation per tensor)."""
    if inv.device != x.device:
        inv = inv.to(x.device, non_blocking=True)
    if x.device.type != "cpu":
        return x.detach().float() * inv
    ws = getattr(_workspace, "buf", None)
    n = x.numel()
    if ws is None or ws.numel() < n:
        ws = _workspace.buf = torch.empty(max(n, 1 << 16), dtype=torch.float32)
    out = ws[:n].view(x.shape)
    out.copy_(x.detach())
    return out.mul_(inv)


_workspace = threading.local()


def histogram(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Count ``x`` into a fresh row; return ``(counts [NUM_BINS] int64, key int32 scalar)`` on x's device."""
    counts, keys = new_table(1, x.device)
    count_into(x, counts, keys, 0)
    return counts[0], keys[0]


def _engine_for(device: torch.device) -> str:
    if device.type != "cpu":
        return "device"
    if CPU_ENGINE in ("torch", "device"):
        return CPU_ENGINE
    from fp16probe.capture import _cpu_kernel

    if CPU_ENGINE == "numba" and not _cpu_kernel.available():
        raise ImportError("FP16PROBE_CPU_ENGINE=numba needs numba: pip install 'fp16probe[fast]'")
    name = "numba" if _cpu_kernel.available() else "torch"
    _ENGINES[(device.type, CPU_ENGINE)] = name
    return name


_ENGINES: dict[tuple[str, str], str] = {}  # (device type, CPU_ENGINE) -> engine, once decided


def _numba_kernel():
    """The numba kernel module when it counts CPU tensors here (CPU_ENGINE), else None."""
    kernel = _KERNELS.get(CPU_ENGINE, False)
    if kernel is False:
        kernel = None
        if _engine_for(torch.device("cpu")) == "numba":
            from fp16probe.capture import _cpu_kernel as kernel
        _KERNELS[CPU_ENGINE] = kernel
    return kernel


_KERNELS: dict[str, object] = {}
_NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)
_host_views: dict[int, tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray]] = {}


def cpu_engine() -> str:
    """Name the engine that counts CPU tensors here: ``"numba"``, ``"torch"`` or ``"device"``."""
    return _engine_for(torch.device("cpu"))


_TRITON: bool | None = None


def _triton_available() -> bool:
    global _TRITON
    if _TRITON is None:
        if os.environ.get("FP16PROBE_TRITON", "1") == "0":
            _TRITON = False
        else:
            try:
                from fp16probe.capture import _triton_kernel

                _TRITON = _triton_kernel.available()
            except ImportError:
                _TRITON = False
    return _TRITON


def max_abs_of_keys(keys: torch.Tensor) -> torch.Tensor:
    """The largest finite |x| over rows' keys, as a float32 device scalar (0.0 if none; no sync)."""
    return keys.amax().sub(_KEY_OFFSET).clamp_min(0).view(torch.float32)


def max_abs_from_key(key: int) -> float:
    """Turn a key from :func:`count_into` into the largest finite |x| (0.0 if none)."""
    if key < _KEY_OFFSET:
        return 0.0
    bits = int(key) - _KEY_OFFSET
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()
