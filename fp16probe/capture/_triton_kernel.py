"""The accelerator engine as fused Triton kernels: one launch per tensor, or one for many.

Each program walks its share of a tensor in tiles of ``BLOCK`` elements (64-bit offsets:
tensors of 2^31 elements and more), bins each tile and adds it into a histogram it keeps in
registers for its whole life; at the end it adds the occupied bins into the row of the
device table with one atomic each, and the key with one ``atomic_max``. No host
synchronisation and no host-to-device copy of data.

Two bin rules, both exact (equal to the CPU engines; ``tests/test_triton_kernel.py``):

* **fp16 data** is binned in the fp16 domain: converted to fp32 (exact; fp16 subnormals
  become fp32 normals), the cell ``(|bits| + 0x7FFFFF) >> 23`` is one of 41 finite cells
  (2^-24 to 65504), zero, inf or NaN: 44 cells in a 64-bin histogram, about a quarter of
  the work of a 512-bin one in Triton's warp-ballot lowering. Unscaling by a power-of-two
  ``1/S = 2^-k`` (GradScaler's scales are powers of two) shifts every bin by ``-k`` exactly,
  so it is applied once, when the bins are added into the row; another ``1/S`` (read on the
  device, no sync) takes the general rule.
* **other data** (fp32, bf16, or fp16 under a scale that is not a power of two): converted
  to fp32, multiplied by ``1/S`` when unscaling, and binned with the branch-free rule of
  :mod:`fp16probe.capture.engine` into 512 bins (281 used).

:func:`count_many` counts many tensors (all weight gradients of a backward) in one launch:
a table of (address, first element, end, row) on the device, one grid row per tensor.

Only used for CUDA tensors when Triton is installed; ``TRITON_INTERPRET=1`` runs the kernels
on CPU tensors, which is how the tests check them against the other engines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

BLOCK = 4096  # elements per tile: 16 per thread at 8 warps (two 128-bit loads of fp16)
MAX_PROGRAMS = 1024  # programs per tensor; a larger tensor loops (the histogram stays in registers)


def available() -> bool:
    """Say whether the Triton kernel can run (Triton installed)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _general_bins(x):  # pragma: no cover - compiled
        """Canonical bins (int32) of fp32 values and their |bits| (the engine's rule)."""
        a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        f = a >> 23
        m = a & 0x7FFFFF
        nz = (m != 0).to(tl.int32)
        # ceil(log2 m) from float(m)'s exponent (exact: m < 2^24)
        c = ((m.to(tl.float32).to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23) - 127
        idx = tl.where(f == 0, tl.where(nz != 0, c, 278), tl.where(f == 255, 279 + nz, f + 22 + nz))
        return idx, a

    @triton.jit
    def _fp16_cells(x):  # pragma: no cover - compiled
        """fp16 values (as fp32) to cells 0 (zero), 1..41 (bins 125..165 unscaled), 42 (inf), 43 (NaN)."""
        a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        cell = (a >> 23) + ((a & 0x7FFFFF) != 0).to(tl.int32)  # = (a + 0x7FFFFF) >> 23, no int32 wrap
        w = tl.where(cell == 0, 0, tl.where(cell >= 255, cell - 213, cell - 102))
        return w, a

    @triton.jit
    def _fp16_loop(x_ptr, start, end, step, shift, counts_ptr, row, BLOCK: tl.constexpr):  # pragma: no cover
        """fp16 tiles into 64 cells kept in registers; the bins shifted by ``-shift`` at the end. Returns the key."""
        lanes = tl.arange(0, BLOCK).to(tl.int64)  # 64-bit offsets: past 2^31 elements
        hist16 = tl.zeros((64,), dtype=tl.int32)
        amax = tl.full((), -1, dtype=tl.int32)
        for s in range(start, end, step):
            offs = s + lanes
            mask = offs < end
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w, a = _fp16_cells(x)
            hist16 += tl.histogram(tl.where(mask, w, 63), 64)
            amax = tl.maximum(amax, tl.max(tl.where(mask & (a < 0x7F800000), a, -1), axis=0))
        # cell w (1..41) holds bin w + 124 unscaled; 1/S = 2^-shift moves it to w + 124 - shift.
        cells = tl.arange(0, 64)
        target = tl.where(cells == 0, 278, tl.where(cells == 42, 279, tl.where(cells == 43, 280, cells + 124 - shift)))
        tl.atomic_add(counts_ptr + row * 281 + target, hist16.to(tl.int64), mask=(cells < 44) & (hist16 > 0))
        # the largest finite |x| times 2^-shift: its exponent field moves by -shift (and stays normal)
        return tl.where(amax > 0, amax - shift * 0x800000 + 0x800000, tl.where(amax == 0, 0x800000, -1))

    @triton.jit
    def _general_loop(x_ptr, start, end, step, inv, counts_ptr, row, SCALED: tl.constexpr,
                      BLOCK: tl.constexpr):  # pragma: no cover
        """fp32 values (times ``inv`` when SCALED) into 512 bins kept in registers. Returns the key."""
        lanes = tl.arange(0, BLOCK).to(tl.int64)  # 64-bit offsets: past 2^31 elements
        hist32 = tl.zeros((512,), dtype=tl.int32)
        key = tl.full((), -1, dtype=tl.int32)
        for s in range(start, end, step):
            offs = s + lanes
            mask = offs < end
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if SCALED:
                x = x * inv
            idx, a = _general_bins(x)
            hist32 += tl.histogram(tl.where(mask, idx, 511), 512)  # padding lands past the last real bin
            key = tl.maximum(key, tl.max(tl.where(mask & (a < 0x7F800000), a + 0x800000, -1), axis=0))
        bins = tl.arange(0, 512)
        tl.atomic_add(counts_ptr + row * 281 + bins, hist32.to(tl.int64), mask=(bins < 281) & (hist32 > 0))
        return key

    @triton.jit
    def _count_range(x_ptr, first, end, inv_ptr, counts_ptr, keys_ptr, row, pid, nprog,
                     SCALED: tl.constexpr, FP16: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover
        """Count elements [first, end) of ``x_ptr`` (this program's tiles) into ``row``; 64-bit offsets."""
        zero = tl.full((), 0, dtype=tl.int64)
        end = zero + end
        step = zero + nprog * BLOCK
        start = zero + first + pid * BLOCK
        if SCALED:
            inv = tl.load(inv_ptr)
            ib = inv.to(tl.int32, bitcast=True)
            shift = 127 - ((ib >> 23) & 0xFF)  # 1/S = 2^-shift when the mantissa is 0
            if FP16:
                pow2 = ((ib & 0x7FFFFF) == 0) & (ib > 0) & (shift >= -112) & (shift <= 102)
                if pow2:
                    key = _fp16_loop(x_ptr, start, end, step, shift, counts_ptr, row, BLOCK)
                else:
                    key = _general_loop(x_ptr, start, end, step, inv, counts_ptr, row, True, BLOCK)
            else:
                key = _general_loop(x_ptr, start, end, step, inv, counts_ptr, row, True, BLOCK)
        else:
            if FP16:
                key = _fp16_loop(x_ptr, start, end, step, 0, counts_ptr, row, BLOCK)
            else:
                key = _general_loop(x_ptr, start, end, step, 1.0, counts_ptr, row, False, BLOCK)
        tl.atomic_max(keys_ptr + row, key)

    @triton.jit
    def _count_kernel(x_ptr, n, inv_ptr, counts_ptr, keys_ptr, row, SCALED: tl.constexpr, FP16: tl.constexpr,
                      BLOCK: tl.constexpr):  # pragma: no cover - compiled
        _count_range(x_ptr, 0, n, inv_ptr, counts_ptr, keys_ptr, row, tl.program_id(0), tl.num_programs(0),
                     SCALED, FP16, BLOCK)

    @triton.jit
    def _count_many_kernel(table_ptr, elem_ptr, inv_ptr, counts_ptr, keys_ptr, SCALED: tl.constexpr,
                           FP16: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover - compiled
        t = tl.program_id(1)
        address = tl.load(table_ptr + 4 * t)
        first = tl.load(table_ptr + 4 * t + 1)
        end = tl.load(table_ptr + 4 * t + 2)
        row = tl.load(table_ptr + 4 * t + 3)
        x_ptr = address.to(elem_ptr.dtype)  # the address as a pointer of the tensors' element type
        _count_range(x_ptr, first, end, inv_ptr, counts_ptr, keys_ptr, row, tl.program_id(0), tl.num_programs(0),
                     SCALED, FP16, BLOCK)


def _flat(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.float()
    flat = x.detach().reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (from pinned memory on CUDA)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _programs(n: int) -> int:
    return max(1, min(triton.cdiv(n, BLOCK), MAX_PROGRAMS))


def count_into(x: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor, row: int, replace: bool,
               inv: torch.Tensor | None = None) -> None:
    """Add ``x`` (times ``inv`` when given) into ``counts[row]``/``keys[row]`` with one kernel."""
    flat = _flat(x)
    if replace:
        counts[row].zero_()
        keys[row].fill_(-1)
    n = flat.numel()
    if n == 0:
        return
    scaled = inv is not None
    _count_kernel[(_programs(n),)](
        flat, n, inv if scaled else flat, counts, keys, row, SCALED=scaled, FP16=flat.dtype == torch.float16,
        BLOCK=BLOCK, num_warps=8,
    )


def count_many(xs: Sequence[torch.Tensor], counts: torch.Tensor, keys: torch.Tensor, rows: Sequence[int],
               replace: bool, inv: torch.Tensor | None = None) -> None:
    """:func:`count_into` for ``xs[t]`` into ``rows[t]``: one launch per element type, not one per tensor.

    The table of addresses goes to the device from pinned memory, without a host sync.
    """
    flats = [_flat(x) for x in xs]
    if replace:
        idx = _to_device(torch.tensor(list(rows), dtype=torch.int64), counts.device)
        counts.index_fill_(0, idx, 0)
        keys.index_fill_(0, idx, -1)
    by_dtype: dict[torch.dtype, list[tuple[int, int, int, int]]] = {}
    for flat, row in zip(flats, rows):
        if flat.numel():
            by_dtype.setdefault(flat.dtype, []).append((flat.data_ptr(), 0, flat.numel(), int(row)))
    for dtype, entries in by_dtype.items():
        launch_many(entries, dtype, counts, keys, inv)
    # ``flats`` (copies of non-contiguous inputs among them) live until here: the launches are
    # queued on the current stream, which uses them before the caching allocator reuses them.


def launch_many(entries: Sequence[tuple[int, int, int, int]], dtype: torch.dtype, counts: torch.Tensor,
                keys: torch.Tensor, inv: torch.Tensor | None = None) -> None:
    """One launch over ``entries``: (address, first element, end, row) of ``dtype`` data on the table's device.

    Elements ``first`` to ``end`` after ``address`` are counted into ``row``; offsets are 64-bit
    (the tests reach offsets past 2^31 with an address moved back by as much).
    """
    table = _to_device(torch.tensor(list(entries), dtype=torch.int64), counts.device)
    longest = max(end - first for _, first, end, _ in entries)
    sample = torch.empty(1, dtype=dtype, device=counts.device)  # only its pointer's element type is read
    scaled = inv is not None
    _count_many_kernel[(_programs(longest), len(entries))](
        table, sample, inv if scaled else sample, counts, keys, SCALED=scaled, FP16=dtype == torch.float16,
        BLOCK=BLOCK, num_warps=8,
    )
