"""What flushes and what overflows at each S = 2^k, and which modules lose the most.

Exact, from the histograms: multiplying by S = 2^k moves a value from bin ``e`` to bin
``e + k`` without rounding, so one profile answers every k at once. Overflow is counted
per profiled step against the one overflow ceiling (:mod:`fp16probe.analysis.ceiling`),
the same one the recommendation's limit comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping, Sequence

from fp16probe.analysis.ceiling import Ceiling
from fp16probe.errors import AnalysisError
from fp16probe.formats import Format, get_format
from fp16probe.histogram import Histogram
from fp16probe.report import ACTIVATION_GRAD as ACTIVATION_GRAD_KIND
from fp16probe.report import ALL_GRADS, KINDS, Report, kinds_named
from fp16probe.report import WEIGHT_GRAD as WEIGHT_GRAD_KIND

__all__ = [
    "ALL_GRADS",
    "ModuleFlush",
    "WhatIfRow",
    "WhatIfTable",
    "flushed_fraction",
    "kinds_of",
    "numerically_zero",
    "what_if",
    "worst_modules",
]


def kinds_of(kind: str) -> tuple[str, ...]:
    """Return the record kinds that ``kind`` names (``all``: both gradient kinds)."""
    if kind != ALL_GRADS and kind not in KINDS:
        raise AnalysisError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS + (ALL_GRADS,))}")
    return kinds_named(kind)


def merged(report: Report, kinds: Sequence[str]) -> Histogram:
    """Return all values of ``kinds`` over every module and step, as one histogram."""
    return Histogram.sum(report.histogram(k) for k in kinds)


def per_step(report: Report, kinds: Sequence[str]) -> Sequence[Histogram] | None:
    """Return per-step histograms of ``kinds`` summed, or None when the trace has none.

    Built one step at a time as it is read (a long trace is not copied into a Histogram per step)."""
    present = [report.trace.histograms[k] for k in kinds if report.trace.histograms.get(k)]
    if not present:
        return None
    return present[0] if len(present) == 1 else _SummedSteps(tuple(present))


class _SummedSteps(Sequence[Histogram]):
    """Step i: the sum of every sequence's i-th histogram."""

    def __init__(self, parts: tuple[Sequence[Histogram], ...]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return min(len(p) for p in self.parts)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return Histogram.sum(p[i] for p in self.parts)


def fraction(part: int, whole: int) -> float:
    """Return part / whole, 0.0 for an empty whole."""
    return part / whole if whole else 0.0


def flushed_fraction(h: Histogram, fmt: str | Format, log2_scale: int = 0) -> float:
    """Return the share of nonzero finite values that flush to zero at S = 2^log2_scale (0.0 when none)."""
    return fraction(h.flushed(fmt, log2_scale), h.nonzero_finite)


# -- what-if tables --------------------------------------------------------------------------

@dataclass(frozen=True)
class WhatIfRow:
    """What happens to the values at S = 2^log2_scale.

    Fractions are of the nonzero finite values; ``overflow_steps`` counts profiled steps
    whose overflow ceiling lands past the format's max at this S (steps holding inf/NaN
    that no scale explains are counted apart, in ``WhatIfTable.nonfinite_steps``).
    """

    log2_scale: int
    flushed_fraction: float
    subnormal_fraction: float
    overflow_steps: int
    flushed: int = 0
    subnormal: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WhatIfRow":
        """Build a row from its JSON form."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class WhatIfTable:
    """The what-if rows for one format and kind: globally (``rows``) and per module.

    A module row's ``overflow_steps`` counts steps, or, where the trace keeps its per-module
    maxima per block of ``module_block`` steps (a long trace), the blocks holding such a step:
    at most the steps, and at least one where there is any.
    """

    format: str
    kind: str
    steps: int
    nonzero: int
    rows: tuple[WhatIfRow, ...]
    modules: Mapping[str, tuple[WhatIfRow, ...]] = field(default_factory=dict)
    nonfinite_steps: int = 0
    module_block: int = 1

    def row(self, log2_scale: int) -> WhatIfRow:
        """Return the row for S = 2^log2_scale."""
        for r in self.rows:
            if r.log2_scale == log2_scale:
                return r
        raise KeyError(f"log2_scale {log2_scale} is not in this table")

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "format": self.format,
            "kind": self.kind,
            "steps": self.steps,
            "nonzero": self.nonzero,
            "rows": [r.to_dict() for r in self.rows],
            "modules": {n: [r.to_dict() for r in rs] for n, rs in self.modules.items()},
            "nonfinite_steps": self.nonfinite_steps,
            **({"module_block": self.module_block} if self.module_block > 1 else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WhatIfTable":
        """Build a table from its JSON form."""
        return cls(
            format=str(d["format"]),
            kind=str(d["kind"]),
            steps=int(d["steps"]),
            nonzero=int(d["nonzero"]),
            rows=tuple(WhatIfRow.from_dict(r) for r in d["rows"]),
            modules={n: tuple(WhatIfRow.from_dict(r) for r in rs) for n, rs in d.get("modules", {}).items()},
            nonfinite_steps=int(d.get("nonfinite_steps", 0)),
            module_block=int(d.get("module_block", 1)),
        )


def _rows(hist: Histogram, step_overflows: Callable[[int], int], fmt: Format,
          log2_scales: Iterable[int]) -> tuple[WhatIfRow, ...]:
    n = hist.nonzero_finite
    out = []
    for k in log2_scales:
        flushed = hist.flushed(fmt, k)
        sub = hist.subnormal(fmt, k)
        out.append(WhatIfRow(int(k), fraction(flushed, n), fraction(sub, n), step_overflows(k), flushed, sub))
    return tuple(out)


def what_if(
    report: Report,
    format: str | Format = "fp16",
    *,
    kind: str = ALL_GRADS,
    log2_scales: Iterable[int] = range(-8, 41),
    modules: bool = True,
) -> WhatIfTable:
    """Tabulate flushed and subnormal fractions and overflowing steps for each S = 2^k.

    Flushing is of ``kind`` (default: activation and weight gradients); overflow is
    always of the overflow ceiling, everything the loss scale multiplies, per profiled step
    (a report without a trace counts as one step), so the first overflowing k is one above
    ``analyze``'s largest safe scale. Per module, it counts the steps in which the module's
    largest finite value overflows; a module whose histogram holds inf/NaN counts at least one.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    kinds = kinds_of(kind)
    scales = [int(k) for k in log2_scales]
    hist = merged(report, kinds)
    ceiling = Ceiling.of(report)

    table_modules: dict[str, tuple[WhatIfRow, ...]] = {}
    if modules:
        for k_ in kinds:
            maxima = report.trace.module_max.get(k_, {})
            for m in report.modules_of(k_):
                table_modules[m.name] = _rows(m.histogram, _module_overflows(maxima.get(m.name), m.histogram, fmt),
                                              fmt, scales)
    return WhatIfTable(fmt.name, kind, len(ceiling.steps), hist.nonzero_finite,
                       _rows(hist, lambda k: ceiling.overflow_steps(fmt, k), fmt, scales), table_modules,
                       ceiling.intrinsic_steps, report.trace.module_block)


def _module_overflows(per_step: Sequence[float] | None, hist: Histogram, fmt: Format) -> Callable[[int], int]:
    def count(k: int) -> int:
        if per_step is None:
            return int(hist.overflows(fmt, k))
        n = sum(1 for v in per_step if v > 0.0 and fmt.overflows(math.ldexp(v, k)))
        return max(n, 1) if hist.nonfinite else n

    return count


# -- the one ranking of worst modules ---------------------------------------------------------

@dataclass(frozen=True)
class ModuleFlush:
    """One module's (or parameter's) values that flush at a given S."""

    name: str
    kind: str
    module_type: str
    flushed: int
    nonzero: int

    @property
    def fraction(self) -> float:
        """Return the share of the module's nonzero values that flush."""
        return fraction(self.flushed, self.nonzero)


def worst_modules(
    report: Report,
    format: str | Format = "fp16",
    *,
    log2_scale: int = 0,
    kind: str = ALL_GRADS,
    count: int = 5,
) -> tuple[ModuleFlush, ...]:
    """Rank modules by the share of their nonzero values that flush at S = 2^log2_scale.

    Ties go to the module with more flushed values, then to the earlier one in forward
    order, then by name. Modules where nothing flushes are left out.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    ranked = []
    for kd in kinds_of(kind):
        for m in report.modules_of(kd):
            nz = m.histogram.nonzero_finite
            flushed = m.histogram.flushed(fmt, log2_scale) if nz else 0
            if flushed:
                ranked.append((m, ModuleFlush(m.name, m.kind, m.module_type, flushed, nz)))
    ranked.sort(key=lambda x: (-x[1].fraction, -x[1].flushed, x[0].order, x[0].name))
    return tuple(r for _, r in ranked[: max(int(count), 0)])


# A sum over the batch that lands this many powers of two below its own terms is a cancellation:
# zero in exact arithmetic, and what is left is fp32 rounding. Measured: an attention key bias
# (BERT, DeBERTa-v2) sits 2^-20 below its Linear's output gradient; no other bias of those
# models, ConvNeXt or GPT-2 is more than 2^-8 below.
CANCELLED_BITS = 12


def numerically_zero(report: Report) -> dict[str, int]:
    """Return the biases whose gradient is zero up to rounding: name -> log2(its max / its module's output-gradient max).

    A bias's gradient is the sum over the batch of its module's output gradient; when it is
    at least 2^CANCELLED_BITS below that gradient's largest value, the terms cancelled (an
    attention key bias, which softmax's shift invariance makes exactly zero). Needs both the
    weight and the activation gradients; {} otherwise.
    """
    outputs = {m.name: m.histogram.max_abs for m in report.modules_of(ACTIVATION_GRAD_KIND)}
    out: dict[str, int] = {}
    for m in report.modules_of(WEIGHT_GRAD_KIND):
        if not m.name.endswith(".bias") or m.histogram.max_abs <= 0.0:
            continue
        around = outputs.get(m.name.removesuffix(".bias"), 0.0)
        if around > 0.0:
            bits = math.floor(math.log2(m.histogram.max_abs / around))
            if bits <= -CANCELLED_BITS:
                out[m.name] = bits
    return out
