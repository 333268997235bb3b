"""The training trial (profile(..., trial=STEPS), --trial): its band, its section, its refusals, and its
conclusion against plain-torch training of the evidence models (tests/fixtures/evidence_models.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import fp16probe
from bench.evidence import order, train
from fp16probe.analysis.trial import (AGREES_ALARM, ALARM_NOT_FELT, ALARMS, HURT_UNSEEN, agreement, judge_curves,
                                      last_mean)
from fp16probe.errors import InputError, ReportFieldError
from fp16probe.presentation.answer import section_lines
from fp16probe.report import Report
from fp16probe.running.trial import TRIAL_SEEDS, data_order
from fp16probe.sections import Trial, TrialEnd
from tests.fixtures.cli import one_error_line, prepare_cli_env, run
from tests.fixtures.evidence_models import CASES

STEPS = 60


def test_the_band_is_fp32s_spread_around_its_seeds_and_one_sided():
    """Last fifth of the steps; band = [min - spread, max + spread] of fp32's seeds; only worse is outside."""
    fp32 = [[5.0] * 8 + [1.0, 1.0], [5.0] * 8 + [1.2, 1.2]]  # last 2 steps: 1.0 and 1.2, spread 0.2
    band = judge_curves(fp32, [[9.0] * 8 + [1.39, 1.39], [0.1] * 10])
    assert band.last == 2 and band.fp32 == (1.0, 1.2)
    assert math.isclose(band.low, 0.8) and math.isclose(band.high, 1.4)
    assert band.inside  # 1.39 under the top; 0.1 trained better than fp32
    assert not judge_curves(fp32, [[1.0] * 10, [1.41] * 10]).inside
    assert not judge_curves(fp32, [[1.0] * 10, [1.0] * 9 + [math.nan]]).inside
    assert not judge_curves(fp32, [[1.0] * 10, [1.0] * 5]).inside  # a run that stopped early
    same = judge_curves([[1.0] * 10, [1.0] * 10], [[1.019] * 10])  # no spread: the 2% floor
    assert same.inside and not judge_curves([[1.0] * 10, [1.0] * 10], [[1.021] * 10]).inside
    assert math.isnan(last_mean([1.0, math.inf], 2))


def test_agreement_codes():
    inside, outside = judge_curves([[1.0], [1.0]], [[1.0]]), judge_curves([[1.0], [1.0]], [[2.0]])
    assert agreement("gradient_error", inside) == ALARM_NOT_FELT
    assert agreement("forward_underflow", outside) == AGREES_ALARM
    assert agreement("none_needed", outside) == HURT_UNSEEN


def test_data_orders_are_permutations_per_pass_and_match_the_evidence_script():
    o = data_order(4, 10, 3)
    assert sorted(o[:4]) == [0, 1, 2, 3] and sorted(o[4:8]) == [0, 1, 2, 3] and len(o) == 10
    assert o == order(4, 10, 3) and data_order(4, 10, 4) != o


def test_the_section_round_trips_and_refuses_a_bad_field():
    t = Trial(steps=3, seeds=(0, 1), format="fp16", scaler={"init_scale": 65536.0}, batches=2, fixed=("fc",),
              fp32=((1.0, 0.5, 0.25), (1.0, 0.6, 0.3)), low=((1.0, 0.5, math.inf), (1.0, math.nan)),
              skipped=(1, 0))
    back = Trial.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.fp32 == t.fp32 and back.low[0][2] == math.inf and math.isnan(back.low[1][1])
    assert back.scaler == t.scaler and back.fixed == t.fixed and back.skipped == t.skipped
    assert Trial.from_dict({"steps": 5, "off": "pure_fp16"}).off == "pure_fp16"  # fields an older writer left out
    d = t.to_dict()
    d["low"] = [[1.0, "x"]]
    with pytest.raises(ReportFieldError) as e:
        Trial.from_dict(d)
    assert e.value.field == "trial.low[0][1]"
    with pytest.raises(ReportFieldError):
        Trial.from_dict({**t.to_dict(), "run": "guessed"})
    end = TrialEnd(verdict="gradient_error", parameter="body.2.bias", error=3.56, noise=1.14, fix_modules=("body.2",),
                   fix_error=0.034, loss_error=math.inf)
    back = Trial.from_dict(json.loads(json.dumps(dataclasses.replace(t, end=end).to_dict())))
    assert back.end == end and Trial.from_dict(t.to_dict()).end is None
    with pytest.raises(ReportFieldError) as e:
        Trial.from_dict({**t.to_dict(), "end": {"verdict": "none_needed", "fix_modules": "body.2"}})
    assert e.value.field == "trial.end.fix_modules"


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10", 10**6])
def test_a_bad_trial_value_is_refused_before_anything_runs(bad):
    with pytest.raises(InputError) as e:
        fp16probe.profile(torch.nn.Linear(2, 2), [torch.ones(1, 2)], trial=bad)
    assert e.value.parameter == "trial"


def test_a_trial_needs_an_fp32_profile_and_an_autocast_format():
    with pytest.raises(InputError, match="profile in fp32"):
        fp16probe.profile(torch.nn.Linear(2, 2), [torch.ones(1, 2)], precision="fp16", trial=5)
    with pytest.raises(InputError, match="fp16 or bf16"):
        fp16probe.profile(torch.nn.Linear(2, 2), [torch.ones(1, 2)], format="fp8_e4m3", trial=5)


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_the_command_line_refuses_a_bad_trial_with_exit_2(monkeypatch, tmp_path, value):
    prepare_cli_env(monkeypatch, tmp_path)
    result = run("profile", "--trial", value, "--steps", "1")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert line.startswith(f"error: --trial {value}: expected a whole number of training steps") or (
        value == "many" and "Invalid value for '--trial'" in line)


def _real_band(name: str, scaler_kwargs: dict | None):
    """fp32's band and the real low-precision runs, in plain torch (bench/evidence.py's training loop)."""
    case = CASES[name]
    fp32 = [train(case, "fp32", s, STEPS)[0] for s in range(TRIAL_SEEDS)]
    low = [train(case, case.format, s, STEPS, scaler_kwargs)[0] for s in range(TRIAL_SEEDS)]
    return judge_curves(fp32, low)


@pytest.fixture
def one_thread():
    """Tiny models: one thread each (two threads on a loaded 2-core machine spin: 10x the CPU time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "naive_variance", "forward_flush"])
def test_the_trial_concludes_as_real_training_does(name, one_thread):
    """One evidence model that trains like fp32 (mlp) and two that low precision hurts: the trial's band and
    verdict agreement equal plain-torch training's at the same settings, data orders and weights."""
    case = CASES[name]
    data = case.data()
    report = fp16probe.profile(case.build(), data, case.loss, steps=len(data), format=case.format, target="cpu",
                               optimizer="adam", lr=case.lr, trial=STEPS)
    t = report.section("trial")
    assert t.off is None and t.run == "autocast" and len(t.low) == TRIAL_SEEDS and t.steps == STEPS
    mine = judge_curves(t.fp32, t.low)
    real = _real_band(name, dict(t.scaler) or None)
    assert mine.inside == real.inside == (name == "mlp")
    assert [round(v, 3) for v in mine.fp32] == [round(v, 3) for v in real.fp32]
    line = next(x for x in section_lines(report) if x.startswith("trial: "))
    assert ("inside fp32's seed band" in line) == mine.inside
    back = Report.from_dict(json.loads(report.to_json()))
    assert back.section("trial") == t


def test_the_trial_leaves_the_model_as_it_was():
    case = CASES["mlp"]
    model = case.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fp16probe.profile(model, case.data()[:2], case.loss, steps=2, target="cpu", trial=3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_plot_draws_the_curves_and_the_band():
    pytest.importorskip("matplotlib")
    from fp16probe.presentation.figures import figure, plot_trial

    case = CASES["mlp"]
    report = fp16probe.profile(case.build(), case.data()[:2], case.loss, steps=2, target="cpu", trial=5)
    ax = plot_trial(report)
    gids = {line.get_gid() for line in ax.get_lines()} | {c.get_gid() for c in ax.collections}
    assert {"trial:fp32:0", "trial:low:2", "trial:band"} <= gids
    assert len(ax.get_lines()[0].get_ydata()) == 5
    fig = figure(report)
    assert any(a.get_title().startswith("training trial") for a in fig.axes)
    old = figure(Report.from_dict({**json.loads(report.to_json()), "sections": {}}))
    assert not any(a.get_title().startswith("training trial") for a in old.axes)


def test_a_report_with_a_trial_meets_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    from tests.test_report_schema import report_schema

    case = CASES["mlp"]
    report = fp16probe.profile(case.build(), case.data()[:2], case.loss, steps=2, target="cpu", trial=2)
    d = json.loads(report.to_json())
    jsonschema.validate(d, report_schema())
    d["sections"]["trial"]["run"] = "guessed"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, report_schema())


def test_off_its_device_the_trial_runs_the_emulated_target_step():
    """A CUDA target profiled on a CPU: the low-precision runs are the emulated CUDA step, not CPU autocast
    (whose curve it would otherwise equal), and the first step's loss is the fp32 one rounded as CUDA would."""
    case = CASES["naive_variance"]
    report = fp16probe.profile(case.build(), case.data()[:2], case.loss, steps=2, target="cuda", trial=3)
    t = report.section("trial")
    assert t.run == "emulated" and t.target == "cuda" and t.device == "cpu"
    assert len(t.low) == TRIAL_SEEDS and all(len(c) == 3 for c in t.low)
    assert t.low[0][0] != t.fp32[0][0]  # the cancelling variance: fp16 arithmetic changes the very first loss


@pytest.fixture(scope="module")
def fine_report():
    case = CASES["mlp"]
    return fp16probe.profile(case.build(), case.data()[:2], case.loss, steps=2, target="cpu", trial=2)


def _with_curves(report: Report, low: tuple[tuple[float, ...], ...]) -> Report:
    d = json.loads(report.to_json())
    d["sections"]["trial"].update(fp32=[[1.0, 0.5], [1.0, 0.52], [1.0, 0.51]], low=[list(c) for c in low])
    return Report.from_dict(d)


@pytest.mark.parametrize("low, hurt", [(((1.0, 0.5), (1.0, 0.51), (1.0, 0.49)), False),
                                       (((1.0, 0.9), (1.0, 0.5), (1.0, 0.5)), True),
                                       (((1.0, math.nan), (1.0, 0.5), (1.0, 0.5)), True)])
def test_a_trial_that_leaves_the_band_under_a_fine_verdict_is_an_alarm(fine_report, low, hurt):
    """A verdict that raised no alarm, whose trial trained outside fp32's band: the answer says so under its
    headline, profile exits 1 (as a verification that did not hold) and the CI gate's trial check fails."""
    from fp16probe.analysis.gate import compare, snapshot
    from fp16probe.cli import _exit_code
    from fp16probe.presentation.answer import brief_answer
    from fp16probe.presentation.gate import check_message

    assert str(fine_report.recommendation.verdict) not in ALARMS
    report = _with_curves(fine_report, low)
    lines = brief_answer(report, report.recommendation)
    said = [x.text for x in lines if x.text.startswith("but trained for real, this is not fine")]
    assert bool(said) == hurt and lines[0].kind == "verdict"
    if hurt:
        assert lines[1].text == said[0] and "OUTSIDE fp32's seed band over 2 steps x 3 data orders" in said[0]
    assert _exit_code(report) == (1 if hurt else 0)
    snap = snapshot(report, report.recommendation)
    check = next(c for c in compare(snap, snap).checks if c.name == "trial")
    assert check.passed != hurt
    assert ("although the verdict called the settings fine" in check_message(check)) == hurt
    old = Report.from_dict({**json.loads(report.to_json()), "sections": {}})  # no trial: no check, exit 0
    assert "trial" not in {c.name for c in compare(snapshot(old, old.recommendation), snapshot(old, old.recommendation)).checks}
    assert _exit_code(old) == 0


def test_a_trial_that_bears_out_an_alarm_is_no_failure(fine_report):
    import dataclasses

    from fp16probe.cli import _exit_code
    from fp16probe.presentation.answer import short_answer
    from fp16probe.recommendation import Verdict

    report = _with_curves(fine_report, ((1.0, 0.9), (1.0, 0.9), (1.0, 0.9)))
    alarm = dataclasses.replace(report.recommendation, verdict=Verdict.GRADIENT_ERROR)
    assert not [x for x in short_answer(report, alarm) if x.text.startswith("but trained for real")]
    d = json.loads(report.to_json())
    d["recommendation"]["verdict"] = "gradient_error"
    assert _exit_code(Report.from_dict(d)) == 0
