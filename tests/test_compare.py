"""The CI gate's pure functions on hand-built reports (no model, no analyzer)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from fp16probe.analysis.gate import Thresholds, compare, flushed_fraction, snapshot, to_junit, to_markdown, worst_modules
from fp16probe.report import Histogram, Metadata, ModuleStats, Report


def make_report(per_module: dict[str, dict[int, int]], **hist_kw) -> Report:
    modules = tuple(
        ModuleStats(name, "activation_grad", "Linear", i, Histogram.from_values(bins, **hist_kw))
        for i, (name, bins) in enumerate(per_module.items())
    )
    return Report(metadata=Metadata("0", "0", "cpu", "M"), modules=modules)


REC = {"verdict": "constant", "log2_scale": 10}
BASE = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}})


def test_flushed_fraction_is_exact():
    # fp16 flushes |x| <= 2^-25: bin -25 flushes, bin -24 does not.
    h = Histogram.from_values({-25: 3, -24: 7})
    assert flushed_fraction(h, "fp16") == 0.3
    assert flushed_fraction(h, "fp16", 1) == 0.0
    assert flushed_fraction(Histogram(), "fp16") == 0.0


def test_worst_modules_only_lossy_ones():
    assert worst_modules(BASE, "fp16", "activation_grad", 3) == (("a", 0.01),)


def test_identical_reports_pass():
    s = snapshot(BASE, REC)
    result = compare(s, s)
    assert result.passed
    assert [c.name for c in result.checks] == ["flushed_fraction", "new_overflow", "scale_shift", "new_worst_modules"]


def test_flushed_rise_fails_beyond_threshold():
    cur = make_report({"a": {-30: 30, -10: 970}, "b": {-10: 1000}, "c": {-5: 1000}})
    base_s, cur_s = snapshot(BASE, REC), snapshot(cur, REC)
    # 10/3000 -> 30/3000: +0.667 points
    assert compare(base_s, cur_s, Thresholds(max_flushed_increase=0.01)).passed
    failed = compare(base_s, cur_s, Thresholds(max_flushed_increase=0.005)).failures
    assert [c.name for c in failed] == ["flushed_fraction"]


def test_new_overflow_at_the_baseline_scale():
    # max |g| 2^6 * 2^10 = 65536 >= 65520: overflows in fp16 at the baseline's S = 2^10.
    cur = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {6: 1000}})
    result = compare(snapshot(BASE, REC), snapshot(cur, REC))
    assert [c.name for c in result.failures] == ["new_overflow"]
    assert compare(snapshot(BASE, REC), snapshot(cur, REC), Thresholds(fail_on_new_overflow=False)).passed


def test_weight_gradient_overflow_counts_whatever_kind_is_analysed():
    """The loss scale multiplies weight gradients too: one that overflows at the baseline's S is new overflow."""
    big_weight_grad = ModuleStats("c", "weight_grad", "Linear", 2, Histogram.from_values({6: 10}))
    cur = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}})
    cur = Report(metadata=cur.metadata, modules=cur.modules + (big_weight_grad,))
    result = compare(snapshot(BASE, REC), snapshot(cur, REC))
    assert [c.name for c in result.failures] == ["new_overflow"]
    assert "max |g| 0.0312 -> 64" in result.failures[0].message
    assert snapshot(cur, REC).to_dict()["overflow_max_abs"] == 64.0


def test_nan_is_new_overflow():
    cur = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}}, nan=1)
    assert "new_overflow" in {c.name for c in compare(snapshot(BASE, REC), snapshot(cur, REC)).failures}


def test_scale_shift():
    base = snapshot(BASE, REC)
    assert compare(base, snapshot(BASE, {"verdict": "constant", "log2_scale": 12})).passed
    moved = compare(base, snapshot(BASE, {"verdict": "constant", "log2_scale": 13}))
    assert [c.name for c in moved.failures] == ["scale_shift"]
    gone = compare(base, snapshot(BASE, {"verdict": "none_needed", "log2_scale": None}))
    assert [c.name for c in gone.failures] == ["scale_shift"]


def test_module_newly_among_worst():
    cur = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-27: 5, -5: 995}})
    result = compare(snapshot(BASE, REC), snapshot(cur, REC), Thresholds(max_flushed_increase=1.0))
    assert [c.name for c in result.failures] == ["new_worst_modules"]
    assert "c" in result.failures[0].message


def test_markdown_and_junit():
    cur = make_report({"a": {-30: 300, -10: 700}, "b": {-10: 1000}, "c": {-5: 1000}})
    result = compare(snapshot(BASE, REC, source="base.json"), snapshot(cur, REC, source="cur.json"))
    md = to_markdown(result)
    assert "FAILED" in md and "`base.json`" in md and "| flushed_fraction | **FAIL** |" in md
    assert r"max \|g\| " in md and "/g/" not in md  # the pipe escaped, not turned into a slash
    assert all(line.count("|") - line.count(r"\|") == 4 for line in md.splitlines() if line.startswith("| "))
    root = ET.fromstring(to_junit(result))
    assert root.get("tests") == "4"
    assert root.get("failures") == str(len(result.failures))
    assert [tc.get("name") for tc in root if tc.find("failure") is not None] == [c.name for c in result.failures]
    assert result.to_dict()["passed"] is False
