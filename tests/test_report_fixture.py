"""Reports written before the architecture change load, re-serialise and analyse as they did.

``tests/data/report-v1-demo.json`` (fp32 demo, 4 steps) and ``report-v1-fp16-weight.json``
(fp16 autocast at S = 1024 with SGD, --kind weight_grad) were written by the CLI at commit
f957af3; ``report-v1-expected-analysis.json`` holds what ``analyze`` returned on them then.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fp16probe.analysis.recommend import analyze
from fp16probe.report import Report
from fp16probe.sections import split_workload
from fp16probe.presentation.verdict import verdict_text

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
    # the run's description that metadata.extra held is the workload section now (absent values dropped)
    workload, raw["metadata"]["extra"] = split_workload(raw["metadata"]["extra"])
    if workload is not None:
        raw["workload"] = workload.to_dict()
    assert report.to_dict() == raw


EXPECTED = _load_json("report-v1-expected-analysis.json")
# Changed on purpose since (issue 11): the wording (citations by authors and title, advice through
# a scaler that backs off) and new evidence keys; every number the old analysis gave is kept.
REWORDED = {"text", "citations"}


def _analyse(key: str):
    name, how = key.split("/")
    report = Report.load(DATA / f"report-v1-{name}.json")
    if how == "bf16":
        return analyze(report, "bf16", kind=report.recommendation.kind)
    return analyze(report, "fp16", kind=how)


@pytest.mark.parametrize("key", sorted(k for k in EXPECTED if not k.startswith("fp16-weight/") or k.endswith("bf16")))
def test_old_report_analyses_as_before(key: str) -> None:
    got = _analyse(key).to_dict()
    old = EXPECTED[key]
    # The replay table's method and row notes were sentences and are codes now, worded in presentation:
    # the same rows carry a note, and every number is the same.
    old = copy.deepcopy(old)
    for table in (got.get("growth_interval_table"), old.get("growth_interval_table")):
        if table:
            del table["method"]
            for row in table["rows"]:
                row["note"] = bool(row["note"])
    assert {k: got[k] for k in old if k not in REWORDED | {"evidence"}} == {
        k: v for k, v in old.items() if k not in REWORDED | {"evidence"}}
    assert {k: got["evidence"][k] for k in old["evidence"]} == old["evidence"]
    # Written before the backward-wide ceiling existed: the caveat says so. A narrowed kind says
    # what it left out; the fp16 run says where its zeros come from.
    codes = [c["code"] for c in got["caveats"]]
    assert "hooked_ceiling" in codes
    assert ("narrowed_kind" in codes) == (old["kind"] != "all")
    assert ("low_precision_run" in codes) == key.startswith("fp16-weight/")
    assert len(codes) == 1 + (old["kind"] != "all") + key.startswith("fp16-weight/")


@pytest.mark.parametrize("kind", ["activation_grad", "weight_grad", "all"])
def test_old_fp16_autocast_report_is_now_insufficient_evidence(kind: str) -> None:
    """Issue 11: its exact zeros (1.18% of values) may hide what fp16 flushed at S = 2^10."""
    rec = _analyse(f"fp16-weight/{kind}")
    assert EXPECTED[f"fp16-weight/{kind}"]["verdict"] == "constant"  # what it said before
    assert rec.verdict == "insufficient_evidence" and rec.evidence["insufficient_reason"] == "autocast_zeros"
    assert "S = 2^10" in verdict_text(rec) and "Profile in fp32" in verdict_text(rec)
    assert rec.grad_scaler_kwargs == {} and rec.log2_scale is None
    (run,) = [c.data for c in rec.caveats if c.code == "low_precision_run"]
    assert run["precision"] == "fp16-autocast" and run["scales"] == [2.0**10]
