"""The CI gate's Python API: ``fp16probe.compare_reports`` gives what ``fp16probe compare`` gives, for a pytest test."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import fp16probe
from fp16probe.cli import EXIT_GATE, app
from fp16probe.errors import ReportError
from tests.test_compare import ISSUE13_BASE, ISSUE13_CUR


def test_a_regression_fails_with_the_checks_the_command_fails(tmp_path):
    base, cur = ISSUE13_BASE.save(tmp_path / "base.json"), ISSUE13_CUR.save(tmp_path / "cur.json")
    result = fp16probe.compare_reports(base, cur)
    assert isinstance(result, fp16probe.GateResult) and not result.passed
    failed = {c.name for c in result.failures}
    assert {"flushed_at_baseline_scale", "flushed_at_recommended_scale", "verdict"} <= failed
    out = CliRunner().invoke(app, ["compare", str(base), str(cur), "--json"])
    assert out.exit_code == EXIT_GATE
    cli = json.loads(out.stdout)
    assert {c["name"] for c in cli["checks"] if not c["passed"]} == failed
    # reports in memory, a threshold loosened as the command's flag would
    loose = fp16probe.GateThresholds(fail_on_worse_verdict=False)
    assert "verdict" not in {c.name for c in fp16probe.compare_reports(ISSUE13_BASE, ISSUE13_CUR,
                                                                        thresholds=loose).failures}


def test_the_same_report_passes():
    result = fp16probe.compare_reports(ISSUE13_BASE, ISSUE13_BASE)
    assert result.passed and result.failures == () and result.warnings == ()


def test_an_unreadable_report_raises_a_report_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ReportError):
        fp16probe.compare_reports(bad, ISSUE13_BASE)
