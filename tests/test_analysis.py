"""The analyzer on hand-built histograms: what-if tables, every verdict and its boundaries, wording."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp16probe.analysis.recommend import VERDICTS, analyze, largest_safe_log2_scale
from fp16probe.analysis.weight_updates import weight_update_loss
from fp16probe.presentation.answer import weight_update_words
from fp16probe.analysis.whatif import WhatIfTable, what_if
from fp16probe.recommendation import Recommendation
from fp16probe.errors import AnalysisError, Fp16ProbeError, ReportError
from fp16probe.formats import get_format
from fp16probe.presentation.cite import cite
from fp16probe.recommendation import Citation
from fp16probe.sources import NVIDIA_GUIDE_URL
from tests.fixtures.wording import wording_problems
from fp16probe.report import Histogram, Metadata, ModuleStats, Report, StepTrace
from fp16probe.sections import ForwardSection
from fp16probe.presentation.verdict import row_note_words, verdict_text

FAST = dict(horizon=2000)  # a shorter replay keeps these tests quick; the rule is the same


def make_report(steps, weight_steps=None, *, trace=True):
    """A Report from per-step {module: Histogram} dicts (activation grads, optional weight grads)."""
    kinds = {"activation_grad": steps}
    if weight_steps is not None:
        kinds["weight_grad"] = weight_steps
    modules, histograms, module_max = [], {}, {}
    order = 0
    for kind, per_step in kinds.items():
        names = list(dict.fromkeys(n for s in per_step for n in s))
        for name in names:
            total = Histogram.sum(s.get(name, Histogram()) for s in per_step)
            modules.append(ModuleStats(name, kind, "Hand", order, total))
            order += 1
        histograms[kind] = tuple(Histogram.sum(s.values()) for s in per_step)
        module_max[kind] = {n: tuple(s.get(n, Histogram()).max_abs for s in per_step) for n in names}
    n = len(steps)
    st = StepTrace(tuple(range(n)), histograms, module_max, (None,) * n, (False,) * n) if trace else StepTrace()
    meta = Metadata("0", torch.__version__, "cpu", "Hand", captured=tuple(kinds), steps_seen=n)
    return Report(meta, tuple(modules), st)


H = Histogram.from_values


# -- what-if ----------------------------------------------------------------------------------

def test_what_if_is_exact_against_the_histograms_and_by_hand():
    a = {"m1": H({-30: 60, -10: 30, 0: 10}), "m2": H({-26: 5})}
    b = {"m1": H({-30: 50, 3: 1}), "m2": H({-24: 4})}
    report = make_report([a, b])
    table = what_if(report, "fp16", log2_scales=range(-2, 20))
    total = report.histogram("activation_grad")
    assert table.nonzero == 160 and table.steps == 2
    for row in table.rows:
        assert row.flushed == total.flushed("fp16", row.log2_scale)
        assert row.flushed_fraction == row.flushed / 160
        assert row.subnormal == total.subnormal("fp16", row.log2_scale)
    # By hand: at S = 1 bins -30 (110 values) and -26 (5) are at or below 2^-25 and flush.
    assert table.row(0).flushed == 115
    # At S = 2^1 bin -26 moves to -25: still flushes; at 2^2 it survives.
    assert table.row(1).flushed == 115 and table.row(2).flushed == 110
    # Overflow: step b's max 2^3 overflows fp16 from S = 2^13 (8 * 8192 = 65536 >= 65520).
    assert table.row(12).overflow_steps == 0 and table.row(13).overflow_steps == 1
    # step a's max 2^0 overflows from 2^16: both steps.
    assert table.row(16).overflow_steps == 2
    m2 = dict(table.modules)["m2"]
    assert [r.flushed for r in m2 if r.log2_scale in (0, 1, 2)] == [5, 5, 0]
    assert WhatIfTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table


def test_what_if_for_weight_grads_all_and_other_formats():
    report = make_report([{"m": H({-12: 4})}], [{"m.weight": H({-20: 2, -8: 2})}])
    w = what_if(report, "fp8_e5m2", kind="weight_grad", log2_scales=[0, 4])
    # e5m2 flushes at or below 2^-17: bin -20 at S = 1; at 2^4 it lands on 2^-16 and survives.
    assert [r.flushed for r in w.rows] == [2, 0]
    both = what_if(report, "fp8_e5m2", kind="all", log2_scales=[0])
    assert both.nonzero == 8 and both.rows[0].flushed == 2
    e4 = what_if(report, "fp8_e4m3", kind="activation_grad", log2_scales=[0, 3])
    assert [r.flushed for r in e4.rows] == [4, 0]  # e4m3 flushes at or below 2^-10
    assert set(e4.modules) == {"m"}
    # The default judges every gradient the loss scale multiplies: the weight gradients' bin -20
    # still flushes at 2^3 (2^-17 <= 2^-10).
    default = what_if(report, "fp8_e4m3", log2_scales=[0, 3])
    assert [r.flushed for r in default.rows] == [6, 2] and set(default.modules) == {"m", "m.weight"}


def test_what_if_without_a_trace_counts_the_profile_as_one_step():
    report = make_report([{"m": H({-30: 9, 10: 1})}], trace=False)
    table = what_if(report, log2_scales=[0, 6])
    assert table.steps == 1 and [r.overflow_steps for r in table.rows] == [0, 1]


# -- verdicts and their boundaries --------------------------------------------------------------

def test_none_needed_and_its_flush_boundary():
    at = analyze(make_report([{"m": H({-10: 999, -25: 1})}]), **FAST)  # exactly 0.1% flushes
    assert at.verdict == "none_needed" and at.flushed_fraction_at_1 == pytest.approx(1e-3)
    assert at.grad_scaler_kwargs == {} and at.log2_scale == 0 and at.scale == 1.0
    over = analyze(make_report([{"m": H({-10: 998, -25: 2})}]), **FAST)
    assert over.verdict != "none_needed"
    # The 2^-25 bin is the flush edge itself; 2^-24 survives.
    survives = analyze(make_report([{"m": H({-10: 500, -24: 500})}]), **FAST)
    assert survives.verdict == "none_needed" and survives.flushed_fraction_at_1 == 0.0


def test_none_needed_and_its_overflow_boundary():
    # max * 2^1 must stay below 65520 (65504 + half an ulp; the tie rounds up to inf).
    below = analyze(make_report([{"m": H({-10: 10, 15: 1}, max_abs=32759.99)}]), **FAST)
    assert below.verdict == "none_needed" and below.headroom_bits == 1
    edge = analyze(make_report([{"m": H({-10: 10, 15: 1}, max_abs=32760.0)}]), **FAST)
    assert edge.verdict == "constant" and edge.log2_scale == -1 and edge.headroom_bits == 1
    assert edge.overflow_steps_at_scale == 0
    assert analyze(make_report([{"m": H({-10: 10, 15: 1}, max_abs=32760.0)}]), margin_bits=0,
                   **FAST).verdict == "none_needed"


def test_constant_is_lit011s_rule_made_exact():
    report = make_report([{"m": H({-30: 1000, 0: 1})}] * 3)
    rec = analyze(report, **FAST)
    # max 2^0: 2^15 * 1 = 32768 < 65520 <= 2^16; one bit of margin: S = 2^14.
    assert rec.verdict == "constant" and rec.log2_scale == 14 and rec.scale == 2.0**14
    assert rec.evidence["largest_safe_log2_scale"] == 15 and rec.headroom_bits == 1
    assert rec.flushed_fraction_at_1 == pytest.approx(1000 / 1001)
    assert rec.flushed_fraction_at_scale == 0.0 and rec.overflow_steps_at_scale == 0
    assert rec.grad_scaler_kwargs["init_scale"] == 2.0**14
    assert set(rec.grad_scaler_kwargs) == {"init_scale", "growth_factor", "backoff_factor", "growth_interval"}
    for margin in (0, 3):
        assert analyze(report, margin_bits=margin, **FAST).log2_scale == 15 - margin
    assert rec.worst_modules == (("m", pytest.approx(1000 / 1001)),)


def test_constant_flush_boundary():
    # At S = 2^14 values at or below 2^-39 flush.
    at = make_report([{"m": H({-30: 998, -39: 1, 0: 1})}])
    assert analyze(at, **FAST).verdict == "constant"
    assert analyze(at, **FAST).flushed_fraction_at_scale == pytest.approx(1e-3)
    over = make_report([{"m": H({-30: 997, -39: 2, 0: 1})}])
    assert analyze(over, **FAST).verdict == "no_single_scale"  # one step: nothing moves


def two_step_report(low_bin=-38, low_count=1000):
    # Step a: max 2^4 -> safe k 11, S 2^10: flushes at or below 2^-35.
    # Step b: max 2^0 -> safe k 15, S 2^14: flushes at or below 2^-39.
    a = {"m": H({-30: 1000}), "big": H({4: 1})}
    b = {"m": H({low_bin: low_count}), "big": H({0: 1})}
    return make_report([a, b])


def test_dynamic_when_the_range_moves():
    rec = analyze(two_step_report(), **FAST)
    assert rec.verdict == "dynamic"
    assert rec.log2_scale == 10 and rec.grad_scaler_kwargs["init_scale"] == 2.0**10
    assert rec.flushed_fraction_at_scale == pytest.approx(1000 / 2002)
    assert rec.evidence["per_step_scale_flushed_fraction"] == 0.0
    assert rec.evidence["per_step_max_range_bits"] == 4.0
    table = rec.growth_interval_table
    chosen = [r for r in table["rows"] if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["growth_interval"] == rec.grad_scaler_kwargs["growth_interval"]
    assert rec.evidence["simulated_skipped_steps"] == chosen[0]["skipped_steps"]
    # Steps in random order jump 4 bits: no schedule reaches the threshold, and the text says so.
    assert rec.evidence["simulated_meets_threshold"] is False and "slow drift" in verdict_text(rec)


def test_dynamic_and_no_single_scale_boundary():
    # Step b at S = 2^14 flushes values at or below 2^-39; step a holds 1000 + 1 values, b 1000 + 1.
    # tau * 2002 = 2.002: two flushed values fit, three do not.
    def report(flushed):
        a = {"m": H({-30: 1000}), "big": H({4: 1})}
        b = {"m": H({-38: 1000 - flushed, -39: flushed}), "big": H({0: 1})}
        return make_report([a, b])

    assert analyze(report(2), **FAST).verdict == "dynamic"
    rec = analyze(report(3), **FAST)
    assert rec.verdict == "no_single_scale"
    assert rec.evidence["per_step_scale_flushed_fraction"] == pytest.approx(3 / 2002)


def test_no_single_scale_names_the_modules_and_the_options():
    rec = analyze(make_report([{"tiny": H({-45: 1000}), "big": H({4: 1})}]), **FAST)
    assert rec.verdict == "no_single_scale"
    assert rec.evidence["limiting_modules"][0][0] == "big"
    assert rec.evidence["flushing_modules_at_scale"][0][0] == "tiny"
    assert rec.evidence["needed_span_bits"] > rec.evidence["format_span_bits"]
    for option in ("bf16", "per tensor", "fp32"):
        assert option in verdict_text(rec)
    assert "big" in verdict_text(rec) and "tiny" in verdict_text(rec)


def test_weight_grads_limit_the_scale_too():
    act = [{"m": H({-30: 100, 0: 1})}]
    weight = [{"m.weight": H({-20: 10, 8: 1})}]  # 2^8 * 2^7 = 32768: safe k 7
    rec = analyze(make_report(act, weight), **FAST)
    assert rec.verdict == "constant" and rec.evidence["largest_safe_log2_scale"] == 7
    assert rec.log2_scale == 6 and rec.overflow_steps_at_scale == 0
    assert analyze(make_report(act, weight), kind="weight_grad", **FAST).verdict == "none_needed"


def test_bf16_is_none_needed_as_measured_and_says_why():
    report = make_report([{"m": H({-30: 1000, 0: 1})}])
    rec = analyze(report, "bf16", **FAST)
    assert rec.verdict == "none_needed" and "exponent range" in verdict_text(rec) and "measured" in verdict_text(rec)
    flushing = make_report([{"m": H({-140: 10, 0: 1})}])  # bf16 flushes at or below 2^-134
    rec = analyze(flushing, "bf16", **FAST)
    assert rec.verdict == "constant" and "Unexpected for bf16" in verdict_text(rec)


def test_fp8_e4m3_saturates_so_the_advice_is_per_tensor_scaling():
    report = make_report([{"m": H({-11: 100, 0: 1})}])  # e4m3 flushes at or below 2^-10
    e4 = analyze(report, "fp8_e4m3", **FAST)  # 1 * 2^8 = 256 < 464 <= 512: safe 8, S = 2^7
    assert e4.verdict == "per_tensor_scaling" and e4.log2_scale == 7
    assert e4.grad_scaler_kwargs == {} and "cannot back off" in e4.text and "448 / amax" in e4.text
    assert e4.evidence["per_tensor_scales"] == [["m", 7, 0.0]]  # 2^-11 * 2^7 = 2^-4 survives
    assert e4.evidence["saturated_fraction_at_scale"] == 0.0
    assert any("Transformer Engine" in cite(c) for c in e4.citations)
    # Two tensors far apart: one scale each recovers what one global scale cannot.
    wide = make_report([{"small": H({-20: 100}), "big": H({0: 1})}])
    rec = analyze(wide, "fp8_e4m3", **FAST)
    assert rec.verdict == "per_tensor_scaling"
    assert rec.evidence["flushed_fraction_at_scale"] == pytest.approx(100 / 101)  # 2^-20 * 2^7 flushes
    assert rec.evidence["per_tensor_flushed_fraction"] == 0.0  # small gets 2^27: 2^-20 * 2^27 = 2^7 survives
    # e5m2 has inf, but FP8 recipes scale every tensor, gradients included, from its own amax:
    # per-tensor scaling again, never a global GradScaler line.
    e5 = analyze(make_report([{"m": H({-20: 100, 0: 1})}]), "fp8_e5m2", **FAST)
    assert e5.verdict == "per_tensor_scaling" and e5.grad_scaler_kwargs == {}
    assert "own amax" in e5.text and "saturate (a value" not in e5.text


def test_nothing_but_zeros_is_insufficient_evidence_not_good_news():
    rec = analyze(make_report([{"m": H({}, zero=10)}]), **FAST)
    assert rec.verdict == "insufficient_evidence" and rec.evidence["insufficient_reason"] == "all_zero"
    assert rec.log2_scale is None and rec.grad_scaler_kwargs == {} and rec.headroom_bits is None
    assert "zero-initialised" in verdict_text(rec) and "Train a step" in verdict_text(rec)


def test_no_trace_falls_back_honestly():
    rec = analyze(make_report([{"m": H({-30: 1000, 0: 1})}], trace=False), **FAST)
    assert rec.verdict == "constant" and rec.grad_scaler_kwargs["growth_interval"] == 2000
    assert "not chosen from data" in verdict_text(rec) and rec.growth_interval_table is None


def with_forward(report, *, overflow=False, flushed=0, loss_fp16=False):
    """The report with a forward audit of one fp16 tensor, as fp16probe.profile writes it."""
    import dataclasses

    tensor = {"name": "m/linear", "module": "m", "op": "linear", "role": "output", "fp16_on": ["cuda", "cpu"],
              "max_abs": 8.2e4 if overflow else 1.0, "nonzero": 10, "flushed": flushed, "subnormal": 0,
              "overflowed": 3 if overflow else 0, "first_overflow_step": 0 if overflow else None,
              "per_step_max": [8.2e4 if overflow else 1.0]}
    forward = {"regime": "autocast", "targets": ["cuda", "cpu"], "steps": [0], "tensors": [tensor],
               "loss_fp16_on": ["cuda", "cpu"] if loss_fp16 else [], "custom_functions": []}
    return dataclasses.replace(report, forward=ForwardSection(audit=forward))


def test_every_verdict_is_reached_and_round_trips_through_json():
    reports = {
        "forward_overflow": with_forward(make_report([{"m": H({-30: 1000, 0: 1})}]), overflow=True),
        "forward_underflow": with_forward(make_report([{"m": H({-30: 1000, 0: 1})}]), flushed=10),
        "none_needed": make_report([{"m": H({-10: 10})}]),
        "constant": make_report([{"m": H({-30: 1000, 0: 1})}]),
        "dynamic": two_step_report(),
        "no_single_scale": make_report([{"tiny": H({-45: 1000}), "big": H({4: 1})}]),
        "insufficient_evidence": make_report([{"m": H({}, zero=10)}]),
        "per_tensor_scaling": make_report([{"m": H({-11: 100, 0: 1})}]),
        "gradient_error": make_report([{"m": H({-30: 1000, 0: 1})}]),
    }
    # gradient_error comes from the emulated step (fp16probe.analysis.effect): m.weight 10% off fp32 at S = 2^14
    emulated = {"format": "fp16", "target": "cuda", "regime": "autocast", "batches": 1, "parameters": ["m.weight"],
                "settings": [{"log2_scale": 14, "keep_fp32": [], "loss_low": False, "params": [[0.01, 1.0, 0, 9, 0]]}]}
    for verdict, report in reports.items():
        rec = analyze(report, "fp8_e4m3" if verdict == "per_tensor_scaling" else "fp16", **FAST)
        if verdict == "gradient_error":
            from fp16probe.analysis.effect import judged

            assert rec.log2_scale == 14
            rec = judged(rec, emulated)
        assert rec.verdict == verdict
        data = json.loads(json.dumps(rec.to_dict(), allow_nan=False))
        assert Recommendation.from_dict(data) == rec
        assert rec.thresholds["margin_bits"] == 1 and rec.thresholds["max_flushed_fraction"] == 1e-3
        saved = report.with_recommendation(rec)
        assert json.loads(saved.to_json())["recommendation"]["verdict"] == verdict
    assert set(reports) == set(VERDICTS)


# -- provenance and wording -----------------------------------------------------------------------

def all_texts():
    cases = [
        (make_report([{"m": H({-10: 10})}]), "fp16"),
        (make_report([{"m": H({-30: 1000, 0: 1})}]), "fp16"),
        (make_report([{"m": H({-30: 1000, 0: 1})}], trace=False), "fp16"),
        (two_step_report(), "fp16"),
        (make_report([{"tiny": H({-45: 1000}), "big": H({4: 1})}]), "fp16"),
        (make_report([{"m": H({-30: 1000, 0: 1})}]), "bf16"),
        (make_report([{"m": H({-140: 10, 0: 1})}]), "bf16"),
        (make_report([{"m": H({-11: 100, 0: 1})}]), "fp8_e4m3"),
        (make_report([{"m": H({-20: 100, 0: 1})}]), "fp8_e5m2"),
        (make_report([{"m": H({}, zero=10)}]), "fp16"),
        (with_forward(make_report([{"m": H({-30: 1000, 0: 1})}]), overflow=True), "fp16"),
        (with_forward(make_report([{"m": H({-30: 1000, 0: 1})}]), flushed=10), "fp16"),
    ]
    from fp16probe.analysis.effect import judged

    emulated = {"format": "fp16", "target": "cuda", "regime": "autocast", "batches": 1, "parameters": ["m.weight"],
                "settings": [{"log2_scale": 14, "keep_fp32": [], "loss_low": False, "params": [[0.01, 1.0, 0, 9, 0]]}]}
    corrupt = judged(analyze(make_report([{"m": H({-30: 1000, 0: 1})}]), "fp16", **FAST), emulated)
    return [analyze(r, f, **FAST) for r, f in cases] + [corrupt]


def test_every_verdicts_wording_keeps_the_provenance_rules():
    seen = set()
    for rec in all_texts():
        seen.add(rec.verdict)
        assert wording_problems(verdict_text(rec)) == [], (rec.verdict, verdict_text(rec))
        if rec.verdict != "insufficient_evidence":
            assert "1710.03740" in verdict_text(rec)  # the underflow mechanism is Micikevicius et al.'s
        assert "LIT-" not in verdict_text(rec) and not any("LIT-" in cite(c) for c in rec.citations)
        assert not any("LIT-" in str(c) for c in rec.caveats)
        assert "optimal" not in verdict_text(rec).lower()
        if rec.verdict not in ("none_needed", "per_tensor_scaling", "insufficient_evidence", "forward_overflow",
                               "forward_underflow"):
            # The schedule's constants are the guide's and GradScaler's defaults, said so.
            assert NVIDIA_GUIDE_URL in verdict_text(rec)
            assert "many other settings are valid" in verdict_text(rec) and "not a measured optimum" in verdict_text(rec)
            # The sources are records (authors, title, arXiv id or URL), written as a line by presentation.
            assert all(isinstance(c, Citation) and c.authors and c.title and (c.arxiv or c.url) for c in rec.citations)
            shown = [cite(c) for c in rec.citations]
            assert any("1710.03740" in c for c in shown)
            assert any(NVIDIA_GUIDE_URL in c for c in shown)
            assert any("GradScaler" in c and "65536" in c for c in shown)
        for row in (rec.growth_interval_table or {}).get("rows", []):
            assert wording_problems(row_note_words(row["note"])) == []
    assert seen == set(VERDICTS)


@pytest.mark.parametrize(
    "bad",
    [
        "A growth interval of 2000 is optimal (" + NVIDIA_GUIDE_URL + ").",
        "LIT-011 (arXiv 1710.03740) grows the scale every 2000 steps. " + NVIDIA_GUIDE_URL,
        "Grow every 2000 steps, x2, x0.5.",
        "Start at 65536 as everyone does.",
        "Most gradients underflow in fp16.",
        "2000 is the optimum.",
    ],
)
def test_wording_check_catches_bad_provenance(bad):
    assert wording_problems(bad)


def test_wording_check_passes_honest_text():
    ok = ("GradScaler's default init_scale is 65536. Growth every 2000 steps, x2 and x0.5 come from "
          f"NVIDIA's guide ({NVIDIA_GUIDE_URL}): not a measured optimum.")
    assert wording_problems(ok) == []


# -- errors -----------------------------------------------------------------------------------------

def test_analysis_errors_say_what_to_do():
    report = make_report([{"m": H({-10: 10})}])
    with pytest.raises(AnalysisError, match="unknown kind"):
        analyze(report, kind="activations_grad")
    with pytest.raises(AnalysisError, match="no weight_grad values"):
        analyze(report, kind="weight_grad")
    with pytest.raises(AnalysisError, match="margin_bits"):
        analyze(report, margin_bits=-1)
    with pytest.raises(AnalysisError, match="max_flushed_fraction"):
        analyze(report, max_flushed_fraction=1.5)
    with pytest.raises(Fp16ProbeError):
        analyze(report, "fp12")
    with pytest.raises(ReportError, match="not a recommendation"):
        Recommendation.from_dict({"verdict": "maybe"})


def test_largest_safe_log2_scale_against_real_casts():
    for name in ("fp16", "bf16", "fp8_e5m2"):
        fmt = get_format(name)
        for m in (1.0, 3.0, 1e-7, 0.7, 12345.0, 2.0**-100):
            k = largest_safe_log2_scale(fmt, m)
            x = torch.tensor([math.ldexp(m, k), math.ldexp(m, k + 1)], dtype=torch.float32)
            cast = x.to(fmt.dtype).float()
            if math.ldexp(m, k + 1) < 3.4e38:
                assert math.isfinite(cast[0]) and not math.isfinite(cast[1]), (name, m, k)
    assert largest_safe_log2_scale("fp16", 0.0) is None


# -- weight updates ------------------------------------------------------------------------------

def test_weight_update_loss_by_hand():
    w = torch.tensor([2048.0, 2048.0, 1.0, 1.0, 1.0, 5.0])
    u = torch.tensor([1.0, 1.5, 2.0**-12, 2.0**-30, 2.0**-10, 0.0])
    res = weight_update_loss({"w": w}, {"w": u})
    # 2048 + 1 ties to even 2048 (lost); 2048 + 1.5 -> 2050; 1 + 2^-12 is below half an ulp (lost);
    # 2^-30 flushes in fp16 (lost); 1 + 2^-10 is one ulp (kept); a zero update is not counted.
    assert res.nonzero_updates == 5 and res.lost == 3 and res.lost_fraction == pytest.approx(0.6)
    assert res.rule_lost == 3  # |w| >= 2^11 |u| for the same three
    text = weight_update_words(res.to_dict())
    assert "1710.03740" in text and wording_problems(text) == [] and "text" not in res.to_dict()
    assert text.startswith("Without fp32 master weights, 60% of the 5 nonzero parameter updates would be lost when added to fp16")
    bf = weight_update_loss({"w": w}, {"w": u}, format="bf16")
    assert bf.lost >= res.lost  # 8 bits of mantissa lose more


def test_weight_update_loss_from_a_model_and_lr():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model(torch.randn(16, 8)).pow(2).mean().backward()
    lr = 1e-4
    res = weight_update_loss(model, lr=lr)
    direct = weight_update_loss(dict(model.named_parameters()),
                                {n: -lr * p.grad for n, p in model.named_parameters()})
    assert res.to_dict() == direct.to_dict()
    w = model.weight.detach()
    u = -lr * model.weight.grad
    want = int(((w.half() + u.half()).half() == w.half()).logical_and(u != 0).sum())
    assert res.parameters[0].lost == want
    with pytest.raises(AnalysisError, match="learning rate"):
        weight_update_loss(model)
    with pytest.raises(AnalysisError, match="shape"):
        weight_update_loss({"w": w}, {"w": torch.zeros(3)})


def test_all_nonfinite_gradients_are_not_called_fine():
    from fp16probe import Histogram, Metadata, ModuleStats, Report, analyze
    from tests.fixtures.wording import wording_problems

    h = Histogram.from_values({}, inf=5, nan=2)
    report = Report(
        metadata=Metadata(fp16probe_version="t", torch_version="t", device="cpu", model_class="M",
                          captured=("activation_grad",)),
        modules=(ModuleStats("m", "activation_grad", "Linear", 0, h),),
    )
    rec = analyze(report)
    assert rec.verdict == "insufficient_evidence" and rec.evidence["insufficient_reason"] == "all_nonfinite"
    assert verdict_text(rec).startswith("No verdict for fp16")
    assert "7 inf/NaN values" in verdict_text(rec) and "divergence" in verdict_text(rec) and rec.grad_scaler_kwargs == {}
    assert not wording_problems(verdict_text(rec))


def _rounding_data(fix_error2: float) -> dict:
    """m.weight 10% off fp32 at S = 2^14; with m kept in fp32, sqrt(fix_error2) off."""
    params = lambda e2: [[e2, 1.0, 0, 9, 0]]  # noqa: E731
    return {"format": "fp16", "target": "cuda", "regime": "autocast", "batches": 1, "parameters": ["m.weight"],
            "settings": [{"log2_scale": 14, "keep_fp32": [], "loss_low": False, "params": params(0.01),
                          "outputs": [["m", [0.0, 1.0]]]},
                         {"log2_scale": 14, "keep_fp32": ["m"], "loss_low": False, "params": params(fix_error2)}]}


def test_gradient_error_offers_the_kept_in_fp32_fix_only_when_its_step_holds():
    from fp16probe.analysis.effect import judged
    from fp16probe.presentation.answer import fix_code, short_answer

    base = analyze(make_report([{"m": H({-30: 1000, 0: 1})}]), "fp16", **FAST)
    works = judged(base, _rounding_data(0.0001))  # 1% off with m in fp32
    assert works.verdict == "gradient_error" and works.evidence["fix_modules"] == ["m"]
    assert works.evidence["emulated"]["fix_holds"] is True and "keep_in_fp32(model, ['m']" in fix_code(works)
    # m's output is within the tolerance: the error is made in backward, not where m's forward starts it
    assert works.evidence["emulated"]["module_output_error"] is None
    refuted = judged(base, _rounding_data(0.0081))  # still 9% off with m in fp32: no fix to offer
    assert refuted.verdict == "gradient_error" and refuted.evidence["emulated"]["fix_holds"] is False
    assert refuted.evidence["fix_modules"] == [] and fix_code(refuted) == ""
    text = "\n".join(line.text for line in short_answer(None, refuted))
    assert "no fix found: with m in fp32 the emulated gradients are 9% off fp32" in text
    assert "keep_in_fp32" not in text and "train in bf16" not in text
    assert "not offered as a fix" in " ".join(refuted.explanation(200).split())  # as words, wherever it wraps
    # the 'why' of show --explain and of the notebook view leads with the emulated step too
    assert "not offered as a fix" in refuted._repr_html_() and "Apart from that error" in refuted._repr_html_()
