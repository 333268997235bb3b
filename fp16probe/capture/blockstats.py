"""The statistics that decide scaled formats (FP8 recipes, MXFP8, NVFP4), as pure functions over tensors.

Tensor in, counts out, on the tensor's device, with no host synchronisation: every count
is a device tensor until a report is asked for. The bin layout and the host-side reading
of the counts are in :mod:`fp16probe.blockscale`.

* :func:`relative_histogram` -- each element's exponent relative to its block's amax, with
  both mantissa classes: from it, exact counts under every power-of-two scale rule
  (MXFP8 FLOOR / RCEIL / CEIL / EVEN, power-of-two tiles and rows) for e4m3 and e5m2;
* :func:`current_scaling_counts`, :func:`scaled_counts` -- per-tensor scales that are not
  powers of two (TransformerEngine's current and delayed scaling): counted from the values;
* :func:`nvfp4_counts` -- NVFP4's two-level scale (an E4M3 scale per 16 values, an fp32
  scale per tensor), whole-block loss and the expected zero share under stochastic rounding;
* delayed scaling's scales come from the amax trace: :func:`fp16probe.blockscale.delayed_scales`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


import torch

from fp16probe.capture import engine
from fp16probe.blockscale import (
    DEPTH,
    ELEMENTS,
    MIN_BLOCK_EXP,
    NUM_CLASSES,
    NUM_D,
    RELATIVE_BINS,
    SPREAD_BINS,
    ElementFormat,
)

__all__ = [
    "COUNT_FIELDS",
    "SPREAD_BINS",
    "blocks",
    "current_scaling_counts",
    "nvfp4_counts",
    "relative_histogram",
    "relative_histograms",
    "scaled_counts",
]

COUNT_FIELDS = ("nonzero", "flushed", "subnormal", "saturated")


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    """Rows along the last dimension (a GEMM's reduction dimension for activations and weights)."""
    x = x.detach().float()
    if x.dim() <= 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _pad(x: torch.Tensor, rows: int, cols: int, value: float = 0) -> torch.Tensor:
    """``x`` padded with ``value`` to multiples of ``rows`` x ``cols`` (zeros change no amax)."""
    r, c = x.shape
    pr, pc = (-r) % rows, (-c) % cols
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr), value=value)
    return x


def blocks(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (fp32) as ``[n_blocks, block_size]`` for a layout of :data:`fp16probe.blockscale.LAYOUTS`.

    ``*_t`` layouts block the transpose (the columns of the 2-D view), as the backward
    pass's GEMMs read a weight or an output gradient. Partial blocks are padded with zeros.
    """
    return _blocks_2d(_as_2d(x), layout)


def _blocks_2d(x2: torch.Tensor, layout: str, pad: float = 0) -> torch.Tensor:
    """:func:`blocks` of a 2-D tensor of any dtype, padding with ``pad``."""
    if layout.endswith("_t"):
        x2, layout = x2.t(), layout[:-2]
    if layout == "tensor":
        return x2.reshape(1, -1)
    if layout == "row":
        return x2.contiguous()
    if layout in ("mx32", "nv16", "tile128"):
        size = {"mx32": 32, "nv16": 16, "tile128": 128}[layout]
        return _pad(x2, 1, size, pad).reshape(-1, size)
    if layout in ("tile128x128", "nv16x16"):
        size = 128 if layout == "tile128x128" else 16
        p = _pad(x2, size, size, pad)
        r, c = p.shape
        return p.reshape(r // size, size, c // size, size).permute(0, 2, 1, 3).reshape(-1, size * size)
    raise ValueError(f"unknown layout {layout!r}")


_SENTINEL = -(1 << 30)  # the key of a value left out of the histogram (zero, inf, NaN, padding)


def _exponent_and_class(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For finite magnitudes ``a = 2^E (1 + f)``: E and the mantissa class 2*floor(16 f) + (16 f not whole), int32.

    Read from the fp32 bits; fp32 subnormals are scaled by 2^64 first (exact) so that their
    bits are normal. Non-finite inputs give meaningless values, to be masked by the caller.
    """
    sub = a.lt(2.0 ** -126)
    bits = torch.where(sub, a * 2.0 ** 64, a).view(torch.int32)
    e = bits.bitwise_right_shift(23).sub_(127).sub_(sub.to(torch.int32) * 64)
    m = bits.bitwise_and(0x7FFFFF)
    c = m.bitwise_right_shift(19).mul_(2).add_(m.bitwise_and(0x7FFFF).ne(0).to(torch.int32))
    return e, c


def relative_histogram(x: torch.Tensor, layout: str, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``x``'s relative-exponent histogram for ``layout`` into ``out``; return ``(out, extra)``.

    ``out`` is a ``[RELATIVE_BINS]`` int64 tensor on ``x``'s device (a new one when None):
    cell ``(c_B, d, c_x)`` counts the nonzero finite elements whose exponent is ``d`` below
    their block amax's (clipped at ``-DEPTH``), by the two mantissa classes. ``extra`` is
    ``[zeros, nonfinite, out_of_range]`` (int64): values outside the histogram. A block
    holding an inf or NaN has no finite scale: its finite values count as nonfinite too.
    """
    if out is None:
        out = torch.zeros(RELATIVE_BINS, dtype=torch.int64, device=x.device)
    extra = relative_histograms(x, (layout,), {layout: out})
    return out, extra[layout]


def relative_histograms(x: torch.Tensor, layouts: Sequence[str], outs: Mapping[str, torch.Tensor],
                        spreads: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """:func:`relative_histogram` for several layouts, each element's exponent and class read once.

    With ``spreads`` (``[SPREAD_BINS]`` int64 per layout), also count the blocks by how many
    binades their amax's exponent lies below the tensor amax's (clipped at ``SPREAD_BINS - 1``;
    all-zero and non-finite blocks left out): the statistic behind a block scale's own range.
    """
    x2 = _as_2d(x)
    if x2.is_cpu and engine.CPU_ENGINE in ("auto", "numba") and _block_kernel() is not None:
        return _relative_histograms_numba(x2, layouts, outs, spreads)
    a2 = x2.abs()
    finite = torch.isfinite(a2)
    a_fin = torch.where(finite, a2, torch.zeros((), device=a2.device))
    e_x, c_x = _exponent_and_class(a_fin)
    nonzero = a_fin.ne(0)
    key = torch.where(nonzero, e_x.mul_(NUM_CLASSES).add_(c_x), torch.full((), _SENTINEL, dtype=torch.int32,
                                                                            device=a2.device))
    bad = (~finite).to(torch.uint8)
    e_t, _ = _exponent_and_class(a_fin.amax().reshape(1, 1))
    zeros = torch.count_nonzero(finite & ~nonzero)  # faster than a boolean .sum(), the same count
    n_bad = bad.sum()
    extras = {}
    for lay in layouts:
        amax = _blocks_2d(a_fin, lay).amax(dim=1, keepdim=True)
        k = _blocks_2d(key, lay, _SENTINEL)
        block_finite = _blocks_2d(bad, lay).amax(dim=1, keepdim=True).eq(0)
        e_b, c_b = _exponent_and_class(amax)
        in_range = block_finite & e_b.ge(MIN_BLOCK_EXP)
        valid = k.ne(_SENTINEL)
        d = k.bitwise_right_shift(5).sub_(e_b).clamp_(min=-DEPTH).add_(DEPTH)
        idx = c_b.mul(NUM_D).add(d).mul_(NUM_CLASSES).add_(k.bitwise_and(NUM_CLASSES - 1))
        spare = torch.full((), RELATIVE_BINS, dtype=torch.int32, device=a2.device)
        idx = torch.where(valid & in_range, idx, spare).reshape(-1)
        # One spare cell takes the values left out, so no boolean indexing (a host sync) is needed.
        if idx.is_cpu and engine.CPU_ENGINE != "device":  # "device": the accelerator path, run on the CPU
            counts = torch.bincount(idx, minlength=RELATIVE_BINS + 1)
        else:  # bincount would synchronise to size its output
            counts = torch.zeros(RELATIVE_BINS + 1, dtype=torch.int64, device=idx.device)
            counts.index_add_(0, idx, torch.ones((), dtype=torch.int64, device=idx.device).expand(idx.numel()))
        outs[lay].add_(counts[:RELATIVE_BINS])
        if spreads is not None:  # how far below the tensor's amax each block's amax lies, in binades
            gap = e_t.sub(e_b).clamp_(0, SPREAD_BINS - 1)
            gap = torch.where(amax.gt(0) & block_finite, gap, torch.full_like(gap, SPREAD_BINS)).reshape(-1).long()
            spread = torch.zeros(SPREAD_BINS + 1, dtype=torch.int64, device=gap.device)
            spread.index_add_(0, gap, torch.ones((), dtype=torch.int64, device=gap.device).expand(gap.numel()))
            spreads[lay].add_(spread[:SPREAD_BINS])
        in_bad_block = torch.count_nonzero(valid & ~block_finite)
        out_of_range = torch.count_nonzero(valid & block_finite & ~in_range)
        extras[lay] = torch.stack([zeros, n_bad + in_bad_block, out_of_range])
    return extras


def _block_kernel():
    """The numba kernel module for the relative histogram, or None (numba absent)."""
    global _KERNEL
    if _KERNEL is False:
        from fp16probe.capture import _cpu_blockkernel

        _KERNEL = _cpu_blockkernel if _cpu_blockkernel.available() else None
    return _KERNEL


_KERNEL: object = False


def _relative_histograms_numba(x2: torch.Tensor, layouts: Sequence[str], outs: Mapping[str, torch.Tensor],
                               spreads: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The CPU path: blocks laid out by torch (one copy), counted by one fused numba pass each."""
    kernel = _block_kernel()
    extras = {}
    for lay in layouts:
        b = _blocks_2d(x2, lay).contiguous()
        extra = torch.zeros(3, dtype=torch.int64)
        spread = spreads[lay] if spreads is not None else torch.zeros(SPREAD_BINS, dtype=torch.int64)
        kernel.count_into(b.numpy(), outs[lay].numpy(), extra.numpy(), spread.numpy())  # type: ignore[attr-defined]
        extra[0] -= b.numel() - x2.numel()  # padding zeros are not the tensor's
        extras[lay] = extra
    return extras


def scaled_counts(x: torch.Tensor, scale: torch.Tensor | float, element: str | ElementFormat) -> torch.Tensor:
    """``[nonzero, flushed, subnormal, saturated]`` (int64, on device) of ``x * scale`` cast to ``element``.

    ``scale`` multiplies in fp32, as TransformerEngine's FP8 casts do (``scale = max / amax``).
    """
    el = ELEMENTS[element] if isinstance(element, str) else element
    a = x.detach().float().abs()
    q = a * scale
    return _classify(a, q, el)


def _classify(a: torch.Tensor, q: torch.Tensor, el: ElementFormat) -> torch.Tensor:
    nonzero = torch.isfinite(a) & a.ne(0)
    flushed = nonzero & q.le(el.flush)
    subnormal = nonzero & q.gt(el.flush) & q.lt(el.normal)
    saturated = nonzero & (q.ge(el.overflow) if el.overflow_inclusive else q.gt(el.overflow))
    return torch.stack([nonzero.sum(), flushed.sum(), subnormal.sum(), saturated.sum()])


def current_scaling_counts(x: torch.Tensor, element: str | ElementFormat) -> torch.Tensor:
    """Counts under per-tensor current scaling (TE ``Float8CurrentScaling``): ``scale = max / amax`` in fp32.

    An all-zero tensor gets scale 1, as TE's ``compute_scale_from_amax`` does.
    """
    el = ELEMENTS[element] if isinstance(element, str) else element
    a = x.detach().float().abs()
    amax = torch.where(torch.isfinite(a), a, torch.zeros((), device=a.device)).amax()
    # A true division, as TE computes it (``max / amax`` in Python would multiply by a reciprocal),
    # with the constant made on the device (``torch.tensor(..., device=cuda)`` would copy from the host).
    scale = torch.where(amax > 0, torch.full_like(amax, el.max).div_(amax), torch.ones_like(amax))
    return _classify(a, a * scale, el)


def nvfp4_counts(
    x: torch.Tensor,
    *,
    tensor_amax: torch.Tensor | None = None,
    block_scale: str = "torchao",
    square: bool = False,
    transposed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 (NVIDIA, arXiv 2509.25149): ``([nonzero, flushed, subnormal, saturated, blocks_lost,
    values_in_lost_blocks] int64, expected zeros under stochastic rounding float64)``, on device.

    Two-level scale as torchao's ``nvfp4_quantize``: per-tensor ``s_T = a_T / (448 * 6)``,
    per-block ``e4m3(a_B / 6 / s_T)``, elements ``x * ((1 / s_T) / block scale)`` cast to E2M1.
    ``block_scale="torchao"`` clamps the block scale to e4m3's min normal 2^-6 first (torchao
    0.18); ``"cast"`` casts it as is (round to nearest even, as a plain e4m3 cast does): a
    block scale at or below 2^-10 becomes 0 and the whole block is lost (``blocks_lost``, its
    values counted as flushed). ``square`` uses 16x16 blocks (the paper's weights) instead
    of 1x16; ``transposed`` blocks the columns (the backward's transposed reads). The stochastic-rounding share is exact: a magnitude ``q < 0.5`` rounds to 0
    with probability ``1 - q / 0.5``, and never from 0.5 up.
    """
    el = ELEMENTS["e2m1"]
    b = blocks(x, "nv16x16" if square else ("nv16_t" if transposed else "nv16"))
    a = b.abs()
    finite = torch.isfinite(a)
    a0 = torch.where(finite, a, torch.zeros((), device=a.device))
    if tensor_amax is None:
        tensor_amax = a0.amax()
    s_t = tensor_amax.float() / (448.0 * 6.0)
    block = a0.amax(dim=1, keepdim=True) / 6.0 / s_t
    if block_scale == "torchao":
        block = block.clamp(min=torch.finfo(torch.float8_e4m3fn).tiny, max=448.0)
    elif block_scale == "cast":
        block = block.clamp(max=448.0)
    else:
        raise ValueError(f"block_scale must be 'torchao' or 'cast', got {block_scale!r}")
    block = block.to(torch.float8_e4m3fn).float()
    lost = block.eq(0)
    recip = torch.where(lost, torch.zeros((), device=a.device), (1.0 / s_t) / torch.where(lost, 1.0, block))
    q = a0 * recip  # torchao then clamps to +-6: what lies past 7 is saturated
    counts = _classify(torch.where(finite, a, torch.zeros((), device=a.device)), q, el)
    nonzero = finite & a.ne(0)
    lost_values = torch.count_nonzero(nonzero & lost)
    lost_blocks = torch.count_nonzero(lost & nonzero.any(dim=1, keepdim=True))
    # A value q rounds to 0 with probability 1 - 2q when q < 0.5 (E2M1's smallest subnormal).
    sr_zero = torch.where(nonzero, (1.0 - 2.0 * q.double()).clamp(min=0.0), torch.zeros((), dtype=torch.float64,
                                                                                      device=a.device)).sum()
    return torch.cat([counts, torch.stack([lost_blocks, lost_values])]), sr_zero
