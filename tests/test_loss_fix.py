"""A loss computed in the low format: the emulated step measures the loss computed in fp32 as a fix.

A distillation loss written to compute in the run's precision rounds in bf16 outside the model, where no
module kept in fp32 helps. The emulated step then also runs with the loss in fp32 (the ops outside the
model unrounded, reading autocast off: ``fp16probe.emulation.LOSS``), and the answer offers that in words
when it brings every parameter within tolerance, or says what it measured when it does not. Checked
against real CPU bf16 autocast written in plain torch, with the loss computed both ways.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe.capture.emulate import emulated_step
from fp16probe.emulation import LOSS
from fp16probe.presentation.answer import short_answer
from tests.fixtures.evidence_models import close_student, kl_in_run_precision


def _in_fp32(loss):
    """The answer's fix: the loss on the output cast to fp32, with autocast off."""
    def fixed(out, batch):
        with torch.autocast("cpu", enabled=False):
            return loss(out.float(), batch)

    return fixed


def _real(model: nn.Module, loss, batch: tuple[torch.Tensor, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    """Plain torch: fp32, bf16 autocast with ``loss`` as written, or bf16 with the loss as the answer's fix."""
    m = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how != "fp32"):
        out = m(batch[0])
        value = _in_fp32(loss)(out, batch) if how == "loss_in_fp32" else loss(out, batch)
    value.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _error(g: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor]) -> float:
    num = sum(float((g[n] - ref[n]).square().sum()) for n in ref)  # type: ignore[operator]
    return (num / sum(float(r.square().sum()) for r in ref.values())) ** 0.5


def _worst(g: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((g[n] - ref[n]).norm() / ref[n].norm()) for n in ref)


def test_the_loss_kept_in_fp32_is_emulated_as_the_real_run_with_the_loss_in_fp32():
    model, batch = close_student()
    fp32 = _real(model, kl_in_run_precision, batch, "fp32")
    real_low = _error(_real(model, kl_in_run_precision, batch, "bf16"), fp32)
    real_fixed = _error(_real(model, kl_in_run_precision, batch, "loss_in_fp32"), fp32)
    m = copy.deepcopy(model)
    low = emulated_step(m, lambda: kl_in_run_precision(m(batch[0]), batch), format="bf16", target="cpu")
    fixed = emulated_step(m, lambda: kl_in_run_precision(m(batch[0]), batch), format="bf16", target="cpu", keep_fp32=[LOSS])
    e_low, e_fixed = _error(low.grads, fp32), _error(fixed.grads, fp32)
    # written: real 21.0% as written, 12.9% with the loss in fp32; emulated 18.7% and 12.9%. What stays with the
    # loss in fp32 is the model's own bf16 rounding (the student is close to its teacher: a small gradient), in
    # the emulated step as in the real one: keeping the loss does not keep the model's modules.
    assert real_fixed < 0.75 * real_low and e_fixed < 0.75 * e_low, (real_low, real_fixed, e_low, e_fixed)
    assert 0.8 * real_fixed < e_fixed < 1.25 * real_fixed, (real_fixed, e_fixed)
    assert 0.5 * real_low < e_low < 2 * real_low, (real_low, e_low)
    assert low.loss_low and not fixed.loss_low


class _Island(nn.Module):
    """The student run in fp32 inside the bf16 run (its own autocast-off island): only the loss rounds."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.body(x)


def test_the_answer_offers_the_loss_in_fp32_when_it_holds_and_the_real_run_bears_it_out():
    student, batch = close_student()
    model = _Island(student)
    # one batch: no batch-to-batch noise to judge against, so the 5% tolerance alone decides (the answer says so)
    report = fp16probe.profile(copy.deepcopy(model), [batch], kl_in_run_precision, steps=1, format="bf16", target="cpu")
    rec = report.recommendation
    assert str(rec.verdict) == "gradient_error"
    em = rec.evidence["emulated"]
    assert em["loss_fix_holds"] is True and rec.evidence["fix_loss"] is True and LOSS not in rec.evidence["fix_modules"]
    text = [x.text for x in short_answer(report, rec)]
    line = next(t for t in text if t.startswith("fix: compute the loss in fp32"))
    assert "torch.autocast('cpu', enabled=False)" in line and "output.float()" in line
    assert not any(t.startswith("no fix found") for t in text)
    assert "made in the loss, outside the model" in text[0]
    fp32 = _real(model, kl_in_run_precision, batch, "fp32")
    fixed = _worst(_real(model, kl_in_run_precision, batch, "loss_in_fp32"), fp32)
    assert fixed < em["tolerance"] < _worst(_real(model, kl_in_run_precision, batch, "bf16"), fp32)


@pytest.mark.slow
def test_on_the_distilled_student_near_convergence_the_loss_in_fp32_is_the_fix_training_bears_out():
    """The evidence model (tests/fixtures/evidence_models.py) after 200 fp32 steps: the loss in fp32 leaves the
    model's own bf16 rounding, over 5% but well under half the gradient noise, so it is offered as the fix (the
    line the alarm is judged by); trained for real in bf16 with the loss in fp32, the student ends inside fp32's
    seed band, as written outside it."""
    from bench.evidence import train, trained_fp32
    from fp16probe.analysis.trial import judge_curves
    from tests.fixtures.evidence_models import CASES

    case = CASES["kl_distillation_bf16"]
    data = case.data()[:4]
    model = trained_fp32(case, 200)
    report = fp16probe.profile(copy.deepcopy(model), data, case.loss, steps=len(data), format="bf16", target="cpu")
    rec = report.recommendation
    em = rec.evidence["emulated"]
    assert str(rec.verdict) == "gradient_error" and em["fix_holds"] is False and em["loss_fix_holds"] is True
    # 68.9% off as written, 15.6% with the loss in fp32, against noise of 81% (whole model) when written
    assert 0.05 < em["loss_fix"]["error"] < 0.5 * em["error"]
    worst = em["loss_fix"]["worst_parameters"][0]
    assert worst[1] < em["noise_share"] * worst[2]
    text = [x.text for x in short_answer(report, rec)]
    assert any(t.startswith("fix: compute the loss in fp32") for t in text)
    # real bf16 gradients on the first batch, the loss as written and in fp32: the same order as the emulated
    ref = _real(model, case.loss, data[0], "fp32")
    real_low = _error(_real(model, case.loss, data[0], "bf16"), ref)
    real_fixed = _error(_real(model, case.loss, data[0], "loss_in_fp32"), ref)
    assert 0.05 < real_fixed < 0.5 * real_low, (real_low, real_fixed)
    # and training: 60 steps x 3 data orders from the initial weights, as tests/test_evidence.py trains it
    fixed = dataclasses.replace(case, loss=_in_fp32(case.loss))
    fp32 = [train(case, "fp32", s, 60)[0] for s in range(3)]
    assert judge_curves(fp32, [train(fixed, "bf16", s, 60)[0] for s in range(3)]).inside
    assert not judge_curves(fp32, [train(case, "bf16", s, 60)[0] for s in range(3)]).inside



@pytest.mark.slow
def test_a_loss_held_in_fp16_caps_the_scale_and_a_real_fp16_step_bears_it_out():
    """The forward audit runs the loss in fp32 (it reads autocast off there); the emulated step holds it in fp16.
    Its seed gradient is then S as an fp16 number, inf from 65520: the verdict's S is capped at 2^15 with the
    loss_fp16 caveat, and the bf16 answer's fp16 comparison is measured at that S. Real CPU fp16 autocast: finite
    at 2^15, not finite at 2^16 and at the uncapped S."""
    from bench.evidence import trained_fp32
    from fp16probe.analysis.recommend import analyze
    from tests.fixtures.evidence_models import CASES

    case = CASES["kl_distillation_bf16"]
    data = case.data()[:4]
    model = trained_fp32(case, 200)
    report = fp16probe.profile(copy.deepcopy(model), data, case.loss, steps=len(data), format="fp16", target="cpu")
    rec = report.recommendation
    assert report.forward.audit["loss_fp16_seen_by"] == "the emulated step"
    assert rec.log2_scale == 15 and any(c.code == "loss_fp16" for c in rec.caveats)
    uncapped = analyze(report, "fp16").evidence["log2_scale_without_loss_cap"]
    assert uncapped > 15  # 2^19 when written
    bf16 = fp16probe.profile(copy.deepcopy(model), data, case.loss, steps=len(data), format="bf16", target="cpu")
    assert bf16.recommendation.evidence["emulated"]["fp16"]["log2_scale"] == 15

    def finite(log2_scale: int) -> bool:
        m = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = case.loss(m(data[0][0]), data[0])
        (loss * torch.full((1,), 2.0**log2_scale)).backward()
        return all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())

    assert finite(15) and not finite(16) and not finite(uncapped)
