"""The words of a loss-scale verdict: the reasoning every medium shows, rendered from the data.

:func:`verdict_text` turns a :class:`~fp16probe.recommendation.Recommendation` (its verdict,
numbers, evidence and thresholds, all decided in ``analysis/``) into the paragraph that
``Recommendation.text``, ``--explain``, the JSON output and the trackers show. An older
report file's stored text is shown as it was stored (``Recommendation.stored_text``).
The sentences about where the rules come from keep the division of labour :mod:`fp16probe.sources`
states (``tests/fixtures/wording.py`` checks them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from fp16probe.analysis.interval_study import NEVER_GROWS
from fp16probe.analysis.replay import GRADSCALER_DEFAULT_ROW, RESAMPLED_STEPS, GrowthIntervalTable
from fp16probe.formats import Format, get_format
from fp16probe.formatting import KIND_WORDS, bits, count, fp16_run, magnitude, percent, power_of_two, scales_in_force
from fp16probe.presentation import escape
from fp16probe.presentation.cite import PAPER, cite
from fp16probe.recommendation import GRADSCALER_DEFAULTS, Recommendation, Verdict
from fp16probe.sources import INTERVAL_STUDY, NVIDIA_GUIDE_URL

__all__ = [
    "BF16_NO_SCALER",
    "CEILING_SOURCE_WORDS",
    "CONSTANT_RULE",
    "DEFAULTS_STANDING",
    "UNDERFLOW_MECHANISM",
    "insufficient_why",
    "method_words",
    "replay_table",
    "row_note_words",
    "study_words",
    "verdict_text",
]

# The growth-interval table's codes (analysis.replay), in words; an older file's stored sentence is shown as it was.
SIMULATION_CAVEAT = (
    "The long-horizon replay resamples the profiled steps (uniformly, with replacement, "
    "seeded), so it assumes future steps look like the profiled ones: a profile taken at "
    "nearly fixed weights cannot see the drift in gradient magnitudes that training brings."
)
ROW_NOTES = {
    GRADSCALER_DEFAULT_ROW: (
        f"GradScaler's default growth_interval, from NVIDIA's guide ({NVIDIA_GUIDE_URL}): one validated "
        "example among many valid settings, not a measured optimum"),
}


def method_words(method: str) -> str:
    """How the replay drew its steps (``GrowthIntervalTable.method``), in words."""
    return SIMULATION_CAVEAT if method == RESAMPLED_STEPS else escape.text(method)


def row_note_words(note: str) -> str:
    """A growth-interval row's note (``GrowthIntervalRow.note``) in words; empty for none."""
    return ROW_NOTES.get(note) or escape.text(note)


def replay_table(replay: Mapping[str, Any]) -> tuple[str, list[str], list[list[str]], list[str]]:
    """A stored growth-interval table (``Recommendation.growth_interval_table``) for a medium to lay out.

    Returns the title, the column heads, the rows of cells and the notes under the table: a
    row with a note is marked after its growth_interval (``(default)`` for GradScaler's, else
    ``(note n)``) and the note is written once below.
    """
    notes: list[str] = []
    rows = []
    for r in replay.get("rows", []):
        mark = ""
        if r.get("note"):
            words = row_note_words(str(r["note"]))
            mark = " (default)" if r["note"] == GRADSCALER_DEFAULT_ROW else f" (note {len(notes) + 1})"
            notes.append(f"{mark.strip()}: {words}")
        rows.append([count(r["growth_interval"]) + mark, count(r["skipped_steps"]),
                     percent(r.get("mean_flushed_fraction")), magnitude(r.get("final_scale") or 0.0)])
    title = f"growth_interval replay over {count(replay.get('horizon', 0))} simulated steps"
    return title, ["growth_interval", "skipped steps", "mean flushed", "final scale"], rows, notes


UNDERFLOW_MECHANISM = (
    "Gradient values below half the format's smallest subnormal round to zero when cast, "
    "and that update information is lost; multiplying the loss by S shifts every gradient "
    f"by log2(S) bits before the cast ({PAPER})."
)
CONSTANT_RULE = (
    f"The constant-S rule is from {PAPER}: choose S so that S times the "
    "largest gradient magnitude seen stays below the format's max; here made exact as the "
    "largest power of two that does so, less a safety margin."
)
DEFAULTS_STANDING = (
    "The growth/backoff factors x2 and x0.5 and a growth interval of 2000 come from NVIDIA's "
    f"mixed-precision guide ({NVIDIA_GUIDE_URL}), which reports them as one setting it trained "
    "with successfully and says many other settings are valid; GradScaler ships them as "
    "defaults. They are a widely-run, once-validated default, not a measured optimum."
)
BF16_NO_SCALER = (
    "bf16 has fp32's exponent range (smallest subnormal 2^-133, max about 3.4e38), so "
    "gradients that fp32 holds do not flush or overflow in bf16; a loss scaler there only "
    "adds a skipped-step mechanism for a failure that cannot occur."
)
# evidence["ceiling_source"] codes; an older report's stored words pass through as they are.
CEILING_SOURCE_WORDS = {
    "measured": "measured over every gradient in backward",
    "hooked": "seen in the hooked modules and parameters only",
}
_BACKOFF = ("If a later step overflows anyway, the scaler skips that one step and halves S, so training "
            "cannot stall at a scale that overflows; do not hold S fixed by skipping steps without backing off.")


def verdict_text(rec: Recommendation, fmt: Format | None = None) -> str:
    """Return the verdict's reasoning in words: the stored text of an older report, else rendered from the data.

    ``fmt``: ``rec.format`` as its caller resolved it (looked up here when not given).
    """
    if rec.stored_text:
        return rec.stored_text
    ev: Mapping[str, Any] = rec.evidence
    if ev.get("insufficient_reason") == "scale_not_carried":
        return _scale_not_carried(rec, ev.get("scale_check") or {})
    fmt = fmt if fmt is not None and fmt.name == rec.format else get_format(rec.format)
    text = _RENDER.get(rec.verdict, _insufficient)(rec, fmt)
    if "shadow_steps" in ev and "reference" in ev:
        text = f"{_shadow_words(ev)} {text}"
    return text


# -- the parts every verdict shares ------------------------------------------------------------

def _what(kind: str) -> str:
    return KIND_WORDS.get(kind, "gradient values") if kind != "all" else "gradient values"


def _overflow_words(fmt: Format) -> str:
    if fmt.has_inf:
        return "overflow to inf"
    return "land beyond the max finite value (saturated or NaN, depending on the cast)"


def _by_kind_words(ev: Mapping[str, Any], k: int, lead: str = " (", close: str = ")") -> str:
    """Return the flushed share per gradient kind at S = 2^k, wrapped in lead/close ("" for one kind)."""
    by_kind = ev.get("by_kind", {})
    if len(by_kind) < 2:
        return "" if close == ")" else close
    key = "flushed_fraction_at_1" if k == 0 else "flushed_fraction_at_scale"
    parts = [f"{KIND_WORDS.get(name, name)} {percent(d[key])}" for name, d in by_kind.items()]
    return lead + ", ".join(parts) + close


def _bf16_surprise(fmt: Format) -> str:
    if fmt.name != "bf16":
        return ""
    return (" Unexpected for bf16, which has fp32's exponent range: values this small are near "
            "fp32's own limits, so look for a bug or a loss that is far too small.")


def _kwargs_words(kwargs: Mapping[str, Any]) -> str:
    k = int(math.log2(kwargs["init_scale"]))
    return (f"GradScaler(init_scale=2.0**{k}, growth_factor={kwargs['growth_factor']}, "
            f"backoff_factor={kwargs['backoff_factor']}, growth_interval={kwargs['growth_interval']})")


def _limit_words(ev: Mapping[str, Any], margin: int) -> str:
    source = str(ev.get("ceiling_source", ""))
    return (f"The largest gradient the loss scale multiplies ({magnitude(ev['max_abs'])}, "
            f"{CEILING_SOURCE_WORDS.get(source, source)}) allows up to S = "
            f"{power_of_two(ev['largest_safe_log2_scale'])}; S keeps {margin} bit(s) of headroom below that.")


def _interval_words(gi: int) -> str:
    return "never growing the scale" if gi >= NEVER_GROWS else f"growth_interval={gi}"


def study_words(ev: Mapping[str, Any]) -> str:
    """What the growth-interval study measured for the family nearest this run's drift (empty without one)."""
    try:
        study = ev.get("interval_study")
        return _study_sentence(study) if isinstance(study, Mapping) else ""
    except (KeyError, TypeError, ValueError):  # a stored report's evidence without the study's numbers
        return ""


def _study_sentence(st: Mapping[str, Any]) -> str:
    n = int(st["families"])
    within = ("" if st["within_range"] else
              " This run's drift lies outside the range the study's families covered, so the study does not "
              "speak for it.")
    head = (f" The growth-interval study ({cite(INTERVAL_STUDY)}) replayed the interval grid on {n} small model "
            f"families trained for real in fp16 on a CPU: this run's gradient scale drifts "
            f"{float(st['drift_log2_per_1000']):+.2f} bits per 1000 steps, nearest the "
            f"{escape.text(str(st['family']))} family's {float(st['family_drift_log2_per_1000']):+.2f}, where ")
    same = f"{int(st['agreeing'])} of {n} families"
    gi, skipped, d_skipped = int(st["growth_interval"]), int(st["skipped_steps"]), int(st["defaults_skipped_steps"])
    steps = count(st["steps"])
    if gi == int(GRADSCALER_DEFAULTS["growth_interval"]):
        return (head + "no growth interval did better than GradScaler's defaults: none skipped fewer steps at no "
                f"more flushed share and gradient error ({count(d_skipped)} skipped in {steps} steps; {same} found "
                f"the same), and the shorter ones skipped more, regrowing the scale into overflows.{within}")
    flushed = (f" and flushed {percent(st['mean_flushed_fraction'])} of gradient values against "
               f"{percent(st['defaults_mean_flushed_fraction'])}")
    if skipped == d_skipped:
        return (head + f"{_interval_words(gi)} skipped as few steps as GradScaler's defaults ({count(skipped)} in "
                f"{steps} steps){flushed}, at no more gradient error ({same} chose that interval).{within}")
    return (head + f"{_interval_words(gi)} (growth factor {float(st['growth_factor']):g}, backoff factor "
            f"{float(st['backoff_factor']):g}) skipped the fewest steps at no more flushed share and gradient error "
            f"than GradScaler's defaults: {count(skipped)} against {count(d_skipped)} in {steps} steps{flushed} "
            f"({same} chose that interval).{within}")


def _study_speaks(ev: Mapping[str, Any]) -> bool:
    study = ev.get("interval_study")
    return isinstance(study, Mapping) and bool(study.get("within_range"))


def _schedule_words(kwargs: Mapping[str, Any], ev: Mapping[str, Any], table: GrowthIntervalTable | None) -> str:
    if table is None:
        return (f" growth_interval={kwargs['growth_interval']} is GradScaler's default, not chosen from "
                "data: this report has no per-step trace to replay.")
    c = table.chosen
    if ev.get("simulated_candidates_tied"):
        return (f" The replay cannot tell the growth_interval candidates {[r.growth_interval for r in table.rows]} "
                f"apart on underflow: over {table.horizon} simulated steps they left "
                f"{percent(min(r.mean_flushed_fraction or 0.0 for r in table.rows))} to "
                f"{percent(max(r.mean_flushed_fraction or 0.0 for r in table.rows))} of values flushed, and the only skipped steps are growth "
                f"probes that overflow ({c.skipped_steps} at growth_interval={c.growth_interval}, the longest "
                "candidate, which probes least often). So the profile says: hold S; the profiled steps do not "
                "drift enough to choose a schedule (profile more steps of real training to see drift), "
                + ("and growth_interval is not a measured optimum." if not _study_speaks(ev) else
                   f"so the growth_interval to paste is {kwargs['growth_interval']}, the one the study below measured "
                   "for the family whose drift is nearest this run's." if ev.get("growth_interval_from_study") else
                   "and the study below measured what the interval costs on runs that do.")
                + f"{study_words(ev)} {method_words(table.method)}")
    return (f" growth_interval={c.growth_interval} was chosen by replaying the candidates "
            f"{[r.growth_interval for r in table.rows]} over {table.horizon} simulated steps: it skipped "
            f"{c.skipped_steps} step(s) ({percent(c.skipped_fraction)}) and left {percent(c.mean_flushed_fraction)} "
            f"of values flushed, the fewest skipped steps among candidates within the threshold (or the "
            f"least underflow when none is).{study_words(ev)} {method_words(table.method)}")


# -- one function per verdict ------------------------------------------------------------------

_REASONS: dict[str, Callable[[Recommendation, Mapping[str, Any]], tuple[str, str]]] = {}


def _reason(code: str) -> Callable[[Callable[[Recommendation, Mapping[str, Any]], tuple[str, str]]],
                                   Callable[[Recommendation, Mapping[str, Any]], tuple[str, str]]]:
    def register(fn: Callable[[Recommendation, Mapping[str, Any]], tuple[str, str]]) -> Any:
        _REASONS[code] = fn
        return fn
    return register


@_reason("nothing_captured")
def _nothing_captured(rec: Recommendation, d: Mapping[str, Any]) -> tuple[str, str]:
    return (f"the report holds no {_what(rec.kind)} (captured: {', '.join(d.get('captured') or []) or 'nothing'})",
            "Profile with the Probe capturing activation and weight gradients over at least one backward pass.")


@_reason("autocast_zeros")
def _autocast_zeros(rec: Recommendation, d: Mapping[str, Any]) -> tuple[str, str]:
    why = (f"this profile was computed in {d.get('precision', 'fp16')} at {scales_in_force(d.get('scales') or [])}, "
           "where gradients that flushed became exact zeros")
    todo = (f"{percent(d.get('zero_fraction'))} of the judged values are zeros (threshold "
            f"{percent(rec.thresholds.get('max_flushed_fraction'))}), and a flushed value cannot be told from a "
            "true zero. Profile in fp32 (the default precision) to measure what flushes.")
    return why, todo + _pending_words(d.get("shadow_pending"))


@_reason("all_zero")
def _all_zero(rec: Recommendation, d: Mapping[str, Any]) -> tuple[str, str]:
    return (f"all {count(d.get('values', 0))} captured {_what(rec.kind)} are exactly zero: a zero-initialised output "
            "layer, a loss that does not depend on the parameters, or a graph cut by detach() gives this",
            "Train a step or a few first (or load trained weights), use the real loss, and profile again.")


@_reason("all_nonfinite")
def _all_nonfinite(rec: Recommendation, d: Mapping[str, Any]) -> tuple[str, str]:
    if d.get("overflowed_at_scale"):
        return (f"the captured {_what(rec.kind)} are all zero, inf or NaN at {scales_in_force(d.get('scales') or [])}: "
                "the run overflowed before anything could be measured",
                "Profile in fp32 (the default precision), or at a lower loss scale.")
    return (f"the captured {_what(rec.kind)} are all zero, inf or NaN ({count(d.get('nonfinite_values', 0))} inf/NaN "
            "values): the run diverged before any cast",
            "Loss scaling cannot fix that: find the divergence (learning rate, loss, inputs) and profile again.")


def _pending_words(pending: Mapping[str, Any] | None) -> str:
    """Why a live fp16/bf16 report has no fp32 shadow yet, and when one comes ("" when not applicable)."""
    if not pending:
        return ""
    if pending.get("off"):
        return f" No fp32 shadow rerun could run: {pending['off']}."
    if pending.get("discarded"):
        d = pending["first"]
        return (f" {pending['discarded']} shadow rerun(s) were discarded, none judged: they did not run in fp32 (at "
                f"step {d['step']}, {d['module']} returned {d['dtype']} with every autocast disabled; something in the "
                "forward casts to low precision itself), so there is no fp32 reference for this run; profile it in "
                "fp32 with fp16probe.profile.")
    nxt = pending.get("next_step")
    when = f"the first comes at step {nxt}" if nxt is not None else "none is scheduled"
    return (f" No fp32 shadow rerun has run yet ({when}, shadow_every={pending.get('every')}); the report after "
            "it carries a verdict.")


def insufficient_why(rec: Recommendation) -> str:
    """Why there is no verdict, in one clause (the short answer's line); "" for another verdict."""
    ev = rec.evidence
    code = str(ev.get("insufficient_reason", ""))
    if code == "scale_not_carried":
        return "the gradients do not carry the loss scale the scaler reports"
    if code in _REASONS and "insufficient_data" in ev:
        return _REASONS[code](rec, ev["insufficient_data"])[0]
    return _OLDER_REASONS.get(code, code.replace("_", " "))


# An older report stored its reason's words only inside its text: the short line says the reason itself.
_OLDER_REASONS = {
    "nothing_captured": "the report holds no gradient values",
    "autocast_zeros": "gradients that flushed in the low-precision run became exact zeros",
    "all_zero": "every captured gradient value is exactly zero",
    "all_nonfinite": "the captured gradient values are all zero, inf or NaN",
}


def _insufficient(rec: Recommendation, fmt: Format) -> str:
    ev = rec.evidence
    code = str(ev.get("insufficient_reason", ""))
    if code not in _REASONS:
        return f"No verdict for {rec.format}: {code.replace('_', ' ') or 'the evidence cannot carry one'}."
    why, todo = _REASONS[code](rec, ev.get("insufficient_data") or {})
    text = f"No verdict for {rec.format}: {why}{';' if code == 'autocast_zeros' else '.'} {todo}"
    return text + (" " + UNDERFLOW_MECHANISM if code == "autocast_zeros" else "")


def _scale_not_carried(rec: Recommendation, check: Mapping[str, Any]) -> str:
    ratio = check.get("log2_ratio", 0.0)
    claimed = ", ".join(f"2^{math.log2(c):g}" if c > 0 else "0" for c in check.get("claimed_scales", []))
    return (f"No verdict for {rec.format}: the gradients do not carry the loss scale the scaler reports. On "
            f"{len(check.get('steps', []))} rerun step(s), the live gradients divided by the reported scale ({claimed}) "
            f"are 2^{ratio:.1f} times the fp32 rerun's (median over {check.get('tensors')} tensors): the backward "
            f"applied about 2^{ratio:.1f} times the reported scale. Every live figure here is off by that factor; "
            "check how the loss is scaled (the scaler's scale() must be what backward runs on) before trusting any "
            "loss-scale advice.")


def _shadow_words(ev: Mapping[str, Any]) -> str:
    steps = list(ev.get("shadow_steps") or [])
    shown = ", ".join(str(s) for s in steps[:8])
    where = f"step {shown}" if len(steps) == 1 else f"steps {shown}{', ...' if len(steps) > 8 else ''}"
    words = (f"Judged on {len(steps)} fp32 rerun(s) of this run's own steps ({where}): the same batch, weights and "
             f"random state in fp32, the reference for the live {ev.get('live_precision', 'fp16')} run.")
    if "live_zero_values" in ev:
        words += (f" Of the live run's {count(ev['live_zero_values'])} zero gradient values on those steps, "
                  f"{count(ev['structural_zero_values'])} are zero in fp32 too (structural) and "
                  f"{count(ev['flushed_in_live_run'])} flushed at the scale in force "
                  f"({percent(ev['flushed_fraction_in_live_run'])} of the nonzero values).")
    return words


def _none_needed(rec: Recommendation, fmt: Format) -> str:
    ev = rec.evidence
    tau = rec.thresholds.get("max_flushed_fraction")
    k_max = ev.get("largest_safe_log2_scale")
    parts = [f"No loss scaling needed for {fmt.name}: at S = 1, {percent(ev['flushed_fraction_at_1'])} of the "
             f"nonzero gradient values flush to zero (threshold {percent(tau)}{_by_kind_words(ev, 0, '; ', ')')}"]
    if k_max is None:
        parts[0] += " and there are no nonzero gradient values to overflow."
    else:
        parts[0] += (f" and the largest gradient ({magnitude(ev['max_abs'])}) sits {k_max} bit(s) below where "
                     f"values would {_overflow_words(fmt)}.")
    if fmt.name == "bf16":
        parts.append(BF16_NO_SCALER + " This was measured on the profile, not assumed.")
    parts.append(UNDERFLOW_MECHANISM)
    return " ".join(parts)


def _scaled(rec: Recommendation, fmt: Format) -> str:
    """constant, dynamic or no_single_scale: the verdict's words, then why S is capped where it is."""
    ev = rec.evidence
    margin, tau = int(rec.thresholds.get("margin_bits", 1)), float(rec.thresholds.get("max_flushed_fraction", 1e-3))
    table = None if rec.growth_interval_table is None else GrowthIntervalTable.from_dict(rec.growth_interval_table)
    before = ev.get("before_loss_cap")
    k = int(ev["log2_scale_without_loss_cap"]) if before else rec.log2_scale
    assert k is not None
    at_k = {**ev, **before} if before else ev  # the figures at the scale the data gives, before the loss's cap
    text = _SCALED[rec.verdict](fmt, k, margin, at_k, rec.grad_scaler_kwargs, table, tau)
    if "fp32_capped_from_log2_scale" in ev:
        text += (f" S is capped at 2^{k}, below the largest safe scale for {fmt.name} "
                 f"(2^{ev['fp32_capped_from_log2_scale']} with the margin), so that GradScaler accepts it (its scale "
                 "is an fp32 number) and the scaled loss and gradients stay finite in fp32.")
    if before:
        cap = rec.log2_scale
        text += (f" The loss is computed in fp16 in the target run, so its seed gradient S must stay below "
                 f"65520: S is capped at 2^{cap} (it would be 2^{k} with the loss in fp32: compute it as "
                 f"loss_fn(output.float(), target)); at 2^{cap}, {percent(ev['flushed_fraction_at_scale'])} of the "
                 "nonzero gradient values flush.")
    return text


def _constant(fmt: Format, k: int, margin: int, ev: Mapping[str, Any], kwargs: Mapping[str, Any],
              table: GrowthIntervalTable | None, tau: float) -> str:
    return (
        f"Use a loss scale of S = 2^{k} for {fmt.name}, applied through a scaler that backs off: "
        f"{_kwargs_words(kwargs)}. At S = 1, {percent(ev['flushed_fraction_at_1'])} of the nonzero gradient "
        f"values flush to zero{_by_kind_words(ev, 0)}; at S = 2^{k}, {percent(ev['flushed_fraction_at_scale'])} "
        f"do (threshold {percent(tau)}{_by_kind_words(ev, k, '; ', ')')} and {ev['overflow_steps_at_scale']} of "
        f"{ev['profiled_steps']} profiled steps {_overflow_words(fmt)}. {_limit_words(ev, margin)} "
        f"{_BACKOFF} GradScaler starts at S and probes upward only every growth_interval steps."
        f"{_schedule_words(kwargs, ev, table)} {CONSTANT_RULE} {UNDERFLOW_MECHANISM}{_bf16_surprise(fmt)} "
        f"{DEFAULTS_STANDING}"
    )


def _dynamic(fmt: Format, k: int, margin: int, ev: Mapping[str, Any], kwargs: Mapping[str, Any],
             table: GrowthIntervalTable | None, tau: float) -> str:
    caveat = ""
    if ev.get("simulated_meets_threshold") is False:
        caveat = (f" In the replay no candidate schedule got the flushed share down to {percent(tau)}: "
                  "with the profiled steps in random order, a scale that follows the range only "
                  "catches slow drift, not jumps from one step to the next; if your range jumps "
                  "like this, per-tensor scaling or bf16 is the sturdier fix.")
    return (
        f"Use a dynamic loss-scale schedule for {fmt.name}: {_kwargs_words(kwargs)}. The largest "
        f"gradient moves over the profile by {bits(ev.get('per_step_max_range_bits', 0.0))} bits from step to "
        f"step, more than one constant scale absorbs: the constant S = 2^{k} that no profiled step "
        f"overflows at (with {margin} bit(s) of margin) leaves {percent(ev['flushed_fraction_at_scale'])} of "
        f"the nonzero values flushed (threshold {percent(tau)}{_by_kind_words(ev, k, '; ', ')')}, while a scale fitted to "
        f"each step leaves {percent(ev['per_step_scale_flushed_fraction'])}. At S = 1, "
        f"{percent(ev['flushed_fraction_at_1'])} flush. init_scale = 2^{k} comes from the data: the largest power "
        f"of two, less the margin, at which no profiled step overflows, so the schedule starts without skipped "
        f"steps. {_BACKOFF}{_schedule_words(kwargs, ev, table)}{caveat} "
        f"{CONSTANT_RULE} {UNDERFLOW_MECHANISM}{_bf16_surprise(fmt)} {DEFAULTS_STANDING}"
    )


def _no_single_scale(fmt: Format, k: int, margin: int, ev: Mapping[str, Any], kwargs: Mapping[str, Any],
                     table: GrowthIntervalTable | None, tau: float) -> str:
    limiting = ", ".join(f"{n} (max 2^{lg:.1f})" for n, lg, _ in ev.get("limiting_modules", [])) or "none"
    flushing = ", ".join(f"{n} ({percent(f)})" for n, f in ev.get("flushing_modules_at_scale", [])) or "none"
    needed = ev.get("needed_span_bits")
    needed_words = "" if needed is None else f" The values that matter span {bits(needed)} bits;"
    return (
        f"No single loss scale fits {fmt.name}. What to do: train in bf16 (fp32's exponent range); keep the "
        f"layers that flush the most in fp32; or scale per layer or per tensor, as FP8 recipes do."
        f"{needed_words} {fmt.name} holds about "
        f"{bits(ev['format_span_bits'])} bits between its flush threshold and its max (less {margin} bit(s) of "
        f"margin). The best constant, S = 2^{k}, still leaves {percent(ev['flushed_fraction_at_scale'])} of the "
        f"nonzero values flushed (threshold {percent(tau)}{_by_kind_words(ev, k, '; ', ')')}, and even a scale fitted to "
        f"each profiled step leaves {percent(ev['per_step_scale_flushed_fraction'])}. The ceiling on S is set by: "
        f"{limiting}. The most values flush in: {flushing}. If you keep one "
        f"scale, the least bad is {_kwargs_words(kwargs)}. {_BACKOFF}{_schedule_words(kwargs, ev, table)} "
        f"{CONSTANT_RULE} {UNDERFLOW_MECHANISM} {DEFAULTS_STANDING}"
    )


_SCALED = {Verdict.CONSTANT: _constant, Verdict.DYNAMIC: _dynamic, Verdict.NO_SINGLE_SCALE: _no_single_scale}


def _per_tensor(rec: Recommendation, fmt: Format) -> str:
    ev, th = rec.evidence, rec.thresholds
    margin, k = int(th.get("margin_bits", 1)), rec.log2_scale
    max_words = magnitude(fmt.max)
    why = (f"its casts saturate (a value past {max_words}, inf included, becomes {max_words} or NaN depending on "
           "the cast), so a GradScaler never sees an overflow there and cannot back off"
           if not fmt.has_inf else
           f"its {bits(math.log2(fmt.overflow_threshold) - fmt.log2_flush_threshold)} bits of range are too few for "
           "one scale over every tensor, and FP8 recipes (Transformer Engine, torchao) scale each tensor from its "
           "own amax instead of scaling the loss")
    return (
        f"Use per-tensor scaling for {fmt.name}, not a loss scaler: {why}. Scale each tensor from its measured "
        f"maximum, "
        f"scale = {max_words} / amax / 2^{margin} (a margin of {margin} bit(s)), as NVIDIA Transformer Engine's "
        f"DelayedScaling recipe does. With one such scale per captured tensor, from its largest |g| over the "
        f"{ev['profiled_steps']} profiled step(s), {percent(ev['per_tensor_flushed_fraction'])} of the nonzero "
        f"gradient values flush to zero and {percent(ev['saturated_fraction_at_scale'])} saturate (threshold "
        f"{percent(th.get('max_flushed_fraction'))}); the per-tensor scales are in the evidence. One scale for every "
        f"gradient, S = 2^{k} from the largest gradient ({magnitude(ev['max_abs'])}), would leave "
        f"{percent(ev['flushed_fraction_at_scale'])} flushed; at S = 1, {percent(ev['flushed_fraction_at_1'])} "
        f"flush. A later step whose amax exceeds the profiled one saturates: take amax from a rolling history "
        f"of recent steps, as the recipe does. {UNDERFLOW_MECHANISM}"
    )


def _forward(rec: Recommendation, fmt: Format) -> str:
    ev, tau = rec.evidence, rec.thresholds.get("max_flushed_fraction")
    overflow = rec.verdict is Verdict.FORWARD_OVERFLOW
    where = fp16_run(str(ev.get("regime", "autocast")), str(ev.get("target", "cuda")))
    inner, inner_k = ev.get("backward_verdict"), ev.get("backward_log2_scale")
    after = (f"Once the forward is fixed, the gradients alone give: {inner}"
             + (f" at S = 2^{inner_k}" if inner_k not in (None, 0) else "") + ".")
    modules = [str(m) for m in ev.get("fix_modules") or []]
    # The fix's code lists every name; a few are named here, more are counted (not listed twice).
    named = ", ".join(modules) if len(modules) <= 3 else f"the {len(modules)} modules the fix names (evidence fix_modules)"
    keep = (f"Keep {named} in fp32 (fp16probe.keep_in_fp32: autocast off inside, fp32 inputs; for a Hugging Face "
            "model loaded in fp16, list the same module names in _keep_in_fp32_modules), or train in bf16, which "
            "has fp32's exponent range."
            if modules else "The op runs in the model's top-level forward: compute it in fp32 there "
            "(torch.autocast(device_type, enabled=False) around it, with .float() inputs), or train in bf16.")
    top = list(ev.get("fix_top_level") or [])
    if modules and top:
        keep += (f" {', '.join(top[:3])} run{'s' if len(top) == 1 else ''} in the model's own forward, outside any "
                 "submodule: compute that in fp32 there too (torch.autocast(device_type, enabled=False), .float() "
                 "inputs).")
    if overflow:
        rows = ev.get("forward_overflow") or [{}]
        first, n = rows[0], ev.get("forward_overflow_count", len(rows))
        m = first.get("max_abs")
        size = ("held inf/NaN" if m is None or math.isinf(m)
                else f"reached {magnitude(m)}, {bits(-(first.get('headroom_bits') or 0.0))} bits past fp16's max "
                     "(65504)")
        text = (f"The forward pass overflows fp16 under {where}: {first.get('name')} ({first.get('role')}) {size} at "
                f"step {first.get('first_overflow_step')}, and {n} fp16 tensor(s) in all pass 65504. In fp16 "
                "those values become inf, and the loss NaN, at every loss scale: a loss scale acts on backward only, "
                f"so no GradScaler setting fixes this. {keep} {after} "
                f"(Forward values traced op by op: {ev.get('forward_tensors')} fp16 tensors measured.)")
    else:
        rows = ev.get("forward_flushing") or [{}]
        worst, n = rows[0], ev.get("forward_flushing_count", len(rows))
        text = (f"The forward pass loses values to fp16 underflow under {where}: {percent(worst.get('flushed_fraction'))} "
                f"of the nonzero values of {worst.get('name')} ({worst.get('role')}) flush to zero (threshold "
                f"{percent(tau)}), and {n} fp16 tensor(s) flush more than "
                "the threshold. A loss scale multiplies gradients, not forward values, so no S brings them back; a "
                "layer whose input flushes also loses that part of its weight gradient at every S. "
                f"{keep} Or rescale the values (the op that makes them this small) into fp16's range. {after}")
    return text + (f" Mixed-precision training keeps such ops in fp32 for this reason: fp16 holds magnitudes from "
                   f"2^-24 to 65504 only ({PAPER}).")


def _gradient_error(rec: Recommendation, fmt: Format) -> str:
    """The gradients' own verdict, for once the rounding error is fixed (``explanation_text`` leads with the error)."""
    backward = rec.evidence.get("backward_verdict")
    if backward not in _RENDER or backward == Verdict.GRADIENT_ERROR:
        return _insufficient(rec, fmt)
    return _RENDER[Verdict(backward)](dataclasses.replace(rec, verdict=Verdict(backward)), fmt)


_RENDER: dict[Verdict, Callable[[Recommendation, Format], str]] = {
    Verdict.NONE_NEEDED: _none_needed,
    Verdict.CONSTANT: _scaled,
    Verdict.DYNAMIC: _scaled,
    Verdict.NO_SINGLE_SCALE: _scaled,
    Verdict.PER_TENSOR_SCALING: _per_tensor,
    Verdict.INSUFFICIENT_EVIDENCE: _insufficient,
    Verdict.FORWARD_OVERFLOW: _forward,
    Verdict.FORWARD_UNDERFLOW: _forward,
    Verdict.GRADIENT_ERROR: _gradient_error,
}
