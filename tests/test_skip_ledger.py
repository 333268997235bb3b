"""The skip ledger: every step a GradScaler skipped, its scale and where its inf/NaN began (issue 39, item 5).

A real fp16 autocast loop with a real ``torch.amp.GradScaler("cpu")`` whose model multiplies one
gradient by 2^12 in backward (a module that is the identity forward): at a high scale that
gradient overflows fp16, the scaler skips the step and backs off. The oracle is plain torch: the
same run without the Probe, which steps the scaler skipped (its scale fell) and, from tensor
hooks on every module's output, the first module in backward whose output gradient held inf/NaN.
The ledger is read back from the report, from ``show`` and from each tracker's own reader.
"""

from __future__ import annotations

import glob
import json
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.presentation.trackers import export
from fp16probe.report import Report
from fp16probe.sections import SkipLedger, SkippedStep

STEPS = 8
GAIN = 2.0**12


class _TimesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gain):
        ctx.gain = gain
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.gain, None


class GradGain(nn.Module):
    """The identity forward; backward multiplies the gradient by ``gain`` (in the gradient's own dtype)."""

    def forward(self, x):
        return _TimesInBackward.apply(x, GAIN)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # backward meets 6, 5, 4, then the gain (3), then 2's output gradient times 2^12: where an inf begins,
    # and flows on into 1's and 0's
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), GradGain(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _train(probe_every: int | None):
    """The loop; returns (scales in force, skipped steps, where each step's inf/NaN began (the oracle run
    only: a module, or the parameters whose gradients held it), the model, the report)."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = None if probe_every is None else Probe(model, scaler=scaler, every=probe_every).start()
    order: list[tuple[str, bool]] = []
    if probe is None:  # the oracle: each module's output gradient, in the order backward makes them
        def watch(name):
            def hook(module, args, output):
                output.register_hook(lambda g: order.append((name, not bool(torch.isfinite(g).all()))))
            return hook

        for name, m in model.named_modules():
            if name:
                m.register_forward_hook(watch(name))
    g = torch.Generator().manual_seed(0)
    scales, skipped, first = [], [], []
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        order.clear()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        # where it began: the first output gradient in backward with inf/NaN; with none, the parameters' own
        # gradients (an fp16 weight-gradient product that overflowed from finite factors)
        first.append(next((n for n, bad in order if bad), None)
                     or tuple(n for n, p in model.named_parameters() if not bool(torch.isfinite(p.grad).all())))
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scales[-1]:
            skipped.append(step)
        opt.zero_grad()
        if probe is not None:
            probe.step()
    return scales, skipped, first, model, (None if probe is None else probe.report())


@pytest.fixture(scope="module")
def oracle():
    return _train(None)


@pytest.fixture(scope="module")
def probed():
    return _train(1)


def test_the_ledger_names_every_skipped_step_its_scale_and_where_it_began(oracle, probed):
    scales, skipped, first, model, _ = oracle
    assert skipped and len(skipped) < STEPS  # the run skips some steps, not all
    ledger = probed[4].section("skips")
    assert isinstance(ledger, SkipLedger) and ledger.source == "history"
    assert [e.step for e in ledger.steps] == skipped
    assert [e.scale for e in ledger.steps] == [scales[s] for s in skipped]
    for e in ledger.steps:
        assert e.sampled, e
        if isinstance(first[e.step], str):
            assert e.kind == "activation_grad" and e.modules[0] == first[e.step] == "2", (e, first[e.step])
            assert e.nonfinite_modules == 3  # 2, then 1 and 0, which backward computes from it
        else:  # no output gradient held one: the parameters' gradients, as plain torch finds them
            assert e.kind == "weight_grad" and set(e.modules) == set(first[e.step]), (e, first[e.step])
    assert {e.kind for e in ledger.steps} == {"activation_grad", "weight_grad"}  # both cases met
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), probed[3].state_dict().values()))


def test_an_unsampled_skipped_step_is_in_the_ledger_without_modules(oracle):
    _, skipped, first, _, _ = oracle
    report = _train(2)[4]
    ledger = report.section("skips")
    assert [e.step for e in ledger.steps] == skipped
    for e in ledger.steps:
        assert e.sampled == (e.step % 2 == 0)
        if not e.sampled:
            assert e.modules == () and e.kind is None
        elif isinstance(first[e.step], str):
            assert e.modules[0] == first[e.step]
        else:
            assert set(e.modules) == set(first[e.step])


def test_the_ledger_survives_json_and_older_reports_load_without_one(probed, tmp_path):
    report = probed[4]
    path = report.save(tmp_path / "r.json")
    assert Report.load(path).section("skips") == report.section("skips")
    data = json.loads(path.read_text())
    del data["sections"]["skips"]
    path.write_text(json.dumps(data))
    assert Report.load(path).section("skips") is None
    from fp16probe.errors import ReportFieldError

    for bad, field in (({"steps": [{"scale": 1.0}]}, "skips.steps[0].step"),
                       ({"steps": [{"step": 1, "modules": [3]}]}, "skips.steps[0].modules"),
                       ({"steps": [], "source": "guess"}, "skips.source")):
        with pytest.raises(ReportFieldError) as e:
            SkipLedger.from_dict(bad)
        assert e.value.field == field


def test_show_prints_the_ledger(oracle, probed, tmp_path, monkeypatch):
    from tests.fixtures.cli import prepare_cli_env, run

    _, skipped, _, _, _ = oracle
    prepare_cli_env(monkeypatch, tmp_path)
    out = run("show", probed[4].save(tmp_path / "r.json"))
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert f"{len(skipped)} steps skipped (gradients held inf/NaN): step {skipped[0]} at scale 2^" in text
    assert "inf/NaN first in 2's output gradient (3 held it)" in text


def test_a_module_name_in_the_ledger_is_escaped():
    from fp16probe.presentation.answer import skipped_step_words

    words = skipped_step_words(SkippedStep(step=3, scale=2.0**10, sampled=True, kind="activation_grad",
                                           modules=("evil\x1b[31m\nname",), nonfinite_modules=2))
    assert "\x1b" not in words and "\n" not in words and words.startswith("step 3 at scale 2^10")


# -- the trackers, each read back by its own reader ---------------------------------------------------

def test_tensorboard_holds_each_skipped_step(probed, oracle, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    scales, skipped, _, _, _ = oracle
    export(probed[4], to="tensorboard", dest=tmp_path / "tb")
    ea = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("fp16probe/skipped_step/scale")] == [(s, scales[s]) for s in skipped]
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("fp16probe/skipped_step/text_summary")}
    assert sorted(texts) == skipped
    for s in skipped:
        assert f"step {s} at scale" in texts[s] and "inf/NaN first in " in texts[s]


def test_wandb_offline_run_holds_each_skipped_step(probed, oracle, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.test_trackers import _has_exit_record, _wandb_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    scales, skipped, _, _, _ = oracle
    export(probed[4], to="wandb", dest=tmp_path, run_name="skips")
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 60
    while not _has_exit_record(run_file):
        assert time.monotonic() < deadline, "the wandb run file never got its exit record"
        time.sleep(0.2)
    got = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "fp16probe/skipped_step" in row:
                got[row["fp16probe/step"]] = (row["fp16probe/skipped_step"], row["fp16probe/skipped_step/scale"])
    assert sorted(got) == skipped
    for s in skipped:
        assert got[s][1] == scales[s] and "inf/NaN first in " in got[s][0]


@pytest.mark.slow  # MLflow's store: seconds on a loaded 2-core machine
def test_mlflow_holds_each_skipped_step(probed, oracle, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's SQLite store: the mlflow extra installs both (CI: .[dev])
    pytest.importorskip("alembic")
    scales, skipped, _, _, _ = oracle
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 reads the folder as written
    run_id = export(probed[4], to="mlflow", dest=tmp_path / "mlruns", run_name="skips")
    client = mlflow.MlflowClient(tracking_uri="sqlite:///" + (tmp_path / "mlruns" / "mlflow.db").as_posix())
    history = client.get_metric_history(run_id, "fp16probe/skipped_step/scale")
    assert sorted((m.step, m.value) for m in history) == [(s, scales[s]) for s in skipped]
    files = sorted(a.path for a in client.list_artifacts(run_id, "fp16probe/skipped_step"))
    assert files == sorted(f"fp16probe/skipped_step/step-{s}.txt" for s in skipped)
    folder = client.download_artifacts(run_id, "fp16probe/skipped_step", str(tmp_path / "down"))
    text = Path(folder, f"step-{skipped[0]}.txt").read_text(encoding="utf-8")
    assert text.startswith(f"step {skipped[0]} at scale") and "inf/NaN first in " in text
