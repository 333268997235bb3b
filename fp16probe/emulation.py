"""The emulated target step's section of a report: per parameter, how far its gradients are from fp32's.

Written by the profile's emulation pass (:mod:`fp16probe.running.effect`, measured by
:mod:`fp16probe.capture.emulate`), read by :mod:`fp16probe.analysis.effect`. Stored under
``"sections"`` → ``"emulation"`` in the report's JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from fp16probe.errors import ReportFieldError
from fp16probe.validation import AUTOCAST_TARGETS, REGIMES

__all__ = ["LOSS", "Emulation", "EmulatedSetting", "GradientNoise"]

# In a setting's ``keep_fp32``: the ops outside the model (the loss) run unrounded and read autocast off, as a
# loss computed in fp32 on the model's output (``loss_fn(output.float(), ...)`` outside autocast) runs.
LOSS = "(loss)"


def _number(v: Any, path: str, *, allow_none: bool = False) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ReportFieldError(path, f"{path}: expected a finite number >= 0, got {v!r}")
    return float(v)


def _finite(v: float | None) -> float | None:
    """None for inf/NaN (JSON holds no such number; None says "not finite")."""
    return v if v is None or math.isfinite(v) else None


@dataclass(frozen=True)
class EmulatedSetting:
    """The emulated step at S = 2^log2_scale with ``keep_fp32`` unrounded, over ``batches`` batches.

    ``params``: per parameter (in :attr:`Emulation.parameters`' order) ``(||g - g_fp32||^2 or None
    when it held inf/NaN, ||g_fp32||^2 or None when that was not finite, zeroed, nonzero, non-finite)``.
    ``outputs``: per module, as its forward finished, ``(name, ||out - out_fp32||^2 or None,
    ||out_fp32||^2 or None)`` on the first batch.
    """

    log2_scale: int
    keep_fp32: tuple[str, ...]
    loss_low: bool
    batches: int
    params: tuple[tuple[float | None, float | None, int, int, int], ...]
    outputs: tuple[tuple[str, float | None, float | None], ...] = ()
    ops: int = 0
    rounded: int = 0
    rounded_outside: int = 0  # of ``rounded``, those rounded outside the model (in the loss)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the analysis reads this form)."""
        return {"log2_scale": self.log2_scale, "keep_fp32": list(self.keep_fp32), "loss_low": self.loss_low,
                "batches": self.batches, "ops": self.ops, "rounded": self.rounded,
                "rounded_outside": self.rounded_outside,
                "params": [[_finite(a), _finite(b), z, n, f] for a, b, z, n, f in self.params],
                "outputs": [[name, [_finite(a), _finite(b)]] for name, a, b in self.outputs]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str = "setting") -> "EmulatedSetting":
        """Read and check the JSON form; a bad field raises ReportFieldError naming it."""
        if not isinstance(d, Mapping):
            raise ReportFieldError(path, f"{path}: expected an object, got {type(d).__name__}")
        k = d.get("log2_scale")
        if isinstance(k, bool) or not isinstance(k, int):
            raise ReportFieldError(f"{path}.log2_scale", f"{path}.log2_scale: expected an integer, got {k!r}")
        keep = d.get("keep_fp32") or []
        if not isinstance(keep, list) or not all(isinstance(s, str) for s in keep):
            raise ReportFieldError(f"{path}.keep_fp32", f"{path}.keep_fp32: expected a list of module names")
        rows = []
        for i, r in enumerate(d.get("params") or []):
            p = f"{path}.params[{i}]"
            if not isinstance(r, list) or len(r) != 5:
                raise ReportFieldError(p, f"{p}: expected [error^2, fp32^2, zeroed, nonzero, non-finite]")
            counts = [int(_number(c, p) or 0) for c in r[2:]]
            rows.append((_number(r[0], p, allow_none=True), _number(r[1], p, allow_none=True), *counts))
        outputs = []
        for i, o in enumerate(d.get("outputs") or []):
            p = f"{path}.outputs[{i}]"
            if not (isinstance(o, list) and len(o) == 2 and isinstance(o[0], str) and isinstance(o[1], list)
                    and len(o[1]) == 2):
                raise ReportFieldError(p, f"{p}: expected [module, [error^2, fp32^2]]")
            outputs.append((o[0], _number(o[1][0], p, allow_none=True), _number(o[1][1], p, allow_none=True)))
        return cls(log2_scale=k, keep_fp32=tuple(keep), loss_low=bool(d.get("loss_low")),
                   batches=int(_number(d.get("batches", 1), f"{path}.batches") or 0),
                   params=tuple(rows), outputs=tuple(outputs),  # type: ignore[arg-type]
                   ops=int(_number(d.get("ops", 0), f"{path}.ops") or 0),
                   rounded=int(_number(d.get("rounded", 0), f"{path}.rounded") or 0),
                   rounded_outside=int(_number(d.get("rounded_outside", 0), f"{path}.rounded_outside") or 0))


@dataclass(frozen=True)
class GradientNoise:
    """The fp32 gradients' batch-to-batch noise (:mod:`fp16probe.capture.noise`) over ``batches`` batches.

    ``params``: per parameter (in :attr:`Emulation.parameters`' order) ``(sum_b ||g_b - mean||^2,
    sum_b ||g_b||^2)``.
    """

    batches: int
    params: tuple[tuple[float, float], ...]
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the analysis reads this form)."""
        return {"batches": self.batches, "params": [[a, b] for a, b in self.params], "source": self.source}

    @classmethod
    def from_dict(cls, d: Any, path: str = "noise") -> "GradientNoise":
        """Read and check the JSON form; a bad field raises ReportFieldError naming it."""
        if not isinstance(d, Mapping):
            raise ReportFieldError(path, f"{path}: expected an object, got {type(d).__name__}")
        rows = []
        for i, r in enumerate(d.get("params") or []):
            p = f"{path}.params[{i}]"
            if not isinstance(r, list) or len(r) != 2:
                raise ReportFieldError(p, f"{p}: expected [spread^2, square^2]")
            rows.append((_number(r[0], p) or 0.0, _number(r[1], p) or 0.0))
        return cls(batches=int(_number(d.get("batches", 0), f"{path}.batches") or 0), params=tuple(rows),
                   source=str(d.get("source", "")))


@dataclass(frozen=True)
class Emulation:
    """The emulation pass of a profile: the target it emulated and each setting it ran (see the module docstring).

    ``error``: why the pass did not run to the end (then nothing else is filled in).
    ``fp16``: under ``--format bf16``, the fp16 step at fp16's own S, for comparison.
    ``noise``: the fp32 gradients' batch-to-batch noise (None in a report from before it, or with one batch).
    """

    format: str = "fp16"
    target: str = "cuda"
    regime: str = "autocast"
    batches: int = 0
    parameters: tuple[str, ...] = ()
    settings: tuple[EmulatedSetting, ...] = ()
    source: str = ""
    seconds: float | None = None
    error: str | None = None
    fp16: "Emulation | None" = None
    noise: GradientNoise | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (what :mod:`fp16probe.analysis.effect` reads)."""
        d: dict[str, Any] = {"format": self.format, "target": self.target, "regime": self.regime,
                             "batches": self.batches, "parameters": list(self.parameters),
                             "settings": [s.to_dict() for s in self.settings], "source": self.source}
        if self.seconds is not None:
            d["seconds"] = self.seconds
        if self.error is not None:
            d["error"] = self.error
        if self.fp16 is not None:
            d["fp16"] = self.fp16.to_dict()
        if self.noise is not None:
            d["noise"] = self.noise.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str = "emulation") -> "Emulation":
        """Read and check the JSON form; a bad field raises ReportFieldError naming it."""
        if not isinstance(d, Mapping):
            raise ReportFieldError(path, f"{path}: expected an object, got {type(d).__name__}")
        for key in ("format", "target", "regime", "source"):
            if key in d and not isinstance(d[key], str):
                raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a string, got {d[key]!r}")
        for key, known in (("target", AUTOCAST_TARGETS), ("regime", REGIMES)):  # both are worded, the target pasted
            if key in d and d[key] not in known:
                shown = repr(d[key]) if len(repr(d[key])) <= 60 else repr(d[key])[:57] + "..."
                raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected {' or '.join(known)}, got {shown}")
        names = d.get("parameters") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ReportFieldError(f"{path}.parameters", f"{path}.parameters: expected a list of parameter names")
        settings = d.get("settings") or []
        if not isinstance(settings, list):
            raise ReportFieldError(f"{path}.settings", f"{path}.settings: expected a list")
        fp16 = d.get("fp16")
        seconds = d.get("seconds")
        error = d.get("error")
        return cls(format=str(d.get("format", "fp16")), target=str(d.get("target", "cuda")),
                   regime=str(d.get("regime", "autocast")),
                   batches=int(_number(d.get("batches", 0), f"{path}.batches") or 0), parameters=tuple(names),
                   settings=tuple(EmulatedSetting.from_dict(s, f"{path}.settings[{i}]") for i, s in enumerate(settings)),
                   source=str(d.get("source", "")),
                   seconds=_number(seconds, f"{path}.seconds", allow_none=True),
                   error=str(error) if error is not None else None,
                   fp16=cls.from_dict(fp16, f"{path}.fp16") if fp16 is not None else None,
                   noise=GradientNoise.from_dict(d["noise"], f"{path}.noise") if d.get("noise") is not None else None)
