"""What every medium says: the short answer, the code to paste, and text that fits a width.

Plain strings, no styling and no third-party imports: ``terminal`` renders them with rich,
``html`` as HTML, ``figures`` on a figure, so the three say the same thing. Every number
comes from the report and its Recommendation. Module names and URLs are treated as data:
a line is broken only at spaces, a module name after a dot (within a part only when the part
is longer than a line), a URL never; names are shown whole in prose, never cut to '…' (a
figure's labels, :func:`shorten_name`, and a part longer than a table's column are shortened).
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from fp16probe import formatting as num
from fp16probe.presentation.cite import PAPER
from fp16probe.formats import Format, get_format
from fp16probe.formatting import KIND_WORDS
from fp16probe.presentation import escape
from fp16probe.presentation.paste import grad_scaler_call, keep_in_fp32_call, loss_in_fp32_call
from fp16probe.presentation.schedule import rule_label
from fp16probe.analysis.trial import HURT_UNSEEN, agreement, ran_trial
from fp16probe.presentation.trial import end_words, trial_line
from fp16probe.presentation.verdict import insufficient_why, verdict_text
from fp16probe.recommendation import Caveat, Recommendation, Verdict
from fp16probe.report import Report
from fp16probe.sections import Trial, Workload
from fp16probe.validation import SCALER_DEVICES
from fp16probe.verification import Verification

__all__ = [
    "CAVEAT_WORDS",
    "KIND_WORDS",
    "VERDICT_WORDS",
    "Line",
    "answer_text",
    "brief_answer",
    "caveat_text",
    "evidence_rows",
    "findings",
    "fit_name",
    "fix_code",
    "grad_scaler_code",
    "invented_sentence",
    "numerically_zero_sentence",
    "recommendation_for",
    "recommendation_summary",
    "report_summary",
    "run_header",
    "scaler_device",
    "set_aside_sentence",
    "short_answer",
    "shorten_name",
    "stacked_table",
    "wrap_text",
]

VERDICT_WORDS = {
    Verdict.NONE_NEEDED: "no loss scaling needed",
    Verdict.CONSTANT: "a constant loss scale",
    Verdict.DYNAMIC: "a dynamic loss-scale schedule",
    Verdict.PER_TENSOR_SCALING: "per-tensor scaling",
    Verdict.NO_SINGLE_SCALE: "no single loss scale fits",
    Verdict.INSUFFICIENT_EVIDENCE: "not enough evidence for a verdict",
    Verdict.FORWARD_OVERFLOW: "the forward pass overflows (no loss scale fixes it)",
    Verdict.FORWARD_UNDERFLOW: "the forward pass flushes values to zero (no loss scale fixes it)",
    Verdict.GRADIENT_ERROR: "rounding puts the gradients off fp32 (no loss scale fixes it)",
}
ELLIPSIS = "…"
NOTES_SHOWN = 10  # notes a summary lists; "and N more notes" stands for the rest
_EQUALS = re.compile(r"(\b\w{1,3}) = (\S)")


@dataclass(frozen=True)
class Line:
    """One line of the short answer: what it says (``kind``) and its words.

    Kinds: ``verdict``, ``flushed``, ``margin``, ``schedule`` (the replay could not choose a
    growth_interval), ``todo`` (no single scale: what to do
    instead), ``device``, ``code`` (already fitted to the
    width; paste as it is), ``invented``, ``finding``, ``emulated`` (the emulated target step's
    gradient error), ``verification``, ``caveat``.
    """

    kind: str
    text: str


def recommendation_for(report: Report, format: str | None = None) -> Recommendation | None:
    """Return the report's stored recommendation when it is for ``format`` (any when None)."""
    rec = report.recommendation
    if rec is None or (format is not None and rec.format != format):
        return None
    return rec


# -- the code to paste -------------------------------------------------------------------
def scaler_device(report: Report | None, requested: str | None = None) -> tuple[str, str]:
    """Return the device for the GradScaler line and, in words, how it was chosen.

    The device goes into code to paste: one of :data:`~fp16probe.validation.SCALER_DEVICES`, else cuda.
    """
    if requested:
        if requested in SCALER_DEVICES:
            return requested, f"for {requested}, as asked"
        return "cuda", f"for CUDA; '{escape.text(requested)}' is not a device type GradScaler takes"
    ran = report.metadata.device.split(":")[0] if report is not None else ""
    if ran and ran not in SCALER_DEVICES:
        where = f"; this report's device '{escape.text(ran)}' is not a device type"
        return "cuda", f"for CUDA, where fp16 training runs{where}"
    if ran and ran != "cpu":
        return ran, f"for {ran}, where this profile ran"
    where = f"; this profile ran on {ran}" if ran else ""
    return "cuda", f"for CUDA, where fp16 training runs{where}"


def grad_scaler_code(rec: Recommendation, device: str = "cuda", width: int | None = None) -> str:
    """Return the Python line(s) creating the recommended GradScaler ('' when none is advised or its
    arguments are not GradScaler's: see :func:`fp16probe.presentation.paste.grad_scaler_call`).

    With ``width``, a call too long for it is split after commas, still valid Python.
    """
    kwargs = dict(rec.grad_scaler_kwargs)
    if not kwargs:
        if rec.verdict is not Verdict.NONE_NEEDED:
            return ""
        kwargs = {"enabled": False}
    return grad_scaler_call(kwargs, device, width) or ""


def fix_code(rec: Recommendation, width: int | None = None) -> str | None:
    """The code keeping a forward or gradient_error verdict's modules in fp32, from its checked names and device.

    '' when the verdict offers no such fix; None when it offers one whose names or device do not fit
    (then no code is shown, and the answer says why). A report's stored ``fix_code`` is never used.
    """
    modules = rec.evidence.get("fix_modules")
    if rec.verdict not in _FIX_VERDICTS or not modules:
        return ""
    return keep_in_fp32_call(modules, _fix_device(rec.evidence), width)


def _fix_device(ev: Mapping[str, Any]) -> Any:
    """The device whose autocast a fix turns off: the evidence's ``fix_device``, or in older reports the target
    the verdict was judged for. Unchecked here: the paste functions take only a device of a fixed set."""
    return (ev["fix_device"] if "fix_device" in ev
            else ev.get("target") or (ev.get("emulated") or {}).get("target") or "cuda")


_FIX_VERDICTS = (Verdict.FORWARD_OVERFLOW, Verdict.FORWARD_UNDERFLOW, Verdict.GRADIENT_ERROR)


# -- the short answer --------------------------------------------------------------------
def run_header(report: Report) -> str:
    """Return one sentence saying what was profiled: model, steps, precision, device, modules."""
    md = report.metadata
    stopped = None if report.workload is None else report.workload.stopped
    state = f" (partial: {escape.text(stopped or 'interrupted')})" if md.partial else ""
    return (f"{escape.text(md.model_class)}: {num.count(md.steps_seen)} step(s){state} in "
            f"{escape.text(md.precision)} on {escape.text(md.device)}, "
            f"{num.count(len(md.hooked_modules))} module(s) hooked")


def short_answer(report: Report | None, rec: Recommendation, *, width: int = 80,
                 device: str | None = None) -> list[Line]:
    """Return the answer in a few lines: verdict, S or schedule, flushed before and after,
    overflow margin, the code to paste and for which device, then what qualifies it."""
    lines = [Line("verdict", _verdict_sentence(rec))]
    refuted = _trial_refutes(report, rec)
    if refuted:
        lines.append(Line("todo", refuted))
    flushed = _flushed_sentence(rec, f" of nonzero {KIND_WORDS.get(rec.kind, rec.kind)}")
    if flushed:
        lines.append(Line("flushed", flushed))
    margin = _margin_sentence(rec)
    if margin:
        lines.append(Line("margin", margin))
    if rec.evidence.get("simulated_candidates_tied") and rec.grad_scaler_kwargs:
        study = rec.evidence.get("interval_study")
        speaks = isinstance(study, dict) and study.get("within_range")
        family = escape.text(str(study.get("family"))) if isinstance(study, dict) else ""
        which = ("the growth-interval study's measured interval for the family whose drift is nearest this run's "
                 f"({family}); the study and the table are in --explain"
                 if rec.evidence.get("growth_interval_from_study") and isinstance(study, dict) else
                 "the longest (fewest growth probes): in effect hold S; "
                 + (f"the growth-interval study's finding for the nearest family ({family}) and the table are in "
                    "--explain" if speaks else "not a measured optimum (--explain shows the table)"))
        lines.append(Line("schedule", f"growth_interval={rec.grad_scaler_kwargs['growth_interval']}: the replay "
                                      f"cannot tell the candidates apart on underflow, so it is {which}"))
    todo = _what_to_do(rec)
    if todo:
        lines.append(Line("todo", todo))
    dev, how = scaler_device(report, device)
    code = grad_scaler_code(rec, dev, width)
    if not code and rec.grad_scaler_kwargs:
        lines.append(Line("todo", "no GradScaler line: the recommendation's GradScaler arguments are not ones "
                                  "torch.amp.GradScaler takes (grad_scaler_kwargs)"))
    if rec.format.startswith("fp8"):  # TransformerEngine and torchao scale FP8 tensors one by one
        code = ""
        lines.append(Line("todo", "FP8 training scales each tensor (TransformerEngine, torchao), not the loss: "
                                     "no GradScaler; fp16probe profile --format "
                                     f"{rec.format} gives the per-tensor, per-layer answer"))
    fix = fix_code(rec, width)
    if fix:
        # bf16's range answers a forward verdict; rounding (gradient_error) is not a matter of range
        lines.append(Line("device", "fix:" if rec.verdict is Verdict.GRADIENT_ERROR else "fix (or train in bf16):"))
        lines.append(Line("code", fix))
    elif fix is None:
        lines.append(Line("todo", "no fix code: the fix's module names or device (evidence fix_modules, fix_device) "
                                  "are not names and a device fp16probe.keep_in_fp32 takes"))
    unfixed = _fix_refuted(rec)
    if unfixed:
        lines.append(Line("todo", unfixed))
    fp16_holds = _fp16_holds(rec)
    if fp16_holds:
        lines.append(Line("todo", fp16_holds))
    if code:
        least_bad = "if you keep one scale, the least bad; " if todo else ""
        lines.append(Line("device", f"paste ({least_bad}{how}):"))
        lines.append(Line("code", code))
    emulated = emulated_sentence(rec)  # after the code: the answer leads with what to paste
    if emulated:
        lines.append(Line("emulated", emulated))
    zero = set_aside_sentence(rec)
    if zero:
        lines.append(Line("emulated", zero))
    if report is not None:
        invented = invented_sentence(report)
        if invented:
            lines.append(Line("invented", invented))
        lines += [Line("finding", f) for f in findings(report)]
        verification = report.verification
        if verification is not None:
            lines.append(Line("verification", _verification_sentence(verification)))
    lines += [Line("caveat", f"caveat: {c}") for c in rec.caveats]
    return lines


def _trial_refutes(report: Report | None, rec: Recommendation) -> str:
    """The headline's counterweight: the report's training trial, in this answer's format, left fp32's band
    although the verdict raised no alarm (empty otherwise)."""
    trial = None if report is None else ran_trial(report)
    if trial is None or not isinstance(trial[0], Trial) or trial[0].format != rec.format:
        return ""
    t, band = trial
    if agreement(str(rec.verdict), band) != HURT_UNSEEN:
        return ""
    ends = ", ".join(f"{v:.4g}" if math.isfinite(v) else "not finite" for v in band.target)
    why = ("The harm is outside what one step at the profiled weights measures (a loss or statistic computed in low "
           "precision, or an effect that builds up over steps): "
           + (end_words(t.end, t.steps) if t.end is not None else
              "keep fp32 where it arises, or train in fp32; the trial line below has the figures"))
    return (f"but trained for real, this is not fine: {escape.text(t.format)} at these settings ended OUTSIDE fp32's "
            f"seed band over {num.count(t.steps)} steps x {len(t.seeds)} data orders (last-{band.last}-step loss "
            f"{ends}; band top {band.high:.4g}). {why}")


# What `recommend` keeps of the short answer: the verdict, the numbers it rests on, what to do and the code.
_BRIEF_KINDS = ("verdict", "flushed", "margin", "schedule", "todo", "device", "code", "emulated")
_MORE_WORDS = {"invented": "note on invented inputs", "finding": "finding", "verification": "verification",
               "caveat": "caveat"}


def brief_answer(report: Report | None, rec: Recommendation, *, width: int = 80,
                 device: str | None = None) -> list[Line]:
    """The short answer cut to the verdict, its numbers, what to do and the code to paste (``recommend``),
    then one line that counts what ``--explain`` adds (caveats, findings, the verification)."""
    lines = short_answer(report, rec, width=width, device=device)
    kept = [line for line in lines if line.kind in _BRIEF_KINDS]
    left = [line.kind for line in lines if line.kind not in _BRIEF_KINDS]
    if left:
        counts = ", ".join(f"{left.count(k)} {_MORE_WORDS.get(k, k)}{'s' if left.count(k) > 1 else ''}"
                           for k in dict.fromkeys(left))
        kept.append(Line("more", f"also {counts}, with the evidence and reasoning: --explain"))
    else:
        kept.append(Line("more", "the evidence and reasoning: --explain"))
    return kept


# -- caveats: the one place their words live ----------------------------------------------
def _names(names: Sequence[str], total: int) -> str:
    return ", ".join(names) + (", ..." if total > len(names) else "")


def _more(n: int) -> str:
    return f" and {n} more" if n > 0 else ""


def _run(d: Mapping[str, Any]) -> str:
    return num.fp16_run(d["regime"], d["target"])


_STOPPED = {"error": "stopped by a failure", "terminated": "terminated (SIGTERM)", "hangup": "hung up (SIGHUP)"}

# Caveat code -> its sentence, from the caveat's data (as the analysis wrote it).
CAVEAT_WORDS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "text": lambda d: str(d["text"]),  # a report from before codes: the sentence it stored
    "low_precision_run": lambda d: (f"This profile was taken under {d['precision']} at "
        f"{num.scales_in_force(d['scales'])}: gradients that flushed during the run are already exact zeros "
        f"({num.count(d['zero_values'])} of {num.count(d['values'])} judged values are zero, true zeros included), so "
        "flushed shares count only what survived and are lower bounds. Profile in fp32 (the default precision) to "
        "measure what flushes."),
    "hooked_ceiling": lambda d: ("The overflow ceiling comes from the hooked modules' and parameters' gradients only: "
        "this report has no backward-wide ceiling, so gradients outside hooked modules (functional ops after the last "
        "module, a temperature or gain before the loss, the loss side) are not seen and a larger one may overflow "
        "before S does."),
    "scale_induced_overflow": lambda d: (f"{d['count']} profiled step(s) held inf/NaN at the scale in force "
        f"({num.scales_in_force(d['scales'])}{'; steps ' + ', '.join(map(str, d['steps'])) if d['steps'] else ''}): "
        "such a step says its largest gradient was at least the format's max divided by that scale, so it counts as "
        "overflowing at that scale and above, not at every scale."),
    "intrinsic_nonfinite": lambda d: (f"{d['count']} profiled step(s) held inf/NaN in an fp32 run without a loss "
        "scaler: no loss scale explains or fixes those; they are left out of the limit on S."),
    "narrowed_kind": lambda d: (f"Only {KIND_WORDS.get(d['kind'], d['kind'])} were judged for flushing "
        f"(kind={d['kind']!r}); the loss scale multiplies {', '.join(KIND_WORDS.get(k, k) for k in d['others'])} too."),
    "silent_modules": lambda d: (f"{d['count']} hooked module(s) recorded no gradient "
        f"({_names(d['modules'], d['count'])}): their forward was bypassed (e.g. a parent that uses their weights "
        "directly) or their output did not reach the loss."),
    "autocast_fp32_ops": lambda d: (f"{d['count']} op(s) whose gradients stay fp32 under fp16 autocast were left out "
        f"of the histograms and the overflow ceiling ({_names(d['ops'], d['count'])}): autocast runs them in fp32 (or "
        "they take fp32 inputs) and only fp32 ops consume them. This assumes training under autocast; a model "
        "converted with .half() computes them in fp16."),
    "partial_run": lambda d: (f"The run was {_STOPPED.get(str(d.get('stopped')), 'interrupted')}: "
        f"{d['steps_seen']} of {d['steps_requested']} requested steps were profiled."),
    "rerun_steps": lambda d: (f"The verdict rests on the {d['count']} rerun step(s), not on the live steps between "
        "them; " + ("no further rerun is scheduled." if d.get("next_step") is None
                    else f"the next rerun comes at step {d['next_step']}.")),
    "scale_not_carried": lambda d: (f"The live gradients carry about 2^{d['log2_ratio']:.1f} times the loss scale "
        f"the scaler reports ({num.scales_in_force(d['claimed_scales'])}), measured against fp32 reruns of steps "
        f"{', '.join(map(str, d['steps'][:8]))}: no live figure was judged."),
    "schedule_differs": lambda d: (f"fp16probe schedule, replaying this run's own {num.count(d['history_steps'])} "
        "steps, " + ("finds GradScaler's defaults already fine" if d["defaults_fine"]
                     else f"advises {rule_label(d['schedule_choice'])!r}")
        + ", which moves the scale differently: it judges skipped steps over the run's history, this verdict "
        "underflow at the scale in force against fp32 reruns. Paste the GradScaler above; use the schedule's table "
        "to tune how the scale moves."),
    "reruns_discarded": lambda d: (f"{d['count']} fp32 rerun(s) were discarded and not judged: with every autocast "
        f"disabled, {d['first']['module']} still returned {d['first']['dtype']} at step {d['first']['step']}, so "
        "they were not fp32."),
    "projected_schedule": lambda d: ("The growth_interval above is a projection: the profiled steps resampled over "
        f"{num.count(d['horizon'])} simulated steps. This report records every one of its "
        f"{num.count(d['history_steps'])} steps: `fp16probe schedule` judges loss-scale rules on the run's own "
        "history."),
    "pure_fp16": lambda d: ("Predicted as a pure-fp16 run (the model came in fp16: .half(), no autocast): every op, "
        "every gradient and the loss are fp16, and without fp32 master weights an update smaller than about 2^-11 of "
        "its weight is lost (profile with --optimizer to measure that share)."),
    "forward_modules_only": lambda d: ("The forward pass was judged on the hooked modules' outputs only (the Probe's "
        "own maxima); functional ops between modules and the loss's dtype were not audited: fp16probe.profile (the "
        "command line's profile) audits every op."),
    "forward_low_headroom": lambda d: (f"Forward values close to fp16's max (65504) under {_run(d)}: "
        f"{', '.join(f'{n} ({num.bits(b)} bits)' for n, b in d['tensors'])}. Less than {num.bits(3.0)} bits of "
        "headroom is how forward overflow starts (a trained T5's feed-forward output grew past 65504 this way); "
        "watch these as training goes on, or keep them in fp32."),
    "forward_flushing": lambda d: (f"Forward values flush to zero in fp16 under {_run(d)} (share of each tensor's "
        f"nonzero values): {', '.join(f'{n} {num.percent(f)}' for n, f in d['tensors'])}"
        f"{_more(d['count'] - len(d['tensors']))}. A loss scale does not act on forward values; these zeros are in "
        "the fp16 run whatever S is."),
    "custom_functions": lambda d: (f"The graph holds custom autograd Functions ({', '.join(d['functions'])}): the "
        "overflow ceiling sees only what flows into and out of their backward, not the values it forms inside (a "
        "backward that multiplies before it divides can overflow at a lower S). Run with --verify "
        "(fp16probe.profile(..., verify=True)) to check the scale for real."),
    "forward_no_effect": lambda d: (f"The forward pass {'overflows' if d['finding'] == 'forward_overflow' else 'flushes'}"
        f" in fp16 under {_run(d)} ({d.get('tensor')}"
        f"{': ' + num.percent(d['flushed_fraction']) + ' of its values' if d.get('flushed_fraction') else ''}), but "
        f"the emulated step's gradients are {num.percent(d['error'])} off fp32 at S = {num.power_of_two(d['log2_scale'])}"
        f", within {num.percent(d['tolerance'])}: no effect on training seen, so the loss-scale verdict leads."),
    "flush_no_effect": lambda d: (f"At S = {num.power_of_two(d['log2_scale'])}, {num.percent(d['flushed_fraction'])} "
        f"of the nonzero gradient values still flush, above the {num.percent(d['threshold'])} threshold (no single "
        "scale keeps all of them in fp16's range"
        + (f"; most flush in {', '.join(escape.text(str(m)) for m in d['modules'])}" if d.get("modules") else "")
        + f"), but the emulated step under {_run(d)} puts the gradients {num.percent(d['error'])} off fp32 there, "
        f"every parameter within {num.percent(d['tolerance'])}"
        + (f" and {num.count(d['zeroed'])} of {num.count(d['nonzero'])} weight-gradient values zeroed"
           if d.get("nonzero") else "")
        + ": the flush costs nothing measurable, so that S is the "
        "answer, not \"no single scale\"."),
    "error_within_noise": lambda d: (f"{d['format']} error {num.percent(d['error'])} of the gradient "
        f"({escape.text(str(d['parameter']))}), against batch-to-batch noise of {num.percent(d['noise'])} (fp32 gradients of "
        f"{d['noise_batches']} batches): {_within_noise_words(d['error'], d['noise'], d.get('ambiguous_share'))}. "
        f"An error within {num.percent(d['noise_share'])} "
        "of the noise SGD already tolerates adds to it as a slightly smaller batch would (McCandlish et al., \"An "
        "Empirical Model of Large-Batch Training\", arXiv:1812.06162), so no alarm; an error the same from step to "
        "step (a bias, not noise) would not average out."),
    "emulated_overflow": lambda d: (f"The emulated step under {_run(d)} held {num.count(d['nonfinite'])} inf/NaN "
        f"gradient value(s) at S = {num.power_of_two(d['log2_scale'])}, and none at half that S "
        f"({num.percent(d['error_below'])} off fp32): a gradient the overflow ceiling did not see reaches fp16's max "
        "there; expect the scaler to back off once."),
    "bf16_worse_than_fp16": lambda d: (f"bf16 rounds this model's gradients {num.percent(d['error'])} off fp32 in the "
        f"emulated step, fp16 with S = {num.power_of_two(d['fp16_log2_scale'])} {num.percent(d['fp16_error'])}: bf16 "
        "needs no loss scale (fp32's exponent range) but keeps 8 significant bits to fp16's 11; where that precision "
        "matters, fp16 with that scale is the closer run."),
    "loss_fp16": lambda d: (f"The loss is computed in fp16 under {_run(d)}: its gradient seeds backward with S itself "
        "as an fp16 number, so any S of 65520 or more overflows on every step. Compute the loss in fp32 to lift that "
        "cap: loss_fn(output.float(), target)."),
}


def _within_noise_words(error: float, noise: float, ambiguous: Any = None) -> str:
    """"training will not feel it", or, from AMBIGUOUS_SHARE of the noise up, what the evidence says there."""
    from fp16probe.analysis.effect import AMBIGUOUS_SHARE

    line = AMBIGUOUS_SHARE if ambiguous is None else float(ambiguous)
    if not noise or error / noise < line:
        return "training will not feel it"
    return (f"{num.percent(error / noise)} of it, under the alarm's line; but from {num.percent(line)} of the noise up, "
            "models have both trained like fp32 and not (a cancelling variance at 13-34% of its noise trained 2-8% "
            "worse, docs/evidence.md): fp16probe profile --trial STEPS trains both to see")


def caveat_text(c: Caveat) -> str:
    """Return a caveat's sentence; a code or data this version cannot word (a newer writer's, an edited
    file's) shows as the code and its data, never as an error."""
    try:
        return CAVEAT_WORDS[c.code](c.data)
    except (KeyError, TypeError, ValueError, IndexError):
        return f"{c.code}: {dict(c.data)}"


def _flushed_sentence(rec: Recommendation, of: str = "") -> str:
    """'flushed: x at S = 1, y at S = 2^k' and ``of`` ('' without a verdict: its shares are no evidence,
    and a "flushed: 0%" beside "not enough evidence" would read as good news)."""
    if rec.flushed_fraction_at_1 is None or rec.verdict is Verdict.INSUFFICIENT_EVIDENCE:
        return ""
    k, at_k = rec.log2_scale, rec.flushed_fraction_at_scale
    after = "" if not k or at_k is None else f", {num.percent(at_k)} at S = {num.power_of_two(k)}"
    return f"flushed: {num.percent(rec.flushed_fraction_at_1)} at S = 1{after}{of}"


def _worst_sentence(rec: Recommendation) -> str:
    worst = ", ".join(f"{n} ({num.percent(f)})" for n, f in rec.worst_modules[:3])
    return f"worst modules at S = 1: {worst}" if worst else ""


def _verdict_sentence(rec: Recommendation) -> str:
    words = VERDICT_WORDS.get(rec.verdict, str(rec.verdict))
    k = rec.log2_scale
    kw = rec.grad_scaler_kwargs
    head = f"verdict for {rec.format}: {words}"
    if rec.verdict is Verdict.CONSTANT and k is not None:
        return f"{head}, S = {num.power_of_two(k)}"
    if rec.verdict is Verdict.DYNAMIC and kw:
        return (f"{head}: start at S = {num.power_of_two(k)}, x{kw['growth_factor']:g} every "
                f"{num.count(kw['growth_interval'])} good steps, x{kw['backoff_factor']:g} on overflow")
    if rec.verdict is Verdict.NO_SINGLE_SCALE and k is not None:
        return f"{head}; the least bad is S = {num.power_of_two(k)}"
    if rec.verdict is Verdict.PER_TENSOR_SCALING and k is not None:
        return f"{head}, about 2^{k} from the measured maxima"
    if rec.verdict in (Verdict.FORWARD_OVERFLOW, Verdict.FORWARD_UNDERFLOW):
        ev = rec.evidence
        rows = ev.get("forward_overflow" if rec.verdict is Verdict.FORWARD_OVERFLOW else "forward_flushing") or []
        where = f" under {ev.get('regime', 'autocast').replace('_', ' ')} on {ev.get('target', 'cuda')}"
        if rows:
            first = rows[0]
            if rec.verdict is Verdict.FORWARD_OVERFLOW:
                m = first.get("max_abs")
                size = "inf/NaN" if m is None or m == float("inf") else f"max {num.magnitude(m)} > 65504"
                return f"{head}: {first.get('name')} {size} at step {first.get('first_overflow_step')}{where}"
            return (f"{head}: {num.percent(first.get('flushed_fraction'))} of {first.get('name')} flushes"
                    f"{where}")
        return head
    if rec.verdict is Verdict.GRADIENT_ERROR:
        em = rec.evidence.get("emulated") or {}
        start = (f"; it starts at {em.get('module')} (output {num.percent(em.get('module_output_error'))} off)"
                 if em.get("module_output_error") is not None else
                 "; made in the loss, outside the model" if em.get("loss_fix_holds") is True else
                 f"; made in backward at or just after {em.get('module')}")
        k = em.get("log2_scale")
        return (f"{head}: {em.get('first_parameter')} is {_error_words(em.get('first_parameter_error'), 0)}"
                f"{_against_noise(em.get('first_parameter_noise') if em.get('first_parameter_error') is not None else None)} "
                f"{'at S = ' + num.power_of_two(k) if k else 'unscaled'} with no overflow and no flush, under "
                f"{_target_run(rec.format, em)}{start}")
    if rec.verdict is Verdict.INSUFFICIENT_EVIDENCE:  # the analysis's words say why and what to do
        return f"{head}: {insufficient_why(rec)} (--explain says what to do)"
    return head


def _target_run(fmt: str, em: Mapping[str, Any]) -> str:
    """The run a verdict judges, named by its format: "fp16 autocast on CUDA", "bf16 autocast on cpu"."""
    target = str(em.get("target"))
    return (num.fp16_run(str(em.get("regime")), target) if fmt == "fp16"
            else f"{fmt} autocast on {target.upper() if target == 'cuda' else target}")


def _against_noise(noise: Any) -> str:
    """", against batch-to-batch noise of 115%" ('' when the noise was not measured)."""
    return f", against batch-to-batch noise of {num.percent(noise)}" if noise is not None else ""


def _error_words(error: Any, nonfinite: Any) -> str:
    return "inf/NaN" if nonfinite or error is None else f"{num.percent(error)} off fp32"


def emulated_sentence(rec: Recommendation) -> str:
    """What the emulated target step measured at the verdict's S ('' when none ran)."""
    em = rec.evidence.get("emulated")
    if not em:
        return ""
    k = em.get("log2_scale")
    at = f"at S = {num.power_of_two(k)}" if k else "unscaled"
    worst = em.get("worst_parameters") or []
    tail = (f" (worst {worst[0][0]}: {_error_words(worst[0][1], 0)})"
            if worst and worst[0][1] is not None and not em.get("nonfinite") else "")
    around = "; ".join(f"{num.power_of_two(j)}: {_error_words(e, bad)}" for j, e, bad in em.get("neighbours") or ())
    around = f"first batch at S = {around}" if around else ""
    fix = em.get("fix")
    fixed = (f"; with {', '.join(fix['keep_fp32'])} in fp32: {_error_words(fix.get('error'), fix.get('nonfinite'))}"
             if fix else "")
    loss = em.get("loss_fix")
    if isinstance(loss, Mapping):
        fixed += f"; with the loss in fp32: {_error_words(loss.get('error'), loss.get('nonfinite'))}"
    run = _target_run(rec.format, em)
    noise = (f"; batch-to-batch noise {num.percent(em.get('noise'))} ({em.get('noise_batches')} fp32 batches)"
             if em.get("noise") is not None else "; batch-to-batch noise not measured (fewer than two batches, or a "
             f"report from before it): the error is judged against {num.percent(em.get('tolerance'))} alone" if "noise" in em else "")
    fp16 = em.get("fp16") if rec.format == "bf16" else None
    beside = (f"; fp16 {'at S = ' + num.power_of_two(fp16.get('log2_scale')) if fp16.get('log2_scale') else 'unscaled'}: "
              f"{_error_words(fp16.get('error'), fp16.get('nonfinite'))}" if isinstance(fp16, Mapping) else "")
    return (f"emulated {rec.format} step ({run}, {em.get('batches')} batch(es)): gradients "
            f"{_error_words(em.get('error'), em.get('nonfinite'))} {at}{tail}{noise}"
            f"{'; ' + around if around else ''}{fixed}{beside}")


ZERO_SHOWN = 3  # names the set-aside line lists


def set_aside_sentence(rec: Recommendation) -> str:
    """The parameters the emulated step's judgement set aside as numerically zero in fp32 ('' when none)."""
    names = [str(n) for n in (rec.evidence.get("emulated") or {}).get("numerically_zero") or ()]
    if not names:
        return ""
    shown = ", ".join(escape.text(n) for n in names[:ZERO_SHOWN])
    more = f" and {num.count(len(names) - ZERO_SHOWN)} more" if len(names) > ZERO_SHOWN else ""
    return (f"set aside as numerically zero: {num.count(len(names))} parameter(s) ({shown}{more}) whose fp32 gradient "
            "is within fp32's own rounding of zero (terms that cancel, as an attention key bias's do): no error is "
            "judged against them, and no fix names them")


WEIGHT_UPDATE_RULE = (
    "Without fp32 master weights an update is lost when it is below half an ulp of the "
    f"weight, i.e. when |w| is at least about 2^11 |update| in fp16 ({PAPER})."
)


def weight_update_words(wul: Mapping[str, Any]) -> str:
    """The weight-update check in words, from ``WeightUpdateLoss.to_dict()``'s numbers (a stored sentence as stored)."""
    if "text" in wul:  # a report from before the words moved here: the sentence it stored
        return str(wul["text"])
    bits = get_format(str(wul["format"])).mantissa_bits + 1
    return (f"Without fp32 master weights, {num.percent(wul['lost_fraction'])} of the {wul['nonzero_updates']} nonzero "
            f"parameter updates would be lost when added to {wul['format']} weights (measured by casting); the "
            f"|w| >= 2^{bits} |update| rule predicts {num.percent(wul['rule_lost_fraction'])}. "
            f"{WEIGHT_UPDATE_RULE}")


def _still(fix: Mapping[str, Any]) -> str:
    """", body.2.weight still 69.9% off fp32": the worst parameter of a measured fix ('' without one)."""
    worst = fix.get("worst_parameters") or []
    return f", {worst[0][0]} still {_error_words(worst[0][1], 0)}" if worst and worst[0][1] is not None else ""


def _fix_line(em: Mapping[str, Any]) -> str:
    """What a fix must reach: "within 5%", and "or under 50% of its batch-to-batch noise" where that was measured."""
    line = num.percent(em.get("tolerance"))
    return (f"{line} or under {num.percent(em.get('noise_share'))} of its batch-to-batch noise"
            if em.get("noise") is not None and em.get("noise_share") is not None else line)


def _fix_refuted(rec: Recommendation) -> str:
    """For ``gradient_error``, the fixes the emulated step measured that are not offered as code: the loss
    computed in fp32 when that holds, else each measured fix that did not bring the gradients within tolerance
    ('' when there is none of either)."""
    em = rec.evidence.get("emulated") or {}
    if rec.verdict is not Verdict.GRADIENT_ERROR:
        return ""
    fix, loss = em.get("fix"), em.get("loss_fix")
    loss = loss if isinstance(loss, Mapping) else None
    tolerance = _fix_line(em)
    if loss is not None and em.get("loss_fix_holds") is True and em.get("fix_holds") is not True:
        code = loss_in_fp32_call(_fix_device(rec.evidence))
        how = f" ({code})" if code is not None else " (no code: the report's device is not one autocast takes)"
        return (f"fix: compute the loss in fp32{how}: the loss rounds in {rec.format} "
                f"(it reads the autocast state or casts itself), and with it in fp32 the emulated gradients are "
                f"{_error_words(loss.get('error'), loss.get('nonfinite'))}, every parameter within {tolerance}")
    tried = []
    if fix and em.get("fix_holds") is False:
        tried.append(f"with {', '.join(fix.get('keep_fp32') or [])} in fp32 the emulated gradients are "
                     f"{_error_words(fix.get('error'), fix.get('nonfinite'))}{_still(fix)}")
    if loss is not None and em.get("loss_fix_holds") is False:
        tried.append(f"with the loss computed in fp32 {_error_words(loss.get('error'), loss.get('nonfinite'))}"
                     f"{_still(loss)}")
    if not tried:
        return ""
    alone = "one module's to keep in fp32" + (" nor the loss's alone" if loss is not None else "")
    return f"no fix found: {'; '.join(tried)} (a fix brings every parameter within {tolerance}); the error is not {alone}"


def _fp16_holds(rec: Recommendation) -> str:
    """For a bf16 ``gradient_error``, fp16's emulated step at its S when every parameter there is within tolerance
    ('' otherwise, and for reports from before that was recorded)."""
    em = rec.evidence.get("emulated") or {}
    fp16 = em.get("fp16")
    if rec.format != "bf16" or rec.verdict is not Verdict.GRADIENT_ERROR or not isinstance(fp16, Mapping):
        return ""
    if fp16.get("harmless") is not True:
        return ""
    k = fp16.get("log2_scale")
    at, train = (f"with S = {num.power_of_two(k)}", "train in fp16 with that loss scale") if k else ("unscaled",
                                                                                                "train in fp16")
    return (f"fp16 holds where bf16 does not: {at}, its emulated gradients are "
            f"{_error_words(fp16.get('error'), fp16.get('nonfinite'))}, every parameter within "
            f"{num.percent(em.get('tolerance'))}: {train} (fp16probe profile --format fp16 gives its GradScaler line)")


def explanation_text(rec: Recommendation, fmt: Format | None = None) -> str:
    """The reasoning: :attr:`Recommendation.text`, led for ``gradient_error`` by what the emulated step measured
    (the scale reasoning that follows is the gradients' verdict, for once the error is fixed).

    ``fmt``: ``rec.format`` as the caller resolved it (``verdict_text``'s)."""
    if rec.verdict is not Verdict.GRADIENT_ERROR:
        return verdict_text(rec, fmt)
    em = rec.evidence.get("emulated") or {}
    fix = em.get("fix") or {}
    k = em.get("log2_scale")
    at = f"S = {num.power_of_two(k)}" if k else "S = 1"
    where = (f"the first module whose output is more than {num.percent(em.get('tolerance'))} off fp32's is "
             f"{em.get('module')} ({num.percent(em.get('module_output_error'))} off)"
             if em.get("module_output_error") is not None else
             "the error is made in the loss, outside the model (in fp32 it is gone)"
             if em.get("loss_fix_holds") is True else
             f"the error is made in backward, at or just after {em.get('module')}")
    fixed = (f" Keeping {', '.join(fix.get('keep_fp32') or [])} in fp32 (fp16probe.keep_in_fp32) brings the "
             f"emulated gradients to {_error_words(fix.get('error'), fix.get('nonfinite'))}"
             + (f": not every parameter within {_fix_line(em)}, so it is not offered as a fix." if em.get("fix_holds") is False
                else ".") if fix else "")
    loss = em.get("loss_fix")
    if isinstance(loss, Mapping):
        fixed += (f" Computing the loss in fp32 (the step rounded values outside the model) brings them to "
                  f"{_error_words(loss.get('error'), loss.get('nonfinite'))}"
                  + (f": every parameter within {_fix_line(em)}, the fix." if em.get("loss_fix_holds") is True
                     else f": not every parameter within {_fix_line(em)}."))
    return (f"The emulated {rec.format} step (every value the target run holds in {rec.format} rounded to it) puts "
            f"{em.get('first_parameter')}'s gradient {_error_words(em.get('first_parameter_error'), 0)} at {at}, "
            f"with no overflow and no flush: rounding, not range, so no loss scale fixes it; {where}.{fixed} "
            f"{'Apart from that error' if em.get('fix_holds') is False and em.get('loss_fix_holds') is not True else 'Once that is fixed'}, the gradients "
            f"alone give: {rec.evidence.get('backward_verdict')}. {verdict_text(rec, fmt)}")


def _what_to_do(rec: Recommendation) -> str:
    """When no single scale fits: the fixes, before any scaler line ('' for other verdicts)."""
    if rec.verdict is not Verdict.NO_SINGLE_SCALE:
        return ""
    names = [str(n) for n, _ in rec.evidence.get("flushing_modules_at_scale", [])]
    keep = (f"keep {names[0]}{' and the others listed' if len(names) > 1 else ''} in fp32"
            if names else "keep the layers that flush the most in fp32")
    return f"what to do: train in bf16 (no loss scale needed), or {keep}, or scale per tensor"


def _margin_sentence(rec: Recommendation) -> str:
    ev = rec.evidence
    k, k_max = rec.log2_scale, ev.get("largest_safe_log2_scale")
    if k is None or k_max is None:
        return ""
    steps = ev.get("profiled_steps")
    over = rec.overflow_steps_at_scale
    at = "S = 1" if k == 0 else f"S = {num.power_of_two(k)}"
    counted = f"; even so {over} of {steps} profiled steps overflow" if over else ""
    bits = k_max - k
    return (f"overflow margin: {bits} bit{'' if bits == 1 else 's'} at {at} (max |g| "
            f"{num.magnitude(ev['max_abs'])}; overflows from S = {num.power_of_two(k_max + 1)}){counted}")


def invented_sentence(report: Report) -> str:
    """Return one line saying the inputs or loss were made up for the run ('' when they were not)."""
    work = report.workload or Workload()
    said = work.stand_in
    if said:
        return f"note: {said}"
    invented = [what for what, synthetic in (("inputs", work.inputs_synthetic), ("loss", work.loss_synthetic))
                if synthetic]
    if not invented:
        return ""
    return f"note: {' and '.join(invented)} invented for this run; S moves with the loss's scale"


def findings(report: Report) -> list[str]:
    """Return what the run itself noted besides the histograms: loading notes, a non-finite loss,
    weight updates lost without fp32 master copies."""
    work = report.workload or Workload()
    notes = work.notes or ()
    out = [f"note: {escape.text(n)}" for n in notes[:NOTES_SHOWN]]
    if len(notes) > NOTES_SHOWN:  # a report may hold any number; the rest stay in the report
        out.append(f"note: and {num.count(len(notes) - NOTES_SHOWN)} more notes (workload.notes)")
    removed = report.capture.removed_modules if report.capture is not None else ()
    if removed:
        out.append(f"note: the model removed {num.count(len(removed))} hooked module(s) during the run "
                   f"({', '.join(escape.text(n) for n in removed[:NOTES_SHOWN])}"
                   f"{' and more' if len(removed) > NOTES_SHOWN else ''}); their statistics cover only the steps before")
    out += compile_notes(report)
    out += precision_cost_lines(report)
    if work.nonfinite_loss_steps:
        out.append(f"finding: the loss was inf/NaN at step(s) {work.nonfinite_loss_steps}")
    wul = work.weight_update_loss
    if wul:
        out.append(f"weight updates: {num.percent(wul['lost_fraction'])} of {num.count(wul['nonzero_updates'])} "
                   f"would be lost in {wul['format']} weights without fp32 master copies")
    return out


def precision_cost_lines(report: Report) -> list[str]:
    """What the live run's precision cost the weight gradients, judged as the profile judges it (or nothing)."""
    from fp16probe.analysis.effect import NOISE_SHARE, TOLERANCE
    from fp16probe.analysis.precision_cost import CostJudgement, judge_against_fp32_change
    from fp16probe.sections import PrecisionCost

    cost = report.sections.get("precision_cost")
    if not isinstance(cost, PrecisionCost) or not cost.steps:
        return []
    v = judge_against_fp32_change(cost)
    what = (f"precision cost: {escape.text(cost.precision)} error {num.percent(v.error)} of the weight gradients "
            f"(relative L2 against the fp32 reruns, median of {num.count(v.steps)} step(s))")
    if v.judgement is CostJudgement.WITHIN_TOLERANCE:
        return [f"{what}: within the {num.percent(TOLERANCE)} a step may be off, training will not feel it"]
    if v.judgement is CostJudgement.UNJUDGED:
        return [f"{what}; one rerun step gives no batch-to-batch noise to judge it by"]
    against = (f"against batch-to-batch noise of {num.percent(v.noise)} (the fp32 gradient's change between rerun "
               f"steps, {num.percent(v.change)}, over sqrt(2))")
    if v.judgement is CostJudgement.WITHIN_NOISE:
        return [f"{what}, {against}: {_within_noise_words(v.error, v.noise)}"]
    return [f"{what}, {against}: more than {num.percent(NOISE_SHARE)} of it, training may feel it; "
            "fp16probe profile --trial STEPS trains both to see"]


def compile_notes(report: Report) -> list[str]:
    """What torch.compile left out of the capture (capture/compiled.py), or nothing."""
    cap = report.capture
    if cap is None or not (cap.compiled_modules or cap.compile_traced):
        return []
    names = ", ".join("the model" if n == "" else escape.text(n) for n in cap.compiled_modules[:NOTES_SHOWN])
    what = f"{names} ran compiled" if names else "torch.compile traced the model"
    return [f"note: {what}: module outputs inside compiled code were not read (that would change what the "
            "compiler builds); weight gradients and the fp32 reruns, run uncompiled, were"]


SKIPS_SHOWN = 3  # ledger entries a summary line names; show --json has them all


def skipped_step_words(entry: Any) -> str:
    """One ledger entry: its step, the scale in force, and where its inf/NaN began (names escaped)."""
    where = ""
    if not entry.sampled:
        where = ", not sampled (no module known)"
    elif entry.modules:
        whose = "output gradient" if entry.kind == "activation_grad" else "gradient"
        held = max(entry.nonfinite_modules, len(entry.modules))
        where = (f", inf/NaN first in {escape.text(entry.modules[0])}'s {whose}"
                 + (f" ({num.count(held)} held it)" if held > 1 else ""))
    return f"step {entry.step} at scale {num.scale(entry.scale)}{where}"


def skip_ledger_words(ledger: Any) -> str | None:
    """The skip ledger as one line: how many steps were skipped, the first few of them."""
    steps = ledger.steps
    if not steps:
        return None
    shown = "; ".join(skipped_step_words(e) for e in steps[:SKIPS_SHOWN])
    rest = len(steps) - SKIPS_SHOWN
    plural = "s" if len(steps) != 1 else ""
    return (f"{num.count(len(steps))} step{plural} skipped (gradients held inf/NaN): {shown}"
            + (f"; {num.count(rest)} more in show --json" if rest > 0 else ""))


# How each registered section that is not a field of the Report is told (one line; the default lists its
# fields). A collector that wants its own words registers them here, beside its section.
# Each takes the section and its report; None: worded elsewhere, so no line of its own.
SECTION_WORDS: dict[str, Callable[[Any, Report], str | None]] = {
    "emulation": lambda _, __: None,  # the answer's "emulated" line says what it measured
    "trial": lambda t, report: trial_line(t, None if report.recommendation is None else report.recommendation.verdict)
    if isinstance(t, Trial) else None,
    "skips": lambda ledger, _: skip_ledger_words(ledger),
}
_BRIEF = 40  # characters a value of an unworded section may take before it is shown by its size


def section_lines(report: Report) -> list[str]:
    """One line per registered section the report carries beyond the built-in ones, in key order.

    A section without words of its own shows its fields, each list or mapping longer than a few
    words by its size (``show --json`` has the values): a line, not a dump.
    """
    out = []
    for key in sorted(report.sections):
        value = report.sections[key]
        words = SECTION_WORDS.get(key)
        if words is not None:
            said = words(value, report)
            if said is not None:
                out.append(f"{key}: {said}")
            continue
        data = value.to_dict() if hasattr(value, "to_dict") else value
        shown = (", ".join(f"{k}={_brief(v)}" for k, v in data.items()) if isinstance(data, Mapping)
                 else _brief(data))
        out.append(f"{key}: {shown}")
    return out


def _brief(value: Any) -> str:
    """``value`` as it reads, or its size when that would be long: ``[32 items]``, ``{5 keys}``."""
    text = str(value)
    if len(text) <= _BRIEF or not isinstance(value, (list, tuple, Mapping)):
        return text if len(text) <= 4 * _BRIEF else f"{text[:_BRIEF]}... ({num.count(len(text))} characters)"
    return f"{{{num.count(len(value))} keys}}" if isinstance(value, Mapping) else f"[{num.count(len(value))} items]"


def numerically_zero_sentence(cancelled: Mapping[str, int]) -> str:
    """Say why a bias whose gradient cancels to rounding ranks among the worst (name -> log2 ratio)."""
    names = ", ".join(f"{n} (2^{b})" for n, b in list(cancelled.items())[:3])
    more = f" and {len(cancelled) - 3} more" if len(cancelled) > 3 else ""
    return (f"* numerically zero: {names}{more} of its module's largest output gradient. A bias's gradient "
            "sums that gradient over the batch, and here the sum cancels: it is zero in exact arithmetic "
            "(an attention key bias is, since softmax ignores a shift shared by all keys) and what flushes "
            "is fp32 rounding noise, not signal.")


def _verification_sentence(v: Verification) -> str:
    cause = verification_cause(v)
    return (f"verification ({v.precision} autocast on {v.device}, {v.steps} steps): prediction "
            f"{'held' if v.held else 'did NOT hold'}; overflowing steps {v.predicted_overflow_steps} "
            f"predicted, {v.measured_overflow_steps} measured; zeroed {num.percent(v.predicted_zeroed_fraction)} "
            f"predicted, {num.percent(v.measured_zeroed_fraction)} measured" + (f". {cause}" if cause else ""))


def verification_cause(v: Verification) -> str:
    """Why the run zeroed more than predicted, from its per-module counts (empty when it did not, or no counts).

    The prediction rounds each fp32 value times S once. A zeroed value fp32 puts above the flush threshold at S
    cannot be a flush of that value: the low-precision run computed it as zero."""
    if v.measured_zeroed_fraction - v.predicted_zeroed_fraction <= v.tolerance or not v.zeroed_by_module:
        return ""
    rows = v.zeroed_by_module
    zeroed, computed = sum(r[2] for r in rows), sum(r[3] for r in rows)
    first = next((r for r in rows if r[3]), None)
    most = max(rows, key=lambda r: (r[3], r[2]))
    if first is not None and 2 * computed >= zeroed:
        where = f"first in backward order at {escape.text(first[0])} ({num.count(first[3])} of its {num.count(first[1])})"
        if most[0] != first[0]:
            where += f", most at {escape.text(most[0])} ({num.count(most[3])} of {num.count(most[1])})"
        return (f"Cause: {num.count(computed)} of the {num.count(zeroed)} values the run zeroed were not small: fp32 "
                f"puts them above {escape.text(v.precision)}'s flush threshold at the scale in force, so rounding "
                f"them once (the prediction) keeps them, and the low-precision run computed them as zero, {where}: a "
                "derivative that rounds to zero in low precision (a saturating tanh, sigmoid or GELU-tanh whose saved "
                "output rounds to +-1) or a zero passed on from upstream. No loss scale changes that; the emulated "
                "step rounds what autograd saves and counts them")
    small = max(rows, key=lambda r: (r[2] - r[3], r[2]))
    return (f"Cause: {num.count(zeroed - computed)} of the {num.count(zeroed)} values the run zeroed are small ones "
            f"(at or below {escape.text(v.precision)}'s flush threshold at the scale in force in fp32 too; most at "
            f"{escape.text(small[0])}, {num.count(small[2] - small[3])} of {num.count(small[1])}): the run flushed "
            "more of them than one rounding of the fp32 values predicts, its own low-precision gradients lying lower "
            "there; a larger S lifts them above it")


# -- the printed summary (str / repr) --------------------------------------------------------
SUMMARY_WIDTH = 88


def answer_text(report: Report | None, rec: Recommendation, width: int = 80) -> str:
    """The short answer (findings and caveats included), then the reasoning, as plain text that fits
    ``width``: what the framework callbacks write beside their report."""
    lines: list[str] = []
    for line in short_answer(report, rec, width=width):
        lines += line.text.splitlines() if line.kind == "code" else wrap_text(line.text, width, "  ")
    return "\n".join([*lines, "", rec.explanation(width)]) + "\n"


def recommendation_summary(rec: Recommendation, width: int = SUMMARY_WIDTH) -> str:
    """A few lines for ``str(rec)`` / ``repr(rec)``: verdict, S, shares, steps, worst modules.

    As torchinfo's summary does, a short table of contents; ``rec.text`` holds the reasoning
    and ``rec.explanation()`` wraps it.
    """
    ev = rec.evidence
    lines = [f"Recommendation({_verdict_sentence(rec).removeprefix('verdict for ')})", _flushed_sentence(
        rec, f" of {num.count(ev.get('nonzero_values', 0))} nonzero {KIND_WORDS.get(rec.kind, rec.kind)}")]
    if "profiled_steps" in ev:
        over = rec.overflow_steps_at_scale
        lines.append(f"steps: {ev['profiled_steps']} profiled" + ("" if over is None else f", {over} overflow at S"))
    lines.append(_worst_sentence(rec))
    if rec.caveats:
        lines.append(f"{len(rec.caveats)} caveat(s) in .caveats; the reasoning in .explanation()")
    out = [ln for line in lines if line for ln in wrap_text(line, width, "  ")]
    code = grad_scaler_code(rec, width=width)  # split after commas: still valid Python to paste
    return "\n".join(out + (code.splitlines() if code else []))


def report_summary(report: Report, width: int = SUMMARY_WIDTH) -> str:
    """A few lines for ``str(report)`` / ``repr(report)``: what ran, the values, the stored verdict, the worst modules."""
    md = report.metadata
    lines = [f"Report({run_header(report)})"]
    for kind in report.kinds:
        h = report.histogram(kind)
        lines.append(f"{kind}: {num.count(h.total)} values, {num.count(h.zero)} zero, {num.count(h.nonfinite)} "
                     f"inf/NaN, max |x| {num.magnitude(h.max_abs)}")
    rec = report.recommendation
    if rec is None:
        lines.append("no recommendation stored: fp16probe.analyze(report) makes one")
    else:
        lines += [_verdict_sentence(rec), _flushed_sentence(rec), _worst_sentence(rec)]
    if report.verification is not None:
        lines.append(_verification_sentence(report.verification))
    if md.partial:
        lines.append(f"partial: {md.steps_seen} of {md.steps_total} requested steps")
    lines.append("more: report.recommendation, report.plot(), fp16probe show REPORT --explain")
    return "\n".join(ln for line in lines if line for ln in wrap_text(line, width, "  "))


# -- text that fits a width --------------------------------------------------------------
def wrap_text(text: str, width: int, indent: str = "") -> list[str]:
    """Wrap ``text`` at spaces; a word longer than a line is broken after dots, a URL never."""
    lines: list[str] = []
    for para in str(text).splitlines() or [""]:
        # "S = 2^17" stays on one line: its spaces become no-break spaces while wrapping.
        para = _EQUALS.sub("\\1\u00a0=\u00a0\\2", para)
        wrapped = textwrap.wrap(para, width, subsequent_indent=indent, break_long_words=False,
                                break_on_hyphens=False) or [""]
        for line in (w.replace("\u00a0", " ") for w in wrapped):
            if len(line) <= width or "://" in line or " " in line.strip():
                lines.append(line)
            else:
                lead = line[: len(line) - len(line.lstrip())]
                lines += [lead + part for part in fit_name(line.strip(), width - len(lead), whole=True)]
    return lines


def stacked_table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int,
                  legend: Sequence[tuple[str, str]] = ()) -> list[str]:
    """A table as plain lines for a terminal too narrow for its columns; no cell is ever cut.

    Each row's first cell (its name) gets a line of its own; its other cells follow on the
    next line, right-aligned under ``headers[1:]`` (short ones, spelled out by ``legend``, a
    list of (header, meaning)). When even those columns are wider than ``width``, each cell
    goes on a line of its own as ``header: value``. Names are wrapped after dots and spaces.
    """
    cells = [list(r[1:]) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers[1:])]
    row_width = 2 + sum(widths) + 2 * (len(widths) - 1)
    lines = wrap_text(f"{headers[0]}, its figures below:" if row_width <= width else headers[0], width)
    if row_width <= width:
        lines.append("  " + "  ".join(h.rjust(w) for h, w in zip(headers[1:], widths)))
    for row, rest in zip(rows, cells):
        lines += wrap_text(row[0], width)
        if row_width <= width:
            lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(rest, widths)))
        else:
            lines += [ln for h, c in zip(headers[1:], rest) for ln in wrap_text(f"  {h}: {c}", width, "    ")]
    if legend:
        lines += wrap_text("; ".join(f"{h}: {meaning}" for h, meaning in legend), width, "  ")
    return lines


def fit_name(name: str, width: int, *, whole: bool = False) -> list[str]:
    """Split a dotted module name into lines of at most ``width``, only after dots.

    A single part longer than ``width`` is shortened in its middle (a table's cell), or with
    ``whole`` broken where the line ends, every character shown (prose: a name is what the
    user searches their code for, so it is never cut to '…').
    """
    width = max(width, 4)
    lines, current = [], ""
    parts = name.split(".")
    for part in [p + "." for p in parts[:-1]] + [parts[-1]]:
        if len(part) > width and not whole:
            part = _middle(part, width)
        if current and len(current) + len(part) > width:
            lines.append(current)
            current = ""
        while len(part) > width:
            lines.append(part[:width])
            part = part[width:]
        current += part
    return lines + [current] if current or not lines else lines


def shorten_name(name: str, width: int) -> str:
    """Return ``name`` if it fits in ``width``, else its first part, '…' and as many of its
    last parts as fit: cut only at dots, so every part shown is whole (``bert.….output.dense``)."""
    parts = name.split(".")
    if len(name) <= width or len(parts) == 1:
        return _middle(name, width)
    tail = [parts[-1]]
    for part in reversed(parts[1:-1]):
        if len(parts[0]) + 3 + len(".".join([part] + tail)) > width:
            break
        tail.insert(0, part)
    short = ".".join([parts[0], ELLIPSIS] + tail)
    if len(short) > width:
        short = ".".join([ELLIPSIS] + tail)
    return short if len(short) <= width else _middle(parts[-1], width)


def _middle(token: str, width: int) -> str:
    if len(token) <= width:
        return token
    keep = max(width - 1, 2)
    return token[: (keep + 1) // 2] + ELLIPSIS + token[len(token) - keep // 2:]


def evidence_rows(evidence: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Return the evidence as (name, value) strings, numbers at 4 significant digits, records as
    ``name value`` pairs (never a Python dict), an empty list as 'none'."""
    return [(str(name), _evidence_text(value)) for name, value in evidence.items()]


def _evidence_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return num.count(value)
    if isinstance(value, Mapping):
        items = dict(value)
        name = items.pop("name", None)  # a record with a name (a tensor, a module) leads with it
        body = ", ".join(f"{k} " + (f"({_evidence_text(v)})" if isinstance(v, Mapping) else _evidence_text(v))
                         for k, v in items.items())
        return f"{name}: {body}" if name is not None else body
    if isinstance(value, (list, tuple)):
        if not value:
            return "none"
        if all(not isinstance(v, (Mapping, list, tuple)) for v in value):
            return " ".join(_evidence_text(v) for v in value)
        return "; ".join(_evidence_text(v) for v in value)
    return str(value)
