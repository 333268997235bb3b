"""The accelerator engine as one fused Triton kernel per tensor.

Each program reads tiles of the tensor (fp32, fp16 or bf16, converted to fp32 in
registers; multiplied by the scaler's reciprocal scale read from device memory when
unscaling), bins them with the branch-free rule of :mod:`fp16probe.capture.engine`,
histograms each tile in registers, and adds the nonzero bins into the module's row of
the device table with one atomic per occupied bin; the key goes in with one
``atomic_max``. No host synchronisation and no host-to-device copy.

Only used for CUDA tensors when Triton is installed; ``TRITON_INTERPRET=1`` runs it on
the CPU, which is how the tests check it against the other engines without a GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None

NUM_BINS = 281  # fp16probe.histogram.NUM_BINS
_BLOCK = 1024
_MAX_PROGRAMS = 1024


def available() -> bool:
    """Say whether the Triton kernel can run (Triton installed)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _count_kernel(x_ptr, n, inv_ptr, counts_ptr, keys_ptr, row, SCALED: tl.constexpr,
                      BLOCK: tl.constexpr):  # pragma: no cover - compiled
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        bins = tl.arange(0, 512)
        hist = tl.zeros((512,), dtype=tl.int32)
        key = tl.full((), -1, dtype=tl.int32)
        if SCALED:
            inv = tl.load(inv_ptr)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if SCALED:
                x = x * inv
            a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            f = a >> 23
            m = a & 0x7FFFFF
            nz = (m != 0).to(tl.int32)
            # ceil(log2 m) from float(m)'s exponent (exact: m < 2^24)
            c = ((m.to(tl.float32).to(tl.int32, bitcast=True) + 0x7FFFFF) >> 23) - 127
            idx = tl.where(f == 0, tl.where(nz != 0, c, 278), tl.where(f == 255, 279 + nz, f + 22 + nz))
            idx = tl.where(mask, idx, 511)  # padding lands past the last real bin
            hist += tl.histogram(idx, 512)
            cand = tl.where(mask & (f < 255), a + 0x800000, -1)
            key = tl.maximum(key, tl.max(cand, axis=0))
        tl.atomic_add(counts_ptr + row * 281 + bins, hist.to(tl.int64), mask=(bins < 281) & (hist > 0))
        tl.atomic_max(keys_ptr + row, key)


def count_into(x: torch.Tensor, counts: torch.Tensor, keys: torch.Tensor, row: int, replace: bool,
               inv: torch.Tensor | None = None) -> None:
    """Add ``x`` (times ``inv`` when given) into ``counts[row]``/``keys[row]`` with one kernel."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.float()
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if replace:
        counts[row].zero_()
        keys[row].fill_(-1)
    n = flat.numel()
    if n == 0:
        return
    programs = min(triton.cdiv(n, _BLOCK), _MAX_PROGRAMS)
    scaled = inv is not None
    _count_kernel[(programs,)](
        flat, n, inv if scaled else flat, counts, keys, row, SCALED=scaled, BLOCK=_BLOCK
    )
