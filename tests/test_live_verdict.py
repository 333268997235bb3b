"""A verdict from the live run: fp32 shadow reruns judge a real fp16 GradScaler run (issue 20).

Every check is against real runs written here with plain torch: a tiny GPT-2 trained under CPU
fp16 autocast with a real ``torch.amp.GradScaler("cpu")``, against the same model trained
without a Probe (bit-identical weights) and against an fp32 profile of the same batches.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fp16probe import Probe, Report
from fp16probe.analysis.recommend import analyze
from fp16probe.capture.shadow import shadow_due
from fp16probe.sections import ShadowRuns
from fp16probe.presentation.verdict import verdict_text
from tests.fixtures.loops import finish_step

transformers = pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).train()  # dropout on: the reruns must draw the same masks


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(n)]


def _train_gpt2(steps: int, *, probe: bool, fp16: bool = True, **probe_options):
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    p = Probe(model, scaler=scaler if fp16 else None, **probe_options).start() if probe else None
    torch.manual_seed(5)  # the dropout draws
    for ids in _batches(steps):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            out = model(input_ids=ids, labels=ids)
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if p is not None:
            p.step()
    return model, p


@pytest.fixture(scope="module")
def live_gpt2():
    """20 real fp16 steps with a plain Probe(model, scaler=scaler), and the same 20 steps unprobed."""
    probed, probe = _train_gpt2(20, probe=True)
    plain, _ = _train_gpt2(20, probe=False)
    return probed, plain, probe.report()


def test_live_fp16_run_gives_a_scale_verdict_near_the_fp32_profile(live_gpt2):
    _, _, report = live_gpt2
    rec = analyze(report)
    assert rec.verdict in ("constant", "dynamic")
    _, fp32_probe = _train_gpt2(20, probe=True, fp16=False)  # an fp32 profile of the same model and batches
    fp32 = analyze(fp32_probe.report())
    assert fp32.verdict in ("constant", "dynamic")
    assert abs(rec.log2_scale - fp32.log2_scale) <= 1, (rec.log2_scale, fp32.log2_scale)
    # the reruns are named, with their cost
    assert rec.evidence["reference"] == "fp32_shadow_reruns"
    assert rec.evidence["shadow_steps"] == [0, 1, 2, 4, 8, 16] == list(report.shadow.trace.steps)
    meta = report.shadow_runs
    assert meta.count == 6 and meta.seconds > 0 and meta.next_step == 32
    assert "Judged on 6 fp32 rerun(s)" in verdict_text(rec)
    # without the reruns the same live report has no verdict: its zeros hide what flushed
    assert analyze(Report(report.metadata, report.modules, report.trace)).verdict == "insufficient_evidence"


def test_training_with_reruns_is_bit_identical_to_training_without(live_gpt2):
    probed, plain, _ = live_gpt2
    a, b = probed.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_zeros_in_both_runs_are_structural(live_gpt2):
    """HF's causal LM loss has no label for the last position: its logit gradient is zero in fp32 too."""
    _, _, report = live_gpt2
    ev = analyze(report).evidence
    per_step_structural = 4 * 64  # batch x vocab at the last position, one shadowed step
    assert ev["structural_zero_values"] >= per_step_structural * len(ev["shadow_steps"])
    assert ev["live_zero_values"] == ev["structural_zero_values"] + ev["flushed_in_live_run"]
    assert 0.0 <= ev["flushed_fraction_in_live_run"] < 1.0


def test_shadow_schedule():
    due = [i for i in range(210) if shadow_due(i, 50)]
    assert due == [0, 1, 2, 4, 8, 16, 32, 50, 100, 150, 200]
    assert [i for i in range(8) if shadow_due(i, 3)] == [0, 1, 2, 3, 6]
    assert not any(shadow_due(i, 0) for i in range(10))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train_net(steps: int, *, probe: bool, explicit: bool):
    torch.manual_seed(0)
    model = _Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    p = Probe(model, scaler=scaler).start() if probe else None
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 8, (32,), generator=g)) for _ in range(steps)]
    torch.manual_seed(3)
    for x, y in data:
        if p is not None and explicit:  # before the step's forward: the same dropout masks
            p.shadow(lambda: nn.functional.cross_entropy(model(x), y))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        finish_step(loss, opt, scaler, p)
    return model, p


def test_a_loss_outside_the_model_says_how_to_rerun_and_probe_shadow_does_it():
    _, p = _train_net(3, probe=True, explicit=False)
    rec = analyze(p.report())
    assert rec.verdict == "insufficient_evidence"
    assert "No fp32 shadow rerun could run" in verdict_text(rec) and "probe.shadow(fn)" in verdict_text(rec)
    model, p = _train_net(3, probe=True, explicit=True)
    plain, _ = _train_net(3, probe=False, explicit=False)
    report = p.report()
    assert report.shadow is not None and report.shadow.trace.steps == (0, 1, 2)
    assert analyze(report).verdict in ("constant", "dynamic", "none_needed", "no_single_scale")
    assert analyze(report).evidence["shadow_steps"] == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def test_shadow_and_history_round_trip(live_gpt2, tmp_path):
    _, _, report = live_gpt2
    back = Report.load(report.save(tmp_path / "live.json"))
    assert back.shadow is not None and back.shadow.to_dict() == report.shadow.to_dict()
    assert back.history == report.history
    assert analyze(back).log2_scale == analyze(report).log2_scale


def test_an_fp32_run_is_not_rerun():
    torch.manual_seed(0)
    model = _Net()
    with Probe(model) as p:
        for _ in range(3):
            nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 8, (8,))).backward()
            p.step()
    report = p.report()
    assert report.shadow is None and report.shadow_runs.count == 0
    assert not math.isnan(report.history.grad_max[0])


def test_the_json_schema_describes_shadow_and_history(live_gpt2):
    jsonschema = pytest.importorskip("jsonschema")
    import json
    from importlib import resources

    schema = json.loads(resources.files("fp16probe").joinpath("schema/report.schema.json").read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    _, _, report = live_gpt2
    d = json.loads(report.to_json())
    assert "shadow" in d and "history" in d
    assert list(validator.iter_errors(d)) == []
    d["history"]["grad_max"][0] = -1.0  # what the loader refuses, the schema refuses too
    assert list(validator.iter_errors(d))


def test_before_the_first_rerun_the_verdict_says_when_it_comes(live_gpt2):
    _, _, report = live_gpt2
    runs = ShadowRuns(every=50, steps=(), count=0, next_step=32)
    rec = analyze(Report(report.metadata, report.modules, report.trace, shadow_runs=runs))
    assert rec.verdict == "insufficient_evidence"
    assert "No fp32 shadow rerun has run yet (the first comes at step 32, shadow_every=50)" in verdict_text(rec)


def test_a_bf16_autocast_run_is_rerun_too():
    torch.manual_seed(0)
    model = _Net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 16), torch.randint(0, 8, (32,))
    with Probe(model) as p:
        for _ in range(2):
            p.shadow(lambda: nn.functional.cross_entropy(model(x), y))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            p.step()
    report = p.report()
    assert report.metadata.precision == "bf16-autocast"
    assert report.shadow is not None and report.shadow.metadata.precision == "fp32"
    assert analyze(report, "bf16").evidence["shadow_steps"] == [0, 1]


def test_a_bf16_loop_gets_the_fp32_references_verdict_and_trains_as_without_the_probe():
    """A bf16 autocast loop (no scaler): the live verdict equals that of a plain fp32 run of the same batches,
    judged for bf16 (no loss scale invented), and the weights end bit-identical with and without the Probe."""
    batches = [(torch.randn(32, 16, generator=torch.Generator().manual_seed(s)),
                torch.randint(0, 8, (32,), generator=torch.Generator().manual_seed(100 + s))) for s in range(4)]

    def run(probed: bool, low: bool):
        torch.manual_seed(0)
        model = _Net().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        probe = Probe(model, shadow_every=1 if low else 0).start() if probed else None
        for x, y in batches:
            if probe is not None and low:
                probe.shadow(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                loss = nn.functional.cross_entropy(model(x), y)
            finish_step(loss, opt, probe=probe)
        if probe is not None:
            probe.stop()
        return [p.detach().clone() for p in model.parameters()], probe

    plain, _ = run(False, True)
    weights, probe = run(True, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, weights))
    live = analyze(probe.report(), "bf16")
    _, fp32 = run(True, False)
    reference = analyze(fp32.report(), "bf16")
    assert live.evidence["reference"] == "fp32_shadow_reruns" and len(live.evidence["shadow_steps"]) == 4
    assert live.verdict == reference.verdict == "none_needed", (live.verdict, reference.verdict)
    assert live.log2_scale == reference.log2_scale == 0 and not live.grad_scaler_kwargs.get("init_scale")
