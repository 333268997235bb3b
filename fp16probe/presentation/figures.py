"""Pictures of a Report: the distribution against a format's range, and what scaling does.

The only module that imports matplotlib; everything else imports this one lazily.
Figures are built on ``matplotlib.figure.Figure`` directly, never on pyplot's global
state, so a library call never opens a window or leaks a figure. Every plot function
takes ``ax=None`` (a fresh Figure is made) and returns the Axes it drew on.

The x-axis of the distribution and the heatmap is log2 of the magnitude: the bin ``e``,
holding magnitudes in ``(2^(e-1), 2^e]``, spans ``[e - 1, e]``, so the format bounds,
which are bin edges, fall on the bars' edges. Exact zeros get a bin of their own to the
left of the axis, as in Figure 3 of Micikevicius et al., "Mixed Precision Training" (arXiv:1710.03740).

Artists that the tests (and anyone post-processing a figure) need to find carry a
``gid``: ``bound:flush``, ``bound:min_normal``, ``bound:max``, ``region:<name>``,
``zeros``, ``histogram``, ``histogram:scaled``, ``annotation:flushed_at_1``,
``annotation:flushed_at_scale``, ``recommendation``, ``what_if:flushed``,
``what_if:overflow``, ``timeline:<label>``, ``skipped:<label>``, ``trial:fp32:<seed>``,
``trial:low:<seed>``, ``trial:band``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fp16probe.errors import Fp16ProbeError, MissingExtraError

try:  # matplotlib is the plot extra's: the text answer and the CLI need none of its ~90 MiB
    from matplotlib.axes import Axes
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator
except ImportError as e:
    raise MissingExtraError("matplotlib", "plot", "drawing figures") from e
from fp16probe.formats import Format, get_format
from fp16probe import formatting as num
from fp16probe.histogram import MIN_EXP
from fp16probe.analysis.whatif import flushed_fraction, what_if, worst_modules
from fp16probe.presentation.answer import recommendation_for, shorten_name, wrap_text
from fp16probe.presentation import escape
from fp16probe.recommendation import GRADSCALER_DEFAULTS, Recommendation
from fp16probe.report import ACTIVATION_GRAD, Histogram, Report, atomic_write_text

__all__ = [
    "FIGURE_KINDS",
    "figure",
    "format_bounds",
    "plot_distribution",
    "plot_module_heatmap",
    "plot_scale_timeline",
    "plot_trial",
    "plot_what_if",
    "save_figures",
]

FIGURE_KINDS = ("all", "distribution", "heatmap", "what_if", "timeline", "trial")

_SAVE_EXTENSIONS = (".png", ".svg", ".pdf")

_REGION_COLORS = {
    "flushes to zero": "#d9d9d9",
    "subnormal": "#fde0b2",
    "normal": "#d7f0d2",
    "overflow": "#f8c9c4",
}
_MEASURED_COLOR = "#3b6ea8"
_SCALED_COLOR = "#d1495b"


# -- numbers the pictures show ---------------------------------------------------------
def format_bounds(fmt: str | Format) -> dict[str, float]:
    """Return the x positions (log2 magnitude) of a format's three bounds.

    ``flush``: half the smallest subnormal, the largest magnitude that rounds to 0;
    ``min_normal``; ``max``: the largest finite value (log2(65504) for fp16).
    """
    fmt = fmt if isinstance(fmt, Format) else get_format(fmt)
    return {
        "flush": float(fmt.log2_flush_threshold),
        "min_normal": float(fmt.log2_min_normal),
        "max": math.log2(fmt.max),
    }


def _literal(text: str) -> str:
    """Text from a report drawn safely (:func:`fp16probe.presentation.escape.figure`: no control character, no mathtext)."""
    return escape.figure(text)


def _recommendation(report: Report | None, given: Recommendation | None, fmt: Format) -> Recommendation | None:
    """The recommendation given, else the report's stored one for ``fmt`` (never a fresh analysis)."""
    if given is not None or report is None:
        return given
    return recommendation_for(report, fmt.name)


def _scale_label(k: int) -> str:
    return f"S = 2^{k} = {2.0**k:g}" if k >= 0 else f"S = 2^{k}"


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig.add_subplot()


def _x_range(histograms: list[tuple[Histogram, int]], fmt: Format) -> tuple[int, int]:
    """Integer x limits that hold every occupied bin (after its shift) and every bound."""
    bounds = format_bounds(fmt)
    lo = math.floor(bounds["flush"]) - 3
    hi = math.ceil(bounds["max"]) + 5
    for h, k in histograms:
        if h.lowest_exp is not None:
            lo = min(lo, h.lowest_exp + k - 2)
            hi = max(hi, h.highest_exp + k + 1)
    return lo, hi


def _bin_values(h: Histogram, lo: int, hi: int, shift: int, denominator: int) -> np.ndarray:
    """Shares of ``h`` shifted by ``shift`` bins, for bins ``lo + 1 .. hi``."""
    out = np.zeros(hi - lo)
    if not denominator:
        return out
    counts = np.asarray(h.counts, dtype=np.float64)
    exps = np.arange(MIN_EXP, MIN_EXP + len(counts)) + shift
    keep = (exps > lo) & (exps <= hi) & (counts > 0)
    out[exps[keep] - lo - 1] = counts[keep] / denominator
    return out


def _log2_ticks(ax: Axes, lo: int, hi: int, zero_x: float | None) -> None:
    span = hi - lo
    step = 4 if span <= 60 else 8 if span <= 120 else 16 if span <= 240 else 32
    ticks = [float(t) for t in range(math.ceil(lo / step) * step, hi + 1, step)]
    labels = {t: f"$2^{{{int(t)}}}$" for t in ticks}
    if zero_x is not None:  # keep the "0" label clear of its neighbour
        ticks = [zero_x] + [t for t in ticks if t - zero_x >= 0.75 * step]
        labels[zero_x] = "0"
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: labels.get(float(x), "")))


def _draw_format(ax: Axes, fmt: Format, lo: float, hi: float, *, label_regions: bool) -> None:
    bounds = format_bounds(fmt)
    edges = [lo, bounds["flush"], bounds["min_normal"], bounds["max"], hi]
    for (name, color), a, b in zip(_REGION_COLORS.items(), edges[:-1], edges[1:]):
        if b <= a:
            continue
        ax.axvspan(a, b, color=color, alpha=0.6 if label_regions else 0.0, lw=0, zorder=0,
                   gid=f"region:{name}")
        if label_regions:
            # A span too narrow for its name gets it upright, never clipped ("overflo").
            narrow = (b - a) < 1.1 * len(name) * (hi - lo) / 90
            ax.text((a + b) / 2, 0.98, name, transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=8 if not narrow else 7, color="#444444", gid=f"region-label:{name}",
                    rotation=90 if narrow else 0, clip_on=False)
    names = {"flush": f"{fmt.flush_threshold:.3g} (rounds to 0 at or below)",
             "min_normal": f"min normal {fmt.min_normal:.3g}",
             "max": f"max {fmt.max:g}"}
    for key, x in bounds.items():
        ax.axvline(x, color="#555555", lw=1, ls="--", zorder=3, gid=f"bound:{key}",
                   label=f"{fmt.name} {names[key]}" if label_regions else None)


# -- the Figure 3 view -------------------------------------------------------------------
def plot_distribution(
    report: Report | Histogram,
    format: str | Format = "fp16",
    *,
    recommendation: Recommendation | None = None,
    log2_scale: int | None = None,
    kind: str = ACTIVATION_GRAD,
    ax: Axes | None = None,
) -> Axes:
    """Draw the Figure 3 view of Micikevicius et al. (arXiv:1710.03740): value shares per log2 bin
    against a format's regions.

    Args:
        report: a Report (its merged histogram of ``kind`` is drawn) or a Histogram.
        format: the target format whose regions are shaded.
        recommendation: a Recommendation; its ``log2_scale`` is the S drawn beside the
            measured histogram. Default: the report's stored one for ``format``.
        log2_scale: draw the histogram shifted by S = 2^log2_scale instead.
        kind: which values of the report to draw.
        ax: the Axes to draw on (default: a new Figure's).

    The y-axis is the share of all values counted (zeros, infinities and NaNs
    included); the annotations give the share of *nonzero* values that flush to zero.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    if isinstance(report, Histogram):
        hist, source = report, None
    else:
        hist, source = report.histogram(kind), report
    if log2_scale is None:
        recommendation = _recommendation(source, recommendation, fmt)
        log2_scale = None if recommendation is None else recommendation.log2_scale
    ax = _new_axes(ax, (9, 4.5))
    total = hist.total
    shifted = [(hist, 0)] + ([(hist, log2_scale)] if log2_scale else [])
    lo, hi = _x_range(shifted, fmt)
    zero_x = lo - 1.5
    edges = np.arange(lo, hi + 1, dtype=np.float64)

    _draw_format(ax, fmt, lo, hi, label_regions=True)
    zero_share = hist.zero / total if total else 0.0
    ax.bar([zero_x], [zero_share], width=1.0, color="#7f7f7f", edgecolor="black", lw=0.6,
           zorder=4, gid="zeros", label=f"exact zeros ({num.percent(zero_share)}; unchanged by S)")
    ax.stairs(_bin_values(hist, lo, hi, 0, total), edges, fill=True, color=_MEASURED_COLOR,
              alpha=0.75, zorder=4, gid="histogram", label="measured (S = 1)")
    if log2_scale:
        ax.stairs(_bin_values(hist, lo, hi, log2_scale, total), edges, fill=False,
                  color=_SCALED_COLOR, lw=1.8, zorder=5, gid="histogram:scaled",
                  label=f"scaled by {_scale_label(log2_scale)}")

    n = hist.nonzero_finite
    lines = [(0, "annotation:flushed_at_1",
              f"flushed to zero at S = 1: {num.percent(flushed_fraction(hist, fmt, 0))} of nonzero values "
              f"({hist.flushed(fmt, 0):,} of {n:,})")]
    if log2_scale:
        lines.append((log2_scale, "annotation:flushed_at_scale",
                      f"flushed at {_scale_label(log2_scale)}: "
                      f"{num.percent(flushed_fraction(hist, fmt, log2_scale))} "
                      f"({hist.flushed(fmt, log2_scale):,} of {n:,})"
                      + ("; OVERFLOWS" if hist.overflows(fmt, log2_scale) else "")))
    # Wrapped to a third of the axes' width and anchored inside its right edge, so a box
    # never reaches the y tick labels, whatever the figure's size.
    chars = max(int(ax.get_position().width * ax.figure.get_figwidth() * 72 / 8.0 * 0.55), 24)
    y = 0.86
    for _k, gid, text in lines:
        wrapped = "\n".join(_literal(line) for line in wrap_text(text, chars))
        ax.text(0.99, y, wrapped, transform=ax.transAxes, ha="right", va="top",
                fontsize=8, zorder=6, gid=gid,
                bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "#999999", "alpha": 0.9})
        y -= 0.075 * (wrapped.count("\n") + 1) + 0.02
    if hist.nonfinite:
        ax.text(0.99, y, f"not drawn: {hist.inf:,} inf, {hist.nan:,} NaN",
                transform=ax.transAxes, ha="right", va="top", fontsize=8, gid="annotation:nonfinite")

    ax.set_xlim(zero_x - 1.5, hi)
    top = max([zero_share] + list(_bin_values(hist, lo, hi, 0, total)) or [0.0])
    ax.set_ylim(0, max(top, 1e-9) * 1.6)  # headroom above the bars for the region names and annotations
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{100 * y:.0f}%" if top > 0.05
                                               else f"{100 * y:.2g}%"))
    _log2_ticks(ax, lo, hi, zero_x)
    ax.set_xlabel("magnitude (log2 bins; bin 2^e holds (2^(e-1), 2^e])")
    ax.set_ylabel("share of values")
    what = kind.replace("_", " ")
    ax.set_title(f"{what} magnitudes vs {fmt.name} ({total:,} values)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7.5,
              frameon=False)
    return ax


# -- per-module heatmap ------------------------------------------------------------------
def plot_module_heatmap(
    report: Report,
    format: str | Format = "fp16",
    *,
    kind: str = ACTIVATION_GRAD,
    max_modules: int | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Draw each module's share of values per log2 bin (rows in forward order).

    Row labels carry each module's flushed share at S = 1; the format's bounds are
    vertical lines. When there are more modules than ``max_modules`` (default: as many as
    keep their labels legible, at most 60 on a new figure), the rows are the modules that
    flush the most, still in forward order, and the title says how many of how many.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    modules = list(report.modules_of(kind))
    if max_modules is None:
        max_modules = _HEATMAP_MAX_ROWS if ax is None else _rows_that_fit(ax)
    shown = modules
    if len(modules) > max_modules:
        keep = {(w.name, w.kind) for w in worst_modules(report, fmt, kind=kind, count=max_modules)}
        rest = [m for m in modules if (m.name, m.kind) not in keep]
        keep |= {(m.name, m.kind) for m in rest[: max_modules - len(keep)]}  # fewer flush: the first others
        shown = [m for m in modules if (m.name, m.kind) in keep]
    ax = _new_axes(ax, (9, max(2.5, _ROW_INCHES * len(shown) + 1.5)))
    if not shown:
        ax.text(0.5, 0.5, f"no {kind} records in this report", transform=ax.transAxes,
                ha="center", va="center")
        ax.set_axis_off()
        return ax
    lo, hi = _x_range([(m.histogram, 0) for m in shown], fmt)
    # Columns: the zero bin on [lo-2, lo-1], a blank gap, then bins lo+1 .. hi.
    edges = np.arange(lo - 2, hi + 1, dtype=np.float64)
    grid = np.zeros((len(shown), len(edges) - 1))
    for r, m in enumerate(shown):
        total = m.histogram.total
        if total:
            grid[r, 0] = m.histogram.zero / total
            grid[r, 2:] = _bin_values(m.histogram, lo, hi, 0, total)
    masked = np.ma.masked_less_equal(grid, 0.0)
    positive = grid[grid > 0]
    norm = LogNorm(vmin=max(positive.min(), 1e-8), vmax=positive.max()) if positive.size else None
    mesh = ax.pcolormesh(edges, np.arange(len(shown) + 1), masked, cmap="viridis", norm=norm,
                         gid="heatmap")
    _draw_format(ax, fmt, lo - 2, hi, label_regions=False)
    for line in ax.lines:  # stand out on both the dark and the bright cells
        line.set_color("#e8412c")
        line.set_linewidth(1.3)
    labels = [_literal(f"{shorten_name(m.name, _LABEL_CHARS)} [{m.module_type}] "
                       f"({num.percent(flushed_fraction(m.histogram, fmt))})") for m in shown]
    ax.set_yticks(np.arange(len(shown)) + 0.5, labels, fontsize=_LABEL_POINTS)
    ax.set_ylim(len(shown), 0)  # first module in forward order at the top
    ax.set_xlim(lo - 2, hi)
    _log2_ticks(ax, lo, hi, lo - 1.5)
    ax.set_xlabel(f"magnitude (log2 bins); dashed: {fmt.name} flush, min normal, max")
    which = (f"all {len(modules)} modules" if len(shown) == len(modules) else
             f"{len(shown)} of {len(modules)} modules, those that flush the most")
    ax.set_title(f"{kind.replace('_', ' ')} per module: {which}, in forward order\n"
                 f"(label: share flushed in {fmt.name} at S = 1)", gid="heatmap:title")
    ax.figure.colorbar(mesh, ax=ax, label="share of the module's values", pad=0.01)
    return ax


_LABEL_POINTS = 7
_LABEL_CHARS = 34  # names shortened in the middle at dots: the cells keep most of the width
_ROW_INCHES = 0.2  # 14.4 pt a row: a 7 pt label with room to spare
_HEATMAP_MAX_ROWS = 60


def _rows_that_fit(ax: Axes) -> int:
    """How many 7 pt labels the Axes' height holds with a line's spacing between them."""
    inches = ax.get_position().height * ax.figure.get_figheight()
    return max(int(inches * 72 / (1.6 * _LABEL_POINTS)), 1)


# -- what-if curve -----------------------------------------------------------------------
def plot_what_if(
    report: Report | Any,
    format: str | Format = "fp16",
    *,
    recommendation: Recommendation | None = None,
    kind: str = ACTIVATION_GRAD,
    ax: Axes | None = None,
) -> Axes:
    """Draw the flushed share and the overflowing steps against log2 S.

    ``report`` is a Report or a WhatIfTable. For a Report, ``fp16probe.analysis`` computes
    both curves: the flushed share of ``kind``, and the overflowing steps of every gradient
    the loss scale multiplies, as the analysis judges overflow, so the curve's first
    overflowing S is the recommendation's limit (drawn dashed). The recommended log2 S is a
    solid line; the overflow steps use the right-hand axis; the legend sits below the plot.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    if isinstance(report, Report):
        table = what_if(report, fmt, kind=kind, modules=False)
        recommendation = _recommendation(report, recommendation, fmt)
    else:
        table = report
    rows = list(table.rows)
    ax = _new_axes(ax, (8, 4.5))
    xs = [r.log2_scale for r in rows]
    flushed = [r.flushed_fraction for r in rows]
    ax.plot(xs, flushed, marker="o", ms=3, color=_MEASURED_COLOR, gid="what_if:flushed",
            label="flushed share of nonzero values")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(0, 1.5)
    ax.set_xlabel("log2 S (loss scale S = 2^k)")
    ax.set_ylabel("flushed to zero (symlog)")
    twin = ax.twinx()
    overflow = [r.overflow_steps for r in rows]
    twin.step(xs, overflow, where="mid", color=_SCALED_COLOR, gid="what_if:overflow",
              label="steps that overflow (any gradient)")
    twin.set_ylabel("steps with an overflow", color=_SCALED_COLOR)
    twin.set_ylim(0, max(max(overflow, default=0), 1) * 1.15)
    if recommendation is not None:
        threshold = recommendation.thresholds.get("max_flushed_fraction")
        if threshold is not None:
            ax.axhline(float(threshold), color="#777777", lw=0.8, ls=":", gid="threshold",
                       label=f"tolerated flushed share ({num.percent(float(threshold))})")
        k = recommendation.log2_scale
        if k is not None:
            ax.axvline(k, color="black", lw=1.5, gid="recommendation",
                       label=f"recommended: {_scale_label(k)} ({recommendation.verdict})")
        k_max = recommendation.evidence.get("largest_safe_log2_scale")
        if k_max is not None:
            ax.axvline(k_max + 1, color=_SCALED_COLOR, lw=1.0, ls="--", gid="limit",
                       label=f"first overflowing S per the analysis: 2^{k_max + 1}")
    handles = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper center",
              bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7.5, frameon=False)
    ax.set_title(f"what if: {fmt.name} at S = 2^k ({kind.replace('_', ' ')})")
    return ax


# -- scale timeline ----------------------------------------------------------------------
def plot_scale_timeline(
    report: Report,
    format: str | Format = "fp16",
    *,
    recommendation: Recommendation | None = None,
    kind: str = ACTIVATION_GRAD,
    horizon: int | None = None,
    seed: int = 0,
    ax: Axes | None = None,
) -> Axes:
    """Draw the replayed loss scale per step, recommended schedule beside GradScaler's default.

    Both schedules are replayed by ``fp16probe.analysis.replay.simulate``, which draws the
    report's profiled steps at random for ``horizon`` steps (its default when None);
    skipped steps (an overflow threw the step away) are marked with crosses.
    A scale the run itself recorded (it had a GradScaler) is drawn too.
    """
    from fp16probe.analysis.replay import simulate

    fmt = format if isinstance(format, Format) else get_format(format)
    recommendation = _recommendation(report, recommendation, fmt)
    ax = _new_axes(ax, (8, 4.5))
    n = len(report.trace)
    horizon_kw = {} if horizon is None else {"horizon": horizon}
    schedules: list[tuple[str, Mapping[str, Any], str]] = []
    kwargs = {} if recommendation is None else dict(recommendation.grad_scaler_kwargs)
    if kwargs:
        schedules.append(("recommended", kwargs, _SCALED_COLOR))
    schedules.append(("GradScaler default", dict(GRADSCALER_DEFAULTS), "#555555"))
    for label, kw, color in schedules:
        result = simulate(report.trace, fmt, kw, seed=seed, kind=kind, **horizon_kw)
        scales = np.asarray(result.scales, dtype=np.float64)
        steps = np.arange(len(scales))
        skipped = np.asarray(result.skipped, dtype=bool)
        ax.step(steps, scales, where="post", color=color, lw=1.6, gid=f"timeline:{label}",
                label=f"{label}: {_kwargs_label(kw)} ({int(skipped.sum())} skipped)")
        if skipped.any():
            ax.plot(steps[skipped], scales[skipped], "x", color=color, ms=7, mew=1.5,
                    gid=f"skipped:{label}", label=f"{label}: skipped step")
    measured = [s for s in report.trace.scale if s is not None]
    if measured and len(measured) == n:
        ax.step(np.arange(n), measured, where="post", color="#888888", ls=":",
                gid="timeline:recorded", label="scale the run recorded")
    if not kwargs:
        verdict = "no recommendation" if recommendation is None else recommendation.verdict
        ax.text(0.02, 0.04, f"verdict {verdict}: no scaler to replay", transform=ax.transAxes,
                fontsize=8, gid="annotation:no_schedule")
    ax.set_yscale("log", base=2)
    # A short growth_interval changes the scale every few steps: over the whole horizon the
    # line is a solid block. Show about 20 of the shortest schedule's growth cycles.
    intervals = [int(kw.get("growth_interval") or 0) for _l, kw, _c in schedules]
    total = len(result.scales)
    window = min(total, max(20 * min(i for i in intervals if i > 0), 200)) if any(intervals) else total
    ax.set_xlim(-0.01 * window, window)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(_steps_label))
    shown = "" if window >= total else f"first {window:,} of {total:,} "
    ax.set_xlabel(f"simulated step ({shown}steps; the {n} profiled steps drawn at random, seed {seed})")
    ax.set_ylabel("loss scale")
    ax.set_title(f"loss scale per step in {fmt.name}: recommended vs GradScaler's default")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7.5, frameon=False)
    return ax


def plot_trial(report: Report, *, ax: Axes | None = None) -> Axes:
    """Draw the training trial's loss curves (``report.section("trial")``): fp32's seeds, the low-precision
    seeds, and the top of fp32's seed band over the steps it averages."""
    from fp16probe.analysis.trial import judge_curves
    from fp16probe.sections import Trial

    ax = _new_axes(ax, (8, 4.5))
    t = report.section("trial")
    if not isinstance(t, Trial) or t.off is not None or not t.fp32:
        ax.text(0.5, 0.5, "no training trial in this report (profile --trial STEPS)", ha="center",
                transform=ax.transAxes, gid="annotation:no_trial")
        ax.set_axis_off()
        return ax
    fmt = _literal(t.format)
    for seed, curve in zip(t.seeds, t.fp32):
        ax.plot(np.arange(1, len(curve) + 1), curve, color=_MEASURED_COLOR, lw=1.2, alpha=0.8,
                gid=f"trial:fp32:{seed}", label="fp32" if seed == t.seeds[0] else None)
    for seed, curve in zip(t.seeds, t.low):
        ax.plot(np.arange(1, len(curve) + 1), curve, color=_SCALED_COLOR, lw=1.2, alpha=0.8, ls="--",
                gid=f"trial:low:{seed}", label=fmt if seed == t.seeds[0] else None)
    band = judge_curves(t.fp32, t.low)
    if math.isfinite(band.high):
        ax.hlines(band.high, t.steps - band.last + 1, t.steps, color="#555555", lw=2, gid="trial:band",
                  label=f"top of fp32's seed band (last {band.last} steps)")
    ax.set_xlabel(f"optimizer step ({len(t.seeds)} data orders each)")
    ax.set_ylabel("training loss")
    ax.set_title(f"training trial: {fmt} {'inside' if band.inside else 'outside'} fp32's seed band")
    ax.legend(fontsize=8, frameon=False)
    return ax


def _steps_label(x: float, _pos: int) -> str:
    """A step count that stays short on a tick: 2500, 12.5k, 1.2M."""
    if abs(x) >= 1e6:
        return f"{x / 1e6:g}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:g}k"
    return f"{x:g}"


def _kwargs_label(kw: Mapping[str, Any]) -> str:
    init = kw.get("init_scale")
    init_s = f"2^{math.log2(init):g}" if init and init > 0 and math.log2(init).is_integer() else f"{init}"
    return (f"init {init_s}, x{kw.get('growth_factor', '?')} every {kw.get('growth_interval', '?')}, "
            f"x{kw.get('backoff_factor', '?')} on overflow")


# -- figures and files -------------------------------------------------------------------
def figure(
    report: Report,
    *,
    which: str = "all",
    recommendation: Recommendation | None = None,
    format: str | Format = "fp16",
    kind: str = ACTIVATION_GRAD,
) -> Figure:
    """Return a Figure with one view (``distribution``, ``heatmap``, ``what_if``,
    ``timeline``, ``trial``) or ``all`` of them in a 2x2 grid (a third row for a training trial's curves)."""
    if which not in FIGURE_KINDS:
        raise Fp16ProbeError(f"unknown figure {which!r}: expected one of {', '.join(FIGURE_KINDS)}")
    fmt = format if isinstance(format, Format) else get_format(format)
    recommendation = _recommendation(report, recommendation, fmt)
    draw = {
        "distribution": lambda ax: plot_distribution(report, fmt, recommendation=recommendation,
                                                     kind=kind, ax=ax),
        "heatmap": lambda ax: plot_module_heatmap(report, fmt, kind=kind, ax=ax),
        "what_if": lambda ax: plot_what_if(report, fmt, recommendation=recommendation, kind=kind, ax=ax),
        "timeline": lambda ax: plot_scale_timeline(report, fmt, recommendation=recommendation,
                                                   kind=kind, ax=ax),
        "trial": lambda ax: plot_trial(report, ax=ax),
    }
    if which != "all":
        fig = Figure(figsize=(9, 5), layout="constrained")
        draw[which](fig.add_subplot())
    else:
        trial = report.section("trial") is not None  # a trial's curves take a third row
        fig = Figure(figsize=(17, 16 if trial else 11), layout="constrained")
        grid = fig.add_gridspec(3 if trial else 2, 2)
        axes = [fig.add_subplot(grid[i // 2, i % 2]) for i in range(4)]
        for name, ax in zip(("distribution", "heatmap", "what_if", "timeline"), axes):
            draw[name](ax)
        if trial:
            draw["trial"](fig.add_subplot(grid[2, :]))
        fig.suptitle(_literal(f"fp16probe: {report.metadata.model_class}, {report.metadata.steps_seen} "
                              f"steps, target {fmt.name}"))
    if recommendation is not None and recommendation.caveats:
        chars = int(fig.get_figwidth() * 14)  # about 8 pt text across the figure
        lines = [line for c in recommendation.caveats for line in wrap_text(f"caveat: {c}", chars)]
        fig.supxlabel("\n".join(_literal(line) for line in lines), fontsize=8, color="#8a4b00", gid="caveats")
    return fig


def check_figure_path(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path if its extension is one save_figures can write, else raise."""
    path = Path(path)
    if path.suffix.lower() not in _SAVE_EXTENSIONS:
        raise Fp16ProbeError(
            f"cannot write figures to {str(path)!r}: expected a file name ending in "
            f"{', '.join(_SAVE_EXTENSIONS)}; pick one of those extensions"
        )
    return path


def save_figures(
    report: Report,
    path: str | os.PathLike[str],
    recommendation: Recommendation | None = None,
    format: str | Format = "fp16",
    *,
    kind: str = ACTIVATION_GRAD,
    dpi: int = 120,
) -> Path:
    """Write every view of the report into one file; PNG, SVG or PDF by the extension.

    The file is written whole or not at all: drawn into a temporary file in the same folder,
    then renamed over ``path``, so a full disk or a crash leaves an old figure intact.
    """
    path = check_figure_path(path)
    fig = figure(report, which="all", recommendation=recommendation, format=format, kind=kind)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=path.suffix[1:].lower())
    atomic_write_text(path, buf.getvalue())  # a full disk or a crash leaves an old figure whole
    return path
