"""The schedule judged on the run's own history (issue 20): every step recorded, replayed exactly.

The real run is written here with plain torch: a few hundred fp16 autocast steps under a real
``torch.amp.GradScaler("cpu")`` whose small growth_interval makes it grow and back off while the
inputs grow (the gradients drift), probed with ``Probe(every=10)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fp16probe import Probe, Report
from fp16probe.analysis.recommend import analyze
from fp16probe.sections import CaptureNotes
from fp16probe.analysis.replay import ScalerRule, replay_scaler
from fp16probe.analysis.schedule import DEFAULTS, OWN, judge_schedules
from fp16probe.presentation.schedule import rule_label, schedule_answer
from fp16probe.report import Metadata, StepHistory
from tests.fixtures.cli import one_error_line, prepare_cli_env, run

STEPS = 240


def _drifting_run(steps: int = STEPS):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10)
    probe = Probe(model, scaler=scaler, every=10).start()
    g = torch.Generator().manual_seed(1)
    real = {"scale": [], "found_inf": [], "grad_max": []}
    for step in range(steps):
        x = torch.randn(16, 16, generator=g) * (1 + step / 80)  # the gradients drift upward
        y = torch.randint(0, 10, (16,), generator=g)
        loss_fn = nn.functional.cross_entropy
        probe.shadow(lambda x=x, y=y: loss_fn(model(x), y))  # the fp32 reference on its schedule
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        s = scaler.get_scale()
        raw = torch.stack([p.grad.abs().max() for p in model.parameters()]).max()
        real["scale"].append(s)
        real["grad_max"].append(float((raw.double() / s).float()))
        scaler.step(opt)
        scaler.update()
        real["found_inf"].append(scaler.get_scale() < s)  # GradScaler backs off exactly on found_inf
        opt.zero_grad()
        probe.step()
    probe.stop()
    return probe.report(), real


@pytest.fixture(scope="module")
def drifting(tmp_path_factory):
    report, real = _drifting_run()
    path = report.save(tmp_path_factory.mktemp("schedule") / "run.json")
    return report, real, path


def test_the_report_holds_every_step(drifting):
    report, real, _ = drifting
    h = report.history
    assert len(h) == STEPS and h.steps == tuple(range(STEPS))
    assert len(report.trace) == STEPS // 10  # histograms stay on sampled steps
    assert list(h.scale) == real["scale"]
    assert list(h.found_inf) == real["found_inf"]
    assert 5 <= sum(real["found_inf"]) and len(set(real["scale"])) >= 4  # it grew and backed off
    finite = [(a, b) for a, b in zip(h.grad_max, real["grad_max"]) if math.isfinite(b)]
    assert all(a == b for a, b in finite)
    assert all(not math.isfinite(a) for a, f in zip(h.grad_max, real["found_inf"]) if f)
    # sampled steps also carry the backward-wide ceiling
    assert [i for i, c in enumerate(h.ceiling) if c is not None] == list(report.trace.steps)


def test_the_runs_own_settings_reproduce_the_real_trajectory(drifting):
    report, real, _ = drifting
    table = judge_schedules(report)
    assert table.reproduced is True and table.mismatched_steps == ()
    own = table.row(OWN)
    assert own.skipped_steps == sum(real["found_inf"])
    assert own.rule["growth_interval"] == 10 and own.rule["init_scale"] == 256.0
    # and GradScaler's own rule over the recorded found_inf gives the same scales (the older replay)
    assert list(replay_scaler(report.history.found_inf, init_scale=256.0, growth_interval=10).scales) == real["scale"]
    assert table.flush_reference == "shadow"
    assert "Flushed shares come from the fp32 shadow reruns, moved with" in schedule_answer(table)
    assert own.mean_flushed_fraction is not None and own.worst_flushed_fraction >= own.mean_flushed_fraction
    assert {r.name for r in table.rows} >= {DEFAULTS, "DeepSpeed (hysteresis 2)", "Megatron (hysteresis 2)"}
    assert rule_label(DEFAULTS) == "GradScaler defaults" and rule_label(OWN) == "this run's settings"
    assert "This is the run's past, not its future" in schedule_answer(table)


def test_schedule_command_prints_the_table(drifting, monkeypatch, tmp_path):
    _, real, path = drifting
    prepare_cli_env(monkeypatch, tmp_path, columns=160)
    result = run("schedule", path)
    assert result.exit_code == 0, result.output
    err = result.stderr
    assert f"replayed over this run's {STEPS} recorded steps" in err
    assert "reproduce its recorded scale on every step and its skipped steps exactly" in err
    assert "this run's settings" in err and "GradScaler defaults" in err
    data = json.loads(run("schedule", path, "--json").stdout)
    assert data["reproduced"] is True
    own = next(r for r in data["rows"] if r["name"] == "this run's settings")
    assert own["skipped_steps"] == sum(real["found_inf"])
    explained = run("recommend", path, "--explain")  # the same table after the recommendation
    assert explained.exit_code == 0 and "reproduce its recorded scale on every step" in explained.stderr
    assert json.loads(run("recommend", path, "--explain", "--json").stdout)["schedule"]["reproduced"] is True


def test_schedule_without_a_history_is_one_error_line(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)
    old = Path(__file__).parent / "data" / "report-v1-demo.json"
    assert "history" not in json.loads(old.read_text())  # an older report still loads ...
    assert Report.load(old).history is None
    result = run("schedule", old)  # ... and schedule says what it needs
    assert result.exit_code == 2
    assert "no per-step history" in one_error_line(result)


def _hand_report(scale, grad_max, ceiling=None, settings=None):
    h = StepHistory(0, tuple(scale), tuple(grad_max), tuple(ceiling or [None] * len(scale)))
    meta = Metadata("0", torch.__version__, "cpu", "hand", precision="fp16-autocast")
    return Report(meta, history=h, capture=CaptureNotes(scaler_settings=settings) if settings else None)


def test_candidate_overflow_reads_known_cases_and_estimates_the_rest():
    """A step clean at s is clean below s; one that overflowed at s overflows above; above a clean s, max x S decides."""
    # 4 steps at scale 2^10: clean with max 1.0 (overflows past 2^16), inf, clean with max 2^-10, clean max 1.0
    report = _hand_report([1024.0] * 4, [1.0, math.inf, 2.0**-10, 1.0],
                          settings={"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000})
    rules = [("low", ScalerRule(2.0**5, growth_interval=2000)), ("same", ScalerRule(2.0**10, growth_interval=2000)),
             ("high", ScalerRule(2.0**16, growth_interval=2000))]
    t = judge_schedules(report, rules=rules)
    assert t.row("low").skipped_steps == 0 and t.row("low").uncertain_steps == 1  # the inf step, read as clean
    assert t.row("same").skipped_steps == 1
    # at 2^16: step 0 (1.0 x 2^16 > 65504) overflows, backs off to 2^15; step 1 inf at 2^10 <= 2^15: overflows
    assert t.row("high").skipped_steps == 2
    assert t.flush_reference is None and t.row("same").steps_over_threshold is None


def test_invalid_history_is_named():
    from fp16probe.errors import ReportError

    d = _hand_report([1.0, 2.0], [0.5, 0.25]).to_dict()
    d["history"]["grad_max"] = [0.5]
    with pytest.raises(ReportError, match="history.grad_max has 1 entries for 2 steps"):
        Report.from_dict(d)


def test_flushed_shares_come_from_the_fp32_reference_moved_with_the_largest_gradient():
    """One fp32 reference step: values at 2^-30 (1000) and 2^-2 (1000); fp16 flushes below 2^-25 at S = 1."""
    from fp16probe.histogram import Histogram
    from fp16probe.report import StepTrace

    def hist(low_exp: int) -> Histogram:
        counts = [0] * len(Histogram().counts)
        from fp16probe.histogram import MIN_EXP

        counts[low_exp - MIN_EXP] = 1000
        counts[-2 - MIN_EXP] = 1000
        return Histogram(counts=tuple(counts), max_abs=0.25)

    shadow_meta = Metadata("0", torch.__version__, "cpu", "hand", precision="fp32")
    shadow = Report(shadow_meta, trace=StepTrace(steps=(0,), histograms={"weight_grad": (hist(-30),)},
                                                 scale=(None,), found_inf=(False,)))
    base = _hand_report([1.0, 1.0], [0.25, 0.5])  # step 1's largest gradient is twice step 0's
    report = Report(base.metadata, history=base.history, shadow=shadow, capture=base.capture)
    rules = [("S=1", ScalerRule(1.0, growth_interval=2000)), ("S=2^5", ScalerRule(2.0**5, growth_interval=2000)),
             ("S=2^6", ScalerRule(2.0**6, growth_interval=2000))]
    t = judge_schedules(report, rules=rules, kind="weight_grad")
    assert t.flush_reference == "shadow"
    # S=1: both steps flush the 2^-30 half; S=2^5: 2^-25 still flushes (<= half the smallest subnormal
    # 2^-24), except at step 1 where the values moved up a bit to 2^-24; S=2^6: nothing flushes
    assert t.row("S=1").worst_flushed_fraction == 0.5 and t.row("S=1").steps_over_threshold == 2
    assert t.row("S=2^5").mean_flushed_fraction == 0.25
    assert t.row("S=2^6").worst_flushed_fraction == 0.0 and t.row("S=2^6").steps_over_threshold == 0


def test_the_docs_demo_runs_and_its_verdict_points_to_the_schedule(monkeypatch, tmp_path):
    """docs/live_training_demo.py (the run behind docs/live-training.md's table), shortened."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("live_training_demo", Path(__file__).parent.parent / "docs" / "live_training_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    path = tmp_path / "live-demo.json"
    demo.run(str(path), steps=30)
    report = Report.load(path)
    rec = analyze(report)  # a scale verdict: its 20,000-step replay is labelled a projection, pointing here
    assert rec.verdict in ("constant", "dynamic") and rec.growth_interval_table
    assert "projected_schedule" in [c.code for c in rec.caveats]
    prepare_cli_env(monkeypatch, tmp_path, columns=160)
    result = run("schedule", path)
    assert result.exit_code == 0 and "reproduce its recorded scale on every step" in result.stderr


def test_ranks_histories_merge_to_the_first_scale_and_the_largest_gradient():
    from fp16probe.capture.distributed import merge_rank_reports

    a = _hand_report([8.0, 8.0, 4.0], [0.5, math.inf, 0.25])
    b = _hand_report([8.0, 8.0, 4.0], [0.75, 0.1, math.nan])
    merged = merge_rank_reports([a, b]).history
    assert merged.scale == (8.0, 8.0, 4.0)
    assert merged.grad_max[:2] == (0.75, math.inf) and math.isnan(merged.grad_max[2])
    assert merged.found_inf == (False, True, True)
    assert merge_rank_reports([a, Report(a.metadata, history=None)]).history is None  # none rather than half


def test_a_model_of_many_parameters_has_every_steps_largest_gradient():
    """The history hooks a few spread-out parameters (not one per parameter): on a 60-parameter model
    each step's row is still written, with the largest |g| over all of them, equal to torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(30) for m in (nn.Linear(8, 8), nn.Tanh())])
    probe = Probe(model, every=4).start()
    real = []
    for step in range(9):
        x = torch.randn(4, 8) * (1 + step)
        model(x).square().mean().backward()
        real.append(torch.stack([p.grad.abs().max() for p in model.parameters()]).max().item())
        model.zero_grad()
        probe.step()
    probe.stop()
    h = probe.report().history
    assert len(list(model.parameters())) == 60 and len(probe.collector("history")._handles) < 60
    assert list(h.grad_max) == real


@pytest.mark.parametrize("scaler", [None, 3.0, torch.tensor(2.0**13)])
def test_the_host_read_writes_the_rows_the_device_read_writes(monkeypatch, scaler):
    """fp32 CPU gradients of an unscaled run take one compiled read (engine.largest_abs_host); every row
    equals the torch path's bit for bit, inf and NaN steps included. Scaled runs (a scale that is not a
    power of two, a tensor scale) keep the device path, which divides without a host read of the scale."""
    from fp16probe.capture import engine

    def run() -> list[tuple[float, float]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        probe = Probe(model, scaler=scaler, every=3).start()
        s = 1.0 if scaler is None else float(scaler)
        for step, poison in enumerate([1.0, 7.0, math.inf, 0.3, math.nan, 1e-30]):
            (model(torch.randn(4, 8)).sum() * poison * s).backward()
            model.zero_grad()
            probe.step()
        probe.stop()
        h = probe.report().history
        return [(a, b) for a, b in zip(h.scale, h.grad_max)]

    host = run()
    monkeypatch.setattr(engine, "largest_abs_host", lambda xs: None)
    device = run()
    assert len(host) == 6
    assert str(host) == str(device)  # NaN == NaN as text


@pytest.mark.parametrize("every", [1, 3])
def test_the_weight_counts_hand_the_history_each_steps_largest_gradient(monkeypatch, every):
    """In a sampled step the history takes its largest |g| from the weight counts (a large parameter
    counted in its accumulate hook, the small ones at the end of backward) instead of reading every
    gradient again. Every row still equals torch's own max |g|: inf and NaN steps, and steps that
    accumulate two micro-batches (the row is the last backward's, over the accumulated gradients)."""
    from fp16probe.capture.recorder import _HOT_FROM, Recorder

    taken: list[float | None] = []
    real_take = Recorder.take_weight_largest
    monkeypatch.setattr(Recorder, "take_weight_largest", lambda self, g: taken.append(real_take(self, g)) or taken[-1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 640), nn.Tanh(), nn.Linear(640, 1))
    assert model[0].weight.numel() >= _HOT_FROM > model[2].weight.numel()
    with torch.no_grad():
        model[0].weight *= 0.01  # large inputs, unsaturated: the hot-counted weight's gradient is the largest
    probe = Probe(model, every=every).start()
    real, largest_is_hot = [], []
    poisons = [1.0, 7.0, math.inf, 0.3, math.nan, 1e-30]
    for step, poison in enumerate(poisons):
        for _ in range(1 + step % 2):  # odd steps accumulate two micro-batches
            (model(torch.randn(4, 8) * 100).sum() * poison).backward()
        largest = [p.grad.abs().max() for p in model.parameters()]
        real.append(torch.stack(largest).max().item())
        largest_is_hot.append(bool(largest[0] == max(largest)))
        model.zero_grad()
        probe.step()
    probe.stop()
    assert str(list(probe.report().history.grad_max)) == str(real)  # NaN == NaN as text
    assert sum(largest_is_hot) >= 3
    sampled_backwards = sum(1 + step % 2 for step in range(len(poisons)) if step % every == 0)
    assert sum(t is not None for t in taken) == sampled_backwards
