"""Reports written before the architecture change load, re-serialise and analyse as they did.

``tests/data/report-v1-demo.json`` (fp32 demo, 4 steps) and ``report-v1-fp16-weight.json``
(fp16 autocast at S = 1024 with SGD, --kind weight_grad) were written by the CLI at commit
f957af3; ``report-v1-expected-analysis.json`` holds what ``analyze`` returned on them then.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp16probe.analysis.recommend import analyze
from fp16probe.report import Report

DATA = Path(__file__).parent / "data"
FIXTURES = ("demo", "fp16-weight")


def _load_json(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", FIXTURES)
def test_old_report_round_trips_unchanged(name: str) -> None:
    raw = _load_json(f"report-v1-{name}.json")
    report = Report.load(DATA / f"report-v1-{name}.json")
    assert report.recommendation is not None
    raw["recommendation"].setdefault("caveats", [])  # the one key added since, optional on load
    assert report.to_dict() == raw


EXPECTED = _load_json("report-v1-expected-analysis.json")


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_old_report_analyses_as_before(key: str) -> None:
    name, how = key.split("/")
    report = Report.load(DATA / f"report-v1-{name}.json")
    if how == "bf16":
        rec = analyze(report, "bf16", kind=report.recommendation.kind)
    else:
        rec = analyze(report, "fp16", kind=how)
    got = rec.to_dict()
    assert got.pop("caveats") == []  # added since; nothing in these fp32-referenced runs to caveat
    assert got == EXPECTED[key]
