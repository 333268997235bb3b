"""Replay loss-scaling rules: GradScaler's exactly, and the hysteresis / floor variants.

:func:`replay_scaler` runs a rule over a given sequence of overflowing and clean steps.
:func:`simulate` closes the loop over a profile: at each simulated step it draws one of
the profiled steps, asks whether that step's gradients overflow at the current scale,
counts what flushes, and lets the rule move the scale. :func:`score_growth_intervals`
runs :func:`simulate` for several growth intervals on the same draws and tabulates
the skipped steps each costs and the underflow each leaves.

The rule (``torch/amp/grad_scaler.py`` and ``_amp_update_scale_``; REFERENCE.md section 4)::

    if found_inf: scale *= backoff_factor; tracker = 0            # and the step is skipped
    else: tracker += 1; if tracker == growth_interval: scale *= growth_factor (if finite); tracker = 0

The scale lives in a float32 tensor and each product is formed in double and rounded to
float32, as the CPU and CUDA kernels do; so does this replay. DeepSpeed and Megatron add
*hysteresis* (back off only after that many overflows since the last growth; every
overflow still skips its step) and a *minimum scale* (backoff never goes below it).
``hysteresis=1, min_scale=0`` is GradScaler's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

import numpy as np

from fp16probe.columns import HistogramColumn
from fp16probe.errors import AnalysisError
from fp16probe.formats import Format, get_format
from fp16probe.histogram import MAX_EXP, MIN_EXP
from fp16probe.analysis.ceiling import Ceiling
from fp16probe.recommendation import GRADSCALER_DEFAULTS
from fp16probe.report import Report, StepTrace, kinds_named

__all__ = [
    "DEFAULT_GROWTH_INTERVALS",
    "GRADSCALER_DEFAULT_ROW",
    "RESAMPLED_STEPS",
    "GrowthIntervalRow",
    "GrowthIntervalTable",
    "ReplayResult",
    "ScalerRule",
    "replay_scaler",
    "score_growth_intervals",
    "simulate",
]

DEFAULT_GROWTH_INTERVALS = (100, 200, 500, 1000, 2000, 5000, 10000)


@dataclass(frozen=True)
class ScalerRule:
    """A dynamic loss-scaling rule in GradScaler's vocabulary, plus hysteresis and a floor.

    ``consecutive_hysteresis`` (DeepSpeed's option) refills the hysteresis budget on every
    clean step instead of only at growth. ``deepspeed_window`` counts the growth interval as
    DeepSpeed's ``DynamicLossScaler.update_scale`` does (0.19.8, and its fused and ZeRO
    optimizers): it grows at a clean step that follows a positive multiple of the window of clean
    steps since the last overflow (or the start), so the first growth after an overflow comes
    one clean step later than GradScaler's and the next ones every window.
    """

    init_scale: float = GRADSCALER_DEFAULTS["init_scale"]
    growth_factor: float = GRADSCALER_DEFAULTS["growth_factor"]
    backoff_factor: float = GRADSCALER_DEFAULTS["backoff_factor"]
    growth_interval: int = GRADSCALER_DEFAULTS["growth_interval"]
    hysteresis: int = 1
    min_scale: float = 0.0
    consecutive_hysteresis: bool = False
    deepspeed_window: bool = False

    def __post_init__(self) -> None:
        ok = (self.growth_factor > 1.0, 0.0 <= self.backoff_factor < 1.0,
              int(self.growth_interval) == self.growth_interval and self.growth_interval >= 1,
              int(self.hysteresis) == self.hysteresis and self.hysteresis >= 1,
              self.min_scale >= 0.0, self.init_scale > 0.0 and math.isfinite(self.init_scale))
        if not all(ok):
            raise AnalysisError("invalid scaler rule: " + "; ".join(problem for good, problem in zip(ok, (
                f"growth_factor={self.growth_factor!r} (must be > 1, as GradScaler requires)",
                f"backoff_factor={self.backoff_factor!r} (must be in [0, 1))",
                f"growth_interval={self.growth_interval!r} (must be a positive integer)",
                f"hysteresis={self.hysteresis!r} (must be a positive integer; 1 is GradScaler's)",
                f"min_scale={self.min_scale!r} (must be >= 0; 0 is GradScaler's, no floor)",
                f"init_scale={self.init_scale!r} (must be a positive finite number)",
            )) if not good) + ": fix these arguments")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None = None, **overrides: Any) -> "ScalerRule":
        """Build a rule from GradScaler keyword arguments (unknown keys are an error)."""
        merged = {**(kwargs or {}), **overrides}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise AnalysisError(
                f"unknown scaler argument(s) {unknown}: expected some of {sorted(known)}"
            )
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        """Return the rule as GradScaler-style keyword arguments plus the variants."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ReplayResult:
    """What a scaling rule did, step by step.

    ``scales[i]`` is the scale in force at step ``i`` (the one the gradients were
    multiplied by), ``skipped[i]`` whether that step's optimizer update was skipped and
    ``final_scale`` the scale after the last update. A simulation also fills
    ``flushed_fraction[i]`` (share of the step's nonzero values that flush at its scale),
    ``sampled_steps[i]`` (which profiled step was drawn) and ``mean_flushed_fraction``
    (flushed values over nonzero values, over the steps that were applied).
    """

    scales: tuple[float, ...]
    skipped: tuple[bool, ...]
    final_scale: float
    backoffs: int = 0
    growths: int = 0
    floor_hits: int = 0
    flushed_fraction: tuple[float, ...] = ()
    sampled_steps: tuple[int, ...] = ()
    mean_flushed_fraction: float | None = None

    @property
    def steps(self) -> int:
        """Return the number of replayed steps."""
        return len(self.scales)

    @property
    def skipped_steps(self) -> int:
        """Return the number of skipped (overflowing) steps."""
        return sum(self.skipped)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "scales": list(self.scales),
            "skipped": list(self.skipped),
            "final_scale": self.final_scale,
            "backoffs": self.backoffs,
            "growths": self.growths,
            "floor_hits": self.floor_hits,
            "flushed_fraction": list(self.flushed_fraction),
            "sampled_steps": list(self.sampled_steps),
            "mean_flushed_fraction": self.mean_flushed_fraction,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ReplayResult":
        """Build a result from its JSON form."""
        return cls(
            scales=tuple(float(s) for s in d["scales"]),
            skipped=tuple(bool(s) for s in d["skipped"]),
            final_scale=float(d["final_scale"]),
            backoffs=int(d.get("backoffs", 0)),
            growths=int(d.get("growths", 0)),
            floor_hits=int(d.get("floor_hits", 0)),
            flushed_fraction=tuple(float(f) for f in d.get("flushed_fraction", ())),
            sampled_steps=tuple(int(s) for s in d.get("sampled_steps", ())),
            mean_flushed_fraction=(
                None if d.get("mean_flushed_fraction") is None else float(d["mean_flushed_fraction"])
            ),
        )


def _f32(x: float) -> float:
    """Round a double to float32, as storing into GradScaler's float32 scale tensor does."""
    return float(np.float32(x))


class _ScalerState:
    """The mutable state of one rule: scale, growth tracker, hysteresis budget."""

    def __init__(self, rule: ScalerRule) -> None:
        self.rule = rule
        self.scale = _f32(rule.init_scale)
        self.min_scale = _f32(rule.min_scale)
        self.tracker = 0
        self.clean_run = 0  # clean steps since the last overflow (DeepSpeed's window counts these)
        self.hysteresis_left = int(rule.hysteresis)
        self.backoffs = self.growths = self.floor_hits = 0

    def update(self, found_inf: bool) -> None:
        rule = self.rule
        if found_inf:
            self.tracker = self.clean_run = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                backed = _f32(self.scale * rule.backoff_factor)
                if backed < self.min_scale:
                    backed = self.min_scale
                    self.floor_hits += 1
                self.scale = backed
                self.backoffs += 1
            return
        if rule.consecutive_hysteresis:
            self.hysteresis_left = int(rule.hysteresis)
        if rule.deepspeed_window:
            grow = self.clean_run > 0 and self.clean_run % rule.growth_interval == 0
            self.clean_run += 1
        else:
            self.tracker += 1
            grow = self.tracker == rule.growth_interval
        if grow:
            grown = _f32(self.scale * rule.growth_factor)
            if math.isfinite(grown):  # GradScaler never grows the scale to inf
                self.scale = grown
                self.growths += 1
            self.tracker = 0
            self.hysteresis_left = int(rule.hysteresis)


def replay_scaler(
    overflow: Sequence[bool],
    *,
    init_scale: float = GRADSCALER_DEFAULTS["init_scale"],
    growth_factor: float = GRADSCALER_DEFAULTS["growth_factor"],
    backoff_factor: float = GRADSCALER_DEFAULTS["backoff_factor"],
    growth_interval: int = GRADSCALER_DEFAULTS["growth_interval"],
    hysteresis: int = 1,
    min_scale: float = 0.0,
    consecutive_hysteresis: bool = False,
    deepspeed_window: bool = False,
) -> ReplayResult:
    """Replay a scaling rule over a fixed sequence of overflowing (True) and clean steps.

    With the defaults this is ``torch.amp.GradScaler`` step for step: the scale after
    each step equals ``scaler.get_scale()`` after ``scaler.update()``.
    """
    rule = ScalerRule(init_scale, growth_factor, backoff_factor, int(growth_interval), int(hysteresis),
                      min_scale, consecutive_hysteresis, deepspeed_window)
    state = _ScalerState(rule)
    scales: list[float] = []
    skipped: list[bool] = []
    with np.errstate(over="ignore"):
        for found_inf in overflow:
            found_inf = bool(found_inf)
            scales.append(state.scale)
            skipped.append(found_inf)
            state.update(found_inf)
    return ReplayResult(tuple(scales), tuple(skipped), state.scale, state.backoffs, state.growths,
                        state.floor_hits)


# -- the profile as a model of future steps ---------------------------------------------

@dataclass(frozen=True)
class _StepModel:
    """Per profiled step: the overflow ceiling the scale multiplies, and what could flush."""

    step_max: np.ndarray  # float64 [T]: the step's overflow ceiling (analysis.ceiling)
    nonfinite: np.ndarray  # bool [T]: inf/NaN that no scale explains (overflows at every scale)
    cumulative: np.ndarray  # int64 [T, bins]: counts of `kind` at or below each bin from `first_bin` on
    nonzero: np.ndarray  # int64 [T]
    first_bin: int = 0  # the bins below it are empty at every step (a long trace keeps only the occupied band)
    # The profiled steps the rows stand for (None: every step, in order). A replay reads only the steps it
    # draws, so a long trace's model holds those rows, not one per profiled step.
    rows: np.ndarray | None = None

    def local(self, draws: np.ndarray) -> np.ndarray:
        """The row of each drawn profiled step."""
        return draws if self.rows is None else np.searchsorted(self.rows, draws)

    def flushed(self, t: int, fmt: Format, scale: float) -> int:
        """Values of step t that flush at ``scale`` (exact for powers of two, else an upper bound)."""
        if scale <= 0.0:
            return int(self.nonzero[t])
        k = math.frexp(scale)[1] - 1  # floor(log2 scale)
        hi = min(fmt.log2_flush_threshold - k, MAX_EXP) - MIN_EXP
        hi -= self.first_bin
        if hi < 0:
            return 0
        return int(self.cumulative[t, hi]) if hi < self.cumulative.shape[1] else int(self.nonzero[t])

    def overflows(self, t: int, fmt: Format, scale: float) -> bool:
        if self.nonfinite[t]:
            return True
        m = float(self.step_max[t])
        return m > 0.0 and fmt.overflows(m * scale)


def _draws(trace: StepTrace, horizon: int, seed: int) -> np.ndarray:
    """The profiled steps a replay of ``horizon`` steps draws, uniformly with replacement (none without steps)."""
    if len(trace) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.random.default_rng(seed).integers(0, len(trace), size=int(horizon))


def _step_model(trace: StepTrace, kind: str, ceiling: Ceiling | None, draws: np.ndarray | None = None) -> _StepModel:
    """The model of the steps in ``draws`` (every step when None), each drawn step's figures exact."""
    kinds = kinds_named(kind)
    hists = [hs for hs in (trace.histograms.get(k) for k in kinds) if hs]
    if not hists:
        raise AnalysisError(
            f"the report's trace has no per-step {kind} histograms: profile with the Probe "
            f"capturing {kind} (and call probe.step() each step) to simulate a scaler"
        )
    n = len(hists[0])
    if n == 0:
        raise AnalysisError("the report's trace has no profiled steps: call probe.step() once per step")
    if ceiling is None:
        ceiling = Ceiling.from_trace(trace)
    if len(ceiling.steps) != n:
        raise AnalysisError(f"the ceiling has {len(ceiling.steps)} steps for a trace of {n}: build it from this trace")
    rows = None if draws is None else np.unique(draws)
    picked = range(n) if rows is None else rows.tolist()
    step_max = np.asarray([ceiling.steps[t].effective_max for t in picked], dtype=np.float64)
    nonfinite = np.asarray([ceiling.steps[t].intrinsic for t in picked], dtype=bool)
    if all(isinstance(hs, HistogramColumn) for hs in hists):  # a packed trace: its arrays, the occupied band only
        cols = [hs for hs in hists if isinstance(hs, HistogramColumn)]
        first = min((int(c.lo[c.width > 0].min()) for c in cols if (c.width > 0).any()), default=0)
        last = max((int((c.lo + c.width)[c.width > 0].max()) for c in cols if (c.width > 0).any()), default=first)
        counts = np.zeros((len(picked), max(last - first, 0)), dtype=np.int64)
        for c in cols:
            for lo in range(0, len(picked), 4096):
                part = (c.dense(lo, min(lo + 4096, n)) if rows is None else c.take(rows[lo:lo + 4096]))
                counts[lo:lo + 4096] += part[:, first:last]
        return _StepModel(step_max, nonfinite, np.cumsum(counts, axis=1), counts.sum(axis=1), first, rows)
    counts = np.zeros((len(picked), len(hists[0][0].counts)), dtype=np.int64)
    for hs in hists:
        counts += np.asarray([hs[t].counts for t in picked], dtype=np.int64)
    return _StepModel(step_max, nonfinite, np.cumsum(counts, axis=1), counts.sum(axis=1), 0, rows)


def simulate(
    trace: StepTrace | Report,
    format: str | Format = "fp16",
    grad_scaler_kwargs: Mapping[str, Any] | None = None,
    *,
    horizon: int = 20000,
    seed: int = 0,
    kind: str = "all",
    ceiling: Ceiling | None = None,
    hysteresis: int | None = None,
    min_scale: float | None = None,
) -> ReplayResult:
    """Run a scaling rule for ``horizon`` steps over steps resampled from a profile.

    Pass the Report (or its trace and ``ceiling=Ceiling.of(report)``) so that the ceiling
    knows the run's precision: a trace alone is read as an fp32 run's.
    Each simulated step draws one profiled step uniformly with replacement (numpy's
    PCG64 seeded with ``seed``): it overflows when that step's overflow ceiling
    (``analysis.ceiling.Ceiling``: every gradient the loss scale multiplies; built from the
    report, or the trace, when not given) times the scale lands past the format's max, or when it held
    inf/NaN that no scale explains; a step that overflowed only at the scale in force while
    profiling overflows here only at that scale and above. Its flushed fraction is the share
    of its nonzero ``kind`` values (default: activation and weight gradients) at or below
    the flush threshold at that scale. This assumes future steps look like the profiled
    ones; a profile cannot see the drift that training brings.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    overrides: dict[str, float] = {}
    if hysteresis is not None:
        overrides["hysteresis"] = hysteresis
    if min_scale is not None:
        overrides["min_scale"] = min_scale
    rule = ScalerRule.from_kwargs({**GRADSCALER_DEFAULTS, **(grad_scaler_kwargs or {})}, **overrides)
    if int(horizon) < 1:
        raise AnalysisError(f"horizon must be a positive number of steps, got {horizon!r}")
    if isinstance(trace, Report):
        ceiling = ceiling or Ceiling.of(trace)
        trace = trace.trace
    draws = _draws(trace, horizon, seed)
    return _run(_step_model(trace, kind, ceiling, draws), fmt, rule, draws)


def _run(model: _StepModel, fmt: Format, rule: ScalerRule, draws: np.ndarray) -> ReplayResult:
    state = _ScalerState(rule)
    scales: list[float] = []
    skipped: list[bool] = []
    fractions: list[float] = []
    flushed_applied = nonzero_applied = 0
    nonzero = model.nonzero
    with np.errstate(over="ignore"):
        for t in model.local(draws).tolist():
            scale = state.scale
            found_inf = model.overflows(t, fmt, scale)
            flushed = model.flushed(t, fmt, scale)
            nz = int(nonzero[t])
            scales.append(scale)
            skipped.append(found_inf)
            fractions.append(flushed / nz if nz else 0.0)
            if not found_inf:
                flushed_applied += flushed
                nonzero_applied += nz
            state.update(found_inf)
    mean = flushed_applied / nonzero_applied if nonzero_applied else None
    return ReplayResult(tuple(scales), tuple(skipped), state.scale, state.backoffs, state.growths,
                        state.floor_hits, tuple(fractions), tuple(draws.tolist()), mean)


# -- choosing a growth interval -----------------------------------------------------------

# The codes the table stores (worded in presentation.verdict): a row's note, the table's method.
GRADSCALER_DEFAULT_ROW = "gradscaler_default"  # the row is GradScaler's default growth_interval
RESAMPLED_STEPS = "resampled_steps"  # future steps drawn from the profiled ones, uniformly with replacement, seeded

@dataclass(frozen=True)
class GrowthIntervalRow:
    """One candidate growth_interval and what it cost over the simulated horizon."""

    growth_interval: int
    skipped_steps: int
    skipped_fraction: float
    mean_flushed_fraction: float | None
    final_scale: float
    backoffs: int
    growths: int
    meets_threshold: bool
    chosen: bool = False
    note: str = ""  # GRADSCALER_DEFAULT_ROW or empty; an older file stored a sentence here, shown as it was

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GrowthIntervalRow":
        """Build a row from its JSON form."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class GrowthIntervalTable:
    """Candidate growth intervals scored on the same resampled steps.

    The chosen row is, among candidates whose mean flushed fraction is at most
    ``max_flushed_fraction``, the one that skips the fewest steps (ties: less underflow,
    then the longer interval); when none meets it, the one with the least underflow
    (ties: fewer skipped steps).
    """

    rows: tuple[GrowthIntervalRow, ...]
    horizon: int
    seed: int
    max_flushed_fraction: float
    rule: Mapping[str, Any] = field(default_factory=dict)
    method: str = RESAMPLED_STEPS  # a code; an older file stored a sentence here, shown as it was

    @property
    def chosen(self) -> GrowthIntervalRow:
        """Return the chosen candidate."""
        return next(r for r in self.rows if r.chosen)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "rows": [r.to_dict() for r in self.rows],
            "horizon": self.horizon,
            "seed": self.seed,
            "max_flushed_fraction": self.max_flushed_fraction,
            "rule": dict(self.rule),
            "method": self.method,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GrowthIntervalTable":
        """Build a table from its JSON form."""
        return cls(
            rows=tuple(GrowthIntervalRow.from_dict(r) for r in d["rows"]),
            horizon=int(d["horizon"]),
            seed=int(d["seed"]),
            max_flushed_fraction=float(d["max_flushed_fraction"]),
            rule=dict(d.get("rule", {})),
            method=str(d.get("method", RESAMPLED_STEPS)),
        )


def score_growth_intervals(
    trace: StepTrace,
    format: str | Format = "fp16",
    *,
    init_scale: float,
    candidates: Sequence[int] = DEFAULT_GROWTH_INTERVALS,
    horizon: int = 20000,
    seed: int = 0,
    growth_factor: float = GRADSCALER_DEFAULTS["growth_factor"],
    backoff_factor: float = GRADSCALER_DEFAULTS["backoff_factor"],
    hysteresis: int = 1,
    min_scale: float = 0.0,
    kind: str = "all",
    ceiling: Ceiling | None = None,
    max_flushed_fraction: float = 1e-3,
) -> GrowthIntervalTable:
    """Simulate each candidate growth_interval on the same resampled steps and score it.

    Every candidate sees the same draws (common random numbers), so differences between
    rows come from the rule, not from the luck of the draw. The row for 2000 is marked as
    GradScaler's default, which is what it is.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    cands = sorted({int(c) for c in candidates})
    if not cands or cands[0] < 1:
        raise AnalysisError(f"growth_interval candidates must be positive integers, got {list(candidates)!r}")
    if int(horizon) < 1:
        raise AnalysisError(f"horizon must be a positive number of steps, got {horizon!r}")
    draws = _draws(trace, horizon, seed)
    model = _step_model(trace, kind, ceiling, draws)
    rows = []
    for g in cands:
        rule = ScalerRule(init_scale, growth_factor, backoff_factor, g, hysteresis, min_scale)
        res = _run(model, fmt, rule, draws)
        mean = res.mean_flushed_fraction
        rows.append(
            GrowthIntervalRow(
                growth_interval=g,
                skipped_steps=res.skipped_steps,
                skipped_fraction=res.skipped_steps / res.steps,
                mean_flushed_fraction=mean,
                final_scale=res.final_scale,
                backoffs=res.backoffs,
                growths=res.growths,
                meets_threshold=mean is not None and mean <= max_flushed_fraction,
                note=GRADSCALER_DEFAULT_ROW if g == GRADSCALER_DEFAULTS["growth_interval"] else "",
            )
        )
    chosen = _choose(rows)
    rows = [replace(r, chosen=True) if r is chosen else r for r in rows]
    settings = {"init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor,
                "hysteresis": hysteresis, "min_scale": min_scale}
    return GrowthIntervalTable(tuple(rows), int(horizon), int(seed), float(max_flushed_fraction), settings)


def _choose(rows: Sequence[GrowthIntervalRow]) -> GrowthIntervalRow:
    def flushed(r: GrowthIntervalRow) -> float:
        return 1.0 if r.mean_flushed_fraction is None else r.mean_flushed_fraction

    good = [r for r in rows if r.meets_threshold]
    if good:
        return min(good, key=lambda r: (r.skipped_steps, flushed(r), -r.growth_interval))
    return min(rows, key=lambda r: (flushed(r), r.skipped_steps, -r.growth_interval))

