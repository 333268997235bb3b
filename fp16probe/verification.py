"""A Verification: the recommended setting run for real, beside what the profile predicted.

Shared data, stored as ``Report.verification`` (JSON key ``"verification"``, absent in
reports written without ``--verify``). :func:`fp16probe.verify` makes one; the gate fails a
current report whose verification did not hold, and every presentation shows it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from fp16probe import formatting as num
from fp16probe.errors import ReportError

__all__ = ["DEFAULT_TOLERANCE", "RELATIVE_TOLERANCE", "VALUE_TOLERANCE", "Verification", "tolerance_for"]

# How far the measured share of zeroed values may lie from the predicted one. The prediction
# multiplies fp32 gradients by S and rounds them to the format once; a real fp16 run also
# computes its forward and backward in fp16, so its gradients differ in their last bits and a
# value near the flush threshold can land on either side. On the demo (5 steps, S = 2^0 to
# 2^17) the two differed by 0.65% to 3.9% of the prediction. The tolerance is 10% of the
# prediction, and never less than 0.01 percentage point (a tenth of the analyzer's default
# 0.1% flush threshold), so a prediction near zero is not judged on a handful of values.
RELATIVE_TOLERANCE = 0.1
DEFAULT_TOLERANCE = 1e-4


def tolerance_for(predicted_zeroed_fraction: float, *, relative: float = RELATIVE_TOLERANCE,
                  floor: float = DEFAULT_TOLERANCE) -> float:
    """Return the absolute tolerance on a predicted zeroed share: ``relative`` of it, at least ``floor``."""
    return max(floor, relative * predicted_zeroed_fraction)


# How far the fp16 run's gradients may lie from the fp32 run's, as sum |fp16 - fp32| / sum |fp32|
# over the judged kind on finite steps: fp16 keeps 11 significant bits (about 0.05% per value),
# and the demo's measured error is 0.03-0.05%; a forward that flushes puts it at tens of percent.
VALUE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Verification:
    """The recommended setting run for ``steps`` steps on the profiled batches, against the prediction.

    ``measured_zeroed_fraction`` is the share of the fp32 run's nonzero gradient values
    (of ``kind``, on the same batches from the same weights) that came out exactly zero in
    the ``precision`` run; ``measured_overflow_steps`` counts the steps whose gradients held
    inf/NaN at the scale in force (a GradScaler skips those). ``held`` is true when no more
    steps overflowed than predicted and the zeroed share lies within ``tolerance`` of the
    prediction.
    """

    precision: str
    device: str
    steps: int
    scaler_kwargs: Mapping[str, Any]
    kind: str
    predicted_overflow_steps: int
    measured_overflow_steps: int
    predicted_zeroed_fraction: float
    measured_zeroed_fraction: float
    tolerance: float
    held: bool
    nonzero_values: int = 0  # the fp32 run's nonzero values of ``kind`` compared
    zeroed_values: int = 0  # of those, how many came out zero
    by_kind: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per kind: nonzero, zeroed, fraction
    scales: tuple[float, ...] = ()  # the loss scale in force at each step of the run
    notes: tuple[str, ...] = ()
    # the modules whose output gradients the run zeroed, in its backward order: (name, fp32 nonzero values, of those
    # zeroed, of those above the format's flush threshold at the scale in force in fp32: computed zero, not flushed)
    zeroed_by_module: tuple[tuple[str, int, int, int], ...] = ()

    @staticmethod
    def judge(predicted_overflow_steps: int, measured_overflow_steps: int, predicted_zeroed_fraction: float,
              measured_zeroed_fraction: float, tolerance: float) -> bool:
        """Return whether a prediction held: no unforeseen overflow, no more zeroed than predicted plus tolerance.

        A run that zeroed fewer values than predicted did better than the prediction: it holds.
        """
        return (measured_overflow_steps <= predicted_overflow_steps
                and measured_zeroed_fraction - predicted_zeroed_fraction <= tolerance)

    @property
    def summary(self) -> str:
        """Return one line of predicted against measured, for gates and logs."""
        return (f"{self.measured_overflow_steps} of {self.steps} steps overflowed "
                f"({self.predicted_overflow_steps} predicted); {num.percent(self.measured_zeroed_fraction)} of "
                f"{self.kind} values zeroed ({num.percent(self.predicted_zeroed_fraction)} predicted, tolerance "
                f"±{self.tolerance * 100:.3g} percentage points), {self.precision} on {self.device}")

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["scaler_kwargs"] = dict(self.scaler_kwargs)
        d["by_kind"] = {k: dict(v) for k, v in self.by_kind.items()}
        d["scales"] = list(self.scales)
        d["notes"] = list(self.notes)
        d["zeroed_by_module"] = [list(r) for r in self.zeroed_by_module]
        return d

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "verification") -> "Verification":
        """Build a Verification from its JSON; a field of the wrong type raises ReportError naming it."""
        if not isinstance(d, Mapping):
            raise ReportError(f"{path}: expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        for name in ("precision", "device", "kind"):
            _expect(isinstance(kw.get(name), str), path, name, "a string", kw.get(name))
        for name in ("steps", "predicted_overflow_steps", "measured_overflow_steps", "nonzero_values", "zeroed_values"):
            value = kw.get(name, 0)
            _expect(type(value) is int and 0 <= value < 2**63, path, name, "a non-negative integer", value)
        for name in ("predicted_zeroed_fraction", "measured_zeroed_fraction", "tolerance"):
            value = kw.get(name)
            _expect(isinstance(value, (int, float)) and type(value) is not bool and math.isfinite(value)
                    and 0 <= value <= 1, path, name,
                    "a fraction in [0, 1]", value)
        _expect(type(kw.get("held")) is bool, path, "held", "true or false", kw.get("held"))
        _expect(isinstance(kw.get("scaler_kwargs", {}), Mapping), path, "scaler_kwargs", "an object",
                kw.get("scaler_kwargs"))
        by_kind = kw.get("by_kind", {})
        _expect(isinstance(by_kind, Mapping) and all(
            isinstance(v, Mapping) and all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in v.values())
            for v in by_kind.values()), path, "by_kind", "an object of per-kind counts and fractions", by_kind)
        _expect(all(type(v) in (int, float, str, bool) for v in kw.get("scaler_kwargs", {}).values())
                if isinstance(kw.get("scaler_kwargs", {}), Mapping) else True, path, "scaler_kwargs",
                "an object of GradScaler arguments", kw.get("scaler_kwargs"))
        scales = kw.get("scales", [])
        _expect(isinstance(scales, list) and all(type(s) in (int, float) and math.isfinite(s) and s > 0 for s in scales), path, "scales",
                "a list of positive numbers", scales)
        notes = kw.get("notes", [])
        _expect(isinstance(notes, list) and all(isinstance(n, str) for n in notes), path, "notes",
                "a list of strings", notes)
        rows = kw.get("zeroed_by_module", [])
        _expect(isinstance(rows, list) and all(
            isinstance(r, list) and len(r) == 4 and isinstance(r[0], str)
            and all(type(c) is int and 0 <= c < 2**63 for c in r[1:]) and r[1] >= r[2] >= r[3] for r in rows),
            path, "zeroed_by_module", "a list of [module, nonzero, zeroed, computed zero] with counts that nest", rows)
        kw["zeroed_by_module"] = tuple((str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows)
        kw["scaler_kwargs"] = dict(kw.get("scaler_kwargs", {}))
        kw["by_kind"] = {str(k): dict(v) for k, v in kw.get("by_kind", {}).items()}
        kw["scales"] = tuple(float(s) for s in scales)
        kw["notes"] = tuple(notes)
        kw["predicted_zeroed_fraction"] = float(kw["predicted_zeroed_fraction"])
        kw["measured_zeroed_fraction"] = float(kw["measured_zeroed_fraction"])
        kw["tolerance"] = float(kw["tolerance"])
        return cls(**kw)


def _expect(ok: bool, path: str, name: str, expected: str, got: Any) -> None:
    if not ok:
        raise ReportError(f"{path}.{name}: expected {expected}, got {got!r:.80}")
