"""The packed per-step columns (fp16probe.columns): the same report in rows and packed, loads bounded, refusals."""

from __future__ import annotations

import base64
import gc
import json
import math
import tracemalloc
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fp16probe import columns
from fp16probe.analysis.schedule import judge_schedules
from fp16probe.analysis.recommend import analyze
from fp16probe.cli import app
from fp16probe.errors import ReportError
from fp16probe.histogram import MIN_EXP, NUM_EXP_BINS, Histogram
from fp16probe.report import Metadata, ModuleStats, Report, StepHistory, StepTrace

DATA = Path(__file__).parent / "data"
NAMES = ("encoder.0", "encoder.1", "head", "head.bias")


def long_report(n: int, seed: int = 0) -> Report:
    """A GradScaler run of ``n`` steps, every step sampled: per-step histograms, module maxima, scale, history."""
    rng = np.random.default_rng(seed)
    lo = rng.integers(-34, -30, n)
    counts = rng.integers(1, 5000, (n, 12))
    max_abs = np.ldexp(rng.uniform(0.501, 1.0, n), lo + 11).astype(np.float32).astype(float)
    found = rng.random(n) < 0.002
    grad_max = np.where(found, math.inf, max_abs)
    scale, good, scales = 2.0**16, 0, []
    for f in found:  # GradScaler's own rule (growth_interval 200 here)
        scales.append(scale)
        if f:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == 200:
                scale, good = scale * 2.0, 0
    hists = tuple(Histogram.from_values({int(e): int(c) for e, c in zip(range(lo[i], lo[i] + 12), counts[i])},
                                        max_abs=float(max_abs[i])) for i in range(n))
    maxima = np.ldexp(rng.uniform(0.5, 1.0, (len(NAMES), n)), rng.integers(-20, -2, (len(NAMES), n)))
    maxima = maxima.astype(np.float32).astype(float)
    total = Histogram.sum(hists)
    modules = tuple(ModuleStats(name, "activation_grad", "Linear", j, total if j == 0 else Histogram())
                    for j, name in enumerate(NAMES))
    ceiling = tuple(math.inf if f else float(m) for f, m in zip(found, max_abs))
    trace = StepTrace(steps=tuple(range(n)), histograms={"activation_grad": hists},
                      module_max={"activation_grad": {name: tuple(maxima[j].tolist()) for j, name in enumerate(NAMES)}},
                      scale=tuple(scales), found_inf=tuple(bool(f) for f in found), ceiling=ceiling)
    history = StepHistory(first_step=0, scale=tuple(scales), grad_max=tuple(grad_max.tolist()),
                          ceiling=(None,) * n, forward_max=tuple([None, 3.5] * (n // 2) + [1.0] * (n % 2)))
    metadata = Metadata("0.1.0", "2.13.0+cpu", "cpu", "Toy", precision="fp16", steps_seen=n, steps_total=n,
                        captured=("activation_grad",), hooked_modules=NAMES, grad_scaler=True)
    return Report(metadata=metadata, modules=modules, trace=trace, history=history)


def rows_json(report: Report) -> dict:
    """The report's JSON with its trace and history as lists, whatever its length."""
    saved, columns.PACK_FROM = columns.PACK_FROM, 10**12
    try:
        return report.to_dict()
    finally:
        columns.PACK_FROM = saved


@pytest.fixture(scope="module")
def report_1000() -> Report:
    return long_report(1000)


def test_a_long_trace_and_history_are_written_packed_and_read_back_exactly(report_1000):
    packed = json.loads(report_1000.to_json())
    assert packed["trace"]["layout"] == "columns" and packed["history"]["layout"] == "columns"
    back = Report.from_dict(packed)
    assert back == report_1000
    assert isinstance(back.trace.histograms["activation_grad"], columns.HistogramColumn)
    rows = rows_json(back)  # packed -> rows: the very lists the rows form of the original holds
    assert rows == rows_json(report_1000)
    assert json.dumps(Report.from_dict(rows).to_dict()) == json.dumps(packed)  # rows -> packed: the same bytes
    assert back.history.grad_max[int(np.flatnonzero(back.history.found_inf)[0])] == math.inf
    assert back.history.ceiling[0] is None and back.history.forward_max[:3].tolist() == [None, 3.5, None]
    assert len(json.dumps(packed)) * 3 < len(json.dumps(rows))


def test_a_short_report_stays_in_rows():
    d = long_report(columns.PACK_FROM).to_dict()
    assert isinstance(d["trace"]["steps"], list) and isinstance(d["history"]["scale"], list)


def test_analysis_and_the_schedule_replay_are_the_same_on_both_forms(report_1000):
    packed = Report.from_dict(json.loads(report_1000.to_json()))
    rows = Report.from_dict(rows_json(report_1000))
    assert analyze(packed, "fp16") == analyze(rows, "fp16")
    a, b = judge_schedules(packed, "fp16"), judge_schedules(rows, "fp16")
    assert a == b and len(a.rows) > 2  # GradScaler and the grid replayed step by step over both: the same table


@pytest.mark.parametrize("name", ["report-v1-demo.json", "report-v1-fp16-weight.json"])
def test_an_older_rows_report_loads_the_same_packed(tmp_path, monkeypatch, name):
    old = Report.load(DATA / name)
    monkeypatch.setattr(columns, "PACK_FROM", 0)  # pack even its 4 steps
    path = tmp_path / "packed.json"
    old.save(path)
    assert json.loads(path.read_text())["trace"]["layout"] == "columns"
    again = Report.load(path)
    assert again == old
    assert analyze(again, "fp16") == analyze(old, "fp16")


@pytest.mark.slow
def test_the_cli_reads_a_long_packed_report_with_bounded_memory(tmp_path):
    """20,000 steps: show and schedule within a tracemalloc peak of 100 MiB (65 MiB measured; before the
    analysis read a packed trace's arrays, a Histogram per step took show to 201 MiB, and 977 MiB at 10^5)."""
    path = tmp_path / "long.json"
    report = long_report(20_000)
    report.save(path)
    del report
    gc.collect()
    for command in ("show", "schedule"):
        tracemalloc.start()
        try:
            result = CliRunner().invoke(app, [command, str(path), "--json"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert result.exit_code == 0, result.output
        assert peak < 100 * 2**20, f"{command}: {peak / 2**20:.0f} MiB"


def corrupt(d: dict, where: str, value: object) -> dict:
    d = json.loads(json.dumps(d))
    node = d
    *parents, last = where.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return d


@pytest.mark.parametrize("where, value, field", [
    ("trace.layout", "rows", "trace.layout"),
    ("trace.scale.dtype", "<f2", "trace.scale.dtype"),
    ("trace.scale.count", 999, "trace.scale has 999 entries"),
    ("trace.scale.zlib", "not base64!", "trace.scale.zlib"),
    ("trace.found_inf", columns.pack(np.full(1000, 2, dtype=np.uint8)), "trace.found_inf"),
    ("trace.ceiling", columns.pack(np.full(1000, -3.0)), "trace.ceiling[0]"),
    ("trace.histograms.activation_grad.max_abs", columns.pack(np.full(1000, 1.0)),
     "trace.histograms['activation_grad'].max_abs"),
    ("trace.histograms.activation_grad.lo", columns.pack(np.full(1000, NUM_EXP_BINS - 3, dtype=np.uint16)),
     "trace.histograms['activation_grad'].lo"),
    ("trace.module_max.activation_grad.names", ["a", "a", "b", "c"], "trace.module_max['activation_grad'].names"),
    ("history.grad_max", columns.pack(np.full(1000, -2.0)), "history.grad_max[0]"),
    ("history.scale", columns.pack(np.full(999, 1.0)), "history.grad_max has 1000 entries"),
])
def test_a_malformed_packed_field_is_refused_naming_it(report_1000, tmp_path, where, value, field):
    bad = corrupt(report_1000.to_dict(), where, value)
    with pytest.raises(ReportError, match=field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        Report.from_dict(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_inflating_stops_at_the_declared_size():
    """A few hundred bytes that would inflate to 32 MiB are refused without inflating them."""
    packed = zlib.compress(bytes(32 * 2**20), 9)
    bomb = {"dtype": "|u1", "count": 10, "zlib": base64.b64encode(packed).decode()}
    assert len(bomb["zlib"]) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(ReportError, match="holds other than 10 values"):
            columns.unpack(bomb, "x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_the_schema_takes_the_packed_form_and_refuses_a_malformed_one(report_1000):
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources

    schema = json.loads(resources.files("fp16probe").joinpath("schema/report.schema.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    good = json.loads(report_1000.to_json())
    validator.validate(good)
    for where, value in (("trace.scale.dtype", "<f2"), ("history.layout", "rows"), ("trace.steps.zlib", 5)):
        assert not validator.is_valid(corrupt(good, where, value)), where


def test_a_packed_histogram_reads_as_the_histogram_it_packs():
    hs = (Histogram.from_values({-3: 5, 0: 7}), Histogram(), Histogram.from_values({MIN_EXP: 1}, max_abs=1e-45),
          replace(Histogram.from_values({100: 2}), inf=1, nan=2, zero=4))
    col = columns.unpack_histograms(json.loads(json.dumps(columns.pack_histograms(hs))), "h", len(hs))
    assert tuple(col) == hs and col == hs
    assert col.total() == Histogram.sum(hs)
    assert (col.dense() == np.asarray([h.counts for h in hs])).all()
    assert col.nonfinite.tolist() == [False, False, False, True]
