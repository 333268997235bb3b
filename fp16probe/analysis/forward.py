"""The forward pass and the loss of the target fp16 run: what no loss scale fixes.

Pure functions over the report's ``forward`` section: its audit (written by
:class:`fp16probe.capture.forward.ForwardAudit` during a profile), else the Probe's own
per-module maxima of forward outputs (in any training loop). They answer, for one target (the device whose autocast rules apply):

* does some tensor that is fp16 there pass fp16's max in forward (it becomes inf, the loss
  NaN, at every loss scale), and which comes first in the forward order;
* how many bits of headroom the largest fp16 forward values keep (a few bits left is the
  seed of the trained-T5 failure, long before it happens);
* which fp16 tensors flush to zero in forward (a scale on the loss cannot bring them back);
* whether the loss itself is fp16 there, which makes the seed gradient S an fp16 number and
  caps S at 2^15.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fp16probe.formats import get_format
from fp16probe.report import Report
from fp16probe.sections import ForwardSection

__all__ = [
    "FP16_LOSS_LOG2_CAP",
    "LOW_HEADROOM_BITS",
    "ForwardFindings",
    "TensorFinding",
    "forward_findings",
    "target_device",
]

FP16_LOSS_LOG2_CAP = 15  # the seed gradient of an fp16 loss is S itself: 2^15 is the largest power of two below 65520
LOW_HEADROOM_BITS = 3.0  # forward values within this many bits of fp16's max are a caveat
_FP16 = get_format("fp16")


@dataclass(frozen=True)
class TensorFinding:
    """One fp16 tensor of the forward pass, as measured."""

    name: str
    module: str
    op: str
    role: str  # output | input (cast to fp16) | consumer (an fp16 input from another module) | weight | module_output
    max_abs: float | None
    headroom_bits: float | None  # log2(65504 / max_abs); negative when it overflows
    nonzero: int
    flushed: int
    subnormal: int
    first_overflow_step: int | None

    @property
    def overflows(self) -> bool:
        """Whether it passed fp16's max (or held inf/NaN) on some step."""
        return self.first_overflow_step is not None

    @property
    def flushed_fraction(self) -> float:
        """Share of its nonzero values that flush to zero in fp16."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (for the evidence)."""
        return {"name": self.name, "module": self.module, "op": self.op, "role": self.role,
                "max_abs": self.max_abs, "headroom_bits": self.headroom_bits, "nonzero": self.nonzero,
                "flushed": self.flushed, "subnormal": self.subnormal,
                "flushed_fraction": self.flushed_fraction, "first_overflow_step": self.first_overflow_step}


@dataclass(frozen=True)
class ForwardFindings:
    """What the forward pass and the loss say for one target."""

    target: str
    regime: str  # autocast | pure_fp16
    source: str  # "audit" (op by op) or "modules" (module outputs only)
    overflowing: tuple[TensorFinding, ...]  # in forward order
    low_headroom: tuple[TensorFinding, ...]  # not overflowing, under LOW_HEADROOM_BITS left
    flushing: tuple[TensorFinding, ...]  # by flushed share, most first
    loss_fp16: bool | None  # None: not known (no audit)
    custom_functions: tuple[str, ...]
    tensors: int  # fp16 tensors measured

    @property
    def first_overflow(self) -> TensorFinding | None:
        """The tensor that overflows first in the forward order."""
        return self.overflowing[0] if self.overflowing else None


def target_device(report: Report, target: str | None = None) -> str:
    """The target device: as asked, else as the profile recorded, else CUDA (where fp16 training runs)."""
    if target:
        return target
    return report.metadata.target or "cuda"


def _num(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        return math.inf if v in ("inf", "nan") else None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _headroom(max_abs: float | None) -> float | None:
    if max_abs is None or max_abs <= 0:
        return None
    if math.isinf(max_abs):
        return -math.inf
    return math.log2(_FP16.max / max_abs)


def _audit_row(t: Mapping[str, Any]) -> TensorFinding:
    """One tensor of the forward audit as a finding; a tensor that overflowed reads as inf."""
    finite_max = _num(t.get("max_abs"))
    first = t.get("first_overflow_step")
    if first is not None and (finite_max is None or finite_max < _FP16.max):
        max_abs: float | None = math.inf
    else:
        max_abs = finite_max
    return TensorFinding(
        name=str(t.get("name")), module=str(t.get("module")), op=str(t.get("op")), role=str(t.get("role")),
        max_abs=max_abs, headroom_bits=_headroom(max_abs), nonzero=int(t.get("nonzero") or 0),
        flushed=int(t.get("flushed") or 0), subnormal=int(t.get("subnormal") or 0),
        first_overflow_step=None if first is None else int(first))


def _from_audit(audit: Mapping[str, Any], tgt: str) -> tuple[list[TensorFinding], str, bool | None, tuple[str, ...]]:
    """Rows, regime, whether the loss is fp16 and the custom functions, from the op-level audit."""
    rows = [_audit_row(t) for t in audit["tensors"]
            if isinstance(t, Mapping) and tgt in (t.get("fp16_on") or ())]
    loss_fp16: bool | None = tgt in (audit.get("loss_fp16_on") or ())
    custom = tuple(str(c) for c in audit.get("custom_functions") or ())
    return rows, str(audit.get("regime", "autocast")), loss_fp16, custom


def _from_modules(report: Report, section: ForwardSection) -> list[TensorFinding]:
    """Rows from the hooked modules' output maxima (no op-level audit)."""
    steps = list(report.trace.steps)
    rows = []
    for name, m in section.module_max.items():
        over = math.isinf(m) or m >= _FP16.overflow_threshold
        first = section.first_overflow_step.get(name, int(steps[0]) if steps else 0)
        rows.append(TensorFinding(name=name, module=name, op="output", role="module_output",
                                  max_abs=m, headroom_bits=_headroom(m), nonzero=0, flushed=0, subnormal=0,
                                  first_overflow_step=first if over else None))
    return rows


def forward_findings(report: Report, target: str | None = None, *, max_flushed_fraction: float = 1e-3,
                     low_headroom_bits: float = LOW_HEADROOM_BITS) -> ForwardFindings | None:
    """Read the forward measurements for ``target``; None when the report holds none."""
    tgt = target_device(report, target)
    section = report.forward
    if section is None:
        return None
    audit = section.audit
    loss_fp16: bool | None
    if isinstance(audit, Mapping) and isinstance(audit.get("tensors"), Sequence):
        source = "audit"
        rows, regime, loss_fp16, custom = _from_audit(audit, tgt)
    else:
        if not section.module_max:
            return None
        source, regime, loss_fp16, custom = "modules", report.metadata.regime, None, ()
        if target is None and "fp16" in str(report.metadata.precision):  # values seen in a real fp16 run
            tgt = str(report.metadata.device).split(":")[0] or tgt
        rows = _from_modules(report, section)
    return _findings(rows, tgt, regime, source, loss_fp16, custom, max_flushed_fraction, low_headroom_bits)


def _findings(rows: list[TensorFinding], tgt: str, regime: str, source: str, loss_fp16: bool | None,
              custom: tuple[str, ...], max_flushed_fraction: float, low_headroom_bits: float) -> ForwardFindings:
    """Sort the rows into what overflows, what runs low on headroom and what flushes."""
    overflowing = tuple(r for r in rows if r.overflows)
    low = tuple(sorted((r for r in rows if not r.overflows and r.headroom_bits is not None
                        and r.headroom_bits < low_headroom_bits), key=lambda r: r.headroom_bits or 0.0))
    # Weights cast to fp16 are left out of the flushing: a weight below 2^-25 adds nothing a
    # forward value can see, and the fp32 master copy keeps it (a weight update is another matter,
    # fp16probe.analysis.weight_updates).
    # Consumer rows repeat their producer's values: counted once, at the producer.
    flushing = tuple(sorted((r for r in rows if r.role not in ("weight", "consumer")
                             and r.flushed_fraction > max_flushed_fraction),
                            key=lambda r: -r.flushed_fraction))
    return ForwardFindings(target=tgt, regime=regime, source=source, overflowing=overflowing, low_headroom=low,
                           flushing=flushing, loss_fp16=loss_fp16, custom_functions=custom, tensors=len(rows))

