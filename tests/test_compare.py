"""The CI gate judges what users deploy: hand-built reports through the real analyzer, and real runs.

Regression cases from issue 13 (constant -> no_single_scale with the share at S = 1 flat)
and issue 15 (a 16-layer model whose first layer's gradients shrank by 2^12; a strictly
better run; a torch.compile'd run of the same model) are each a test here.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fp16probe import Probe, analyze
from fp16probe.recommendation import Recommendation
from fp16probe.analysis.gate import (
    GateWarning,
    GateThresholds,
    canonical_module_names,
    check_consistency,
    compare,
    flushed_fraction,
    natural_key,
    snapshot,
    worst_modules,
)
from fp16probe.cli import EXIT_GATE, EXIT_OK, EXIT_USAGE, app
from fp16probe.errors import ReportError
from fp16probe.presentation.ci import github_annotations, to_junit, to_markdown
from fp16probe.presentation.gate import check_message, warning_texts
from fp16probe.report import Histogram, Metadata, ModuleStats, Report

FAST = dict(growth_intervals=(2000,), horizon=200)


def make_report(per_module: dict[str, dict[int, int]], model_class: str = "M", **hist_kw) -> Report:
    modules = tuple(
        ModuleStats(name, "activation_grad", "Linear", i, Histogram.from_values(bins, **hist_kw))
        for i, (name, bins) in enumerate(per_module.items())
    )
    return Report(metadata=Metadata("0", "0", "cpu", model_class), modules=modules)


def snap(report: Report, source: str = "", **kw):
    return snapshot(report, analyze(report, "fp16", **FAST), source=source, **kw)


def gate(base: Report, cur: Report, thresholds: GateThresholds = GateThresholds()):
    return compare(snap(base, "base.json"), snap(cur, "cur.json"), thresholds)


def rec_of(verdict: str, log2_scale: int | None) -> Recommendation:
    """A typed Recommendation carrying only what the gate reads."""
    return Recommendation.from_dict({
        "verdict": verdict, "format": "fp16", "log2_scale": log2_scale,
        "scale": None if log2_scale is None else 2.0**log2_scale, "grad_scaler_kwargs": {},
        "flushed_fraction_at_1": None, "flushed_fraction_at_scale": None, "overflow_steps_at_scale": None,
        "headroom_bits": None, "worst_modules": [], "evidence": {}, "thresholds": {}, "citations": [], "text": "",
    })


REC = rec_of("constant", 10)
BASE = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}})
CHECKS = ["flushed_at_baseline_scale", "flushed_at_recommended_scale", "flushed_fraction", "verdict",
          "new_overflow", "scale_shift", "module_regressions"]


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
    assert result.passed and result.warnings == ()
    assert [c.name for c in result.checks] == CHECKS


# -- issue 13: the gate's blind spot ------------------------------------------------------------

# One module, max |g| = 1, so the analyzer recommends S = 2^14 (2^15 x 1 is the largest
# safe, less one bit of margin); at 2^14 values <= 2^-39 flush. Half of the 40% lost at
# S = 1 sits at 2^-30, which the scale recovers in both runs.
ISSUE13_BASE = make_report({"net": {-45: 13, -30: 40_000, -5: 59_986, 0: 1}})
ISSUE13_CUR = make_report({"net": {-45: 650, -30: 40_000, -5: 59_349, 0: 1}})


def test_issue13_constant_to_no_single_scale_fails_though_s1_is_flat():
    b, c = snap(ISSUE13_BASE), snap(ISSUE13_CUR)
    assert (b.verdict, c.verdict) == ("constant", "no_single_scale")
    assert b.log2_scale == c.log2_scale == 14
    assert b.flushed_at(14) == pytest.approx(0.00013) and c.flushed_at(14) == pytest.approx(0.0065)
    result = compare(b, c)
    failed = {x.name for x in result.failures}
    assert {"flushed_at_baseline_scale", "flushed_at_recommended_scale", "verdict"} <= failed
    # What the gate looked at before: the share at S = 1 (+0.64 points, under 1), the scale
    # (unmoved) and the worst-modules list (unchanged) all pass; this case got through.
    assert {"flushed_fraction", "scale_shift", "module_regressions"}.isdisjoint(failed)
    at_scale = next(x for x in result.checks if x.name == "flushed_at_baseline_scale")
    assert "0.013% to 0.65%" in check_message(at_scale) and "S = 2^14" in check_message(at_scale)


def test_worse_verdict_alone_fails_and_can_be_allowed():
    b = snapshot(BASE, rec_of("constant", 10))
    for worse in ("dynamic", "no_single_scale", "insufficient_evidence"):
        c = snapshot(BASE, rec_of(worse, 10))
        assert [x.name for x in compare(b, c).failures] == ["verdict"], worse
        assert compare(b, c, GateThresholds(fail_on_worse_verdict=False)).passed
    for better in ("none_needed", "constant"):
        c = snapshot(BASE, rec_of(better, 10))
        assert "verdict" not in {x.name for x in compare(b, c).failures}
    anything = snapshot(BASE, rec_of("no_single_scale", 10))
    unsure = snapshot(BASE, rec_of("insufficient_evidence", 10))
    assert "verdict" in {x.name for x in compare(anything, unsure).failures}


def test_share_at_the_current_recommendation():
    """A run whose own recommendation moved down to a scale that flushes more fails, even within the shift limit."""
    b = snapshot(BASE, rec_of("constant", 10))
    c = snapshot(BASE, rec_of("constant", 8))  # at 2^8, bin -30 (1% of a) ... still kept
    assert compare(b, c).passed
    low = make_report({"a": {-36: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}})
    base = snapshot(low, rec_of("constant", 12))
    moved = snapshot(low, rec_of("constant", 10))
    result = compare(base, moved)
    assert [x.name for x in result.failures] == ["flushed_at_recommended_scale"]


# -- issue 15: by how much each module's own share rose, not by rank ---------------------------

def test_strictly_better_run_passes_though_the_worst_list_changes():
    base = make_report({"a": {-40: 30, -10: 970}, "b": {-40: 20, -10: 980}, "c": {-40: 10, -10: 990},
                        "d": {-40: 5, -10: 995}})
    better = make_report({"a": {-10: 1000}, "b": {-40: 20, -10: 980}, "c": {-40: 10, -10: 990},
                          "d": {-40: 5, -10: 995}})
    rank_b = [n for n, _ in worst_modules(base, "fp16", "activation_grad", 3)]
    rank_c = [n for n, _ in worst_modules(better, "fp16", "activation_grad", 3)]
    assert rank_b == ["a", "b", "c"] and rank_c == ["b", "c", "d"]  # d moved into the worst 3
    result = gate(base, better)
    assert result.passed, [check_message(x) for x in result.failures]


def test_a_module_that_got_worse_fails_by_its_own_rise():
    base = make_report({"a": {-10: 1000}, "b": {-10: 1000}, "c": {-5: 1000}})
    cur = make_report({"a": {-10: 1000}, "b": {-10: 1000}, "c": {-45: 30, -5: 970}})
    result = compare(snapshot(base, REC), snapshot(cur, REC), GateThresholds(max_flushed_increase_at_scale=1.0))
    assert [x.name for x in result.failures] == ["module_regressions"]
    assert "c 0% -> 3%" in check_message(result.failures[0])


def test_module_names_match_across_torch_compile_and_ddp():
    names = ["", "0", "block.2", "block.10"]
    compiled = {"_orig_mod": "", **{f"_orig_mod.{n}": n for n in names if n}}
    assert canonical_module_names(compiled) == compiled
    ddp = {"module": "", **{f"module.{n}": n for n in names if n}}
    assert canonical_module_names(ddp) == ddp
    both = {f"module._orig_mod.{n}": n for n in names if n}
    assert canonical_module_names(both) == both
    # A model's own child called "module" keeps its name when other names do not carry the prefix.
    assert canonical_module_names(["module.x", "head"]) == {"module.x": "module.x", "head": "head"}


def test_renamed_by_a_wrapper_is_the_same_model():
    base = make_report({"0": {-30: 10, -10: 990}, "1": {-10: 1000}})
    wrapped = make_report({"_orig_mod.0": {-30: 10, -10: 990}, "_orig_mod.1": {-10: 1000}})
    result = gate(base, wrapped)
    assert result.passed and result.warnings == ()
    assert "2 modules matched" in check_message(next(x for x in result.checks if x.name == "module_regressions"))


def test_natural_order_of_module_names():
    assert sorted(["layers.10", "layers.2", "layers.1.attn", "head"], key=natural_key) == [
        "head", "layers.1.attn", "layers.2", "layers.10"]
    base = make_report({f"l{i}": {-10: 1000} for i in (1, 2, 10)})
    cur = make_report({f"l{i}": {-45: 100, -10: 900} for i in (1, 2, 10)})
    failure = next(x for x in gate(base, cur).failures if x.name == "module_regressions")
    assert check_message(failure).index("l2 ") < check_message(failure).index("l10 ")


def test_different_models_are_named_in_warnings():
    other = make_report({"x": {-10: 1000}}, model_class="OtherNet")
    result = gate(BASE, other)
    assert any("different model: M (baseline) vs OtherNet (current)" in w for w in warning_texts(result))
    assert any("3 module(s) only in the baseline (a, b, c)" in w for w in warning_texts(result))


def test_reports_recommended_for_different_formats_are_named_in_warnings():
    fp16 = BASE.with_recommendation(analyze(BASE, "fp16", **FAST))
    bf16 = BASE.with_recommendation(analyze(BASE, "bf16", **FAST))
    result = compare(snap(fp16), snap(bf16))
    assert [(w.code, w.data["label"]) for w in result.warnings] == [("workload", "format")]
    assert warning_texts(result) == ("the reports profiled different target format: fp16 (baseline) vs bf16 (current)",)
    edited = BASE.with_recommendation(replace(analyze(BASE, "fp16", **FAST), log2_scale=3))
    result = compare(snap(fp16), snap(edited))
    assert result.passed and warning_texts(result) == (
        "the current report's stored recommendation (constant, S = 2^3) differs from its re-analysis "
        "(constant, S = 2^19); the gate judges the re-analysis",)


def test_verification_that_did_not_hold_fails():
    b = snapshot(BASE, REC)
    held = replace(b, verification=(True, "overflow steps 0 predicted, 0 measured"))
    failed = replace(b, verification=(False, "predicted 0.1% zeroed, measured 4%"))
    assert "verification" not in {x.name for x in compare(b, b).checks}  # no verification: no check
    assert compare(b, held).passed
    result = compare(b, failed)
    assert [x.name for x in result.failures] == ["verification"]
    assert "did not hold: predicted 0.1% zeroed, measured 4%" in check_message(result.failures[0])


def _verified(report: Report, **changes) -> Report:
    from fp16probe.verification import Verification

    fields = dict(precision="fp16", device="cpu", steps=4, scaler_kwargs={"init_scale": 1024.0}, kind="activation_grad",
                  predicted_overflow_steps=0, measured_overflow_steps=0, predicted_zeroed_fraction=0.001,
                  measured_zeroed_fraction=0.0012, tolerance=0.0005, held=True)
    fields.update(changes)
    return report.with_verification(Verification(**fields))


def test_a_real_verification_in_the_report(tmp_path):
    """Report.verification, saved and loaded: held passes; not held fails; 'held' contradicted by its numbers fails."""
    b = snap(BASE)
    for changes, passed, words in [({}, True, "0.12% of activation_grad values zeroed (0.1% predicted"),
                                   ({"measured_overflow_steps": 2, "held": False}, False, "2 of 4 steps overflowed"),
                                   ({"measured_zeroed_fraction": 0.04}, False, "but its own numbers say")]:
        path = tmp_path / "v.json"
        _verified(BASE, **changes).save(path)
        result = compare(b, snap(Report.load(path)))
        check = next(x for x in result.checks if x.name == "verification")
        assert check.passed is passed and result.passed is passed, check_message(check)
        assert words in check_message(check)


# -- the older checks ---------------------------------------------------------------------------

def test_flushed_rise_at_s1_fails_beyond_threshold():
    cur = make_report({"a": {-30: 30, -10: 970}, "b": {-10: 1000}, "c": {-5: 1000}})
    base_s, cur_s = snapshot(BASE, REC), snapshot(cur, REC)
    # 10/3000 -> 30/3000: +0.667 points at S = 1; nothing flushes at the deployed 2^10
    assert compare(base_s, cur_s, GateThresholds(max_flushed_increase=0.01)).passed
    failed = compare(base_s, cur_s, GateThresholds(max_flushed_increase=0.005)).failures
    assert [c.name for c in failed] == ["flushed_fraction"]


def test_new_overflow_at_the_baseline_scale():
    # max |g| 2^6 * 2^10 = 65536 >= 65520: overflows in fp16 at the baseline's S = 2^10.
    cur = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {6: 1000}})
    result = compare(snapshot(BASE, REC), snapshot(cur, REC))
    assert [c.name for c in result.failures] == ["new_overflow"]
    assert compare(snapshot(BASE, REC), snapshot(cur, REC), GateThresholds(fail_on_new_overflow=False)).passed


def test_weight_gradient_overflow_counts_whatever_kind_is_analysed():
    """The loss scale multiplies weight gradients too: one that overflows at the baseline's S is new overflow."""
    big_weight_grad = ModuleStats("c", "weight_grad", "Linear", 2, Histogram.from_values({6: 10}))
    cur = Report(metadata=BASE.metadata, modules=BASE.modules + (big_weight_grad,))
    result = compare(snapshot(BASE, REC), snapshot(cur, REC))
    assert [c.name for c in result.failures] == ["new_overflow"]
    assert "max |g| 0.0312 -> 64" in check_message(result.failures[0])
    assert snapshot(cur, REC).to_dict()["overflow_max_abs"] == 64.0


def test_overflow_ceiling_counts_when_the_report_has_one():
    """The trace's ceiling (largest |g| anywhere in backward) is overflow evidence beyond the hooked modules."""
    b = snapshot(BASE, REC)
    assert compare(b, replace(b, ceiling=2.0**5)).passed
    result = compare(b, replace(b, ceiling=2.0**6))
    assert [c.name for c in result.failures] == ["new_overflow"]
    assert [c.name for c in compare(b, replace(b, ceiling=float("inf"))).failures] == ["new_overflow"]


def test_nan_is_new_overflow():
    cur = make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}}, nan=1)
    assert "new_overflow" in {c.name for c in compare(snapshot(BASE, REC), snapshot(cur, REC)).failures}


def test_scale_shift():
    base = snapshot(BASE, REC)
    assert compare(base, snapshot(BASE, rec_of("constant", 12))).passed
    moved = compare(base, snapshot(BASE, rec_of("constant", 13)))
    assert [c.name for c in moved.failures] == ["scale_shift"]


def test_tampered_module_counts_are_an_error():
    from fp16probe.report import StepTrace

    h = Histogram.from_values({-30: 10, -10: 990})
    trace = StepTrace(steps=(0,), histograms={"activation_grad": (h,)}, module_max={}, scale=(None,),
                      found_inf=(False,))
    honest = Report(metadata=Metadata("0", "0", "cpu", "M"),
                    modules=(ModuleStats("a", "activation_grad", "Linear", 0, h),), trace=trace)
    check_consistency(honest)
    edited = replace(honest, modules=(ModuleStats("a", "activation_grad", "Linear", 0,
                                                  Histogram.from_values({-10: 1000})),))
    with pytest.raises(ReportError, match="do not add up to its per-step trace"):
        check_consistency(edited, "cur.json")


# -- outputs ------------------------------------------------------------------------------------

def _failing_result():
    cur = make_report({"a": {-30: 300, -40: 50, -10: 650}, "b": {-10: 1000}, "c": {-5: 1000}})
    return compare(snapshot(BASE, REC, source="base.json"), snapshot(cur, REC, source="cur.json"))


def test_markdown_ends_with_a_blank_line_so_appended_summaries_stay_apart():
    result = _failing_result()
    md = to_markdown(result)
    assert md.endswith("|\n\n")
    assert "FAILED" in md and "`base.json`" in md and "| flushed_fraction | **FAIL** |" in md
    assert r"max \|g\| " in md and "/g/" not in md  # the pipe escaped, not turned into a slash
    assert all(line.count("|") - line.count(r"\|") == 4 for line in md.splitlines() if line.startswith("| "))
    both = to_markdown(result) + to_markdown(compare(snapshot(BASE, REC), snapshot(BASE, REC)))
    blocks = [b for b in both.split("\n\n") if b.startswith("| check")]
    assert len(blocks) == 2  # a table ends before the next summary's heading begins


def test_junit_has_a_testsuites_root_times_and_every_checks_numbers():
    result = _failing_result()
    root = ET.fromstring(to_junit(result, seconds=1.25))
    assert root.tag == "testsuites" and root.get("time") == "1.250"
    suite = root.find("testsuite")
    assert suite.get("tests") == str(len(CHECKS)) and suite.get("failures") == str(len(result.failures))
    assert suite.get("timestamp")
    cases = suite.findall("testcase")
    assert [tc.get("name") for tc in cases] == CHECKS
    assert all(float(tc.get("time")) >= 0 for tc in cases)
    failed = [tc.get("name") for tc in cases if tc.find("failure") is not None]
    assert failed == [c.name for c in result.failures]
    passing = next(tc for tc in cases if tc.find("failure") is None)
    check = next(c for c in result.checks if c.name == passing.get("name"))
    assert check_message(check) in passing.find("system-out").text and "limit:" in passing.find("system-out").text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["baseline"] == "base.json" and props["current_verdict"] == "constant"


def test_github_annotations_escape_their_text():
    result = _failing_result()
    lines = github_annotations(result)
    assert len(lines) == len(result.failures)
    assert all(ln.startswith("::error title=fp16probe compare%3A ") for ln in lines)
    weird = replace(result, warnings=(GateWarning("workload", {"label": "inputs", "baseline": "50% of it\nsecond line",
                                                               "current": "x"}),))
    assert github_annotations(weird)[-1] == ("::warning title=fp16probe compare::the reports profiled different inputs: "
                                             "50%25 of it%0Asecond line (baseline) vs x (current)")


# -- the command line ---------------------------------------------------------------------------

def _save(report: Report, path) -> str:
    report.save(path)
    return str(path)


@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_cli_issue13_regression_exits_1_with_annotations_under_github_actions(cli_env, monkeypatch):
    base, cur = _save(ISSUE13_BASE, cli_env / "b.json"), _save(ISSUE13_CUR, cli_env / "c.json")
    summary = cli_env / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = CliRunner().invoke(app, ["compare", base, cur, "--junit", "j.xml"])
    assert result.exit_code == EXIT_GATE, result.output
    errors = [ln for ln in result.stdout.splitlines() if ln.startswith("::error ")]
    assert any("flushed_at_baseline_scale" in ln for ln in errors)
    assert any("verdict" in ln for ln in errors)
    # again, appended: two summaries, two tables; --json keeps stdout for JSON alone
    result = CliRunner().invoke(app, ["compare", base, cur, "--json"])
    assert result.exit_code == EXIT_GATE
    assert json.loads(result.stdout)["current"]["verdict"] == "no_single_scale"
    assert "::error " in result.stderr
    text = summary.read_text()
    assert text.count("### fp16probe compare: FAILED") == 2 and text.endswith("\n\n")
    assert ET.parse(cli_env / "j.xml").getroot().tag == "testsuites"


def test_cli_no_annotations_outside_github_actions(cli_env):
    base, cur = _save(ISSUE13_BASE, cli_env / "b.json"), _save(ISSUE13_CUR, cli_env / "c.json")
    result = CliRunner().invoke(app, ["compare", base, cur])
    assert result.exit_code == EXIT_GATE
    assert "::error" not in result.output


def test_cli_warns_or_refuses_different_models(cli_env):
    base = _save(BASE, cli_env / "b.json")
    other = _save(make_report({"a": {-30: 10, -10: 990}, "b": {-10: 1000}, "c": {-5: 1000}},
                              model_class="OtherNet"), cli_env / "o.json")
    result = CliRunner().invoke(app, ["compare", base, other])
    assert result.exit_code == EXIT_OK, result.output
    assert "warning: the reports profiled different model: M (baseline) vs OtherNet" in result.stderr
    result = CliRunner().invoke(app, ["compare", base, other, "--require-same-workload"])
    assert result.exit_code == EXIT_USAGE
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "different model" in lines[0]


def test_cli_tampered_report_is_an_error_not_a_pass(cli_env):
    """Editing a module's counts to hide a loss, without the trace, is caught: exit 2."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with Probe(model) as probe:
        for _ in range(2):
            (model(torch.randn(3, 4)).pow(2).mean() * 1e-9).backward()
            model.zero_grad()
            probe.step()
    good = _save(probe.report(), cli_env / "good.json")
    d = json.loads((cli_env / "good.json").read_text())
    m = next(m for m in d["modules"] if m["kind"] == "activation_grad" and m["histogram"]["bins"])
    low = min(m["histogram"]["bins"], key=int)
    m["histogram"]["bins"][low] -= 1
    m["histogram"]["zero"] += 1
    (cli_env / "edited.json").write_text(json.dumps(d))
    result = CliRunner().invoke(app, ["compare", good, str(cli_env / "edited.json")])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "do not add up to its per-step trace" in result.stderr


# -- real runs: issue 15's 16-layer model, and torch.compile -------------------------------------

class Shrink(torch.autograd.Function):
    """Identity forward; multiplies the gradient flowing back by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


BASE_SHRINK = 2.0**-10  # puts the first layer's gradients near the bottom of fp16's range at the deployed S


class Deep(nn.Module):
    """16 Linear+Tanh layers; ``shrink`` scales the gradient reaching the first layer's output."""

    def __init__(self, shrink: float = BASE_SHRINK) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(16))
        self.shrink = shrink

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == 0 and self.shrink != 1.0:
                x = Shrink.apply(x, self.shrink)
        return x


def _profile_deep(model: nn.Module, probe_target: nn.Module | None = None) -> Report:
    torch.manual_seed(1)
    batches = [torch.randn(16, 32) for _ in range(4)]
    with Probe(model if probe_target is None else probe_target) as probe:
        for x in batches:
            (model(x).pow(2).mean() * 2.0**-18).backward()
            model.zero_grad()
            probe.step()
    return probe.report()


@pytest.fixture(scope="module")
def deep_base() -> Report:
    torch.manual_seed(0)
    return _profile_deep(Deep())


def test_issue15_first_layer_shrunk_by_2_12_fails(deep_base):
    torch.manual_seed(0)
    shrunk = _profile_deep(Deep(shrink=BASE_SHRINK * 2.0**-12))
    b, c = snap(deep_base), snap(shrunk)
    k = b.log2_scale
    first = "layers.0"
    before = flushed_fraction(b.modules[first], "fp16", k)
    after = flushed_fraction(c.modules[first], "fp16", k)
    assert before < 0.01 and after > 0.5  # the first layer's gradients now flush at the deployed S
    assert b.flushed_at(k) <= 1e-3 < 0.01 < c.flushed_at(k)
    assert (b.verdict, c.verdict) == ("constant", "no_single_scale")
    # At S = 1 every value flushed in both runs: the share the gate used to judge stayed flat.
    assert b.flushed_fraction == c.flushed_fraction == 1.0
    result = compare(b, c)
    failed = {x.name for x in result.failures}
    assert {"flushed_at_baseline_scale", "verdict", "module_regressions"} <= failed, [check_message(x) for x in result.checks]
    assert "layers.0" in check_message(next(x for x in result.failures if x.name == "module_regressions"))


def test_equal_run_passes(deep_base):
    torch.manual_seed(0)
    again = _profile_deep(Deep())
    result = compare(snap(deep_base), snap(again))
    assert result.passed and result.warnings == ()


def test_torch_compiled_run_of_the_same_model_passes(deep_base):
    torch.manual_seed(0)
    model = Deep()
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(UserWarning, match="runs compiled"):  # module outputs inside compiled code are not read
        report = _profile_deep(compiled, probe_target=compiled)
    assert any(m.name.startswith("_orig_mod.") for m in report.modules)
    result = compare(snap(deep_base), snap(report))
    assert result.passed, [check_message(x) for x in result.failures]
    # Reading module outputs inside compiled code would change what the compiler builds (capture/compiled.py):
    # the compiled run has none, and the gate says it compared no module rather than passing silently.
    warned = warning_texts(result)
    assert any("OptimizedModule" in w for w in warned)
    assert any(f"{len(snap(deep_base).modules)} module(s) only in the baseline" in w for w in warned), warned


def test_cli_a_report_that_cannot_be_judged_is_an_error_in_every_output(cli_env, monkeypatch):
    """No stale or missing file reads as a pass: JUnit gets an error, the summary says ERROR, GitHub an ::error."""
    good = _save(BASE, cli_env / "b.json")
    (cli_env / "bad.json").write_text('{"schema_version": 1, "metadata": {}, "modules": [], "trace": {}}')
    junit = cli_env / "j.xml"
    junit.write_text('<testsuites tests="7" failures="0"/>')  # a passing file from an earlier run
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    result = CliRunner().invoke(app, ["compare", good, "bad.json", "--junit", str(junit), "--summary", "s.md"])
    assert result.exit_code == EXIT_USAGE
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and root.get("errors") == "1"
    assert "metadata" in root.find("testsuite/testcase/error").get("message")
    assert (cli_env / "s.md").read_text().startswith("### fp16probe compare: ERROR")
    assert result.stdout.startswith("::error title=fp16probe compare%3A error::")
    assert len([ln for ln in result.stderr.splitlines() if ln.strip()]) == 1


def test_junit_and_markdown_hold_any_module_name():
    """Module names are data: control characters, pipes, markup and XML specials cannot break the outputs."""
    name = 'evil\x01|</testcase>"&[/bold]\nnext'
    base = make_report({name: {-10: 1000}, "ok": {-10: 1000}})
    cur = make_report({name: {-45: 500, -10: 500}, "ok": {-10: 1000}})
    result = compare(snapshot(base, REC), snapshot(cur, REC))
    assert not result.passed
    root = ET.fromstring(to_junit(result))
    failure = root.find("testsuite/testcase[@name='module_regressions']/failure")
    assert 'evil\\x01|</testcase>"&[/bold]\\nnext' in failure.get("message")  # escaped visibly, one line
    md = to_markdown(result)
    row = next(line for line in md.splitlines() if line.startswith("| module_regressions"))
    assert row.count("|") - row.count(r"\|") == 4
