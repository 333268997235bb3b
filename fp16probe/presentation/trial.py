"""The words for the training trial (the report's ``trial`` section): one line for ``show`` and the answer.

The judgement is :func:`fp16probe.analysis.trial.judge_curves` and :func:`~fp16probe.analysis.trial.agreement`;
this module only says it.
"""

from __future__ import annotations

import math
from typing import Any

from fp16probe import formatting as num
from fp16probe.analysis.trial import (AGREES_ALARM, AGREES_FINE, ALARM_NOT_FELT, ALARMS, HURT_UNSEEN, agreement,
                                      judge_curves)
from fp16probe.presentation import escape
from fp16probe.sections import Trial, TrialEnd

__all__ = ["OFF_WORDS", "end_words", "trial_line"]

OFF_WORDS = {
    "pure_fp16": "the model came in fp16 (a .half() run), which has no autocast to train under",
    "format": "autocast computes in fp16 or bf16 only",
    "no_batch": "the profile kept no batch to train on",
    "distributed": "under torch.distributed every rank would train its own copies; run it in one process",
    "stopped": "a stop signal came before it finished",
}

_AGREEMENT = {
    AGREES_FINE: "as the verdict says, training does not feel the precision",
    AGREES_ALARM: "the verdict's alarm is borne out in training",
    ALARM_NOT_FELT: "the verdict's alarm ({verdict}) is about one step's numbers, and training over these steps "
                    "did not feel it",
    HURT_UNSEEN: "the verdict ({verdict}) raised no alarm, yet training left fp32's band: the harm is outside "
                 "what one step measures (a loss or statistic computed in low precision, or an effect that "
                 "builds up over steps)",
}


def _g(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else "not finite"


def _scaler(t: Trial) -> str:
    init = t.scaler.get("init_scale")
    if not t.scaler:
        return "no loss scaler"
    if isinstance(init, (int, float)) and init > 0 and math.log2(init).is_integer():
        return f"GradScaler init_scale 2^{int(math.log2(init))}"
    return f"GradScaler init_scale {init}" if init is not None else "GradScaler's defaults"


def end_words(end: TrialEnd, steps: int) -> str:
    """The emulated step at the weights the trial's first fp32 run ended on, in words: its verdict, worst parameter
    against its noise, and the fix that holds there."""
    alarm = end.verdict in ALARMS
    line = (f"at the weights fp32 training reached in {num.count(steps)} steps, the emulated step finds "
            + (escape.text(end.verdict) if alarm else f"no alarm ({escape.text(end.verdict)})"))
    if end.parameter is not None and end.error is not None:
        line += f": {escape.text(end.parameter)} {num.percent(end.error)} off fp32"
        if end.noise is not None:
            line += f", against batch-to-batch noise of {num.percent(end.noise)}"
    there = f" ({num.percent(end.fix_error)} off there)" if end.fix_error is not None else ""
    if end.fix_modules:
        line += (f"; fix: keep {', '.join(escape.text(m) for m in end.fix_modules)} in fp32 "
                 f"(fp16probe.keep_in_fp32){there}")
    elif end.fix_loss:
        line += f"; fix: compute the loss in fp32 (loss_fn(output.float(), ...) with autocast off){there}"
    elif alarm:
        line += "; no fix found there"
    if end.loss_error is not None and not end.fix_loss:
        line += f"; with the loss computed in fp32, {num.percent(end.loss_error)} off"
    return line


def trial_line(t: Trial, verdict: Any = None) -> str:
    """The trial in one line: where the low-precision curves ended against fp32's band, its cost, and how that
    stands to ``verdict`` (the report's, when given)."""
    fmt = escape.text(t.format)
    if t.off is not None:
        return f"not run: {OFF_WORDS.get(t.off, escape.text(t.off))}"
    band = judge_curves(t.fp32, t.low)
    how = (f"{t.target} autocast" if t.run == "autocast" else
           f"the emulated {escape.text(t.target)} step on {escape.text(t.device)}")
    fixed = f", {num.count(len(t.fixed))} module(s) kept in fp32" if t.fixed else ""
    where = "inside" if band.inside else "OUTSIDE"
    line = (f"{fmt} ({how}, {_scaler(t)}{fixed}) trained {num.count(t.steps)} {escape.text(t.optimizer)} steps x "
            f"{len(t.seeds)} data orders: last-{band.last}-step loss "
            f"{', '.join(_g(v) for v in band.target)} against fp32's {', '.join(_g(v) for v in band.fp32)} "
            f"(band top {_g(band.high)}): {where} fp32's seed band; "
            f"{num.count(sum(t.skipped))} skipped step(s); cost {num.count(t.steps * len(t.seeds) * 2)} training steps")
    if verdict is not None:
        line += "; " + _AGREEMENT[agreement(str(verdict), band)].format(verdict=escape.text(str(verdict)))
    if t.end is not None:
        line += "; " + end_words(t.end, t.steps)
    return line
