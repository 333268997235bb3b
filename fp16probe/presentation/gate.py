"""The CI gate's words: each check's message, each warning, and the JSON ``fp16probe compare --json`` prints.

:mod:`fp16probe.analysis.gate` returns checks and warnings as data (a check's two values, its
limit and ``facts``; a warning's code and data); this module words them once, for every
medium (the terminal table, the Markdown summary, JUnit, GitHub annotations, the JSON).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from fp16probe import formatting as num
from fp16probe.analysis.gate import Check, GateResult, GateWarning, Snapshot
from fp16probe.analysis.trial import AGREES_ALARM, AGREES_FINE, ALARM_NOT_FELT, HURT_UNSEEN

__all__ = ["check_message", "result_dict", "snapshot_dict", "warning_text", "warning_texts"]

EDITED = "; the report says it held, but its own numbers say it did not (edited?)"


def _points(rise: float) -> str:
    value = f"{rise * 100:.3g}"
    return f"{'+' if rise >= 0 else ''}{value} point{'' if value in ('1', '-1') else 's'}"


def _magnitude(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.3g}"


def _scale(k: int | None) -> str:
    return "no scale" if k is None else f"S = 2^{k}"


def _short(v: Any) -> str:
    text = "none" if v is None else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:4])
    return shown + (f", and {len(names) - 4} more" if len(names) > 4 else "")


def _rise(c: Check, what: str) -> str:
    return (f"{what} went from {num.percent(c.baseline)} to {num.percent(c.current)} "
            f"({_points(c.current - c.baseline)}; allowed +{c.limit * 100:.3g})")


def _verdict(c: Check) -> str:
    sb, sc = c.facts["severity"]
    how = "worse" if sc > sb else "better" if sc < sb else "as severe"
    return (f"verdict {c.baseline} -> {c.current} ({how}; severity {sb} -> {sc}"
            f"{'' if c.facts['judged'] else ', not judged'})")


def _new_overflow(c: Check) -> str:
    (mb, mc), (nb, nc) = c.facts["max_abs"], c.facts["nonfinite"]
    return (f"at the baseline's {_scale(c.facts['log2_scale'])}: overflow {'yes' if c.baseline else 'no'} before, "
            f"{'yes' if c.current else 'no'} now (max |g| {_magnitude(mb)} -> {_magnitude(mc)}, "
            f"non-finite {nb} -> {nc})")


def _scale_shift(c: Check) -> str:
    kb, kc = c.baseline, c.current
    if kb is None and kc is None:
        return "no scale recommended in either run"
    if kb is None or kc is None:
        vb, vc = c.facts["verdicts"]
        return f"recommended scale changed from {_scale(kb)} to {_scale(kc)} (verdict {vb} -> {vc})"
    return f"recommended scale moved from 2^{kb} to 2^{kc} ({kc - kb:+d} bits; allowed ±{c.limit})"


def _module_regressions(c: Check) -> str:
    k, over, largest = c.facts["log2_scale"], c.facts["over"], c.facts["largest"]
    if over:
        named = ", ".join(f"{name} {num.percent(before)} -> {num.percent(after)}" for name, (before, after) in c.current.items())
        more = f" and {over - len(c.current)} more" if over > len(c.current) else ""
        return (f"{over} module(s) lose more at the baseline's {_scale(k)}: {named}{more} "
                f"(allowed {_points(c.limit)} each)")
    if largest is not None:
        return (f"no module's own flushed share at {_scale(k)} rose more than the allowed {_points(c.limit)} "
                f"(largest change: {largest[0]} {_points(largest[1])}; {c.baseline} modules matched)")
    return "no module is in both reports; nothing to match (see the warnings)"


def _verified(c: Check) -> str:
    summary = c.facts["summary"] + (EDITED if c.facts["edited"] else "")
    return f"the current report's measured verification {'held' if c.current else 'did not hold'}: {summary}"


def _trialled(c: Check) -> str:
    said = {AGREES_FINE: "stayed inside fp32's seed band, as the verdict says",
            AGREES_ALARM: "left fp32's seed band, as the verdict's alarm says",
            ALARM_NOT_FELT: "stayed inside fp32's seed band although the verdict raised an alarm",
            HURT_UNSEEN: "left fp32's seed band although the verdict called the settings fine"}
    before = "" if c.baseline is None else f" (baseline: {said.get(str(c.baseline), 'unknown')})"
    return f"the current report's training trial {said.get(str(c.current), 'unknown')}{before}"


_MESSAGES: dict[str, Callable[[Check], str]] = {
    "flushed_at_baseline_scale": lambda c: _rise(c, f"flushed at the baseline's recommended {_scale(c.facts['log2_scale'])}"),
    "flushed_at_recommended_scale": lambda c: _rise(
        c, "flushed at each run's own recommendation ({} -> {})".format(*map(_scale, c.facts["log2_scales"]))),
    "flushed_fraction": lambda c: _rise(c, "flushed at S = 1"),
    "verdict": _verdict,
    "new_overflow": _new_overflow,
    "scale_shift": _scale_shift,
    "module_regressions": _module_regressions,
    "verification": _verified,
    "trial": _trialled,
}


def check_message(check: Check) -> str:
    """Return the check's message: what was compared, both values and the limit, in one line."""
    return _MESSAGES[check.name](check)


_WORKLOAD_LABELS = {"model_class": "model", "precision": "precision", "captured": "captured kinds",
                    "inputs": "inputs", "loss": "loss", "loss_scale": "loss scale", "format": "target format"}


def _partial(d: Mapping[str, Any]) -> str:
    of = f" of {d['requested']}" if d.get("requested") else ""
    why = f" ({d['stopped']})" if d.get("stopped") else ""
    return (f"the {d['label']} report is partial: the run stopped early{why} after {d['steps']}{of} "
            "step(s), so its numbers cover only those steps")


def _modules(d: Mapping[str, Any]) -> str:
    only_b, only_c = list(d["only_baseline"]), list(d["only_current"])
    return (f"{len(only_b)} module(s) only in the baseline ({_names(only_b)}) and {len(only_c)} only in the current "
            f"report ({_names(only_c)}); only the {d['both']} in both are compared module by module")


def _stored(d: Mapping[str, Any]) -> str:
    (sv, sk), (av, ak) = d["stored"], d["analysed"]
    return (f"the {d['label']} report's stored recommendation ({sv}, {_scale(sk)}) differs from its "
            f"re-analysis ({av}, {_scale(ak)}); the gate judges the re-analysis")


_WARNINGS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "partial": _partial,
    "workload": lambda d: (f"the reports profiled different {_WORKLOAD_LABELS[d['label']]}: {_short(d['baseline'])} "
                           f"(baseline) vs {_short(d['current'])} (current)"),
    "modules": _modules,
    "stored_recommendation": _stored,
}


def warning_text(warning: GateWarning) -> str:
    """Return one warning about what the two reports profiled, in one line."""
    return _WARNINGS[warning.code](warning.data)


def warning_texts(result: GateResult) -> tuple[str, ...]:
    """Return every warning of ``result``, worded, in order."""
    return tuple(warning_text(w) for w in result.warnings)


def check_dict(check: Check) -> dict[str, Any]:
    """Return one check as JSON-ready data, with its message."""
    return {"name": check.name, "passed": check.passed, "baseline": check.baseline, "current": check.current,
            "limit": check.limit, "message": check_message(check), "seconds": check.seconds}


def snapshot_dict(snap: Snapshot) -> dict[str, Any]:
    """Return a snapshot as JSON-ready data, an edited verification's summary saying so."""
    d = snap.to_dict()
    if d["verification"] is not None and snap.verification_edited:
        d["verification"]["summary"] += EDITED
    return d


def result_dict(result: GateResult) -> dict[str, Any]:
    """Return the gate's result as the JSON ``fp16probe compare --json`` prints."""
    return {
        "passed": result.passed,
        "checks": [check_dict(c) for c in result.checks],
        "warnings": list(warning_texts(result)),
        "baseline": snapshot_dict(result.baseline),
        "current": snapshot_dict(result.current),
        "thresholds": result.thresholds.to_dict(),
    }
