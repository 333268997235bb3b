"""The pictures draw what the numbers say: bounds, zero bin, shares, annotations."""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from fp16probe import Fp16ProbeError, get_format
from fp16probe.report import ACTIVATION_GRAD, Histogram
from tests.fixtures.reports import HAND_MODULES, hand_report, probe_report

from fp16probe.presentation import figures as plotting

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _agg_backend():
    matplotlib.use("Agg")


@pytest.fixture(scope="module")
def hand():
    return hand_report()


@pytest.fixture(scope="module")
def probed():
    return probe_report()


def _by_gid(artists, gid):
    found = [a for a in artists if a.get_gid() == gid]
    assert found, f"no artist with gid {gid!r}"
    return found


def _line_x(ax: Axes, gid: str) -> float:
    (line,) = _by_gid(ax.lines, gid)
    xs = set(np.asarray(line.get_xdata(), dtype=float).tolist())
    assert len(xs) == 1, "a bound is a vertical line"
    return xs.pop()


def _stairs(ax: Axes, gid: str) -> tuple[np.ndarray, np.ndarray]:
    (patch,) = _by_gid(ax.patches, gid)
    data = patch.get_data()
    return np.asarray(data.values), np.asarray(data.edges)


def _share_in_bin(values: np.ndarray, edges: np.ndarray, e: int) -> float:
    """The drawn share of the bin (2^(e-1), 2^e], which spans [e-1, e] on the x-axis."""
    i = int(np.searchsorted(edges, e - 1))
    assert edges[i] == e - 1 and edges[i + 1] == e
    return float(values[i])


def _percent_and_counts(text: str) -> tuple[float, int, int]:
    text = " ".join(text.split())  # the annotation wraps to its axes' width
    m = re.search(r"([\d.e+-]+)% .*\(([\d,]+) of ([\d,]+)\)", text)
    assert m, text
    return float(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", ""))


def _save_png(ax_or_fig, tmp_path, name="fig.png") -> bytes:
    fig = ax_or_fig if isinstance(ax_or_fig, Figure) else ax_or_fig.figure
    path = tmp_path / name
    fig.savefig(path, dpi=60)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    return data


# -- the Figure 3 view ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_bound_lines_sit_at_the_format_bounds(hand, fmt, tmp_path):
    ax = plotting.plot_distribution(hand, fmt, log2_scale=0)
    f = get_format(fmt)
    assert _line_x(ax, "bound:flush") == f.log2_flush_threshold
    assert _line_x(ax, "bound:min_normal") == f.log2_min_normal
    assert _line_x(ax, "bound:max") == pytest.approx(math.log2(f.max))
    _save_png(ax, tmp_path)


def test_fp16_bounds_are_the_known_numbers(hand):
    ax = plotting.plot_distribution(hand, "fp16", log2_scale=0)
    assert _line_x(ax, "bound:flush") == -25  # 2^-25: half of 2^-24 rounds to 0
    assert _line_x(ax, "bound:min_normal") == -14
    assert _line_x(ax, "bound:max") == pytest.approx(math.log2(65504))


def test_regions_are_shaded_between_the_bounds(hand):
    ax = plotting.plot_distribution(hand, "fp16", log2_scale=0)
    (sub,) = _by_gid(ax.patches, "region:subnormal")
    x0, x1 = sub.get_x(), sub.get_x() + sub.get_width()
    assert (x0, x1) == (-25, -14)
    (normal,) = _by_gid(ax.patches, "region:normal")
    assert normal.get_x() == -14
    assert normal.get_x() + normal.get_width() == pytest.approx(math.log2(65504))
    labels = {t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("region-label:")}
    assert labels == {"flushes to zero", "subnormal", "normal", "overflow"}


def test_zero_bin_is_drawn_apart_with_the_share_of_zeros(hand, tmp_path):
    ax = plotting.plot_distribution(hand, "fp16", log2_scale=0)
    h = hand.histogram(ACTIVATION_GRAD)
    (bar,) = _by_gid(ax.patches, "zeros")
    assert bar.get_height() == pytest.approx(h.zero / h.total)
    _values, edges = _stairs(ax, "histogram")
    assert bar.get_x() + bar.get_width() < edges[0], "the zero bin sits left of every magnitude bin"
    zero_x = bar.get_x() + bar.get_width() / 2
    assert ax.xaxis.get_major_formatter()(zero_x, 0) == "0"
    _save_png(ax, tmp_path)


def test_measured_shares_are_counts_over_all_values(hand):
    ax = plotting.plot_distribution(hand, "fp16", log2_scale=0)
    h = hand.histogram(ACTIVATION_GRAD)
    values, edges = _stairs(ax, "histogram")
    for e in (-40, -30, -26, -25, -22, -20, -16, -13, -10, -8, -6, 10):
        assert _share_in_bin(values, edges, e) == pytest.approx(h.count(e) / h.total), e
    assert values.sum() + h.zero / h.total == pytest.approx(1.0)
    assert not [p for p in ax.patches if p.get_gid() == "histogram:scaled"]


def test_scaled_histogram_is_the_same_counts_shifted_by_log2_s(hand):
    k = 9
    ax = plotting.plot_distribution(hand, "fp16", log2_scale=k)
    h = hand.histogram(ACTIVATION_GRAD)
    values, edges = _stairs(ax, "histogram:scaled")
    for e in (-40, -30, -25, -13, -6, 10):
        assert _share_in_bin(values, edges, e + k) == pytest.approx(h.count(e) / h.total), e


@pytest.mark.parametrize("k", [0, 5, 12, 20])
def test_annotations_give_the_exact_flushed_counts(hand, k):
    ax = plotting.plot_distribution(hand, "fp16", log2_scale=k)
    h = hand.histogram(ACTIVATION_GRAD)
    (at1,) = _by_gid(ax.texts, "annotation:flushed_at_1")
    pct, flushed, n = _percent_and_counts(at1.get_text())
    # by hand: at S = 1 the "deep" bins -40, -30, -26, -25 flush (2^-25 rounds to 0)
    deep, _ = HAND_MODULES["deep"]
    assert flushed == h.flushed("fp16", 0) == 6 * (deep[-40] + deep[-30] + deep[-26] + deep[-25])
    assert n == h.nonzero_finite
    assert pct == pytest.approx(100 * flushed / n, rel=5e-3)
    scaled = [t for t in ax.texts if t.get_gid() == "annotation:flushed_at_scale"]
    if k == 0:
        assert not scaled
        return
    pct_k, flushed_k, _ = _percent_and_counts(scaled[0].get_text())
    assert flushed_k == h.flushed("fp16", k)
    assert pct_k == pytest.approx(100 * flushed_k / n, rel=5e-3) if flushed_k else pct_k == 0
    assert ("OVERFLOWS" in scaled[0].get_text()) == h.overflows("fp16", k)


def test_overflow_is_flagged_past_max(hand):
    # the largest value is 2^10: at S = 2^6 it is 2^16 > 65504 and overflows fp16
    text = _by_gid(plotting.plot_distribution(hand, "fp16", log2_scale=6).texts,
                   "annotation:flushed_at_scale")[0].get_text()
    assert "OVERFLOWS" in text
    text = _by_gid(plotting.plot_distribution(hand, "fp16", log2_scale=5).texts,
                   "annotation:flushed_at_scale")[0].get_text()
    assert "OVERFLOWS" not in text


def test_distribution_of_a_histogram_and_of_a_probe_run(probed, tmp_path):
    ax = plotting.plot_distribution(probed.histogram(), "fp16", log2_scale=10)
    h = probed.histogram()
    values, edges = _stairs(ax, "histogram")
    assert values.sum() == pytest.approx(h.nonzero_finite / h.total)
    (bar,) = _by_gid(ax.patches, "zeros")
    assert bar.get_height() == pytest.approx(h.zero / h.total)
    assert h.zero > 0, "ReLU zeros the gradient of inactive units: the zero bin is occupied"
    _save_png(ax, tmp_path)


def test_draws_on_a_given_axes_and_returns_it():
    fig = Figure()
    ax = fig.add_subplot()
    assert plotting.plot_distribution(Histogram.from_values({-20: 3}), ax=ax, log2_scale=0) is ax


def test_empty_histogram_draws_without_error(tmp_path):
    ax = plotting.plot_distribution(Histogram(), "fp16", log2_scale=0)
    (bar,) = _by_gid(ax.patches, "zeros")
    assert bar.get_height() == 0
    _save_png(ax, tmp_path)


def test_nonfinite_values_are_reported_not_drawn():
    h = Histogram.from_values({-3: 10}, inf=2, nan=1)
    ax = plotting.plot_distribution(h, "fp16", log2_scale=0)
    (note,) = _by_gid(ax.texts, "annotation:nonfinite")
    assert "2 inf" in note.get_text() and "1 NaN" in note.get_text()


def test_no_pyplot_state_is_touched(hand):
    import sys

    plotting.plot_distribution(hand, log2_scale=3)
    plotting.plot_module_heatmap(hand)
    if "matplotlib.pyplot" in sys.modules:
        import matplotlib.pyplot as plt

        assert plt.get_fignums() == []


# -- heatmap -------------------------------------------------------------------------------
def test_heatmap_rows_are_modules_in_forward_order(probed, tmp_path):
    ax = plotting.plot_module_heatmap(probed, "fp16")
    names = [t.get_text().split(" ")[0] for t in ax.get_yticklabels()]
    assert names == [m.name for m in probed.modules_of(ACTIVATION_GRAD)]
    _save_png(ax, tmp_path)


def test_heatmap_cells_are_each_modules_shares(hand):
    ax = plotting.plot_module_heatmap(hand, "fp16")
    (mesh,) = _by_gid(ax.collections, "heatmap")
    grid = np.ma.filled(mesh.get_array(), 0.0).reshape(3, -1)
    lo = int(ax.get_xlim()[0]) + 2  # columns: zero bin, gap, then bins lo+1 ..
    for r, m in enumerate(hand.modules_of(ACTIVATION_GRAD)):
        h = m.histogram
        assert grid[r, 0] == pytest.approx(h.zero / h.total)
        assert grid[r, 1] == 0
        for e in range(lo + 1, lo + grid.shape[1] - 1):
            assert grid[r, e - lo + 1] == pytest.approx(h.count(e) / h.total), (m.name, e)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    deep = hand.module("deep").histogram
    assert labels[2].endswith(f"({100 * deep.flushed('fp16') / deep.nonzero_finite:.3g}%)")
    assert _line_x(ax, "bound:flush") == -25
    assert _line_x(ax, "bound:min_normal") == -14


def test_heatmap_keeps_the_worst_modules_when_asked(hand):
    ax = plotting.plot_module_heatmap(hand, "fp16", max_modules=1)
    assert [t.get_text().split(" ")[0] for t in ax.get_yticklabels()] == ["deep"]


def test_heatmap_of_a_kind_not_captured_says_so(hand):
    ax = plotting.plot_module_heatmap(hand, kind="activation")
    assert any("no activation records" in t.get_text() for t in ax.texts)


# -- files ---------------------------------------------------------------------------------
def test_save_figures_refuses_an_unknown_extension(hand, tmp_path):
    with pytest.raises(Fp16ProbeError, match=r"\.png, \.svg, \.pdf"):
        plotting.save_figures(hand, tmp_path / "figures.jpeg")


def test_unknown_figure_name_is_an_error(hand):
    with pytest.raises(Fp16ProbeError, match="expected one of"):
        plotting.figure(hand, which="pie")


def test_report_plot_returns_a_figure_of_one_view(hand, hand_rec, tmp_path):
    from dataclasses import replace

    fig = hand.plot("distribution", recommendation=replace(hand_rec, log2_scale=4))
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    (text,) = _by_gid(ax.texts, "annotation:flushed_at_scale")
    assert "2^4" in text.get_text()
    _save_png(fig, tmp_path)


# -- against the analyzer ------------------------------------------------------------------
@pytest.fixture(scope="module")
def hand_rec(hand):
    from fp16probe.analysis.recommend import analyze

    return analyze(hand, "fp16", kind="activation_grad")  # the kind the plots show by default


@pytest.fixture(scope="module")
def probed_rec(probed):
    from fp16probe.analysis.recommend import analyze

    return analyze(probed, "fp16", kind="activation_grad")


@pytest.mark.parametrize("which", ["hand", "probed"])
def test_annotations_equal_the_analyzers_numbers(which, request):
    report = request.getfixturevalue(which)
    rec = request.getfixturevalue(f"{which}_rec")
    ax = plotting.plot_distribution(report, "fp16", recommendation=rec)
    pct, _, _ = _percent_and_counts(_by_gid(ax.texts, "annotation:flushed_at_1")[0].get_text())
    assert pct == pytest.approx(100 * rec.flushed_fraction_at_1, rel=5e-3)
    scaled = [t for t in ax.texts if t.get_gid() == "annotation:flushed_at_scale"]
    if rec.log2_scale:
        pct_k, _, _ = _percent_and_counts(scaled[0].get_text())
        expected = 100 * rec.flushed_fraction_at_scale
        assert pct_k == pytest.approx(expected, rel=5e-3) if expected else pct_k == 0
        assert f"2^{rec.log2_scale}" in scaled[0].get_text()
    else:
        assert not scaled


def test_distribution_draws_the_stored_recommendation_and_runs_no_analysis(hand, hand_rec):
    ax = plotting.plot_distribution(hand.with_recommendation(hand_rec), "fp16")
    values, edges = _stairs(ax, "histogram:scaled")
    h = hand.histogram(ACTIVATION_GRAD)
    k = hand_rec.log2_scale
    assert k, "the hand-built report needs a scale"
    assert _share_in_bin(values, edges, -30 + k) == pytest.approx(h.count(-30) / h.total)
    bare = plotting.plot_distribution(hand.with_recommendation(None), "fp16")
    assert not [a for a in bare.patches if a.get_gid() == "histogram:scaled"]
    assert not [t for t in bare.texts if t.get_gid() == "annotation:flushed_at_scale"]


def test_stored_recommendation_is_drawn(hand, hand_rec):
    report = hand.with_recommendation(hand_rec)
    ax = plotting.plot_distribution(report, "fp16")
    assert f"2^{hand_rec.log2_scale}" in _by_gid(ax.texts, "annotation:flushed_at_scale")[0].get_text()


def test_what_if_curve_is_the_what_if_table(hand, hand_rec, tmp_path):
    from fp16probe.analysis.whatif import what_if

    table = what_if(hand, "fp16", kind="activation_grad")
    ax = plotting.plot_what_if(hand, "fp16", recommendation=hand_rec)
    (flushed,) = _by_gid(ax.lines, "what_if:flushed")
    assert list(flushed.get_xdata()) == [r.log2_scale for r in table.rows]
    assert list(flushed.get_ydata()) == [r.flushed_fraction for r in table.rows]
    twin = [a for a in ax.figure.axes if a is not ax][0]
    (overflow,) = _by_gid(twin.lines, "what_if:overflow")
    every_gradient = what_if(hand, "fp16", kind="all")  # overflow is judged on every gradient
    assert list(overflow.get_ydata()) == [r.overflow_steps for r in every_gradient.rows]
    # the hand-built report's 2^10 value overflows fp16 in one of six steps from S = 2^6 on
    assert table.row(5).overflow_steps == 0 and table.row(6).overflow_steps == 1
    assert _line_x(ax, "recommendation") == hand_rec.log2_scale
    (threshold,) = _by_gid(ax.lines, "threshold")
    assert threshold.get_ydata()[0] == hand_rec.thresholds["max_flushed_fraction"]
    _save_png(ax, tmp_path)


def test_what_if_accepts_a_table(hand):
    from fp16probe.analysis.whatif import what_if

    table = what_if(hand, "bf16", log2_scales=range(0, 5))
    ax = plotting.plot_what_if(table, "bf16")
    assert list(_by_gid(ax.lines, "what_if:flushed")[0].get_xdata()) == [0, 1, 2, 3, 4]
    assert not [line for line in ax.lines if line.get_gid() == "recommendation"]


def test_timeline_is_the_replayed_scale_with_skipped_steps(hand, hand_rec, tmp_path):
    from fp16probe.analysis.replay import GRADSCALER_DEFAULTS, simulate

    ax = plotting.plot_scale_timeline(hand, "fp16", recommendation=hand_rec, horizon=300, seed=1)
    for label, kwargs in [("recommended", hand_rec.grad_scaler_kwargs),
                          ("GradScaler default", GRADSCALER_DEFAULTS)]:
        expected = simulate(hand.trace, "fp16", kwargs, horizon=300, seed=1)
        (line,) = _by_gid(ax.lines, f"timeline:{label}")
        assert list(line.get_ydata()) == list(expected.scales)
        skipped = [i for i, s in enumerate(expected.skipped) if s]
        marks = [m for m in ax.lines if m.get_gid() == f"skipped:{label}"]
        assert (list(marks[0].get_xdata()) if marks else []) == skipped
        assert f"({len(skipped)} skipped)" in line.get_label()
    default_skips = sum(simulate(hand.trace, "fp16", GRADSCALER_DEFAULTS, horizon=300, seed=1).skipped)
    assert default_skips > 0, "GradScaler's 2^16 overflows on the 2^10 gradient: its backoffs show"
    _save_png(ax, tmp_path)


def test_timeline_without_a_schedule_says_so(probed, probed_rec):
    ax = plotting.plot_scale_timeline(probed, "bf16", horizon=50)
    assert [line.get_gid() for line in ax.lines if line.get_gid().startswith("timeline:")] == [
        "timeline:GradScaler default"]
    assert _by_gid(ax.texts, "annotation:no_schedule")


@pytest.mark.slow
@pytest.mark.parametrize("ext, magic", [(".png", PNG_MAGIC), (".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_save_figures_writes_all_four_views(hand, hand_rec, tmp_path, ext, magic):
    path = plotting.save_figures(hand, tmp_path / f"figures{ext}", recommendation=hand_rec)
    assert path.read_bytes().startswith(magic)
    fig = plotting.figure(hand, recommendation=hand_rec)
    gids = {a.get_gid() for ax in fig.axes for a in (*ax.lines, *ax.patches, *ax.collections)}
    assert {"histogram", "zeros", "heatmap", "what_if:flushed", "timeline:recommended"} <= gids
    if ext == ".svg":
        text = path.read_text(encoding="utf-8")
        assert "bound:min_normal" in text, "gids survive into the SVG"


def test_report_plot_all_views(hand):
    fig = hand.plot()
    assert len([ax for ax in fig.axes if ax.get_title()]) >= 4


# -- many modules, odd names, legends, the limit, files (issues 12 and 15) ------------------
def _many_modules(n: int = 141):
    from dataclasses import replace

    from fp16probe.report import ModuleStats

    base = hand_report()
    deep = base.module("deep").histogram
    head = base.module("head").histogram
    mods = tuple(ModuleStats(f"model.layers.{i}.mlp.down_proj", ACTIVATION_GRAD, "Linear", i,
                             deep if i % 7 == 0 else head) for i in range(n))
    return replace(base, modules=mods)


def test_heatmap_of_many_modules_says_how_many_it_shows_and_keeps_labels_legible():
    report = _many_modules()
    fig = report.plot("all")
    ax = next(a for a in fig.axes if [c for c in a.collections if c.get_gid() == "heatmap"])
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert f"{len(labels)} of 141 modules, those that flush the most" in ax.get_title()
    # each label gets at least 1.6 times its font size of height
    fig.draw_without_rendering()
    height_pt = ax.get_window_extent().height * 72 / fig.dpi
    assert height_pt / len(labels) >= 1.6 * 7
    # the rows kept are those that flush the most: every 7th module is the "deep" one
    shown = [int(re.match(r"model\.layers\.(\d+)\.", t).group(1)) for t in labels]
    assert len(labels) >= 21 and set(range(0, 141, 7)) <= set(shown) and shown == sorted(shown)
    alone = plotting.plot_module_heatmap(report)
    assert "60 of 141 modules" in alone.get_title()
    few = plotting.plot_module_heatmap(hand_report())
    assert "all 3 modules" in few.get_title()


def test_module_names_with_markup_and_mathtext_are_drawn_as_text(tmp_path):
    from dataclasses import replace

    base = hand_report()
    odd = ("$\\frac{$", "[/bold]", "a.$x$.b")
    mods = tuple(replace(m, name=odd[i]) if i < 3 else m for i, m in enumerate(base.modules))
    report = replace(base, modules=mods, metadata=replace(base.metadata, model_class="Net$1$"))
    fig = report.plot("all")
    _save_png(fig, tmp_path)  # mathtext would raise on "$\frac{$"
    ax = next(a for a in fig.axes if [c for c in a.collections if c.get_gid() == "heatmap"])
    texts = [t.get_text() for t in ax.get_yticklabels()]
    assert any(t.startswith("\\$\\frac{\\$ [Linear]") for t in texts)
    assert any(t.startswith("a.\\$x\\$.b [Linear]") for t in texts)


def test_legends_sit_off_the_data(hand):
    from fp16probe.analysis.recommend import analyze

    report = hand.with_recommendation(analyze(hand, "fp16"))
    for draw in (plotting.plot_what_if, plotting.plot_scale_timeline, plotting.plot_distribution):
        ax = draw(report, "fp16")
        ax.figure.draw_without_rendering()
        legend = ax.get_legend().get_window_extent()
        assert not legend.overlaps(ax.get_window_extent()), draw.__name__


def test_what_if_first_overflow_is_the_recommendations_limit():
    from fp16probe.analysis.recommend import analyze
    from fp16probe.report import Report

    for report in (Report.load(Path(__file__).parent / "data" / "report-v1-demo.json"), hand_report()):
        rec = analyze(report, "fp16")
        ax = plotting.plot_what_if(report, "fp16", recommendation=rec)
        twin = [a for a in ax.figure.axes if a is not ax][0]
        (overflow,) = _by_gid(twin.lines, "what_if:overflow")
        first = next(x for x, y in zip(overflow.get_xdata(), overflow.get_ydata()) if y > 0)
        assert first == rec.evidence["largest_safe_log2_scale"] + 1
        assert _line_x(ax, "limit") == first


def test_save_figures_is_atomic_and_leaves_the_old_figure_on_a_full_disk(hand, tmp_path, monkeypatch):
    import errno

    path = tmp_path / "figures.png"
    plotting.save_figures(hand, path)
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("fp16probe.report.os.fsync", full_disk)  # the disk fills while the new figure is written
    with pytest.raises(OSError):
        plotting.save_figures(hand, path)
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.png"]  # no temporary file left
