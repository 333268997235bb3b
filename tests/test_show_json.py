"""``fp16probe show --json``: what show prints, as JSON alone on stdout."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fp16probe import Histogram, Metadata, ModuleStats, Report
from fp16probe.cli import EXIT_OK, EXIT_USAGE, app


@pytest.fixture
def report_path(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    modules = tuple(
        ModuleStats(name, "activation_grad", "Linear", i, Histogram.from_values(bins, zero=5))
        for i, (name, bins) in enumerate({"layers.10": {-30: 40, -10: 60}, "layers.2": {-30: 40, -10: 60},
                                          "head": {-5: 100}}.items())
    )
    path = tmp_path / "r.json"
    Report(metadata=Metadata("0", "0", "cpu", "Net"), modules=modules).save(path)
    return path


def test_show_json_is_the_numbers_show_prints(report_path):
    result = CliRunner().invoke(app, ["show", str(report_path), "--json", "--top", "2"])
    assert result.exit_code == EXIT_OK, result.output
    assert result.stderr == ""
    data = json.loads(result.stdout)
    dist = data["distribution"]
    assert dist["values"] == 315 and dist["nonzero"] == 300 and dist["zero"] == 15
    assert dist["flushed_fraction_at_1"] == pytest.approx(80 / 300)  # bin -30 flushes in fp16 at S = 1
    assert sum(dist["bins"].values()) == 300 and dist["bins"]["-30"] == 80
    k = dist["log2_scale"]
    assert data["recommendation"]["log2_scale"] == k and dist["flushed_fraction_at_scale"] == 0.0
    # the worst two, ranked as the terminal's table ranks them (analysis.whatif.worst_modules):
    # equal shares go to the module earlier in forward order, layers.10 (order 0) before layers.2
    assert [m["name"] for m in data["worst_modules"]] == ["layers.10", "layers.2"]
    assert data["metadata"]["model_class"] == "Net"
    rec = json.loads(CliRunner().invoke(app, ["recommend", str(report_path), "--json"]).stdout)
    assert data["recommendation"]["verdict"] == rec["verdict"]


def test_show_json_bad_report_is_one_error_line_and_empty_stdout(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "metadata": {}, "modules": [], "trace": {}}')
    result = CliRunner().invoke(app, ["show", str(bad), "--json"])
    assert result.exit_code == EXIT_USAGE
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
