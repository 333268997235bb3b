"""fp16probe: measure whether FP16 training loses gradients to underflow, and what fixes it."""

from fp16probe._version import __version__
from fp16probe.errors import Fp16ProbeError, ProbeError, ReportError, UnknownFormatError
from fp16probe.formats import FORMATS, Format, get_format
from fp16probe.probe import Probe
from fp16probe.report import Histogram, Metadata, ModuleStats, Report, StepTrace

__all__ = [
    "FORMATS",
    "Format",
    "Fp16ProbeError",
    "Histogram",
    "Metadata",
    "ModuleStats",
    "Probe",
    "ProbeError",
    "Report",
    "ReportError",
    "StepTrace",
    "UnknownFormatError",
    "__version__",
    "get_format",
]
