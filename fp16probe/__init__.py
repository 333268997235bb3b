"""fp16probe: measure whether FP16 training loses gradients to underflow, and what fixes it."""

from fp16probe._version import __version__
from fp16probe.analysis.recommend import WhatIfRow, WhatIfTable, analyze, weight_update_loss, what_if
from fp16probe.errors import (
    AnalysisError,
    Fp16ProbeError,
    InputError,
    ModelError,
    ModelLoadError,
    ProbeError,
    ReportError,
    ReportFieldError,
    UnknownFormatError,
)
from fp16probe.recommendation import Recommendation, Verdict
from fp16probe.formats import FORMATS, Format, get_format
from fp16probe.capture.probe import Probe
from fp16probe.analysis.replay import ReplayResult, replay_scaler, simulate
from fp16probe.presentation.trackers import export
from fp16probe.report import Histogram, Metadata, ModuleStats, Report, StepTrace
from fp16probe.running.profile import profile
from fp16probe.running.verify import verify
from fp16probe.verification import Verification

__all__ = [
    "AnalysisError",
    "FORMATS",
    "Format",
    "Fp16ProbeError",
    "Histogram",
    "InputError",
    "Metadata",
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
    "StepTrace",
    "UnknownFormatError",
    "Verdict",
    "Verification",
    "WhatIfRow",
    "WhatIfTable",
    "__version__",
    "analyze",
    "export",
    "get_format",
    "profile",
    "replay_scaler",
    "simulate",
    "verify",
    "weight_update_loss",
    "what_if",
]
