"""The Report file: round trips, atomic writes, clear errors, merging."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from fp16probe import Histogram, Probe, Report, ReportError
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, SCHEMA_VERSION


def small_report(seed: int = 0, steps: int = 2) -> Report:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    torch.manual_seed(100)  # the same batches whatever the weights
    batches = [torch.randn(3, 4) for _ in range(steps)]
    with Probe(model) as probe:
        for x in batches:
            (model(x).pow(2).mean() * 1e-5).backward()
            model.zero_grad()
            probe.step()
    return probe.report(extra={"inputs": "synthetic"})


def test_round_trip(tmp_path):
    report = small_report()
    path = report.save(tmp_path / "r.json")
    loaded = Report.load(path)
    assert loaded == report
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION
    assert loaded.workload.inputs == "synthetic"
    assert loaded.metadata.torch_version == torch.__version__


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    small_report().save(path)
    before = path.read_text()

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        small_report(seed=1).save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary left behind


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "empty"),
        ('{"schema_version": 1, "metadata": {', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"metadata": {}}', "no schema_version"),
        ('{"schema_version": 99}', "schema_version 99 is not supported"),
        ('{"schema_version": 1, "metadata": {}}', "malformed report"),
    ],
)
def test_bad_files_get_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=message) as info:
        Report.load(path)
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)


def test_truncated_real_report(tmp_path):
    path = small_report().save(tmp_path / "r.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ReportError, match="truncated or corrupt"):
        Report.load(path)


def test_negative_count_is_rejected(tmp_path):
    d = small_report().to_dict()
    d["modules"][0]["histogram"]["zero"] = -1
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ReportError, match="non-negative integer"):
        Report.load(path)


def test_missing_file():
    with pytest.raises(ReportError, match="no such report file"):
        Report.load("/nonexistent/r.json")


def test_merge_ranks_sums_counts_and_takes_maxima():
    a, b = small_report(seed=0), small_report(seed=1)
    merged = a.merge(b)
    assert merged.trace.steps == a.trace.steps
    assert merged.metadata.world_size == 2
    for m in merged.modules:
        assert m.histogram == a.module(m.name, m.kind).histogram + b.module(m.name, m.kind).histogram
    for i in range(len(a.trace)):
        ha = a.trace.histograms[ACTIVATION_GRAD][i]
        hb = b.trace.histograms[ACTIVATION_GRAD][i]
        assert merged.trace.histograms[ACTIVATION_GRAD][i] == ha + hb
        for name, vals in merged.trace.module_max[WEIGHT_GRAD].items():
            assert vals[i] == max(a.trace.module_max[WEIGHT_GRAD][name][i],
                                  b.trace.module_max[WEIGHT_GRAD][name][i])


def test_merge_runs_appends_traces():
    a, b = small_report(steps=2), small_report(steps=3)
    merged = a.merge(b)
    assert len(merged.trace) == 5 and merged.metadata.steps_seen == 5
    assert merged.trace.histograms[ACTIVATION_GRAD] == (
        a.trace.histograms[ACTIVATION_GRAD] + b.trace.histograms[ACTIVATION_GRAD]
    )


def test_histogram_arithmetic_by_hand():
    h = Histogram.from_values({-30: 5, -25: 2, -24: 3, 0: 1}, zero=4)
    assert h.total == 15 and h.nonzero_finite == 11
    # fp16 flushes |x| <= 2^-25 at S = 1; at S = 2 only |x| <= 2^-26.
    assert h.flushed("fp16", 0) == 7 and h.flushed("fp16", 1) == 5 and h.flushed("fp16", 6) == 0
    assert h.subnormal("fp16", 0) == 3
    assert h.max_abs == 1.0 and not h.overflows("fp16", 15) and h.overflows("fp16", 16)
    assert Histogram.from_dict(h.to_dict()) == h


def test_from_values_refuses_bins_outside_the_range_and_negative_counts():
    # -150 used to wrap (a negative list index) into bin 128, the top of the range.
    for e in (-150, 129):
        with pytest.raises(ValueError, match=f"bin {e} outside"):
            Histogram.from_values({e: 1})
    with pytest.raises(ValueError, match="non-negative"):
        Histogram.from_values({-3: -2})
    edges = Histogram.from_values({-149: 1, 128: 1})
    assert edges.lowest_exp == -149 and edges.highest_exp == 128
