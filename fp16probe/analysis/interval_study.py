"""What the growth-interval study measured (``bench/interval_study.py``, docs/interval-study.md), as data.

The study trained small model families for real in fp16 (CPU autocast, ``GradScaler("cpu")``),
recorded each run's per-step history with the Probe and replayed a grid of loss-scale rules on
it. Per family it keeps here: the measured drift of the gradient scale (the least-squares slope
of log2 max|g| over the run's clean steps, in bits per 1000 steps), the growth interval that
skipped the fewest steps (at the defaults' x2 and x0.5) at no more flushed share, steps below the
needed scale and emulated gradient error than GradScaler's defaults (:func:`choose`), and the
skipped steps of both. ``tests/test_interval_study.py``
checks that :data:`FAMILIES` equals :func:`summarise` of the study's JSON
(docs/data/interval-study.json), so this table cannot drift from the measurement.

A run's own drift (:func:`drift_per_1000`) is set against the families' by :func:`nearest`:
the family whose drift is closest, and whether the run's drift lies inside the range the study
covered. Outside it, the study says nothing about the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from fp16probe.report import Report

__all__ = ["FAMILIES", "StudyFamily", "StudyMatch", "choose", "drift_per_1000", "evidence", "nearest", "summarise"]


@dataclass(frozen=True)
class StudyFamily:
    """One family's finding: its drift, the chosen rule and what it saved against the defaults."""

    family: str
    steps: int
    drift_log2_per_1000: float
    growth_interval: int  # the chosen interval at the defaults' factors (NEVER_GROWS: never grow)
    growth_factor: float
    backoff_factor: float
    skipped_steps: int
    defaults_skipped_steps: int
    mean_flushed_fraction: float | None  # the chosen interval's, over the run
    defaults_mean_flushed_fraction: float | None


@dataclass(frozen=True)
class StudyMatch:
    """A run's drift set against the study's families."""

    drift_log2_per_1000: float
    family: StudyFamily
    within_range: bool  # the run's drift lies inside the families' range of drifts
    agreeing: int  # families whose chosen growth_interval equals this family's


NEVER_GROWS = 10**9  # the study's "never": a growth interval no run reaches
MIN_SPAN = 100  # steps a run's measured drift must span before it is set against the study's


def drift_per_1000(steps: Iterable[int], largest: Iterable[float | None]) -> float | None:
    """The least-squares slope of log2 of each step's largest |g| against the step number, per 1000 steps.

    Steps whose largest gradient is missing, zero or not finite (an overflow) are left out; None
    with fewer than two steps left or one step number only."""
    pts = [(float(s), math.log2(g)) for s, g in zip(steps, largest)
           if g is not None and math.isfinite(g) and g > 0.0]
    if len(pts) < 2 or len({p[0] for p in pts}) < 2:
        return None
    x, y = np.array(pts, dtype=np.float64).T
    return float(np.polyfit(x, y, 1)[0] * 1000.0)


ERROR_TOLERANCE = 0.01  # relative: the emulated error at these scales is fp16's rounding, moving by parts in 10^5


def _le(a: float | None, b: float | None, tolerance: float = 1e-9) -> bool:
    return a is None or b is None or a <= b * (1 + tolerance)


def meets(row: Mapping[str, Any], defaults: Mapping[str, Any]) -> bool:
    """Whether a replayed rule flushes and spends steps flushing no more than the defaults, and errs no more
    within :data:`ERROR_TOLERANCE` of the defaults' emulated gradient error (None: not measured)."""
    return (_le(row["mean_flushed_fraction"], defaults["mean_flushed_fraction"])
            and _le(row["steps_below_needed"], defaults["steps_below_needed"])
            and _le(row["gradient_error"], defaults["gradient_error"], ERROR_TOLERANCE))


def choose(rows: Sequence[Mapping[str, Any]], *, defaults_factors: bool = True) -> Mapping[str, Any]:
    """The study's choice among a family's replayed rules (``rows[0]`` is GradScaler's defaults).

    Among the rules that :func:`meets` the defaults, the one skipping the fewest steps (ties: less
    flushed, then the defaults' own interval, then the longer interval: a tie with the defaults is
    the defaults). ``defaults_factors``: only the rules with the defaults'
    growth x2, backoff x0.5 and no hysteresis (the growth interval alone varies); else every rule."""
    d = rows[0]
    pool = [r for r in rows if meets(r, d) and (not defaults_factors or (
        r["growth_factor"] == d["growth_factor"] and r["backoff_factor"] == d["backoff_factor"]
        and r["hysteresis"] == 1))]
    return min(pool, key=lambda r: (r["skipped_steps"], r["mean_flushed_fraction"] or 0.0,
                                    r["growth_interval"] != d["growth_interval"], -r["growth_interval"]))


def summarise(study: Mapping[str, Any]) -> tuple[StudyFamily, ...]:
    """The per-family findings of a study's JSON (``bench/interval_study.py --out``): the interval :func:`choose` picks."""
    out = []
    for f in study["families"]:
        best = choose(f["rows"])
        out.append(StudyFamily(str(f["family"]), int(f["steps"]), round(float(f["drift_log2_per_1000"]), 3),
                               int(best["growth_interval"]), float(best["growth_factor"]),
                               float(best["backoff_factor"]), int(best["skipped_steps"]),
                               int(f["rows"][0]["skipped_steps"]), best["mean_flushed_fraction"],
                               f["rows"][0]["mean_flushed_fraction"]))
    return tuple(out)


def nearest(drift: float | None, families: Sequence[StudyFamily] | None = None) -> StudyMatch | None:
    """The study family whose drift of the gradient scale is closest to ``drift``, sign included (None: no drift
    or no study): gradients that shrink leave the scale room to grow, gradients that grow do not."""
    fams = FAMILIES if families is None else tuple(families)
    if drift is None or not math.isfinite(drift) or not fams:
        return None
    fam = min(fams, key=lambda f: (abs(f.drift_log2_per_1000 - drift), f.family))
    spread = [f.drift_log2_per_1000 for f in fams]
    agreeing = sum(f.growth_interval == fam.growth_interval for f in fams)
    return StudyMatch(float(drift), fam, min(spread) <= drift <= max(spread), agreeing)


def evidence(report: Report, per_step_max: Sequence[float] | None = None) -> dict[str, Any]:
    """The run's drift of the gradient scale set against the study's families, as the verdict's evidence.

    The drift comes from the per-step history where there is one (every step's largest |g|),
    else from ``per_step_max`` over the profiled steps (their overflow ceilings). Empty when
    neither gives a drift, the steps span fewer than :data:`MIN_SPAN` steps, or the package holds
    no study (:data:`FAMILIES`)."""
    h = report.history
    steps: Sequence[int] = ()
    if h is not None and len(h):
        steps, largest = range(h.first_step, h.first_step + len(h)), list(h.grad_max)
    elif per_step_max is not None and len(report.trace):
        steps, largest = list(report.trace.steps), list(per_step_max)
    if not steps or max(steps) - min(steps) < MIN_SPAN:  # a few steps' slope says nothing of drift
        return {}
    drift = drift_per_1000(steps, largest)
    match = nearest(drift)
    if match is None:
        return {}
    f = match.family
    return {"drift_log2_per_1000": match.drift_log2_per_1000, "family": f.family,
            "family_drift_log2_per_1000": f.drift_log2_per_1000, "growth_interval": f.growth_interval,
            "growth_factor": f.growth_factor, "backoff_factor": f.backoff_factor,
            "skipped_steps": f.skipped_steps, "defaults_skipped_steps": f.defaults_skipped_steps,
            "mean_flushed_fraction": f.mean_flushed_fraction,
            "defaults_mean_flushed_fraction": f.defaults_mean_flushed_fraction, "steps": f.steps, "within_range": match.within_range, "agreeing": match.agreeing,
            "families": len(FAMILIES)}


# The full study's findings: summarise(docs/data/interval-study.json), checked by tests/test_interval_study.py.
FAMILIES: tuple[StudyFamily, ...] = (
    StudyFamily('gpt2', 5000, 0.228, 2000, 2.0, 0.5, 9, 9,
                6.581652654066164e-05, 6.581652654066164e-05),
    StudyFamily('bert', 5000, 0.299, 2000, 2.0, 0.5, 11, 11,
                0.007737762707278332, 0.007737762707278332),
    StudyFamily('t5', 5000, -0.137, 2000, 2.0, 0.5, 10, 10,
                0.0012729929696918285, 0.0012729929696918285),
    StudyFamily('resnet', 5000, -1.637, 1000, 2.0, 0.5, 7, 7,
                4.458463146620785e-07, 1.4474490723846227e-06),
    StudyFamily('vit', 5000, -1.726, 400, 2.0, 0.5, 10, 10,
                5.2256820418530064e-05, 0.0004157381159628821),
    StudyFamily('lstm', 5000, -0.02, 2000, 2.0, 0.5, 8, 8,
                0.009089369788624083, 0.009089369788624083),
)
