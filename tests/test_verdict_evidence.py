"""Issue 11 on hand-built reports: what the verdict judges, weak evidence, scale-induced overflow,
the cap on S, per-tensor scaling for e4m3, one ceiling everywhere, and the typed Recommendation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fp16probe.analysis.ceiling import Ceiling
from fp16probe.analysis.recommend import analyze
from fp16probe.analysis.whatif import what_if, worst_modules
from fp16probe.presentation.verdict import verdict_text, CEILING_SOURCE_WORDS
from fp16probe.formats import get_format
from fp16probe.formatting import count, magnitude, percent, power_of_two, scale
from fp16probe.recommendation import GRADSCALER_DEFAULTS, Caveat, Recommendation, Verdict
from fp16probe.report import Histogram, Metadata, ModuleStats, Report, StepTrace

H = Histogram.from_values
FAST = dict(horizon=2000)
DATA = Path(__file__).parent / "data"


def codes(rec):
    return [c.code for c in rec.caveats]


def report_of(act_steps, weight_steps=None, *, precision="fp32", scale=None, found_inf=None, ceiling=None):
    """A Report from per-step {name: Histogram} dicts, with the trace fields issue 11 reads."""
    kinds = {"activation_grad": act_steps}
    if weight_steps is not None:
        kinds["weight_grad"] = weight_steps
    modules, histograms, module_max, order = [], {}, {}, 0
    for kind, per_step in kinds.items():
        names = list(dict.fromkeys(n for s in per_step for n in s))
        for name in names:
            modules.append(ModuleStats(name, kind, "Hand", order, Histogram.sum(s.get(name, Histogram()) for s in per_step)))
            order += 1
        histograms[kind] = tuple(Histogram.sum(s.values()) for s in per_step)
        module_max[kind] = {n: tuple(s.get(n, Histogram()).max_abs for s in per_step) for n in names}
    n = len(act_steps)
    trace = StepTrace(tuple(range(n)), histograms, module_max, tuple(scale or (None,) * n),
                      tuple(found_inf or (False,) * n), ceiling)
    meta = Metadata("0", torch.__version__, "cpu", "Hand", precision=precision, captured=tuple(kinds), steps_seen=n)
    return Report(meta, tuple(modules), trace)


# -- the verdict judges everything the loss scale multiplies ----------------------------------

def test_weight_gradients_that_flush_decide_the_default_verdict():
    act = [{"fc": H({-10: 1000, -1: 1})}]  # activation gradients sit in range
    weight = [{"fc.weight": H({-30: 1000, -5: 1})}]  # weight gradients all flush at S = 1
    report = report_of(act, weight)
    rec = analyze(report, **FAST)
    assert rec.verdict == "constant" and rec.kind == "all"
    assert rec.evidence["by_kind"]["weight_grad"]["flushed_fraction_at_1"] == pytest.approx(1000 / 1001)
    assert rec.evidence["by_kind"]["activation_grad"]["flushed_fraction_at_1"] == 0.0
    assert "weight gradients" in verdict_text(rec) and "activation gradients" in verdict_text(rec)
    # --kind still narrows: activation gradients alone need nothing, and the caveat says what was left out.
    narrow = analyze(report, kind="activation_grad", **FAST)
    assert narrow.verdict == "none_needed"
    assert Caveat("narrowed_kind", {"kind": "activation_grad", "others": ["weight_grad"]}) in narrow.caveats


def test_the_trace_ceiling_sets_the_limit_and_the_what_if_table_agrees():
    # Histograms top out at 2^0, but backward held a gradient of 1024 (a functional gain after the model).
    steps = [{"m": H({-30: 100, 0: 1})}] * 3
    report = report_of(steps, ceiling=(1024.0, 3.0, 2.0))
    rec = analyze(report, **FAST)
    fmt = get_format("fp16")
    assert rec.evidence["max_abs"] == 1024.0 and rec.evidence["ceiling_source"] == "measured"
    assert "every gradient in backward" in CEILING_SOURCE_WORDS[rec.evidence["ceiling_source"]]
    assert rec.evidence["largest_safe_log2_scale"] == 5  # 1024 * 2^6 = 65536 overflows fp16
    assert rec.log2_scale == 4 and rec.overflow_steps_at_scale == 0
    table = what_if(report, "fp16", log2_scales=range(0, 20))
    assert _first_overflowing(table) == rec.evidence["largest_safe_log2_scale"] + 1
    # 3 * 2^15 and 2 * 2^15 both reach 65520; 3 * 2^14 = 49152 does not
    assert table.row(6).overflow_steps == table.row(14).overflow_steps == 1 and table.row(15).overflow_steps == 3
    assert "hooked_ceiling" not in codes(rec)
    # Without the ceiling the histograms alone would allow 2^15 and say so in a caveat.
    blind = analyze(report_of(steps), **FAST)
    assert blind.evidence["largest_safe_log2_scale"] == 15
    assert "hooked_ceiling" in codes(blind)
    assert Ceiling.of(report).overflow_steps(fmt, 5) == 0


def test_what_if_first_overflow_is_the_recommendations_limit_on_a_real_report():
    report = Report.load(DATA / "report-v1-demo.json")
    rec = analyze(report, **FAST)
    table = what_if(report, "fp16")
    assert _first_overflowing(table) == rec.evidence["largest_safe_log2_scale"] + 1
    assert table.row(rec.log2_scale).overflow_steps == rec.overflow_steps_at_scale == 0


# -- weak evidence is never good news -------------------------------------------------------

def test_nothing_captured_is_insufficient_evidence():
    empty = Report(Metadata("0", torch.__version__, "cpu", "Hand"))
    rec = analyze(empty, **FAST)
    assert rec.verdict == Verdict.INSUFFICIENT_EVIDENCE and rec.evidence["insufficient_reason"] == "nothing_captured"
    assert rec.grad_scaler_kwargs == {} and "Profile with the Probe" in verdict_text(rec)


def test_fp16_autocast_zeros_hide_flushing_so_the_evidence_is_insufficient():
    steps = [{"m": H({-10: 900}, zero=100)}]  # 10% exact zeros, any of which may be a flushed value
    rec = analyze(report_of(steps, precision="fp16-autocast"), **FAST)
    assert rec.verdict == "insufficient_evidence" and rec.evidence["insufficient_reason"] == "autocast_zeros"
    assert "10% of the judged values are zeros" in verdict_text(rec) and "Profile in fp32" in verdict_text(rec)
    assert Caveat("low_precision_run", {"precision": "fp16-autocast", "scales": [], "zero_values": 100,
                                        "values": 1000}) in rec.caveats  # no scaler in the trace: S = 1
    # The same zeros in an fp32 profile are true zeros; under bf16 autocast (fp32's range) too.
    assert analyze(report_of(steps), **FAST).verdict == "none_needed"
    assert analyze(report_of(steps, precision="bf16-autocast"), **FAST).verdict == "none_needed"
    # Few zeros bound what can hide: a verdict, with the caveat.
    few = analyze(report_of([{"m": H({-10: 100000}, zero=10)}], precision="fp16-autocast"), **FAST)
    assert few.verdict == "none_needed" and "low_precision_run" in codes(few)


# -- scale-induced overflow -----------------------------------------------------------------

def test_a_step_that_overflowed_at_the_scale_in_force_bounds_s_without_collapsing_it():
    """A GradScaler's probe at 2^16 overflowed; the gradients it saw elsewhere are small."""
    clean = {"m": H({-30: 1000, -8: 1})}
    probed = {"m": H({-30: 1000, -8: 1}, inf=3)}
    report = report_of([clean, probed, clean, clean], precision="fp16-autocast",
                       scale=(2.0**15, 2.0**16, 2.0**15, 2.0**15), found_inf=(False, True, False, False),
                       ceiling=(2.0**-8, math.inf, 2.0**-8, 2.0**-8))
    rec = analyze(report, **FAST)
    assert rec.evidence["nonfinite_steps"] == 0  # not "inf at every scale"
    assert rec.evidence["scale_induced_overflow_steps"] == [1]
    assert rec.evidence["largest_safe_log2_scale"] == 15  # overflows at 2^16 and above only
    assert rec.verdict == "constant" and rec.log2_scale == 14
    assert rec.evidence["simulated_final_scale"] >= 2.0**14  # the replay does not collapse the scale
    assert rec.evidence["simulated_mean_flushed_fraction"] < 1e-3
    assert "already held inf/NaN; no scale fixes those" not in verdict_text(rec)
    # The scales in force, from the trace.
    assert Caveat("scale_induced_overflow", {"count": 1, "scales": [2.0**15, 2.0**16], "steps": [1]}) in rec.caveats
    table = what_if(report, "fp16", log2_scales=range(10, 20))
    assert _first_overflowing(table) == 16 and table.nonfinite_steps == 0


def test_inf_in_an_fp32_run_without_a_scaler_is_left_out_of_the_limit():
    clean = {"m": H({-30: 1000, 0: 1})}
    broken = {"m": H({-30: 1000, 0: 1}, nan=2)}
    rec = analyze(report_of([clean, broken]), **FAST)
    assert rec.evidence["nonfinite_steps"] == 1 and rec.evidence["largest_safe_log2_scale"] == 15
    assert rec.overflow_steps_at_scale == 0 and Caveat("intrinsic_nonfinite", {"count": 1}) in rec.caveats


# -- advice that cannot deadlock ------------------------------------------------------------

def test_advice_goes_through_a_scaler_that_backs_off():
    rec = analyze(report_of([{"m": H({-30: 1000, 0: 1})}]), **FAST)
    assert "backs off" in verdict_text(rec) and "halves S" in verdict_text(rec)
    assert "skip any step whose gradients hold inf/NaN" not in verdict_text(rec)
    assert rec.grad_scaler_kwargs["backoff_factor"] == 0.5 < 1.0


def test_s_is_capped_so_gradscaler_accepts_it_and_the_scaled_values_stay_finite():
    # bf16 flushes at or below 2^-134; the largest gradient 2^-3 would allow S = 2^130.
    report = report_of([{"m": H({-140: 10, -3: 1})}])
    rec = analyze(report, "bf16", **FAST)
    k = rec.log2_scale
    assert rec.evidence["largest_safe_log2_scale"] - 1 > k == 126 and "capped" in verdict_text(rec)
    scaler = torch.amp.GradScaler("cpu", **rec.grad_scaler_kwargs)
    scaled = scaler.scale(torch.tensor(1.5))
    assert torch.isfinite(scaled) and math.isfinite(rec.scale * 2.0**-3)


# -- fp8 e4m3 -------------------------------------------------------------------------------

def test_e4m3_gets_per_tensor_scales_from_the_measured_maxima():
    report = report_of([{"small": H({-20: 100}), "big": H({3: 1, -2: 10})}])
    rec = analyze(report, "fp8_e4m3", **FAST)
    assert rec.verdict == "per_tensor_scaling" and rec.grad_scaler_kwargs == {}
    scales = {name: k for name, k, _ in rec.evidence["per_tensor_scales"]}
    # 448 / amax less one bit: small's amax 2^-20 gets 2^27 (2^-20 * 2^28 = 256 < 464 <= 512), big's 2^3 gets 2^4.
    assert scales == {"small": 27, "big": 4}
    assert rec.evidence["per_tensor_flushed_fraction"] == 0.0 and rec.evidence["saturated_fraction_at_scale"] == 0.0
    assert rec.evidence["flushed_fraction_at_scale"] == pytest.approx(100 / 111)  # one scale loses small


# -- one ranking, one formatter, one set of defaults ---------------------------------------

def test_worst_modules_is_one_ranking_with_one_tie_break():
    report = report_of([{"b": H({-30: 1, -10: 1}), "a": H({-30: 1, -10: 1}), "c": H({-30: 2, -10: 2}),
                         "d": H({-10: 5})}])
    ranked = worst_modules(report, "fp16")
    # equal shares: more flushed values first, then forward order; nothing flushed is left out
    assert [m.name for m in ranked] == ["c", "b", "a"]
    assert ranked[0].fraction == 0.5 and ranked[0].flushed == 2
    assert analyze(report, **FAST).worst_modules == tuple((m.name, m.fraction) for m in ranked)


def test_formatters():
    assert percent(None) == "n/a" and percent(0) == "0%" and percent(0.000142) == "0.0142%"
    assert power_of_two(17) == "2^17" and power_of_two(None) == "none" and power_of_two(-1.5) == "2^-1.5"
    assert scale(65536.0) == "2^16" and scale(3.0) == "3" and scale(None) == "none"
    assert count(1234567) == "1,234,567" and magnitude(0.19584) == "0.1958"


def test_gradscaler_defaults_are_torchs():
    scaler = torch.amp.GradScaler("cpu")
    assert GRADSCALER_DEFAULTS == {"init_scale": scaler.get_scale(), "growth_factor": scaler.get_growth_factor(),
                                   "backoff_factor": scaler.get_backoff_factor(),
                                   "growth_interval": scaler.get_growth_interval()}


# -- the typed Recommendation ---------------------------------------------------------------

def test_verdict_is_a_str_enum_with_a_severity():
    assert Verdict("constant") is Verdict.CONSTANT and Verdict.CONSTANT == "constant"
    assert f"{Verdict.DYNAMIC}" == "dynamic" and str(Verdict.DYNAMIC) == "dynamic"
    order = ["none_needed", "constant", "dynamic", "per_tensor_scaling", "no_single_scale", "insufficient_evidence",
             "forward_underflow", "gradient_error", "forward_overflow"]
    assert sorted(Verdict, key=lambda v: v.severity) == [Verdict(v) for v in order]
    assert Verdict.NONE_NEEDED.severity == 0 and Verdict.INSUFFICIENT_EVIDENCE.severity == 5


def test_recommendation_json_round_trip_keeps_types_and_caveats():
    rec = analyze(report_of([{"m": H({-30: 1000, 0: 1})}], precision="fp16-autocast"), **FAST)
    data = json.loads(json.dumps(rec.to_dict(), allow_nan=False))
    assert data["verdict"] == "constant" and data["caveats"] == [c.to_dict() for c in rec.caveats]
    assert data["caveats"][0] == {"code": "low_precision_run", "data": {
        "precision": "fp16-autocast", "scales": [], "zero_values": 0, "values": 1001}}
    back = Recommendation.from_dict(data)
    assert back == rec and isinstance(back.verdict, Verdict) and isinstance(back.caveats, tuple)
    old = {k: v for k, v in data.items() if k != "caveats"}  # a file from before caveats existed
    assert Recommendation.from_dict(old).caveats == ()
    # Reports written before caveats had codes stored the sentence: it loads as code "text", shown as it was.
    older = Recommendation.from_dict({**data, "caveats": ["An old caveat."]})
    assert older.caveats == (Caveat("text", {"text": "An old caveat."}),) and str(older.caveats[0]) == "An old caveat."


def test_a_hooked_module_that_recorded_nothing_is_named():
    report = report_of([{"used": H({-30: 1000, 0: 1}), "out_proj": H({})}])
    rec = analyze(report, **FAST)
    assert Caveat("silent_modules", {"count": 1, "modules": ["out_proj"]}) in rec.caveats


def test_every_step_holding_inf_in_an_fp32_run_is_not_none_needed():
    steps = [{"m": H({-10: 100}, nan=1)}, {"m": H({-12: 100}, inf=2)}]
    rec = analyze(report_of(steps), **FAST)
    assert rec.verdict == "insufficient_evidence" and rec.evidence["insufficient_reason"] == "all_nonfinite"
    assert "divergence" in verdict_text(rec)


def _first_overflowing(table) -> int | None:
    """The smallest k in the table at which some profiled step overflows."""
    return next((r.log2_scale for r in table.rows if r.overflow_steps), None)
