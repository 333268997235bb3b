"""matplotlib is the plot extra's: without it the text answer works, and every way to draw
asks for the extra in one line (exit 2 on the command line), before any work."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fp16probe.presentation
from fp16probe.cli import app
from fp16probe.errors import MissingExtraError
from tests.fixtures.reports import hand_report

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_matplotlib(monkeypatch, tmp_path):
    """matplotlib as if not installed: its import fails, and figures must import it again."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "fp16probe.presentation.figures", raising=False)
    monkeypatch.delattr(fp16probe.presentation, "figures", raising=False)  # `from ... import figures` reads it
    monkeypatch.chdir(tmp_path)
    hand_report().save(tmp_path / "r.json")
    return tmp_path


def test_the_base_install_leaves_matplotlib_to_the_plot_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["plot"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["dev"])


def test_without_matplotlib_the_answer_works_and_drawing_asks_for_the_extra(no_matplotlib):
    runner = CliRunner()
    for args in (["show", "r.json"], ["recommend", "r.json"]):
        assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, ["plot", "r.json", "--out", "fig.png"])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "pip install 'fp16probe[plot]'" in result.output
    assert not (no_matplotlib / "fig.png").exists()
    result = runner.invoke(app, ["profile", "--steps", "1", "--plot", "fig.png", "--out", "p.json"])
    assert result.exit_code == 2 and "fp16probe[plot]" in result.output
    assert not (no_matplotlib / "p.json").exists()  # refused before the run
    report = hand_report()
    with pytest.raises(MissingExtraError, match=r"fp16probe\[plot\]"):
        report.plot()
    from fp16probe.presentation.html import report_html

    assert "fp16probe[plot]" in report_html(report, "fp16")
