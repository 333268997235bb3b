"""The growth-interval study (issue 42): its CI tier runs, its replay matches real fp16 runs, its finding reaches the answer.

``bench/interval_study.py --quick`` trains six tiny families for real under CPU fp16 autocast with
``torch.amp.GradScaler("cpu")`` (the real skipped steps are read off ``scaler.get_scale()`` in the
script's plain-torch loop) and replays the grid on the Probe's history; the full study's JSON
(docs/data/interval-study.json) is what docs/interval-study.md and
``fp16probe.analysis.interval_study.FAMILIES`` are made from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fp16probe.analysis import interval_study
from fp16probe.analysis.interval_study import StudyFamily, drift_per_1000, nearest, summarise
from fp16probe.analysis.schedule import judge_schedules
from fp16probe.presentation.schedule import note_text
from fp16probe.report import Report
from fp16probe.presentation.verdict import study_words
from tests.fixtures.wording import wording_problems

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import interval_study as study  # noqa: E402
from docs import interval_study_doc as doc  # noqa: E402

DATA = ROOT / "docs" / "data" / "interval-study.json"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("study") / "quick.json"
    assert study.main(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_quick_tier_runs_every_family_over_the_whole_grid(quick):
    assert quick["tier"] == "quick"
    assert [f["family"] for f in quick["families"]] == list(study.FAMILIES)
    assert len(study.FAMILIES) >= 6
    for f in quick["families"]:
        names = [r["rule"] for r in f["rows"]]
        assert names[0] == "defaults" and {"DeepSpeed", "Megatron"} <= set(names)
        assert len(names) == 1 + len(study.INTERVALS) * len(study.FACTORS) + 2
        assert f["flush_reference"] == "shadow"  # the flushed shares come from fp32 reruns
        assert f["drift_log2_per_1000"] is not None
        assert f["best"] in names
        d = f["rows"][0]
        assert d["growth_interval"] == 2000 and d["growth_factor"] == 2.0 and d["backoff_factor"] == 0.5
        assert f["history_real_skipped"] > 0  # the initial scale overflows: skipped steps mean something


@pytest.mark.slow
def test_the_replays_skipped_steps_equal_the_real_runs(quick):
    for f in quick["families"]:
        assert f["history_own_replay"] == f["history_real_skipped"], f["family"]
        assert len(f["checks"]) == 3
        for c in f["checks"]:
            # each check run's own history replayed with its rule, and the main history replayed with it
            assert c["own_replay"] == c["real"] and c["own_equal"], (f["family"], c)
            assert c["predicted"] == c["real"], (f["family"], c)


def test_the_package_holds_the_full_studys_findings():
    full = json.loads(DATA.read_text(encoding="utf-8"))
    assert full["tier"] == "full"
    assert interval_study.FAMILIES == summarise(full)
    assert len(interval_study.FAMILIES) >= 6


def test_the_pages_tables_are_the_studys_json():
    assert doc.main(["--check"]) == 0


def test_drift_is_the_slope_of_log2_max_g_per_1000_steps():
    steps = range(0, 2000, 10)
    assert drift_per_1000(steps, [2.0 ** (s / 500) for s in steps]) == pytest.approx(2.0)
    assert drift_per_1000(steps, [float("inf") if s % 20 else 2.0 ** (-s / 1000) for s in steps]) == pytest.approx(-1.0)
    assert drift_per_1000([1, 2], [None, 1.0]) is None


def test_the_nearest_family_is_the_closest_drift_and_says_when_it_is_outside_the_range():
    fams = (StudyFamily("a", 1000, 0.5, 400, 2.0, 0.5, 3, 9, 0.0, 0.0), StudyFamily("b", 1000, -3.0, 10**9, 2.0, 0.5, 5, 5, 0.0, 0.0))
    m = nearest(-0.7, fams)
    assert m is not None and m.family.family == "a" and m.within_range and m.agreeing == 1
    far = nearest(40.0, fams)
    assert far is not None and far.family.family == "a" and not far.within_range
    shrinking = nearest(-2.0, fams)  # the sign counts: -2 is nearer -3 than +0.5
    assert shrinking is not None and shrinking.family.family == "b" and shrinking.within_range
    assert nearest(None, fams) is None


def test_the_verdicts_words_cite_the_study_and_keep_the_wording_rules():
    f = interval_study.FAMILIES[0]
    ev = {"interval_study": {"drift_log2_per_1000": f.drift_log2_per_1000, "family": f.family,
                             "family_drift_log2_per_1000": f.drift_log2_per_1000, "growth_interval": f.growth_interval,
                             "growth_factor": f.growth_factor, "backoff_factor": f.backoff_factor,
                             "skipped_steps": f.skipped_steps, "defaults_skipped_steps": f.defaults_skipped_steps,
                             "mean_flushed_fraction": f.mean_flushed_fraction,
                             "defaults_mean_flushed_fraction": f.defaults_mean_flushed_fraction, "steps": f.steps, "within_range": True, "agreeing": 1,
                             "families": len(interval_study.FAMILIES)}}
    words = study_words(ev)
    assert "fp16probe developers" in words and "docs/interval-study.md" in words and f.family in words
    assert "LIT-" not in words and "optimum" not in words
    assert wording_problems(words + " (Micikevicius et al., arXiv:1710.03740)") == []
    assert ("no growth interval did better than GradScaler's defaults" in words) == (f.growth_interval == 2000)
    fewer = study_words({"interval_study": {**ev["interval_study"], "growth_interval": 400, "skipped_steps": 3,
                                            "defaults_skipped_steps": 9, "within_range": False}})
    assert "growth_interval=400" in fewer and "3 against 9" in fewer and "does not speak for it" in fewer
    same = study_words({"interval_study": {**ev["interval_study"], "growth_interval": 200, "skipped_steps": 10,
                                           "defaults_skipped_steps": 10, "mean_flushed_fraction": 3e-5,
                                           "defaults_mean_flushed_fraction": 1e-4}})
    assert "growth_interval=200 skipped as few steps as GradScaler's defaults (10 in" in same and "0.003%" in same
    assert study_words({"interval_study": {"family": "x"}}) == ""  # a stored report's partial evidence: nothing


def test_schedule_sets_the_runs_drift_against_the_study(monkeypatch):
    """The run's drift against the families (stand-ins placed around it, so the test does not move with the study's
    numbers): inside their range the nearest family's interval is replayed beside the grid; outside, only said."""
    from tests.test_schedule import _drifting_run

    report, _ = _drifting_run(120)
    drift = interval_study.evidence(report)["drift_log2_per_1000"]
    monkeypatch.setattr(interval_study, "FAMILIES", (
        StudyFamily("near", 5000, round(drift, 3) - 0.5, 400, 2.0, 0.5, 3, 5, 0.0, 0.0),
        StudyFamily("far", 5000, round(drift, 3) + 1.0, 2000, 2.0, 0.5, 5, 5, 0.0, 0.0)))
    table = judge_schedules(report)
    note = next(n for n in table.notes if n.code == "interval_study")
    assert note.data["drift_log2_per_1000"] == pytest.approx(drift)
    assert note.data["family"] == "near" and note.data["within_range"]
    assert "docs/interval-study.md" in note_text(note)
    # the study's interval for the nearest family is replayed on the run's own history beside the grid
    row = next(r for r in table.rows if r.name.startswith("study: "))
    assert row.rule["growth_interval"] == note.data["growth_interval"] == 400
    assert row.rule["init_scale"] == report.history.scale[0]
    longer, _ = _drifting_run(240)  # drifts faster than any family: the note says so, no study row
    assert interval_study.evidence(longer)["drift_log2_per_1000"] > drift + 1.0
    far = judge_schedules(longer)
    assert not next(n for n in far.notes if n.code == "interval_study").data["within_range"]
    assert not [r for r in far.rows if r.name.startswith("study: ")]
    short, _ = _drifting_run(40)  # a slope over 40 steps says nothing of drift: no note
    assert not [n for n in judge_schedules(short).notes if n.code == "interval_study"]


def _tiny_loss_run(steps: int) -> Report:
    """A live fp32 Probe over ``steps`` steps of a small MLP whose loss is x1e-6: a scaled verdict whose replay
    cannot tell the growth intervals apart (tied)."""
    import torch.nn.functional as F

    from fp16probe import Probe
    from tests.test_first_hour import _labelled, _mlp

    model = _mlp()
    with Probe(model) as probe:
        for x, y in _labelled(steps):
            (F.cross_entropy(model(x), y) * 1e-6).backward()
            model.zero_grad()
            probe.step()
    return probe.report()


def test_a_tied_replay_points_to_the_study_only_where_the_runs_drift_lies_inside_it():
    import dataclasses


    from fp16probe.analysis.recommend import analyze
    from fp16probe.presentation.answer import short_answer
    from fp16probe.presentation.verdict import verdict_text

    rec = analyze(_tiny_loss_run(4), "fp16")
    assert rec.evidence["simulated_candidates_tied"] and "interval_study" not in rec.evidence  # 4 steps: no drift
    f = interval_study.FAMILIES[-1]
    study = {"drift_log2_per_1000": f.drift_log2_per_1000, "family": f.family,
             "family_drift_log2_per_1000": f.drift_log2_per_1000, "growth_interval": f.growth_interval,
             "growth_factor": f.growth_factor, "backoff_factor": f.backoff_factor, "skipped_steps": f.skipped_steps,
             "defaults_skipped_steps": f.defaults_skipped_steps, "mean_flushed_fraction": f.mean_flushed_fraction,
             "defaults_mean_flushed_fraction": f.defaults_mean_flushed_fraction, "steps": f.steps,
             "within_range": True, "agreeing": 1, "families": len(interval_study.FAMILIES)}
    for within in (True, False):
        r = dataclasses.replace(rec, evidence={**rec.evidence, "interval_study": {**study, "within_range": within}})
        text = verdict_text(r)
        line = next(x.text for x in short_answer(None, r) if x.kind == "schedule")
        assert ("growth_interval is not a measured optimum" in text) != within
        assert ("not a measured optimum" in line) != within
        assert "docs/interval-study.md" in text and wording_problems(text) == []
        assert (f"nearest family ({f.family})" in line) == within


def test_a_tied_replay_pastes_the_studys_interval_where_the_runs_drift_lies_inside_it(monkeypatch):
    """The run's own replay cannot choose (tied): the pasted growth_interval is the study's for the nearest family
    inside the families' range, and the longest candidate outside it."""

    from fp16probe.analysis.recommend import analyze
    from fp16probe.presentation.answer import short_answer
    from fp16probe.presentation.answer import grad_scaler_code
    from fp16probe.presentation.verdict import verdict_text

    report = _tiny_loss_run(120)
    drift = interval_study.drift_per_1000(range(len(report.history)), report.history.grad_max)
    assert drift is not None
    near = StudyFamily("near", 5000, round(drift, 3) + 0.1, 400, 2.0, 0.5, 3, 5, 0.0, 0.0)
    far = StudyFamily("far", 5000, round(drift, 3) - 3.0, 2000, 2.0, 0.5, 5, 5, 0.0, 0.0)
    monkeypatch.setattr(interval_study, "FAMILIES", (near, far))
    rec = analyze(report, "fp16")
    assert rec.evidence["simulated_candidates_tied"] and rec.evidence["interval_study"]["family"] == "near"
    assert rec.evidence["growth_interval_from_study"] and rec.grad_scaler_kwargs["growth_interval"] == 400
    assert "growth_interval=400" in grad_scaler_code(rec, "cuda", 80)
    line = next(x.text for x in short_answer(report, rec) if x.kind == "schedule")
    assert "growth_interval=400" in line and "study" in line and "(near)" in line
    text = verdict_text(rec)
    assert "the growth_interval to paste is 400" in text and wording_problems(text) == []

    # outside the families' range the study does not speak for the run: the replay's longest candidate
    monkeypatch.setattr(interval_study, "FAMILIES", (
        StudyFamily("a", 5000, round(drift, 3) + 3.0, 400, 2.0, 0.5, 3, 5, 0.0, 0.0),
        StudyFamily("b", 5000, round(drift, 3) + 6.0, 400, 2.0, 0.5, 3, 5, 0.0, 0.0)))
    rec = analyze(report, "fp16")
    assert not rec.evidence["interval_study"]["within_range"] and "growth_interval_from_study" not in rec.evidence
    assert rec.grad_scaler_kwargs["growth_interval"] == max(r["growth_interval"] for r in rec.growth_interval_table["rows"])
