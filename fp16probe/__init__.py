"""fp16probe: measure whether FP16 training loses gradients to underflow, and what fixes it.

The public names load on first use (PEP 562 module ``__getattr__``): ``import fp16probe``
and ``fp16probe --help`` do not import torch; ``fp16probe.Probe`` and friends do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fp16probe._version import __version__
from fp16probe.errors import (
    AnalysisError,
    Fp16ProbeError,
    InputError,
    MissingExtraError,
    ModelError,
    ModelLoadError,
    ProbeError,
    ReportError,
    ReportFieldError,
    UnknownFormatError,
)

if TYPE_CHECKING:
    from fp16probe.analysis.recommend import analyze
    from fp16probe.analysis.schedule import judge_schedules
    from fp16probe.analysis.weight_updates import weight_update_loss
    from fp16probe.analysis.gate import GateResult, GateThresholds, compare_reports
    from fp16probe.analysis.whatif import WhatIfRow, WhatIfTable, what_if
    from fp16probe.analysis.replay import ReplayResult, replay_scaler, simulate
    from fp16probe.running.mismatch import MismatchResult, measure_mismatch
    from fp16probe.capture.probe import Probe
    from fp16probe.formats import FORMATS, Format, get_format
    from fp16probe.presentation.trackers import export
    from fp16probe.recommendation import Recommendation, Verdict
    from fp16probe.report import Histogram, Metadata, ModuleStats, Report, StepHistory, StepTrace
    from fp16probe.running.fixes import keep_in_fp32
    from fp16probe.running.profile import profile
    from fp16probe.running.verify import verify
    from fp16probe.verification import Verification

# name -> the module that defines it (imported when the name is first used)
_LAZY = {
    "analyze": "fp16probe.analysis.recommend",
    "judge_schedules": "fp16probe.analysis.schedule",
    **dict.fromkeys(("GateResult", "GateThresholds", "compare_reports"), "fp16probe.analysis.gate"),
    "weight_update_loss": "fp16probe.analysis.weight_updates",
    **dict.fromkeys(("WhatIfRow", "WhatIfTable", "what_if"), "fp16probe.analysis.whatif"),
    **dict.fromkeys(("ReplayResult", "replay_scaler", "simulate"), "fp16probe.analysis.replay"),
    **dict.fromkeys(("MismatchResult", "measure_mismatch"), "fp16probe.running.mismatch"),
    "Probe": "fp16probe.capture.probe",
    **dict.fromkeys(("FORMATS", "Format", "get_format"), "fp16probe.formats"),
    "export": "fp16probe.presentation.trackers",
    **dict.fromkeys(("Recommendation", "Verdict"), "fp16probe.recommendation"),
    **dict.fromkeys(("Histogram", "Metadata", "ModuleStats", "Report", "StepHistory", "StepTrace"), "fp16probe.report"),
    "profile": "fp16probe.running.profile",
    "keep_in_fp32": "fp16probe.running.fixes",
    "verify": "fp16probe.running.verify",
    "Verification": "fp16probe.verification",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp16probe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """List the public names (loaded or not) beside the module's own."""
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AnalysisError",
    "FORMATS",
    "Format",
    "Fp16ProbeError",
    "GateResult",
    "GateThresholds",
    "Histogram",
    "InputError",
    "Metadata",
    "MismatchResult",
    "MissingExtraError",
    "ModelError",
    "ModelLoadError",
    "ModuleStats",
    "Probe",
    "ProbeError",
    "Recommendation",
    "ReplayResult",
    "Report",
    "ReportError",
    "ReportFieldError",
    "StepHistory",
    "StepTrace",
    "UnknownFormatError",
    "Verdict",
    "Verification",
    "WhatIfRow",
    "WhatIfTable",
    "__version__",
    "analyze",
    "compare_reports",
    "export",
    "get_format",
    "judge_schedules",
    "keep_in_fp32",
    "measure_mismatch",
    "profile",
    "replay_scaler",
    "simulate",
    "verify",
    "weight_update_loss",
    "what_if",
]
