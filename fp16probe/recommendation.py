"""The Recommendation: typed data for a loss-scale verdict, its evidence and its sources.

Shared data, beside the Report: the analysis stage builds it, the report stores it, and
every presentation reads it by attribute. Its JSON keys are those of the first version
(new keys are optional), so report files written before this module existed still load.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Mapping, TypedDict, cast

from fp16probe.errors import ReportError, ReportFieldError

__all__ = [
    "GRADSCALER_DEFAULTS",
    "Caveat",
    "Citation",
    "Cited",
    "Evidence",
    "GradScalerKwargs",
    "Recommendation",
    "Thresholds",
    "Verdict",
    "citation_from_json",
    "citation_to_json",
    "citations_from_json",
]


class Verdict(str, Enum):
    """What the analyzer concluded; compares equal to its JSON string."""

    NONE_NEEDED = "none_needed"
    CONSTANT = "constant"
    DYNAMIC = "dynamic"
    PER_TENSOR_SCALING = "per_tensor_scaling"
    NO_SINGLE_SCALE = "no_single_scale"
    INSUFFICIENT_EVIDENCE = "insufficient_evidence"
    FORWARD_UNDERFLOW = "forward_underflow"  # forward values flush in fp16: no loss scale brings them back
    FORWARD_OVERFLOW = "forward_overflow"  # a forward value passes fp16's max: inf at every loss scale
    GRADIENT_ERROR = "gradient_error"  # the emulated step's gradients are off fp32 with no overflow: rounding

    # A str mixin formats as "Verdict.X" on some Pythons; the value is what users read.
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @property
    def severity(self) -> int:
        """Return how bad the verdict is for a gate: higher is worse (none_needed is 0)."""
        return _SEVERITY[self]


_SEVERITY = {
    Verdict.NONE_NEEDED: 0,
    Verdict.CONSTANT: 1,
    Verdict.DYNAMIC: 2,
    Verdict.PER_TENSOR_SCALING: 3,
    Verdict.NO_SINGLE_SCALE: 4,
    Verdict.INSUFFICIENT_EVIDENCE: 5,
    Verdict.FORWARD_UNDERFLOW: 6,
    Verdict.FORWARD_OVERFLOW: 7,
    Verdict.GRADIENT_ERROR: 6,  # as bad as a forward flush: the gradients are wrong at every S
}


class GradScalerKwargs(TypedDict):
    """Keyword arguments for ``torch.amp.GradScaler``, in its own vocabulary."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int


# torch.amp.GradScaler's defaults, stated once (torch/amp/grad_scaler.py). The factors and the
# interval come from NVIDIA's mixed-precision guide: a validated setting, not a measured optimum.
GRADSCALER_DEFAULTS: GradScalerKwargs = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}


class Thresholds(TypedDict, total=False):
    """The analyzer's parameters as the recommendation was made with them."""

    format: str
    kind: str
    margin_bits: int
    max_flushed_fraction: float
    growth_factor: float
    backoff_factor: float
    growth_intervals: list[int]
    horizon: int
    seed: int
    hysteresis: int
    min_scale: float
    worst: int


class Evidence(TypedDict, total=False):
    """The numbers behind a verdict, all computed from the report.

    Fractions are of the nonzero finite values of the judged kinds; ``*_at_1`` is at S = 1,
    ``*_at_scale`` at the recommended S = 2^log2_scale. Keys appear only where they apply.
    """

    # what was measured
    nonzero_values: int  # nonzero finite values of the judged kinds
    zero_values: int  # exact zeros
    nonfinite_values: int  # inf/NaN values
    profiled_steps: int
    nonfinite_steps: int  # steps whose gradients held inf/NaN at the scale in force
    max_abs: float  # the overflow ceiling: the largest |g| the loss scale multiplies
    log2_max_abs: float | None
    ceiling_source: str  # where max_abs comes from: "measured" (the trace's ceiling) or "hooked" (the histograms)
    largest_safe_log2_scale: int | None  # largest k with max_abs * 2^k below the overflow threshold
    lowest_log2: int | None
    highest_log2: int | None
    per_step_max_range_bits: float  # log2(largest / smallest per-step maximum)
    # at S = 1 and at the recommended S
    flushed_fraction_at_1: float
    subnormal_fraction_at_1: float
    overflow_steps_at_1: int
    log2_scale: int
    flushed_fraction_at_scale: float
    subnormal_fraction_at_scale: float
    overflow_steps_at_scale: int
    # how much range the data needs and the format holds
    per_step_scale_flushed_fraction: float | None  # flushed if each step had its own S
    needed_span_bits: float | None
    format_span_bits: float
    limiting_modules: list[list[Any]]  # [name, log2 max, largest safe k] of modules setting the ceiling
    flushing_modules_at_scale: list[list[Any]]  # [name, flushed fraction] at the recommended S
    # the growth-interval replay (absent without a per-step trace)
    simulated_growth_interval: int
    simulated_skipped_steps: int
    simulated_skipped_fraction: float
    simulated_mean_flushed_fraction: float | None
    simulated_final_scale: float
    simulated_meets_threshold: bool
    simulated_candidates_tied: bool  # the replay could not tell the growth_interval candidates apart on underflow
    interval_study: dict[str, Any]  # the run's drift against the growth-interval study's families (analysis.interval_study)
    growth_interval_from_study: bool  # the replay was tied and the run's drift lies inside the study's range: its interval pasted
    # the breakdown by kind and the judgement of weak evidence (issue 11)
    by_kind: dict[str, dict[str, Any]]  # per gradient kind: nonzero values, flushed fractions, max |g|
    scale_induced_overflow_steps: list[int]  # steps that overflowed at the scale in force, not at S = 1
    insufficient_reason: str  # a code: nothing_captured, autocast_zeros, all_zero, all_nonfinite, scale_not_carried
    insufficient_data: dict[str, Any]  # the numbers the reason is worded from (precision, scales, counts, shadow_pending)
    fp32_capped_from_log2_scale: int  # S was capped below this (the largest safe scale less the margin) to stay in fp32
    before_loss_cap: dict[str, Any]  # the figures at log2_scale_without_loss_cap, before the fp16 loss capped S
    # fp8 e4m3: per-tensor scaling from the measured maxima
    per_tensor_scale_log2: int  # one scale for every gradient, from the ceiling
    per_tensor_scales: list[list[Any]]  # [tensor name, log2 scale, flushed fraction] per captured tensor
    per_tensor_flushed_fraction: float  # flushed with one scale per tensor
    saturated_fraction_at_scale: float  # saturated with one scale per tensor
    single_scale_saturated_fraction: float
    # a live fp16/bf16 run judged on its fp32 shadow reruns (analysis.shadow)
    reference: str  # what the verdict was judged on: "fp32_shadow_reruns" (older reports: "fp32 shadow reruns of the live run")
    shadow_steps: list[int]  # the live steps rerun in fp32
    shadow_next_step: int | None  # when the next rerun comes
    live_precision: str  # the precision the live run computed in
    live_zero_values: int  # exact zeros in the live run on the shadowed steps (judged kinds)
    structural_zero_values: int  # of those, zero in the fp32 rerun too
    flushed_in_live_run: int  # zero in the live run, nonzero in fp32: flushed at the scale in force
    flushed_fraction_in_live_run: float | None  # of the fp32 rerun's nonzero values
    # the forward pass and the loss of the target run (fp16probe.analysis.forward)
    target: str  # the device whose autocast rules the prediction applies ("cuda", "cpu")
    regime: str  # "autocast" or "pure_fp16" (a .half() model)
    forward_source: str  # "audit" (op by op, in a profile) or "modules" (module outputs, the Probe)
    forward_overflow: list[dict[str, Any]]  # fp16 forward tensors that pass fp16's max, in forward order
    forward_low_headroom: list[dict[str, Any]]  # fp16 forward tensors within a few bits of fp16's max
    forward_flushing: list[dict[str, Any]]  # fp16 forward tensors that flush more than the threshold
    loss_fp16: bool  # the loss itself is fp16 in the target run: its seed gradient is S in fp16
    log2_scale_without_loss_cap: int  # what S would be with the loss computed in fp32
    custom_functions: list[str]  # custom autograd.Function nodes: their backward is opaque to the ceiling
    fix_code: str  # older reports' code for the fix, as text: never shown (presentation.paste writes the code)
    fix_modules: list[str]  # the modules a forward or gradient_error verdict's fix keeps in fp32
    fix_device: str  # the device_type of that fix ("cuda", "cpu"): the target whose autocast it turns off
    fix_top_level: list[str]  # up to 3 ops that run in the model's own forward, outside any submodule
    forward_overflow_count: int  # fp16 forward tensors that pass fp16's max (forward_overflow lists the first 20)
    forward_flushing_count: int  # fp16 forward tensors that flush more than the threshold
    forward_tensors: int  # fp16 forward tensors measured
    backward_verdict: str  # the loss-scale verdict the gradients alone give, once the forward is fixed
    emulated: dict[str, Any]  # the emulated target step at the verdict's S (fp16probe.analysis.effect)
    backward_log2_scale: int | None


@dataclass(frozen=True)
class Citation:
    """One work the advice rests on: ``authors`` and ``title``, then an ``arxiv`` id, a ``url`` or both.

    The records are in :mod:`fp16probe.sources`; ``presentation.cite`` writes one as a line. ``note`` is what the reader needs beside the title: where it appeared, which version, or
    what of it the tool uses (GradScaler's defaults, Transformer Engine's scale rule).
    """

    authors: str
    title: str
    arxiv: str = ""
    url: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        """Return the JSON form: the non-empty fields."""
        return {k: v for k, v in asdict(self).items() if v}


Cited = Citation | str  # a record, or the sentence an older report stored (shown as it was)


def citation_from_json(value: Any, path: str = "citations") -> Cited:
    """A stored citation: a record, or an older report's sentence kept as it was.

    A field that is not a string raises ReportFieldError naming it.
    """
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ReportFieldError(path, f"{path}: expected a citation object or a string, got {type(value).__name__}")
    known = {f.name for f in fields(Citation)}
    for key in ("authors", "title"):
        if not isinstance(value.get(key), str):
            raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a string")
    for key, v in value.items():
        if key in known and not isinstance(v, str):
            raise ReportFieldError(f"{path}.{key}", f"{path}.{key}: expected a string, got {type(v).__name__}")
    return Citation(**{k: v for k, v in value.items() if k in known})


def citations_from_json(value: Any, path: str) -> tuple[Cited, ...]:
    """A stored list of citations (each a record or an older report's sentence); a bad one raises ReportFieldError."""
    if not isinstance(value, list):
        raise ReportFieldError(path, f"{path}: expected a list, got {type(value).__name__}")
    return tuple(citation_from_json(c, f"{path}[{i}]") for i, c in enumerate(value))


def citation_to_json(c: Cited) -> dict[str, str] | str:
    """The stored form: a record's non-empty fields, or an older file's sentence as it was."""
    return c if isinstance(c, str) else c.to_dict()


@dataclass(frozen=True)
class Caveat:
    """A limit of the evidence: a ``code`` and its ``data``; ``str(caveat)`` words it (``presentation.answer``)."""

    code: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form, ``{"code": ..., "data": {...}}``."""
        return {"code": self.code, "data": jsonable(self.data)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | str) -> "Caveat":
        """Build a Caveat from its JSON form; an older report's sentence becomes code ``"text"``."""
        return cls("text", {"text": d}) if isinstance(d, str) else cls(str(d["code"]), dict(d.get("data") or {}))

    def __str__(self) -> str:
        from fp16probe.presentation.answer import caveat_text

        return caveat_text(self)


@dataclass(frozen=True)
class Recommendation:
    """A verdict on loss scaling for one format, with its evidence, thresholds and sources.

    ``log2_scale`` is the constant S's exponent (constant), the schedule's init_scale
    exponent (dynamic), the best compromise (no_single_scale), the per-tensor scale
    (per_tensor_scaling), 0 (none_needed) or None (insufficient_evidence).
    ``grad_scaler_kwargs`` go straight to ``torch.amp.GradScaler``; empty where no
    GradScaler is advised. ``caveats`` are the limits of this evidence (:class:`Caveat`
    records); every presentation shows them in the same words. :attr:`text`, the reasoning
    in words, is rendered from this data (``presentation.verdict``); ``stored_text`` holds
    the words a report file stored (an older file's are shown as they were), else is empty.
    """

    verdict: Verdict
    format: str
    log2_scale: int | None
    scale: float | None
    grad_scaler_kwargs: Mapping[str, Any]
    flushed_fraction_at_1: float | None
    flushed_fraction_at_scale: float | None
    overflow_steps_at_scale: int | None
    headroom_bits: int | None
    worst_modules: tuple[tuple[str, float], ...]
    evidence: Evidence
    thresholds: Thresholds
    citations: tuple[Cited, ...]  # records (fp16probe.sources); an older file's sentences as stored
    stored_text: str = field(default="", compare=False)  # words, derived from the data: not part of equality
    kind: str = "activation_grad"
    growth_interval_table: Mapping[str, Any] | None = None
    caveats: tuple[Caveat, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form (the first version's keys, plus ``caveats``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stored_text"}
        d["text"] = self.text  # rendered here, at the edge, so the file and the JSON output carry the words
        d["verdict"] = self.verdict.value
        d["grad_scaler_kwargs"] = dict(self.grad_scaler_kwargs)
        d["worst_modules"] = [[n, f] for n, f in self.worst_modules]
        d["evidence"] = jsonable(self.evidence)
        d["thresholds"] = jsonable(self.thresholds)
        d["citations"] = [citation_to_json(c) for c in self.citations]
        d["growth_interval_table"] = jsonable(self.growth_interval_table)
        d["caveats"] = [c.to_dict() for c in self.caveats]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Recommendation":
        """Build a Recommendation from its JSON form; an unknown verdict raises ReportError."""
        try:
            verdict = Verdict(d.get("verdict"))
        except ValueError as e:
            raise ReportError(
                f"not a recommendation: verdict {d.get('verdict')!r} is not one of "
                f"{[v.value for v in Verdict]}"
            ) from e
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["stored_text"] = str(d.get("text") or "")
        kw["verdict"] = verdict
        kw["worst_modules"] = tuple((str(n), float(f)) for n, f in d.get("worst_modules", ()))
        kw["citations"] = citations_from_json(d.get("citations", []), "recommendation.citations")
        kw["grad_scaler_kwargs"] = dict(d.get("grad_scaler_kwargs", {}))
        kw["evidence"] = cast(Evidence, dict(d.get("evidence", {})))
        kw["thresholds"] = cast(Thresholds, dict(d.get("thresholds", {})))
        kw["caveats"] = tuple(Caveat.from_dict(c) for c in d.get("caveats", ()))
        return cls(**kw)

    # -- presentation (rich loads only when these are called) -------------------------
    @property
    def text(self) -> str:
        """The reasoning in words: the stored text of a report file, else rendered from the data."""
        from fp16probe.presentation.verdict import verdict_text

        return verdict_text(self)

    def __repr__(self) -> str:
        from fp16probe.presentation.answer import recommendation_summary

        return recommendation_summary(self)

    __str__ = __repr__

    def explanation(self, width: int = 88) -> str:
        """Return :attr:`text`, the reasoning, wrapped at spaces to ``width`` (URLs and numbers stay whole);
        a verdict the emulated step gave leads with what it measured."""
        from fp16probe.presentation.answer import explanation_text, wrap_text

        return "\n".join(wrap_text(explanation_text(self), width))

    def _repr_html_(self) -> str:
        from fp16probe.presentation.html import recommendation_html

        return recommendation_html(self)

    def __rich__(self) -> Any:
        from fp16probe.presentation.terminal import recommendation_view

        return recommendation_view(self)


def jsonable(obj: Any) -> Any:
    """``obj`` as JSON-ready data: enums as their values, mappings with string keys, non-finite floats as None."""
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
