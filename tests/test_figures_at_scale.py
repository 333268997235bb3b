"""Figures of a ConvNeXt-sized report (220 modules, long names) that hold up: nothing clipped,
no annotation over the ticks, tick labels apart, names shortened, a timeline that can be read.

Checked with the artists' own extents (``get_window_extent`` after a draw), not by eye alone.
"""

from __future__ import annotations

import torch

from fp16probe.analysis.recommend import analyze
from fp16probe.presentation import figures
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD, Histogram, Metadata, ModuleStats, Report, StepTrace

PARTS = ("dwconv", "layernorm", "pwconv1", "act", "pwconv2", "drop_path")


def convnext_sized_report(steps: int = 6) -> Report:
    """220 modules named as ConvNeXt's are, their gradients spread from 2^-50 to 2^10."""
    modules, names = [], []
    for s, depth in enumerate((3, 3, 27, 3)):
        for layer in range(depth):
            for part in PARTS:
                names.append(f"convnext.encoder.stages.{s}.layers.{layer}.{part}")
    names = names[:220]
    per_module = []
    for i, name in enumerate(names):
        top = -8 - (i % 30)  # deeper modules sit lower, some far below fp16's range
        bins = {top - j: 40 + 10 * j for j in range(12)}
        h = Histogram.from_values({e: c * steps for e, c in bins.items()}, zero=5 * steps)
        per_module.append(Histogram.from_values(bins, zero=5))
        modules.append(ModuleStats(name, ACTIVATION_GRAD, "Linear", i, h))
    big = Histogram.from_values({10: 1})  # one large gradient: the ceiling, 2^10
    modules.append(ModuleStats("classifier.weight", WEIGHT_GRAD, "Linear", len(names), big))
    step = Histogram.sum(per_module)
    trace = StepTrace(
        steps=tuple(range(steps)),
        histograms={ACTIVATION_GRAD: (step,) * steps, WEIGHT_GRAD: (Histogram.from_values({10: 1}),) * steps},
        module_max={}, scale=(None,) * steps, found_inf=(False,) * steps, ceiling=(2.0**10,) * steps)
    meta = Metadata(fp16probe_version="test", torch_version=torch.__version__, device="cpu",
                    model_class="ConvNextForImageClassification", steps_seen=steps, steps_total=steps,
                    captured=(ACTIVATION_GRAD, WEIGHT_GRAD), hooked_modules=tuple(names))
    report = Report(metadata=meta, modules=tuple(modules), trace=trace)
    # growth_interval=100: the schedule that drew a solid red block over 20,000 steps
    return report.with_recommendation(analyze(report, "fp16", growth_intervals=(100,)))


def _extent(artist, renderer):
    return artist.get_window_extent(renderer)


def test_the_figures_of_a_200_module_report_hold_up(tmp_path):
    report = convnext_sized_report()
    assert report.recommendation.grad_scaler_kwargs["growth_interval"] == 100
    fig = figures.figure(report, recommendation=report.recommendation, format="fp16", kind="all")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    page = fig.bbox
    dist, heat, what_if, timeline = fig.axes[:4]
    for ax in (dist, heat, what_if, timeline):
        labels = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
        boxes = sorted((_extent(t, renderer) for t in labels), key=lambda b: b.x0)
        for a, b in zip(boxes, boxes[1:]):
            assert a.x1 <= b.x0, f"{ax.get_title()}: x tick labels collide"
        legend = ax.get_legend()
        if legend is not None:
            box = _extent(legend, renderer)
            assert page.x0 <= box.x0 and box.x1 <= page.x1, f"{ax.get_title()}: legend clipped"
    # the distribution: annotations inside the axes, over no tick label; region names whole
    ticks = [_extent(t, renderer) for t in dist.get_yticklabels() if t.get_text()]
    frame = dist.get_window_extent(renderer)
    for text in dist.texts:
        box = _extent(text, renderer)
        if (text.get_gid() or "").startswith(("annotation:", "region-label:")):
            assert frame.x0 <= box.x0 and box.x1 <= frame.x1 + 1, f"{text.get_gid()} leaves the axes"
            assert frame.y0 <= box.y0 and box.y1 <= frame.y1 + 1, f"{text.get_gid()} leaves the axes"
            assert not any(box.overlaps(t) for t in ticks), f"{text.get_gid()} covers a tick label"
    # the heatmap: names shortened in the middle, and the cells keep most of the width
    names = [t.get_text() for t in heat.get_yticklabels()]
    assert names and all("…" in n or len(n) <= 60 for n in names)
    labels_width = max(_extent(t, renderer).width for t in heat.get_yticklabels())
    assert heat.get_window_extent(renderer).width > 1.5 * labels_width
    # the timeline: the window shows whole growth cycles, a few pixels apart, not a block
    lo, hi = timeline.get_xlim()
    (line,) = [ln for ln in timeline.lines if ln.get_gid() == "timeline:recommended"]
    ys = line.get_ydata()
    changes = sum(1 for i in range(1, min(len(ys), int(hi) + 1)) if ys[i] != ys[i - 1])
    pixels = timeline.get_window_extent(renderer).width
    assert 0 < changes and pixels / changes >= 4, f"{changes} scale changes in {pixels:.0f} px"
    path = tmp_path / "convnext.png"
    figures.save_figures(report, path, report.recommendation, "fp16", kind="all")
    assert path.stat().st_size > 10_000
