"""The evidence models (tests/fixtures/evidence_models.py) trained for real: the tool's alarm against training.

Each of the eight models is profiled with a training trial (``profile(..., trial=STEPS)``) and trained
again here in plain torch (bench/evidence.py's loop: Adam from the same weights, fp32 and the target
precision under CPU autocast, fp16 with ``torch.amp.GradScaler("cpu")`` at the answer's settings, three
data orders). The band is fp16probe.analysis.trial.judge_curves's, computed here from the plain-torch
curves. Asserted for each model: which side of fp32's band it trains on (both kinds are present), that
the tool raises an alarm exactly when training is hurt, and that the trial concludes as plain torch does.
The two models whose harm the tool does not see today are marked ``xfail(strict=True)``: a fix flags them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
import torch

import fp16probe
from bench.evidence import scaler_settings, train, trained_fp32
from fp16probe.analysis.effect import NOISE_SHARE
from fp16probe.analysis.trial import ALARMS, Band, judge_curves
from fp16probe.report import Report
from fp16probe.running.trial import TRIAL_SEEDS
from tests.fixtures.evidence_models import CASES

pytestmark = pytest.mark.slow

STEPS = 60
# Which models low precision hurts (outside fp32's seed band at STEPS steps, docs/evidence.md), and why.
HURT = {
    "naive_variance": "E[x^2]-E[x]^2 cancels in fp16",
    "forward_flush": "activations x 2^-26 flush in the forward pass",
    "offset_regression_bf16": "bf16's spacing 0.125 at the output 16 is a loss floor",
    "kl_distillation_bf16": "the KL loss is computed in bf16",
}
FINE = ("mlp", "bn_resnet_raw_pixels", "loss_weight_2^-24", "offset_regression_fp16")
MISSED = {
    "offset_regression_bf16": "the harm is a loss floor reached near convergence: at the profiled (initial) weights "
                              "bf16's error is 0.15 of the gradient noise, at trained weights 2.5 (docs/evidence.md)",
    "kl_distillation_bf16": "at the profiled (initial) weights the bf16 loss's error is under a tenth of the gradient "
                            "noise; at trained weights it is an alarm (docs/evidence.md)",
}


@functools.cache
def _runs(name: str) -> tuple[Report, Band]:
    """The tool's report with its trial, and the plain-torch band at the answer's settings (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: two threads on a loaded 2-core machine spin
    try:
        case = CASES[name]
        data = case.data()
        report = fp16probe.profile(case.build(), data, case.loss, steps=len(data), format=case.format,
                                   target="cpu", optimizer="adam", lr=case.lr, trial=STEPS)
        kwargs: dict[str, Any] | None = scaler_settings(report.recommendation) if case.format == "fp16" else None
        fp32 = [train(case, "fp32", s, STEPS)[0] for s in range(TRIAL_SEEDS)]
        low = [train(case, case.format, s, STEPS, kwargs)[0] for s in range(TRIAL_SEEDS)]
        return report, judge_curves(fp32, low)
    finally:
        torch.set_num_threads(threads)


def test_both_kinds_are_present():
    assert len(FINE) + len(HURT) == len(CASES) >= 8 and set(FINE) | set(HURT) == set(CASES)
    assert len(FINE) >= 3 and len(HURT) >= 3


@pytest.mark.parametrize("name", list(CASES))
def test_the_model_trains_on_its_side_of_fp32s_band(name):
    """Plain torch alone: the fine models end inside fp32's seed band, the hurt ones outside."""
    _, real = _runs(name)
    assert real.inside == (name not in HURT), (real.fp32, real.target, real.high)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=MISSED[n]))
                                  if n in MISSED else n for n in CASES])
def test_the_tool_alarms_exactly_when_training_is_hurt(name):
    report, real = _runs(name)
    alarm = str(report.recommendation.verdict) in ALARMS
    assert alarm == (not real.inside), str(report.recommendation.verdict)


@pytest.mark.parametrize("name", list(CASES))
def test_the_trial_concludes_as_plain_torch_training_does(name):
    report, real = _runs(name)
    t = report.section("trial")
    assert t is not None and t.off is None and t.steps == STEPS and len(t.low) == TRIAL_SEEDS
    mine = judge_curves(t.fp32, t.low)
    assert mine.inside == real.inside
    assert [round(v, 3) for v in mine.fp32] == [round(v, 3) for v in real.fp32]


@pytest.mark.parametrize("name", list(CASES))
def test_with_its_trial_the_answer_says_hurt_exactly_when_training_is(name):
    """The answer with its trial (profile --trial): an alarm verdict, or under a fine verdict the trial's
    counterweight below the headline, exactly on the models plain-torch training puts outside fp32's band (the
    two the one-step verdict misses included); profile exits 1 on the counterweight, as on a failed --verify."""
    from fp16probe.cli import _exit_code
    from fp16probe.presentation.answer import short_answer

    report, real = _runs(name)
    rec = report.recommendation
    refuted = any(x.text.startswith("but trained for real, this is not fine") for x in short_answer(report, rec))
    assert (str(rec.verdict) in ALARMS or refuted) == (not real.inside)
    assert _exit_code(report) == (1 if refuted else 0)
    assert refuted == (name in MISSED)


@pytest.mark.parametrize("name", list(CASES))
def test_where_the_trial_finds_a_harm_the_answer_looks_where_fp32_training_ended(name):
    """On the two models the one-step verdict misses, the trial's harm comes with the emulated step at the weights
    its first fp32 run ended on: the bf16 loss floor is gradient_error there with its fix (body.2 in fp32), which
    trains inside fp32's band for real; the KL loss rounds mostly in the loss (the step with the loss in fp32 is a
    fraction as far off). The others carry no such judgement: their trial found no unseen harm."""
    from fp16probe.presentation.answer import short_answer

    report, _ = _runs(name)
    end = report.section("trial").end
    assert (end is not None) == (name in MISSED)
    if end is None:
        return
    said = next(x.text for x in short_answer(report, report.recommendation) if x.text.startswith("but trained"))
    assert f"at the weights fp32 training reached in {STEPS} steps, the emulated step finds" in said
    jsonschema = pytest.importorskip("jsonschema")
    from tests.test_report_schema import report_schema

    jsonschema.validate(json.loads(report.to_json()), report_schema())
    if name == "offset_regression_bf16":
        # written: body.0.weight 129% against noise 95%; with body.2 in fp32 3.42% off
        assert end.verdict == "gradient_error" and end.fix_modules == ("body.2",) and end.fix_error < 0.05
        assert end.error > NOISE_SHARE * end.noise and "fix: keep body.2 in fp32" in said
        case = CASES[name]
        kept = fp16probe.keep_in_fp32(case.build(), ["body.2"], device_type="cpu")
        fp32 = [train(case, "fp32", s, STEPS)[0] for s in range(TRIAL_SEEDS)]
        assert judge_curves(fp32, [train(case, "bf16", s, STEPS, model=kept)[0] for s in range(TRIAL_SEEDS)]).inside
    else:
        # written: no alarm there (body.2.weight 35.4% against 85.4%), 6.48% off with the loss in fp32
        assert end.loss_error is not None and end.loss_error < 0.5 * end.error
        assert "with the loss computed in fp32" in said


LATE = 200  # fp32 steps before the late profile: docs/evidence.md's "after fp32 training" column


@functools.cache
def _late(name: str) -> Report:
    """The tool's answer on the weights of LATE fp32 Adam steps (seed 0's data order), near the end of training."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = CASES[name]
        data = case.data()[:4]
        return fp16probe.profile(trained_fp32(case, LATE), data, case.loss, steps=len(data), format=case.format,
                                 target="cpu")
    finally:
        torch.set_num_threads(threads)


def test_profiled_near_convergence_the_bf16_loss_floor_is_an_alarm_with_its_fix():
    """The miss of offset_regression_bf16 is where the profile looks, not the line: on trained weights the
    output's rounding is several times the gradient noise, and the fix keeps the output layer in fp32."""
    rec = _late("offset_regression_bf16").recommendation
    assert str(rec.verdict) == "gradient_error"
    em = rec.evidence["emulated"]
    name, error, noise = em["worst_parameters"][0]
    assert name.startswith("body.2.") and error > 2 * noise  # 356% against 114% when written
    assert em["fix"]["keep_fp32"] == ["body.2"] and em["fix"]["error"] < 0.05


def test_profiled_near_convergence_the_bf16_kl_loss_is_an_alarm():
    """The loss reads the autocast state and computes in bf16; the emulated step answers that state as the bf16
    run would, so the loss's rounding is measured. On trained weights it is a material share of the noise. No
    module kept in fp32 fixes it (the rounding is in the loss, outside the model): tests/test_loss_fix.py has its fix."""
    rec = _late("kl_distillation_bf16").recommendation
    assert str(rec.verdict) == "gradient_error"
    name, error, noise = rec.evidence["emulated"]["worst_parameters"][0]
    assert error > NOISE_SHARE * noise  # body.2.weight 69.8% against 81.8% when written


@pytest.mark.parametrize("name", ["offset_regression_fp16", "bn_resnet_raw_pixels"])
def test_profiled_near_convergence_the_fine_models_stay_fine(name):
    """Fine in training, fine on trained weights too: their error is within NOISE_SHARE of the noise. The fp16
    regressor sits at 0.45 of it (52% against 114% when written): a line much under 0.5 would alarm on it."""
    rec = _late(name).recommendation
    assert str(rec.verdict) not in ALARMS
    within = [c for c in rec.caveats if c.code == "error_within_noise"]
    assert within and within[0].data["error"] <= NOISE_SHARE * within[0].data["noise"]
