"""Report and Recommendation display themselves in Jupyter (HTML) and in rich."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from fp16probe.presentation import notebook as display
from fp16probe.recommendation import Recommendation, Verdict
from fp16probe.report import ACTIVATION_GRAD, ModuleStats
from tests.fixtures.reports import hand_report

ROOT = Path(__file__).resolve().parents[1]

REC = Recommendation.from_dict({
    "verdict": "constant",
    "format": "fp16",
    "log2_scale": 5,
    "scale": 32.0,
    "grad_scaler_kwargs": {"init_scale": 32.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                           "growth_interval": 2000},
    "flushed_fraction_at_1": 0.25,
    "flushed_fraction_at_scale": 0.125,
    "overflow_steps_at_scale": 0,
    "headroom_bits": 1,
    "worst_modules": [["deep", 0.5]],
    "text": "a <constant> scale",
    "citations": ["arXiv:1710.03740"],
})


@pytest.fixture(scope="module")
def hand():
    return hand_report()


def _rich_text(renderable, width: int = 140) -> str:
    from rich.console import Console

    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_report_html_has_the_summary_numbers(hand):
    page = display.report_html(hand, recommendation=REC, figure=False)
    h = hand.histogram(ACTIVATION_GRAD)
    flushed = f"{100 * h.flushed('fp16') / h.nonzero_finite:.3g}%"
    zeros = f"{100 * h.zero / h.total:.3g}%"
    assert "HandBuilt" in page
    row = re.search(r"<tr><td>activation_grad</td>(.*?)</tr>", page).group(1)
    assert f"<td>{h.total:,}</td><td>{zeros}</td><td>{flushed}</td>" in row
    assert "<td>weight_grad</td>" in page


def test_report_html_ranks_the_worst_modules(hand):
    page = display.report_html(hand, recommendation=REC, figure=False)
    table = page.split("modules losing the most")[1]
    table = table.split("</table>")[0]
    deep = hand.module("deep").histogram
    assert f"<td>deep</td><td>Linear</td><td>{100 * deep.flushed('fp16') / deep.nonzero_finite:.3g}%</td>" in table
    # "mid" and "head" lie above 2^-25 and lose nothing: they are not listed
    assert "<td>mid</td>" not in table and "<td>head</td>" not in table


def test_report_html_shows_the_recommendation_and_the_figure(hand):
    page = display.report_html(hand, recommendation=REC)
    assert ">constant</span>" in page
    assert "2^5 = 32" in page
    assert "torch.amp.GradScaler(&quot;cuda&quot;, init_scale=32.0" in page
    assert "a &lt;constant&gt; scale" in page, "text is escaped"
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1)
    assert base64.b64decode(png).startswith(b"\x89PNG\r\n\x1a\n")


def test_module_names_are_escaped(hand):
    evil = replace(hand.modules[2], name="<script>alert(1)</script>")
    report = replace(hand, modules=(*hand.modules[:2], evil, *hand.modules[3:]))
    page = display.report_html(report, recommendation=REC, figure=False)
    assert "<script>" not in page
    assert "&lt;script&gt;" in page


def test_stored_recommendation_is_used(hand):
    page = hand.with_recommendation(REC)._repr_html_()
    assert ">constant</span>" in page


def test_recommendation_html_alone():
    page = display.recommendation_html(REC)
    assert "fp16probe recommendation" in page
    assert "12.5%" in page and "25%" in page
    assert "<li>arXiv:1710.03740</li>" in page


def test_none_needed_has_no_scaler_call():
    rec = replace(REC, verdict=Verdict.NONE_NEEDED, log2_scale=None, grad_scaler_kwargs={},
                  flushed_fraction_at_scale=None)
    page = display.recommendation_html(rec)
    assert "GradScaler(" not in page
    assert "no loss scaling needed" in page


def test_report_rich_renders_the_tables(hand):
    text = _rich_text(display.report_rich(hand, recommendation=REC))
    h = hand.histogram(ACTIVATION_GRAD)
    assert "fp16probe report: HandBuilt" in text
    assert f"{100 * h.flushed('fp16') / h.nonzero_finite:.3g}%" in text
    assert "deep" in text
    assert "2^5 = 32" in text
    assert 'torch.amp.GradScaler("cuda", init_scale=32.0' in text


def test_report_dunder_rich_is_the_renderer(hand):
    text = _rich_text(hand.with_recommendation(REC))
    assert "fp16probe report: HandBuilt" in text
    assert "constant" in text


@pytest.mark.slow
def test_importing_fp16probe_loads_neither_matplotlib_nor_rich():
    code = ("import sys, fp16probe, fp16probe.presentation.notebook; "
            "print('matplotlib' in sys.modules, 'rich' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_worst_modules_skips_modules_that_lose_nothing(hand):
    names = [n for n, _t, _f in display.worst_modules(hand, "fp16")]
    assert names == ["deep"]
    # in e4m3 (flushes at or below 2^-10) "mid" and "deep" lose everything, "head" half
    e4m3 = display.worst_modules(hand, "fp8_e4m3")
    assert [(n, f) for n, _t, f in e4m3] == [("mid", 1.0), ("deep", 1.0), ("head", 6 * 400 / (6 * 800 + 1))]
    extra = ModuleStats("silent", ACTIVATION_GRAD, "Linear", 9, hand.module("head").histogram)
    assert "silent" not in [n for n, _t, _f in display.worst_modules(replace(hand, modules=(*hand.modules, extra)))]


def test_recommendation_displays_itself(hand):
    from fp16probe.analysis.recommend import analyze

    rec = analyze(hand, "fp16")
    page = rec._repr_html_()
    assert f">{rec.verdict}</span>" in page
    assert f"{100 * rec.flushed_fraction_at_1:.3g}%" in page
    assert f"init_scale={display._number(rec.grad_scaler_kwargs['init_scale'])}" in page
    text = _rich_text(rec)
    assert rec.verdict in text and f"2^{rec.log2_scale}" in text


def test_report_html_runs_the_analyzer_when_none_is_stored(hand):
    from fp16probe.analysis.recommend import analyze

    rec = analyze(hand, "fp16")
    page = hand._repr_html_()
    assert f">{rec.verdict}</span>" in page
    assert f"2^{rec.log2_scale} = {2.0 ** rec.log2_scale:g}" in page


def test_long_module_names_fold_instead_of_being_cut(hand):
    """On a narrow or non-terminal console a truncated name ("encoder.layers.1…") no longer says which module."""
    from rich.console import Console

    from fp16probe.presentation import terminal as render

    name = "encoder.layers.11.attention.output.dense_projection"
    long = replace(hand.modules[2], name=name)
    report = replace(hand, modules=(*hand.modules[:2], long, *hand.modules[3:]))
    for renderable in (render._worst_table(report, ACTIVATION_GRAD, "fp16", 5, 10),
                       display.report_rich(report, recommendation=REC)):
        console = Console(record=True, width=60, color_system=None)
        console.print(renderable)
        text = console.export_text()
        # The folded pieces of the name, read down the first column, give it back whole.
        cells = [ln.split("│")[1].strip() for ln in text.splitlines() if ln.count("│") > 2]
        assert name in "".join(cells)
