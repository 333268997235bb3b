"""Scaled low-precision formats (FP8 recipes, MXFP8, NVFP4): element limits, scale rules,
and exact counts from the relative-exponent statistic.

Plain host-side data, like :mod:`fp16probe.histogram`: the device side that fills the
statistic is :mod:`fp16probe.capture.blockstats`.

The statistic
-------------
A scaled format divides each block of values (32 for MX, 128 for tiles, a row, the whole
tensor) by one scale ``2^s`` and casts the quotient to an element format. For every rule
with a power-of-two scale, ``s = E_B + offset(rule, mantissa of a_B)`` where ``E_B`` is the
binary exponent of the block's amax ``a_B``; and whether an element flushes, goes
subnormal or saturates depends only on ``E_x - s`` and the element's own mantissa, compared
with three thresholds of the element format, each ``2^j (1 + k/16)``. So one histogram over

* ``c_B``: the block amax's mantissa class (its top four fraction bits, and whether any lower
  bit is set: 32 classes),
* ``d = E_x - E_B`` (clipped at ``-DEPTH``: further down, every format here flushes),
* ``c_x``: the element's mantissa class (32 classes),

gives, count for count, what every such rule (OCP FLOOR, RCEIL as cuBLAS and TE do, CEIL,
EVEN; power-of-two tiles) does to the block, in one pass. Sources: OCP Microscaling Formats
(MX) Specification v1.0; Rouhani et al., "Microscaling Data Formats for Deep Learning",
arXiv 2310.10537; Mishra et al., "Recipes for Pre-training LLMs with MXFP8", arXiv
2506.08027; Micikevicius et al., "FP8 Formats for Deep Learning", arXiv 2209.05433.

Shares are of nonzero finite values. TransformerEngine's ``underflows%`` divides by the
element count (zeros included), so its figure is lower on tensors with many zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Mapping

import numpy as np

from fp16probe.formats import ELEMENTS, FAMILIES, SCALED_FORMATS, ElementFormat

__all__ = [
    "BLOCK_KINDS",
    "FAMILIES",
    "DEPTH",
    "ELEMENTS",
    "LAYOUTS",
    "MIN_BLOCK_EXP",
    "NUM_CLASSES",
    "RELATIVE_BINS",
    "RULES",
    "SPREAD_BINS",
    "BlockCounts",
    "BlockStats",
    "DelayedRecipe",
    "ElementFormat",
    "TensorBlockStats",
    "block_stats_of",
    "counts_from_relative",
    "families_for",
    "delayed_scales",
    "scale_offsets",
]

NUM_CLASSES = 32  # a mantissa class: 2 * (top four fraction bits) + (any lower bit set)
DEPTH = 40  # d = E_x - E_B is clipped at -DEPTH; every element format here flushes below -33
NUM_D = DEPTH + 1
RELATIVE_BINS = NUM_CLASSES * NUM_D * NUM_CLASSES  # 41,984 counts per tensor and layout
# Blocks whose amax is below 2^MIN_BLOCK_EXP are counted apart ("out of range"): there the
# scale's own range (E8M0 from 2^-127, torchao's clamp at fp32's min normal) decides, not the rule.
MIN_BLOCK_EXP = -100
SPREAD_BINS = 65  # the block-amax-below-tensor-amax histogram: 0..64 binades (the last: 64 and more)

RULES = ("floor", "rceil", "ceil", "even")
# Layouts: "mx32" 1x32 blocks along rows, "mx32_t" along columns (the transpose), "nv16"
# 1x16 blocks, "tile128" 1x128, "tile128x128" 128x128, "row" one block per row, "tensor" one block.
LAYOUTS = ("mx32", "mx32_t", "tile128", "tile128_t", "tile128x128", "row", "tensor")


def _sixteenths(value: float) -> tuple[int, int]:
    """``value = 2^j (1 + k/16)``: return (j, k); raise when it is not of that form."""
    m, e = math.frexp(value)
    k = (2 * m - 1) * 16
    if k != int(k):
        raise ValueError(f"{value!r} is not 2^j (1 + k/16)")
    return e - 1, int(k)


# The tensors of a Linear layer's three GEMMs, as the capture names them.
BLOCK_KINDS = ("input", "weight", "output_grad", "weight_grad")


def families_for(formats: str | Sequence[str]) -> tuple[str, ...]:
    """The statistics families the ``--format`` names need (empty for fp16 and bf16)."""
    names = [formats] if isinstance(formats, str) else list(formats)
    return tuple(sorted({SCALED_FORMATS[n].family.name for n in names if n in SCALED_FORMATS}))


@dataclass(frozen=True)
class DelayedRecipe:
    """TransformerEngine's ``DelayedScaling(amax_history_len=..., margin=..., amax_compute_algo=...)``."""

    history_len: int = 1024
    margin: int = 0
    algo: str = "max"

    def __post_init__(self) -> None:
        if isinstance(self.history_len, bool) or not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"history_len must be a positive whole number, got {self.history_len!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or not 0 <= self.margin <= 64:
            raise ValueError(f"margin must be a whole number from 0 to 64, got {self.margin!r}")
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {self.algo!r}")

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {"history_len": self.history_len, "margin": self.margin, "algo": self.algo}


def scale_offsets(rule: str, element: ElementFormat) -> np.ndarray:
    """``s - E_B`` for each block-amax mantissa class under ``rule`` (a [32] int array).

    * ``floor`` (OCP MX v1.0): ``s = E_B - emax``;
    * ``ceil`` (torchao CEIL): one more when the amax is not a power of two;
    * ``even`` (torchao EVEN): the amax rounded to the element's mantissa width first, so one
      more when its fraction is at least ``1 - 2^-(m+1)``;
    * ``rceil`` (cuBLAS and TE; torchao RCEIL): ``s = ceil(log2(a_B / max))``, one more than
      FLOOR when the fraction of ``a_B`` exceeds ``max / 2^emax - 1`` (0.75 for e4m3 and e5m2);
      the power-of-two tiles of TE's ``Float8BlockScaling`` (``2^floor(log2(max / a_B))``)
      give the same scale.
    """
    classes = np.arange(NUM_CLASSES)
    top, rest = classes // 2, classes % 2
    base = -element.emax
    if rule == "floor":
        bump = np.zeros(NUM_CLASSES, dtype=bool)
    elif rule == "ceil":
        bump = classes != 0
    elif rule == "even":
        k = 16 - 2 ** (4 - element.mantissa_bits - 1)  # 16 (1 - 2^-(m+1)) sixteenths
        bump = top >= k
    elif rule in ("rceil", "pow2"):
        _, k = _sixteenths(element.max)
        bump = (top > k) | ((top == k) & (rest == 1))
    else:
        raise ValueError(f"unknown scale rule {rule!r}: expected one of {', '.join(RULES)}")
    return (base + bump.astype(np.int64)).astype(np.int64)


@dataclass(frozen=True)
class BlockCounts:
    """Nonzero finite values and what the cast does to them (exact counts)."""

    nonzero: int = 0
    flushed: int = 0
    subnormal: int = 0
    saturated: int = 0
    out_of_range: int = 0  # values in blocks whose amax is below 2^MIN_BLOCK_EXP (not classified)
    blocks_lost: int = 0  # NVFP4 with a flushing block scale: blocks zeroed whole
    values_in_lost_blocks: int = 0  # their nonzero values (counted as flushed too)
    expected_zero_sr: float | None = None  # stochastic rounding: the expected number of values sent to 0

    def share(self, what: str) -> float:
        """Return ``what`` ("flushed", "subnormal", "saturated") as a share of the nonzero values."""
        return getattr(self, what) / self.nonzero if self.nonzero else 0.0

    def __add__(self, other: "BlockCounts") -> "BlockCounts":
        sr = None
        if self.expected_zero_sr is not None or other.expected_zero_sr is not None:
            sr = (self.expected_zero_sr or 0.0) + (other.expected_zero_sr or 0.0)
        return BlockCounts(
            self.nonzero + other.nonzero, self.flushed + other.flushed, self.subnormal + other.subnormal,
            self.saturated + other.saturated, self.out_of_range + other.out_of_range,
            self.blocks_lost + other.blocks_lost, self.values_in_lost_blocks + other.values_in_lost_blocks, sr,
        )

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        d: dict[str, Any] = {k: getattr(self, k) for k in ("nonzero", "flushed", "subnormal", "saturated")}
        if self.out_of_range:
            d["out_of_range"] = self.out_of_range
        if self.blocks_lost:
            d["blocks_lost"] = self.blocks_lost
            d["values_in_lost_blocks"] = self.values_in_lost_blocks
        if self.expected_zero_sr is not None:
            d["expected_zero_sr"] = self.expected_zero_sr
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, path: str = "counts") -> "BlockCounts":
        """Build from JSON; a bad field raises ReportFieldError naming ``path``."""
        from fp16probe.errors import ReportFieldError

        if not isinstance(d, Mapping):
            raise ReportFieldError(path, f"{path}: expected an object of counts, got {type(d).__name__}")
        out: dict[str, Any] = {}
        for key in ("nonzero", "flushed", "subnormal", "saturated", "out_of_range", "blocks_lost",
                    "values_in_lost_blocks"):
            v = d.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a count, got {v!r}")
            out[key] = v
        if out["flushed"] + out["subnormal"] + out["saturated"] > out["nonzero"]:
            raise ReportFieldError(path, f"{path}: more values flushed, subnormal or saturated than nonzero")
        sr = d.get("expected_zero_sr")
        if sr is not None and (isinstance(sr, bool) or not isinstance(sr, (int, float)) or not sr >= 0):
            raise ReportFieldError(f"{path}.expected_zero_sr", f"{path}.expected_zero_sr: expected a number >= 0")
        return cls(**out, expected_zero_sr=None if sr is None else float(sr))


def _below(r: np.ndarray, c: np.ndarray, j: int, k: int, *, inclusive: bool) -> np.ndarray:
    """Whether ``2^r (1 + f)`` is below (or, inclusive, at most) ``2^j (1 + k/16)``, f from class c."""
    at = c <= 2 * k if inclusive else c < 2 * k
    return (r < j) | ((r == j) & at)


def _masks(element: ElementFormat, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[c_B, d, c_x] masks of flushed, subnormal and saturated cells for these scale offsets."""
    d = np.arange(-DEPTH, 1).reshape(1, NUM_D, 1)
    c = np.arange(NUM_CLASSES).reshape(1, 1, NUM_CLASSES)
    r = d - offsets.reshape(NUM_CLASSES, 1, 1)  # E_x - s
    jf, kf = _sixteenths(element.flush)
    jn, kn = _sixteenths(element.normal)
    jo, ko = _sixteenths(element.overflow)
    flushed = _below(r, c, jf, kf, inclusive=True)
    flushed[:, 0, :] = True  # the clipped cell: d <= -DEPTH flushes in every format here
    subnormal = ~flushed & _below(r, c, jn, kn, inclusive=False)
    saturated = ~_below(r, c, jo, ko, inclusive=not element.overflow_inclusive)
    return flushed, subnormal, saturated


_MASKS: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def counts_from_relative(relative: np.ndarray | Mapping[int, int], element: str | ElementFormat,
                         rule: str, *, out_of_range: int = 0) -> BlockCounts:
    """Exact counts under a power-of-two scale ``rule`` from one relative-exponent histogram.

    ``relative`` is the flat ``[RELATIVE_BINS]`` histogram (or its sparse ``{index: count}``
    form) that :func:`fp16probe.capture.blockstats.relative_histogram` fills.
    """
    el = ELEMENTS[element] if isinstance(element, str) else element
    key = (el.name, rule)
    if key not in _MASKS:
        _MASKS[key] = _masks(el, scale_offsets(rule, el))
    flushed, subnormal, saturated = _MASKS[key]
    if isinstance(relative, Mapping):
        dense = np.zeros(RELATIVE_BINS, dtype=np.int64)
        for i, n in relative.items():
            dense[int(i)] = n
        relative = dense
    h = np.asarray(relative, dtype=np.int64).reshape(NUM_CLASSES, NUM_D, NUM_CLASSES)
    return BlockCounts(
        nonzero=int(h.sum()) + out_of_range, flushed=int(h[flushed].sum()), subnormal=int(h[subnormal].sum()),
        saturated=int(h[saturated].sum()), out_of_range=out_of_range,
    )


def delayed_scales(
    amax_trace: Sequence[float],
    element: str | ElementFormat,
    *,
    history_len: int = 1024,
    margin: int = 0,
    algo: str = "max",
) -> list[float]:
    """The scale each step of ``amax_trace`` is cast with under TE's ``DelayedScaling``.

    TransformerEngine's update (``transformer_engine.pytorch`` recipe ``DelayedScaling``):
    after each step its amax enters a window of the last ``history_len`` amaxes; the next
    step's scale is ``(fp8_max / amax) / 2^margin`` with ``amax`` the window's maximum
    (``"max"``) or its newest entry (``"most_recent"``), kept unchanged while that amax is 0
    or not finite. The first step is cast with the initial scale 1.0.
    """
    el = ELEMENTS[element] if isinstance(element, str) else element
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    if history_len < 1:
        raise ValueError(f"history_len must be at least 1, got {history_len}")
    scales: list[float] = []
    scale = 1.0
    window: list[float] = []
    for amax in amax_trace:
        scales.append(scale)
        window = (window + [float(amax)])[-history_len:]
        ref = max(window) if algo == "max" else window[-1]
        if ref > 0 and math.isfinite(ref):  # fp32 arithmetic, as TE computes it
            scale = float(np.float32(el.max) / np.float32(ref) / np.float32(2.0 ** margin))
    return scales


@dataclass(frozen=True)
class TensorBlockStats:
    """One GEMM operand's scaled-format statistics, summed over the steps recorded."""

    module: str
    type: str
    kind: str
    shape: tuple[int, ...]
    calls: int
    amax_trace: tuple[float, ...]
    relative: Mapping[str, Mapping[str, Any]]  # layout -> {"bins": {index: count}, "zero", "nonfinite", "out_of_range"}
    current: Mapping[str, BlockCounts]  # element -> counts under per-tensor current scaling
    delayed: tuple[tuple[DelayedRecipe, str, BlockCounts], ...]
    nvfp4: Mapping[str, BlockCounts]  # "1x16", "1x16_cast", "16x16"

    def spread(self, layout: str) -> dict[int, int]:
        """Blocks by how many binades their amax lies below the tensor's (summed over steps)."""
        return dict(self.relative[layout].get("spread", {}))

    def counts(self, layout: str, element: str, rule: str) -> BlockCounts:
        """Exact counts under a power-of-two scale ``rule`` for blocks of ``layout``."""
        rel = self.relative[layout]
        return counts_from_relative(rel["bins"], element, rule, out_of_range=rel["out_of_range"])


@dataclass(frozen=True)
class BlockStats:
    """Everything the capture counted for scaled formats (the report's ``blocks`` section)."""

    families: tuple[str, ...]
    layouts: tuple[str, ...]
    steps: int
    hook_errors: int
    tensors: tuple[TensorBlockStats, ...]

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (what :meth:`from_dict` reads)."""
        tensors = []
        for t in self.tensors:
            entry: dict[str, Any] = {
                "module": t.module, "type": t.type, "kind": t.kind, "shape": list(t.shape), "calls": t.calls,
                "amax_trace": list(t.amax_trace),
                "relative": {lay: {"bins": {str(k): v for k, v in r["bins"].items()},
                                   **{k: r[k] for k in ("zero", "nonfinite", "out_of_range")},
                                   "spread": {str(k): v for k, v in r.get("spread", {}).items()}}
                             for lay, r in t.relative.items()},
            }
            if t.current:
                entry["current"] = {el: c.to_dict() for el, c in t.current.items()}
            if t.delayed:
                entry["delayed"] = [{**recipe.to_dict(), "element": el, "counts": c.to_dict()}
                                    for recipe, el, c in t.delayed]
            if t.nvfp4:
                entry["nvfp4"] = {v: c.to_dict() for v, c in t.nvfp4.items()}
            tensors.append(entry)
        return {"version": 1, "families": list(self.families), "layouts": list(self.layouts), "steps": self.steps,
                "hook_errors": self.hook_errors, "tensors": tensors}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "blocks") -> "BlockStats":
        """Build from the JSON the capture wrote; a bad field raises ReportFieldError naming it."""
        if not isinstance(d, Mapping):
            raise _fail(path, f"expected an object, got {type(d).__name__}")
        if d.get("version") != 1:
            raise _fail(f"{path}.version", f"version {d.get('version')!r} is not supported (expected 1)")
        layouts = d.get("layouts", [])
        if not isinstance(layouts, list) or any(lay not in LAYOUTS for lay in layouts):
            raise _fail(f"{path}.layouts", f"expected a list of {', '.join(LAYOUTS)}")
        families = d.get("families", [])
        if not isinstance(families, list) or any(f not in FAMILIES for f in families):
            raise _fail(f"{path}.families", f"expected a list of {', '.join(FAMILIES)}")
        raw = d.get("tensors")
        if not isinstance(raw, list):
            raise _fail(f"{path}.tensors", "expected a list")
        tensors = tuple(_tensor_from_dict(t, layouts, f"{path}.tensors[{i}]") for i, t in enumerate(raw))
        return cls(tuple(families), tuple(layouts), _count(d.get("steps", 0), f"{path}.steps"),
                   _count(d.get("hook_errors", 0), f"{path}.hook_errors"), tensors)


def _fail(where: str, what: str) -> Exception:
    from fp16probe.errors import ReportFieldError

    return ReportFieldError(where, f"{where}: {what}")


def _count(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _fail(where, f"expected a count, got {v!r}")
    return v


def _tensor_from_dict(t: Any, layouts: Sequence[str], tp: str) -> TensorBlockStats:
    """One tensor's entry of ``blocks.tensors`` (at ``tp``), checked field by field."""
    if not isinstance(t, Mapping) or not isinstance(t.get("module"), str):
        raise _fail(tp, "expected an object with a module name")
    if t.get("kind") not in BLOCK_KINDS:
        raise _fail(f"{tp}.kind", f"expected one of {', '.join(BLOCK_KINDS)}, got {t.get('kind')!r}")
    trace = t.get("amax_trace", [])
    if not isinstance(trace, list) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                          or not math.isfinite(v) or v < 0 for v in trace):
        raise _fail(f"{tp}.amax_trace", "expected a list of finite magnitudes")
    relative = {lay: _relative_from_dict(t.get("relative", {}).get(lay), f"{tp}.relative.{lay}") for lay in layouts}
    current = {el: BlockCounts.from_dict(c, path=f"{tp}.current.{el}")
               for el, c in (t.get("current") or {}).items() if el in ELEMENTS}
    delayed = tuple(_delayed_from_dict(dl, f"{tp}.delayed[{j}]") for j, dl in enumerate(t.get("delayed") or []))
    nvfp4 = {v: BlockCounts.from_dict(c, path=f"{tp}.nvfp4.{v}") for v, c in (t.get("nvfp4") or {}).items()}
    shape = t.get("shape", [])
    return TensorBlockStats(
        module=t["module"], type=str(t.get("type", "")), kind=t["kind"],
        shape=tuple(int(v) for v in shape) if isinstance(shape, list) else (),
        calls=_count(t.get("calls", 0), f"{tp}.calls"), amax_trace=tuple(float(v) for v in trace),
        relative=relative, current=current, delayed=delayed, nvfp4=nvfp4,
    )


def _relative_from_dict(r: Any, rp: str) -> dict[str, Any]:
    """One layout's relative-exponent statistic (at ``rp``): its bins, spread and counts."""
    if not isinstance(r, Mapping) or not isinstance(r.get("bins"), Mapping):
        raise _fail(rp, "expected {bins, zero, nonfinite, out_of_range}")
    bins = _bins_from_dict(r["bins"], RELATIVE_BINS, f"{rp}.bins")
    spread = _bins_from_dict(r.get("spread") or {}, SPREAD_BINS, f"{rp}.spread")
    return {"bins": bins, "spread": spread, **{k: _count(r.get(k, 0), f"{rp}.{k}")
                                               for k in ("zero", "nonfinite", "out_of_range")}}


def _bins_from_dict(raw: Mapping[Any, Any], size: int, where: str) -> dict[int, int]:
    """Counts by bin index, each index in ``0..size-1``."""
    bins = {}
    for k, v in raw.items():
        if not str(k).isdigit() or not 0 <= int(k) < size:
            raise _fail(where, f"bin {k!r} outside 0..{size - 1}")
        bins[int(k)] = _count(v, f"{where}.{k}")
    return bins


def _delayed_from_dict(dl: Any, dp: str) -> tuple[DelayedRecipe, str, BlockCounts]:
    """One delayed-scaling entry (at ``dp``): its recipe, element and counts."""
    try:
        recipe = DelayedRecipe(dl["history_len"], dl["margin"], dl["algo"])
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(dp, f"not a delayed-scaling recipe ({e})") from e
    if dl.get("element") not in ELEMENTS:
        raise _fail(f"{dp}.element", f"expected one of {', '.join(ELEMENTS)}")
    return recipe, dl["element"], BlockCounts.from_dict(dl.get("counts"), path=f"{dp}.counts")


def block_stats_of(report: Any) -> BlockStats | None:
    """The scaled-format statistics stored in ``report`` (None when it was captured without them)."""
    return report.blocks
