"""The replay against the real torch.amp.GradScaler, the hysteresis/floor variants, and simulate."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fp16probe.formats import get_format
from fp16probe.errors import AnalysisError, Fp16ProbeError
from fp16probe.analysis.replay import (
    GRADSCALER_DEFAULT_ROW,
    GRADSCALER_DEFAULTS,
    RESAMPLED_STEPS,
    GrowthIntervalTable,
    ReplayResult,
    ScalerRule,
    replay_scaler,
    score_growth_intervals,
    simulate,
)
from fp16probe.presentation.verdict import method_words, row_note_words
from fp16probe.report import Histogram, StepTrace

BAD = (float("inf"), float("-inf"), float("nan"))


def real_gradscaler(pattern, **kwargs):
    """Drive torch.amp.GradScaler('cpu'): a non-finite grad on the chosen steps, clean otherwise.

    Returns per step (scale in force, whether the optimizer stepped, scale after update).
    Weight decay makes every applied step move the weight, so a skip is observable.
    """
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=1e-3, weight_decay=1.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as the first scaled loss does
    out = []
    for i, overflow in enumerate(pattern):
        before = scaler.get_scale()
        grad = torch.zeros(4)
        if overflow:
            grad[i % 4] = BAD[i % 3]
        p.grad = grad
        w0 = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        out.append((before, not torch.equal(p.detach(), w0), scaler.get_scale()))
    return out


def assert_same(pattern, **kwargs):
    real = real_gradscaler(pattern, **kwargs)
    sim = replay_scaler(pattern, **kwargs)
    after = list(sim.scales[1:]) + [sim.final_scale]
    for i, (before, stepped, scale_after) in enumerate(real):
        assert sim.scales[i] == before, (i, kwargs)
        assert sim.skipped[i] == (not stepped), (i, kwargs)
        assert after[i] == scale_after, (i, kwargs, pattern[: i + 1])


def test_defaults_are_gradscalers():
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.get_growth_interval() == GRADSCALER_DEFAULTS["growth_interval"]
    assert scaler.get_growth_factor() == GRADSCALER_DEFAULTS["growth_factor"]
    assert scaler.get_backoff_factor() == GRADSCALER_DEFAULTS["backoff_factor"]
    assert scaler.get_scale() == GRADSCALER_DEFAULTS["init_scale"]
    assert ScalerRule() == ScalerRule.from_kwargs(GRADSCALER_DEFAULTS)


def test_matches_gradscaler_on_random_patterns_and_parameters():
    rng = random.Random(1234)
    for _ in range(150):
        n = rng.randint(1, 60)
        p = rng.choice([0.0, 0.05, 0.2, 0.5, 0.9, 1.0])
        pattern = [rng.random() < p for _ in range(n)]
        kwargs = dict(
            init_scale=rng.choice([2.0 ** rng.randint(-20, 40), rng.uniform(1e-3, 1e6), 3.0, 65536.0]),
            growth_factor=rng.choice([2.0, 1.5, 3.0, 1.0001, 4.0, rng.uniform(1.0001, 10.0)]),
            backoff_factor=rng.choice([0.5, 0.25, 0.9, rng.uniform(0.01, 0.99)]),
            growth_interval=rng.choice([1, 2, 3, 5, 7, rng.randint(1, 20)]),
        )
        assert_same(pattern, **kwargs)


def test_matches_gradscaler_at_the_fp32_edges():
    # Growth stops short of float32's max instead of going to inf.
    assert_same([False] * 12, init_scale=2.0**120, growth_factor=2.0, growth_interval=1)
    assert_same([False] * 8, init_scale=3.0e38, growth_factor=1.1, growth_interval=1)
    # Backoff with no floor goes below 1, into float32's subnormals and down to 0.
    assert_same([True] * 40, init_scale=1.0, backoff_factor=0.1)
    # Non-power-of-two products round to float32 exactly as the kernel does.
    assert_same([False, True] * 15, init_scale=1.0 / 3.0, growth_factor=1.7, backoff_factor=0.3,
                growth_interval=1)


def test_default_schedule_on_a_long_run():
    pattern = [False] * 4500 + [True] + [False] * 2100
    sim = replay_scaler(pattern)
    assert sim.scales[2000] == 2.0**17 and sim.scales[4000] == 2.0**18
    assert sim.scales[4501] == 2.0**17 and sim.final_scale == 2.0**18
    assert sim.growths == 3 and sim.backoffs == 1 and sim.skipped_steps == 1


# -- hysteresis and floor: DeepSpeed's and Megatron's rules, transcribed from their sources --

def deepspeed_rule(pattern, init_scale, scale_factor, scale_window, min_scale, delayed_shift,
                   consecutive_hysteresis=False):
    """deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale (no raise at min)."""
    cur_scale, cur_iter, last_overflow_iter = init_scale, 0, -1
    cur_hysteresis = delayed_shift
    scales = []
    for overflow in pattern:
        scales.append(cur_scale)
        if overflow:
            if delayed_shift == 1 or cur_hysteresis == 1:
                cur_scale = max(cur_scale / scale_factor, min_scale)
            else:
                cur_hysteresis -= 1
            last_overflow_iter = cur_iter
        else:
            if consecutive_hysteresis:
                cur_hysteresis = delayed_shift
            stable_interval = (cur_iter - last_overflow_iter) - 1
            if stable_interval > 0 and stable_interval % scale_window == 0:
                if not consecutive_hysteresis:
                    cur_hysteresis = delayed_shift
                cur_scale *= scale_factor
        cur_iter += 1
    return scales, cur_scale


def megatron_rule(pattern, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale):
    """megatron/core/optimizer/grad_scaler.py DynamicGradScaler.update."""
    scale, growth_tracker, hysteresis_tracker = init_scale, 0, hysteresis
    scales = []
    for found_inf in pattern:
        scales.append(scale)
        if found_inf:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * backoff_factor, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == growth_interval:
                growth_tracker = 0
                hysteresis_tracker = hysteresis
                scale = scale * growth_factor
    return scales, scale


@pytest.mark.parametrize("consecutive", [False, True])
def test_hysteresis_and_floor_match_deepspeed(consecutive):
    rng = random.Random(7 + consecutive)
    for _ in range(200):
        pattern = [rng.random() < rng.choice([0.1, 0.3, 0.6]) for _ in range(rng.randint(1, 80))]
        init = 2.0 ** rng.randint(0, 32)
        window, hyst, floor = rng.randint(1, 10), rng.randint(1, 4), rng.choice([1.0, 2.0**-4, 0.0])
        want, want_final = deepspeed_rule(pattern, init, 2.0, window, floor, hyst, consecutive)
        got = replay_scaler(pattern, init_scale=init, growth_interval=window, hysteresis=hyst,
                            min_scale=floor, consecutive_hysteresis=consecutive, deepspeed_window=True)
        assert list(got.scales) == want and got.final_scale == want_final
        assert got.skipped == tuple(pattern)  # every overflow skips its step, hysteresis or not


def test_hysteresis_and_floor_match_megatron():
    rng = random.Random(11)
    for _ in range(200):
        pattern = [rng.random() < rng.choice([0.1, 0.3, 0.6]) for _ in range(rng.randint(1, 80))]
        init = 2.0 ** rng.randint(0, 32)
        window, hyst, floor = rng.randint(1, 10), rng.randint(1, 4), rng.choice([1.0, 0.0])
        want, want_final = megatron_rule(pattern, init, 2.0, 0.5, window, hyst, floor)
        got = replay_scaler(pattern, init_scale=init, growth_interval=window, hysteresis=hyst, min_scale=floor)
        assert list(got.scales) == want and got.final_scale == want_final


def test_hysteresis_by_hand():
    # hysteresis 2: the first overflow since the last growth only skips; the second backs off.
    got = replay_scaler([True, True, True, False, False, True], init_scale=8.0, growth_interval=2, hysteresis=2)
    assert got.scales == (8.0, 8.0, 4.0, 2.0, 2.0, 4.0) and got.final_scale == 4.0
    assert got.backoffs == 2 and got.growths == 1


def test_floor_holds_and_is_counted():
    got = replay_scaler([True] * 5, init_scale=4.0, min_scale=1.0)
    assert got.scales == (4.0, 2.0, 1.0, 1.0, 1.0) and got.final_scale == 1.0
    assert got.floor_hits == 3


def test_bad_rules_raise_package_errors():
    for kwargs in [dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0),
                   dict(hysteresis=0), dict(min_scale=-1.0), dict(init_scale=0.0)]:
        with pytest.raises(Fp16ProbeError, match="invalid scaler rule"):
            replay_scaler([False], **kwargs)
    with pytest.raises(AnalysisError, match="unknown scaler argument"):
        ScalerRule.from_kwargs({"growth_intervall": 5})


def test_replay_result_round_trips():
    res = replay_scaler([False, True, False], init_scale=4.0, growth_interval=1)
    assert ReplayResult.from_dict(res.to_dict()) == res


# -- simulate over a profile ---------------------------------------------------------------

def trace_of(step_hists, weight=None):
    hists = {"activation_grad": tuple(step_hists)}
    if weight is not None:
        hists["weight_grad"] = tuple(weight)
    n = len(step_hists)
    return StepTrace(steps=tuple(range(n)), histograms=hists, scale=(None,) * n, found_inf=(False,) * n)


def test_simulate_closes_the_loop_exactly():
    # Two kinds of step: max 2^0 (overflows fp16 above S = 2^15) and max 2^4 (above 2^11).
    quiet = Histogram.from_values({-30: 90, 0: 10})
    loud = Histogram.from_values({-30: 90, 4: 10})
    trace = trace_of([quiet, loud])
    res = simulate(trace, "fp16", {"init_scale": 2.0**12, "growth_interval": 3}, horizon=500, seed=3)
    draws = res.sampled_steps
    assert len(res.scales) == 500 and set(draws) <= {0, 1}
    # The same draws through replay_scaler, with overflow decided by hand, give the same scales:
    # fp16 overflows from 65520 up (65504 + half an ulp; the tie rounds away from odd 65504).
    overflow = [(2.0**0 if t == 0 else 2.0**4) * s >= 65520.0 for t, s in zip(draws, res.scales)]
    again = replay_scaler(overflow, init_scale=2.0**12, growth_interval=3)
    assert again.scales == res.scales and again.skipped == res.skipped
    # Flushed at scale s: 2^-30 * s <= 2^-25 iff s <= 2^5, never here, so nothing flushes.
    assert all(f == 0.0 for f in res.flushed_fraction)
    low = simulate(trace, "fp16", {"init_scale": 2.0**4, "growth_interval": 10**6}, horizon=10, seed=0)
    assert all(f == pytest.approx(0.9) for f in low.flushed_fraction)
    assert low.mean_flushed_fraction == pytest.approx(0.9)


def test_simulate_is_seeded_and_uses_weight_grads_for_overflow():
    act = [Histogram.from_values({-20: 5, -2: 1})] * 3
    weight = [Histogram.from_values({-10: 5, 6: 1})] * 3  # 2^6 limits S to 2^9 in fp16
    trace = trace_of(act, weight)
    a = simulate(trace, "fp16", {"init_scale": 2.0**10, "growth_interval": 100}, horizon=50, seed=5)
    b = simulate(trace, "fp16", {"init_scale": 2.0**10, "growth_interval": 100}, horizon=50, seed=5)
    assert a == b
    assert a.skipped[0] and a.scales[1] == 2.0**9 and not a.skipped[1]


def test_a_step_that_overflowed_at_the_scale_in_force_overflows_only_from_that_scale_up():
    """Issue 11: a GradScaler's own overflow probe must not collapse the replayed scale."""
    from fp16probe.analysis.ceiling import Ceiling

    clean = Histogram.from_values({-20: 5, -2: 1})
    probed = Histogram.from_values({-20: 5, -2: 1}, inf=1)  # the step held inf at S = 2^12
    trace = StepTrace(steps=(0, 1, 2), histograms={"activation_grad": (clean, probed, clean)},
                      scale=(2.0**12, 2.0**12, 2.0**11), found_inf=(False, True, False))
    ceiling = Ceiling.from_trace(trace, "fp16-autocast")
    assert ceiling.scale_induced_steps == (1,) and ceiling.intrinsic_steps == 0
    # max|g| >= 65520 / 2^12 ~ 16: overflows fp16 from 2^12 on, not at 2^11.
    assert ceiling.steps[1].overflows(get_format("fp16"), 12)
    assert not ceiling.steps[1].overflows(get_format("fp16"), 11)
    below = simulate(trace, "fp16", {"init_scale": 2.0**11, "growth_interval": 10**6}, horizon=300,
                     seed=0, ceiling=ceiling)
    assert below.skipped_steps == 0 and below.final_scale == 2.0**11
    above = simulate(trace, "fp16", {"init_scale": 2.0**12, "growth_interval": 50}, horizon=2000,
                     seed=0, ceiling=ceiling)
    # It backs off once to 2^11 and then only re-probes 2^12 after each growth interval: the scale
    # never falls below 2^11 (the fp32-run reading, inf at every scale, would drive it towards 0).
    assert min(above.scales) == 2.0**11 and above.final_scale >= 2.0**11
    assert 0 < above.skipped_steps <= 2000 // 50 + 1
    # A Report carries its precision: simulate reads the same ceiling from it.
    from fp16probe.report import Metadata, Report

    report = Report(Metadata("0", "t", "cpu", "M", precision="fp16-autocast"), trace=trace)
    assert simulate(report, "fp16", {"init_scale": 2.0**11, "growth_interval": 10**6}, horizon=300,
                    seed=0) == below
    # Read as an fp32 run without a scaler, the same inf is intrinsic: every scale overflows.
    fp32 = Ceiling.from_trace(StepTrace(steps=(0, 1), histograms={"activation_grad": (clean, probed)},
                                        scale=(None, None), found_inf=(False, True)))
    assert fp32.intrinsic_steps == 1 and fp32.scale_induced_steps == ()


def test_simulate_errors():
    with pytest.raises(AnalysisError, match="no per-step"):
        simulate(StepTrace(), "fp16", {}, horizon=10, seed=0)
    with pytest.raises(AnalysisError, match="horizon"):
        simulate(trace_of([Histogram.from_values({0: 1})]), "fp16", {}, horizon=0, seed=0)


def test_growth_interval_table_marks_the_default_and_chooses_by_the_stated_rule():
    # Steps whose max moves over 6 bits: any interval trades skipped steps against underflow.
    steps = [Histogram.from_values({-40: 50, -26: 50, e: 1}) for e in (-6, -4, -2, 0)]
    table = score_growth_intervals(trace_of(steps), "fp16", init_scale=2.0**14, horizon=4000, seed=1,
                                   candidates=(10, 100, 2000), max_flushed_fraction=0.6)
    by_g = {r.growth_interval: r for r in table.rows}
    assert by_g[2000].note == GRADSCALER_DEFAULT_ROW and by_g[10].note == by_g[100].note == ""
    words = row_note_words(by_g[2000].note)
    assert "GradScaler's default" in words and "not a measured optimum" in words
    assert by_g[10].skipped_steps > by_g[2000].skipped_steps
    good = [r for r in table.rows if r.meets_threshold]
    want = min(good, key=lambda r: (r.skipped_steps, r.mean_flushed_fraction, -r.growth_interval)) \
        if good else min(table.rows, key=lambda r: r.mean_flushed_fraction)
    assert table.chosen == want and sum(r.chosen for r in table.rows) == 1
    assert GrowthIntervalTable.from_dict(table.to_dict()) == table
    assert table.method == RESAMPLED_STEPS and "drift" in method_words(table.method)
    for r in table.rows:
        assert 0.0 <= r.mean_flushed_fraction <= 1.0 and math.isfinite(r.final_scale)
