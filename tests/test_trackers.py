"""Exporters: a report's histograms and scalars reach TensorBoard, wandb and MLflow exactly.

Each tracker is read back with its own reader: TensorBoard's EventAccumulator, the records
of a wandb offline run, and an MLflow client on a local file store.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import struct
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp16probe.cli import app
from fp16probe.errors import Fp16ProbeError, InputError
from fp16probe.histogram import MIN_EXP
from fp16probe.presentation.trackers import TrackerLog, export, log_histogram, tracker_series
from fp16probe.recommendation import Caveat, Recommendation, Verdict
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Histogram
from tests.fixtures.reports import hand_report

# The hand report's per-step activation-gradient histogram (see tests/fixtures/reports.py):
# 2000 nonzero values a step (2001 at step 3, which also holds one value at 2^10).
# fp16 flushes |x| <= 2^-25: bins -40 (250), -30 (150), -26 (100), -25 (50) = 550 values.
# At S = 2^8 only |x| <= 2^-33 flushes: bin -40, 250 values; at S = 2^7, |x| <= 2^-32: the same 250.
SCALES = (256.0, 256.0, 256.0, 128.0, 128.0, 100.0)
FOUND_INF = (False, False, False, True, False, False)
CEILING = (0.5, 0.5, 0.5, math.inf, 2.0**10, 0.25)  # the largest unscaled |g| in backward, per step


def scaled_report():
    """The hand report as if taken under a loss scaler that backed off once at step 3."""
    r = hand_report()
    trace = dataclasses.replace(r.trace, scale=SCALES, found_inf=FOUND_INF, ceiling=CEILING)
    return dataclasses.replace(r, trace=trace, metadata=dataclasses.replace(r.metadata, grad_scaler=True))


def expected_buckets(h: Histogram) -> tuple[list[float], list[int]]:
    """Bucket upper edges and counts, one per log2 bin from the lowest to the highest occupied one."""
    occupied = [MIN_EXP + i for i, c in enumerate(h.counts) if c]
    exps = list(range(min(occupied), max(occupied) + 1))
    return [float(e) for e in exps], [h.count(e) for e in exps]


# -- what is logged, with no tracker ----------------------------------------------------------

def test_log_histogram_has_one_bucket_per_log2_bin_and_zeros_apart():
    h = Histogram.from_values({-30: 7, -27: 3, -24: 5}, zero=11, inf=2)
    lh = log_histogram(h)
    assert lh.edges == (-31.0, -30.0, -29.0, -28.0, -27.0, -26.0, -25.0, -24.0)
    assert lh.counts == (7, 0, 0, 3, 0, 0, 5)
    assert (lh.num, lh.zero, lh.nonfinite) == (15, 11, 2)
    magnitude = log_histogram(h, "magnitude")
    assert magnitude.edges == tuple(2.0 ** e for e in range(-31, -23))
    assert magnitude.counts == lh.counts
    assert log_histogram(Histogram(zero=5)) is None


def test_series_scalars_are_the_closed_form_shares():
    rec = Recommendation(verdict=Verdict.CONSTANT, format="fp16", log2_scale=8, scale=256.0, grad_scaler_kwargs={},
                         flushed_fraction_at_1=None, flushed_fraction_at_scale=None, overflow_steps_at_scale=None,
                         headroom_bits=None, worst_modules=(), evidence={}, thresholds={}, citations=(),
                         stored_text="advice", caveats=(Caveat("text", {"text": "one"}), Caveat("text", {"text": "two"})))
    series = tracker_series(scaled_report(), "fp16", recommendation=rec)
    by = {}
    for tag, step, value in series.scalars:
        by.setdefault(tag, {})[step] = value
    at1 = by["fp16probe/activation_grad/flushed_fraction_at_1"]
    assert at1 == {0: 550 / 2000, 1: 550 / 2000, 2: 550 / 2000, 3: 550 / 2001, 4: 550 / 2000, 5: 550 / 2000}
    in_force = by["fp16probe/activation_grad/flushed_fraction_at_scale_in_force"]
    # step 5's scale (100) is not a power of two: the bins cannot give that share exactly
    assert in_force == {0: 250 / 2000, 1: 250 / 2000, 2: 250 / 2000, 3: 250 / 2001, 4: 250 / 2000}
    assert by["fp16probe/activation_grad/flushed_fraction_at_recommended_scale"][0] == 250 / 2000
    assert by["fp16probe/weight_grad/flushed_fraction_at_1"][0] == 0.0  # 2^-12 survives
    assert by["fp16probe/activation_grad/max_abs"][3] == 2.0 ** 10
    assert by["fp16probe/activation_grad/max_abs"][0] == 2.0 ** -6
    assert by["fp16probe/activation_grad/zero_fraction"][0] == 1600 / 3600
    assert by["fp16probe/loss_scale"] == dict(enumerate(SCALES))
    assert by["fp16probe/skipped_steps"] == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}
    assert by["fp16probe/overflow_ceiling"] == {0: 0.5, 1: 0.5, 2: 0.5, 4: 2.0**10, 5: 0.25}  # not the inf
    assert by["fp16probe/recommended_log2_scale"][5] == 8
    assert series.texts == (("fp16probe/recommendation", "advice\n\ncaveat: one\ncaveat: two"),)


def test_series_without_a_scaler_has_no_scale_or_skipped_steps():
    series = tracker_series(hand_report(), "fp16", step_offset=10)
    tags = {t for t, _, _ in series.scalars}
    assert "fp16probe/loss_scale" not in tags and "fp16probe/skipped_steps" not in tags
    assert {s for _, s, _ in series.scalars} == set(range(10, 16))
    # no scale in force means S = 1
    at1 = [v for t, s, v in series.scalars if t.endswith("activation_grad/flushed_fraction_at_1")]
    in_force = [v for t, s, v in series.scalars if t.endswith("activation_grad/flushed_fraction_at_scale_in_force")]
    assert at1 == in_force


# -- TensorBoard ------------------------------------------------------------------------------

def _accumulator(log_dir):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"histograms": 0, "scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def test_tensorboard_event_files_hold_the_exact_bins(tmp_path):
    pytest.importorskip("tensorboard")
    report = scaled_report()
    assert export(report, to="tensorboard", dest=tmp_path / "tb", modules=True) == tmp_path / "tb"
    ea = _accumulator(tmp_path / "tb")
    for kind in (ACTIVATION_GRAD, WEIGHT_GRAD):
        events = ea.Histograms(f"fp16probe/{kind}")
        assert [e.step for e in events] == list(range(6))
        for event, h in zip(events, report.trace.histograms[kind]):
            v = event.histogram_value
            limits, counts = expected_buckets(h)
            assert list(v.bucket_limit) == limits
            assert list(v.bucket) == counts
            assert v.min == limits[0] - 1  # the lowest bucket's lower edge
            assert v.num == h.nonzero_finite
    step3 = ea.Histograms("fp16probe/activation_grad")[3].histogram_value
    assert (step3.bucket_limit[0], step3.bucket_limit[-1], step3.bucket[0], step3.bucket[-1]) == (-40, 10, 250, 1)
    for m in report.modules:  # module totals, at the last step
        (event,) = ea.Histograms(f"fp16probe/{m.kind}/{m.name}")
        assert event.step == 5
        assert (list(event.histogram_value.bucket_limit), list(event.histogram_value.bucket)) == expected_buckets(m.histogram)
    scale = ea.Scalars("fp16probe/loss_scale")
    assert [(s.step, s.value) for s in scale] == list(enumerate(SCALES))
    shares = ea.Scalars("fp16probe/activation_grad/flushed_fraction_at_1")
    assert [s.value for s in shares] == pytest.approx([550 / 2000] * 3 + [550 / 2001] + [550 / 2000] * 2, rel=1e-6)
    assert "fp16probe/recommendation/text_summary" in ea.Tags()["tensors"]


def test_tensorboard_magnitude_axis_holds_powers_of_two(tmp_path):
    pytest.importorskip("tensorboard")
    report = hand_report()
    export(report, to="tensorboard", dest=tmp_path, axis="magnitude")
    v = _accumulator(tmp_path).Histograms("fp16probe/activation_grad")[0].histogram_value
    assert list(v.bucket_limit) == [2.0 ** e for e in range(-40, -5)]
    assert v.min == 2.0 ** -41


def test_live_log_sends_each_step_once(tmp_path):
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    report = scaled_report()
    first = dataclasses.replace(report, trace=_first_steps(report.trace, 3))
    writer = tensorboard.SummaryWriter(log_dir=str(tmp_path))
    log = TrackerLog(writer, step_offset=1, recommend=False, modules=True)
    assert log.log(first) == 3
    assert log.log(first) == 0  # nothing new
    assert log.log(report) == 3
    writer.close()
    events = _accumulator(tmp_path).Histograms("fp16probe/activation_grad")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in _accumulator(tmp_path).Histograms("fp16probe/activation_grad/deep")] == [3, 6]
    assert [list(e.histogram_value.bucket) for e in events] == [expected_buckets(h)[1] for h in report.trace.histograms[ACTIVATION_GRAD]]


def _first_steps(trace, n):
    return dataclasses.replace(
        trace, steps=trace.steps[:n], scale=trace.scale[:n], found_inf=trace.found_inf[:n],
        ceiling=None if trace.ceiling is None else trace.ceiling[:n],
        histograms={k: v[:n] for k, v in trace.histograms.items()},
        module_max={k: {m: v[:n] for m, v in mm.items()} for k, mm in trace.module_max.items()},
    )


# -- wandb (offline) ----------------------------------------------------------------------------

def _wandb_records(path):
    """Yield the protobuf records of a wandb offline run file (LevelDB log format after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + n > len(data):  # a record still being written: read up to it
            return
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):
            pending += chunk


def _has_exit_record(path):
    """Whether the run file is complete; a record caught half-written reads as not yet."""
    from google.protobuf.message import DecodeError

    try:
        return any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(path))
    except DecodeError:
        return False


def test_wandb_offline_run_holds_the_exact_bins(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    report = scaled_report()
    export(report, to="wandb", dest=tmp_path, run_name="test")
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    deadline = time.monotonic() + 60
    # wandb's service process may still be writing the file when finish() returns
    while not _has_exit_record(run_file):
        assert time.monotonic() < deadline, "the wandb run file never got its exit record"
        time.sleep(0.2)
    rows = []
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({tuple(i.nested_key) or (i.key,): json.loads(i.value_json) for i in record.history.item})
    rows = [r for r in rows if ("fp16probe/step",) in r]
    assert [r[("fp16probe/step",)] for r in rows] == list(range(6))
    for row, h in zip(rows, report.trace.histograms[ACTIVATION_GRAD]):
        limits, counts = expected_buckets(h)
        assert row[("fp16probe/activation_grad", "_type")] == "histogram"
        assert row[("fp16probe/activation_grad", "bins")] == [limits[0] - 1] + limits
        assert row[("fp16probe/activation_grad", "values")] == counts
        assert row[("fp16probe/activation_grad/flushed_fraction_at_1",)] == 550 / h.nonzero_finite
    assert [r[("fp16probe/skipped_steps",)] for r in rows] == [0, 0, 0, 1, 1, 1]


# -- MLflow (a folder: a SQLite store MLflow 3 reads with no opt-in) ----------------------------

@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
def test_mlflow_folder_is_read_by_mlflow_itself_with_no_env_var(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's SQLite store: the mlflow extra installs both (CI: .[dev])
    pytest.importorskip("alembic")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    report = scaled_report()
    run_id = export(report, to="mlflow", dest=tmp_path / "mlruns", run_name="test")
    assert "MLFLOW_ALLOW_FILE_STORE" not in __import__("os").environ  # set by no one, at no time
    assert sorted(p.name for p in (tmp_path / "mlruns").iterdir()) == ["artifacts", "mlflow.db"]
    client = mlflow.MlflowClient(tracking_uri="sqlite:///" + (tmp_path / "mlruns" / "mlflow.db").as_posix())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "test"
    history = client.get_metric_history(run_id, "fp16probe/activation_grad/flushed_fraction_at_1")
    assert sorted((m.step, m.value) for m in history) == [
        (s, 550 / h.nonzero_finite) for s, h in enumerate(report.trace.histograms[ACTIVATION_GRAD])]
    skipped = client.get_metric_history(run_id, "fp16probe/skipped_steps")
    assert sorted((m.step, m.value) for m in skipped) == list(enumerate([0, 0, 0, 1, 1, 1]))
    names = {a.path for a in client.list_artifacts(run_id, "fp16probe")}
    assert names >= {"fp16probe/fp16probe-figures.png", "fp16probe/fp16probe-report.html",
                     "fp16probe/fp16probe-report.json", "fp16probe/recommendation.txt"}
    folder = client.download_artifacts(run_id, "fp16probe", str(tmp_path / "down"))
    page = Path(folder, "fp16probe-report.html").read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and "HandBuilt" in page
    assert Path(folder, "fp16probe-figures.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a second export joins the same store and experiment
    again = export(report, to="mlflow", dest=tmp_path / "mlruns", run_name="again")
    assert {r.info.run_id for r in client.search_runs([run.info.experiment_id])} == {run_id, again}


def test_mlflow_folder_uri_is_its_sqlite_store_unless_it_holds_a_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from fp16probe.presentation import trackers

    monkeypatch.setattr(trackers, "_sqlite_writable", lambda: True)
    assert trackers._mlflow_uri(tmp_path / "new") == "sqlite:///" + (tmp_path / "new" / "mlflow.db").as_posix()
    assert trackers._mlflow_uri("sqlite:///x.db") == "sqlite:///x.db"
    old = tmp_path / "old"
    (old / "0").mkdir(parents=True)
    (old / "0" / "meta.yaml").write_text("name: Default\n")  # what MLflow's file store makes first
    assert trackers._mlflow_uri(old) == old.as_uri()


def test_mlflow_3_without_sqlalchemy_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util
    from importlib import metadata

    from fp16probe.presentation import trackers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sqlalchemy" else real(name, *a))
    monkeypatch.setattr(metadata, "version", lambda dist: "3.18.0")
    with pytest.raises(InputError, match=r"MLFLOW_ALLOW_FILE_STORE=true.*pip install 'fp16probe\[mlflow\]'"):
        trackers._mlflow_uri(tmp_path)
    monkeypatch.setattr(metadata, "version", lambda dist: "2.22.0")  # MLflow 2 reads its file store as it is
    assert trackers._mlflow_uri(tmp_path) == tmp_path.absolute().as_uri()


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
def test_mlflow_export_to_a_file_uri_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    export(hand_report(), to="mlflow", dest=tmp_path.as_uri())
    assert "MLFLOW_ALLOW_FILE_STORE" not in __import__("os").environ
    assert list(tmp_path.glob("*/meta.yaml"))  # the file store the URI named
    from fp16probe.presentation.trackers import _mlflow_uri

    assert _mlflow_uri(tmp_path) == tmp_path.as_uri()  # the same folder given as a path stays a file store


# -- missing extras, bad input, the CLI -------------------------------------------------------

@pytest.mark.parametrize("to,module,extra", [("tensorboard", "tensorboard", "tensorboard"),
                                             ("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")])
def test_a_missing_tracker_package_names_its_extra(tmp_path, monkeypatch, to, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(Fp16ProbeError, match=rf"pip install 'fp16probe\[{extra}\]'") as e:
        export(hand_report(), to=to, dest=tmp_path)
    assert "\n" not in str(e.value)


def test_cli_export_writes_event_files_and_refuses_bad_input(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    path = scaled_report().save(tmp_path / "r.json")
    runner = CliRunner()
    ok = runner.invoke(app, ["export", str(path), str(tmp_path / "tb"), "--to", "tensorboard", "--modules"])
    assert ok.exit_code == 0, ok.output
    assert "exported 6 step(s) to tensorboard" in ok.output
    ea = _accumulator(tmp_path / "tb")
    assert len(ea.Histograms("fp16probe/activation_grad")) == 6
    assert len(ea.Histograms("fp16probe/activation_grad/deep")) == 1
    no_dest = runner.invoke(app, ["export", str(path)])
    assert no_dest.exit_code == 2 and "needs DEST" in no_dest.output
    bad_to = runner.invoke(app, ["export", str(path), str(tmp_path), "--to", "comet"])
    assert bad_to.exit_code == 2
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    missing = runner.invoke(app, ["export", str(path), str(tmp_path / "tb2")])
    assert missing.exit_code == 2 and "fp16probe[tensorboard]" in missing.output
    assert len([line for line in missing.output.splitlines() if line.strip()]) == 1


def test_exact_log2_of_scale_is_only_for_powers_of_two():
    from fp16probe.presentation.trackers import _exact_log2

    assert [_exact_log2(x) for x in (1.0, 65536.0, 2.0 ** -3, 100.0, 0.0, math.inf, None)] == [0, 16, -3, None, None, None, None]
