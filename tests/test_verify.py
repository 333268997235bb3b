"""fp16probe.verify / profile(verify=True) / profile --verify: the recommendation run for real."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import fp16probe
from fp16probe import InputError, Report, ReportError, Verification
from fp16probe.cli import EXIT_OK, EXIT_USAGE, app
from fp16probe.running.demo import DemoNet, demo_batches, demo_loss
from fp16probe.verification import tolerance_for


def small_gradient_model() -> nn.Module:
    """A narrow version of the demo: 16 tanh layers whose gradients shrink towards the input."""
    return DemoNet(depth=16, width=32)


def small_batches(n: int = 3):
    return [b for _, b in zip(range(n), demo_batches(width=32, batch=64))]


mse = demo_loss


@pytest.fixture(scope="module")
def verified() -> Report:
    return fp16probe.profile(small_gradient_model(), small_batches(), mse, steps=3, verify=True)


def test_verify_runs_the_recommendation_and_the_prediction_holds(verified):
    v = verified.verification
    rec = verified.recommendation
    assert v is not None and v.precision == "fp16" and v.device == "cpu" and v.steps == 3
    assert v.scaler_kwargs == dict(rec.grad_scaler_kwargs)
    assert v.scales[0] == rec.grad_scaler_kwargs.get("init_scale", 1.0)
    assert v.predicted_zeroed_fraction == rec.flushed_fraction_at_scale
    assert v.nonzero_values > 0 and v.measured_zeroed_fraction == v.zeroed_values / v.nonzero_values
    assert v.measured_overflow_steps == 0
    assert abs(v.measured_zeroed_fraction - v.predicted_zeroed_fraction) <= v.tolerance
    assert v.held


def test_at_scale_one_the_real_fp16_run_loses_what_the_profile_predicts(verified):
    """Independent of the recommendation: with no scaler, fp16 autocast zeroes the share the histograms flush at S = 1."""
    rec = dataclasses.replace(verified.recommendation, grad_scaler_kwargs={}, log2_scale=0,
                              flushed_fraction_at_scale=verified.recommendation.flushed_fraction_at_1,
                              overflow_steps_at_scale=0)
    v = fp16probe.verify(small_gradient_model(), verified.with_recommendation(rec), small_batches(), mse)
    assert rec.flushed_fraction_at_1 > 0.1  # the model does lose values at S = 1
    assert v.measured_zeroed_fraction == pytest.approx(rec.flushed_fraction_at_1, rel=0.1)
    assert v.held


def test_a_scale_that_overflows_is_caught(verified):
    """The check can fail: a doctored recommendation of S = 2^40 that claims no overflow does not hold."""
    kwargs = dict(verified.recommendation.grad_scaler_kwargs, init_scale=2.0**40, growth_interval=2000)
    rec = dataclasses.replace(verified.recommendation, grad_scaler_kwargs=kwargs, log2_scale=40,
                              overflow_steps_at_scale=0)
    v = fp16probe.verify(small_gradient_model(), verified.with_recommendation(rec), small_batches(), mse)
    assert v.measured_overflow_steps > 0
    assert v.scales[1] < v.scales[0]  # the real GradScaler backed off
    assert not v.held


def test_verification_round_trips_through_the_report_file(verified, tmp_path):
    path = verified.save(tmp_path / "r.json")
    loaded = Report.load(path)
    assert loaded.verification == verified.verification
    assert "verification" in json.loads(path.read_text())


def test_a_report_without_verification_has_no_key(tmp_path):
    report = fp16probe.profile(small_gradient_model(), small_batches(1), mse, steps=1)
    assert report.verification is None and "verification" not in report.to_dict()


@pytest.mark.parametrize("field,value", [
    ("held", "false"), ("measured_zeroed_fraction", -0.1), ("tolerance", float("nan")),
    ("measured_overflow_steps", 1.5), ("scales", [0.0]), ("scales", [float("inf")]), ("precision", 16),
    ("by_kind", {"activation_grad": {"zeroed_values": -1}}), ("by_kind", {"x": [[[]]]}), ("scaler_kwargs", {"a": [1]}),
])
def test_a_tampered_verification_is_refused(verified, field, value):
    d = verified.verification.to_dict()
    d[field] = value
    with pytest.raises(ReportError, match=f"verification.{field}"):
        Verification.from_dict(d)


def test_tolerance_is_relative_with_a_floor():
    assert tolerance_for(0.3) == pytest.approx(0.03)
    assert tolerance_for(1e-6) == 1e-4
    assert Verification.judge(0, 0, 0.01, 0.0109, 0.001) and not Verification.judge(0, 0, 0.01, 0.0111, 0.001)
    assert not Verification.judge(0, 1, 0.01, 0.01, 0.001)


@pytest.mark.parametrize("kwargs,match", [
    ({"precision": "fp16", "verify": True}, "verify= checks a prediction made from the fp32 reference"),
    ({"format": "fp8_e4m3", "verify": True}, "verify= runs the recommendation under torch.autocast"),
])
def test_verify_settings_refused_before_the_run(kwargs, match):
    with pytest.raises(InputError, match=match):
        fp16probe.profile(small_gradient_model(), small_batches(1), mse, steps=1, **kwargs)


def test_cli_verify_stores_and_shows_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()
    result = runner.invoke(app, ["profile", "--steps", "2", "--verify", "--out", "r.json"])
    assert result.exit_code == EXIT_OK, result.output
    assert Report.load("r.json").verification is not None
    shown = runner.invoke(app, ["show", "r.json"])
    assert "verification (fp16 autocast on cpu, 2 steps): prediction held" in shown.stderr
    explained = runner.invoke(app, ["show", "r.json", "--explain"])
    assert "verification: the recommendation run for real: fp16 autocast on cpu, 2 steps" in explained.stderr
    refused = runner.invoke(app, ["profile", "--steps", "2", "--verify", "--precision", "fp16", "--out", "f.json"])
    assert refused.exit_code == EXIT_USAGE and "error: --verify checks a prediction" in refused.stderr


def test_a_verified_report_meets_the_published_schema(verified):
    import jsonschema
    from importlib import resources

    schema = json.loads(resources.files("fp16probe").joinpath("schema/report.schema.json").read_text(encoding="utf-8"))
    jsonschema.validate(json.loads(verified.to_json()), schema)
    bad = json.loads(verified.to_json())
    bad["verification"]["held"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_summary_states_both_sides(verified):
    v = verified.verification
    assert v.summary.startswith(f"0 of 3 steps overflowed (0 predicted); {v.measured_zeroed_fraction * 100:.3g}% of")


def test_cli_verify_that_does_not_hold_exits_1_and_keeps_the_report(tmp_path, monkeypatch):
    from pathlib import Path

    from fp16probe.cli import EXIT_GATE

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures"))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(Verification, "judge", staticmethod(lambda *a: False))  # as if the real run disagreed
    result = CliRunner().invoke(app, ["profile", "cli_models:TinyMLP", "--input-shape", "5,8", "--steps", "2",
                                      "--verify", "--out", "r.json"])
    assert result.exit_code == EXIT_GATE, result.output
    assert "prediction did NOT hold" in result.stderr
    assert Report.load("r.json").verification.held is False


def test_verify_with_an_optimizer_starts_from_the_weights_before_the_profile():
    model = small_gradient_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    report = fp16probe.profile(model, small_batches(), mse, steps=3, optimizer="sgd", lr=0.1, verify=True)
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())  # the profile trained it
    v = report.verification
    assert v.steps == 3 and v.notes == () and v.held
    # verify() on a fresh model with the starting weights counts the same: the verification ran from the
    # weights before the profile, not from the trained ones
    again = fp16probe.verify(DemoNet(depth=16, width=32), report, small_batches(), mse)
    assert again.by_kind == v.by_kind


def test_a_verification_that_fails_on_computed_zeros_names_the_cause_and_where():
    """GELU-tanh written out (autograd saves tanh's output): the real fp16 run saves t = -1 in saturation and
    zeroes gradients that fp32 puts far above the flush threshold at S. The prediction (each fp32 value times S,
    rounded once) keeps them, so it does not hold, and the answer says why and where, counted as plain torch
    counts them."""
    import torch.nn.functional as F

    from fp16probe.presentation.answer import short_answer, verification_cause
    from tests.test_emulate import _ExplicitTanhGELU

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), _ExplicitTanhGELU(), nn.Linear(64, 4))
    with torch.no_grad():
        model[0].weight.mul_(4)  # pre-activations reach -4 and below: tanh rounds to -1 in fp16
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g))
    report = fp16probe.profile(model, [batch], lambda out, b: F.mse_loss(out, b[1]), steps=1, target="cpu",
                               verify=True)
    v = report.verification
    assert not v.held and v.measured_overflow_steps == 0
    scale = v.scales[0]

    def fc_out_grad(low: bool) -> torch.Tensor:  # plain torch: module 0's output gradient, fp32 or fp16 x S
        got = []

        def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
            out.register_hook(lambda gr: got.append(gr.float()))

        h = model[0].register_forward_hook(keep)
        try:
            with torch.autocast("cpu", dtype=torch.float16, enabled=low):
                loss = F.mse_loss(model(batch[0]), batch[1])
            (loss.float() * (scale if low else 1.0)).backward()
        finally:
            h.remove()
            model.zero_grad(set_to_none=True)
        return got[0]

    ref, real = fc_out_grad(False), fc_out_grad(True)
    zeroed = (ref != 0) & (real == 0)
    computed = zeroed & (ref.abs() * scale > 2.0**-25)
    assert int(computed.sum()) > 0.01 * int((ref != 0).sum())  # saturation zeroes a few percent for real
    row = dict((r[0], r[1:]) for r in v.zeroed_by_module)["0"]
    assert row == (int((ref != 0).sum()), int(zeroed.sum()), int(computed.sum()))
    cause = verification_cause(v)
    assert "first in backward order at 0" in cause and "computed them as zero" in cause
    line = next(x.text for x in short_answer(report, report.recommendation) if x.kind == "verification")
    assert "did NOT hold" in line and cause in line
    back = Report.from_dict(json.loads(report.to_json()))
    assert back.verification.zeroed_by_module == v.zeroed_by_module


def test_the_cause_tells_flushed_small_values_from_computed_zeros(verified):
    from fp16probe.presentation.answer import verification_cause

    v = verified.verification
    base = dataclasses.replace(v, predicted_zeroed_fraction=0.0, measured_zeroed_fraction=0.5, tolerance=1e-4)
    small = dataclasses.replace(base, zeroed_by_module=(("a", 100, 10, 0), ("b", 100, 40, 5)))
    assert "45 of the 50 values the run zeroed are small ones" in verification_cause(small)
    assert "most at b, 35 of 100" in verification_cause(small)
    computed = dataclasses.replace(base, zeroed_by_module=(("a", 100, 10, 0), ("b", 100, 40, 30), ("c", 90, 50, 40)))
    words = verification_cause(computed)
    assert "70 of the 100 values the run zeroed were not small" in words
    assert "first in backward order at b (30 of its 100), most at c (40 of 90)" in words
    assert verification_cause(dataclasses.replace(computed, measured_zeroed_fraction=0.0)) == ""  # it held
    assert verification_cause(dataclasses.replace(base, zeroed_by_module=())) == ""  # an older report: no counts
    with pytest.raises(ReportError):
        Verification.from_dict({**v.to_dict(), "zeroed_by_module": [["a", 1, 2, 0]]})  # zeroed above nonzero
