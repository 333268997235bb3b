"""Every command's human output in an 80-column pipe (a CI log): no line wider than 80 but a
whole URL, and nothing cut to '…' (a number, a column header, a sentence)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from fp16probe.cli import app
from fp16probe.presentation.answer import stacked_table

WIDTH = 80
URL = re.compile(r"^\W*https?://\S+\W*$")


def _run(args: list[str], code: int | None = 0) -> str:
    """Run a command at 80 columns; ``code`` None allows 0 or 1 (a gate or a verification that did not hold)."""
    result = CliRunner().invoke(app, args, env={"COLUMNS": str(WIDTH), "NO_COLOR": "1"})
    assert result.exit_code in ((0, 1) if code is None else (code,)), result.output
    return result.output


def _fits(output: str) -> None:
    assert "…" not in output, output
    for line in output.splitlines():
        assert len(line) <= WIDTH or URL.match(line), f"{len(line)} columns: {line!r}"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Each command on small demo reports, as a user runs them in CI, and what it printed."""
    d = tmp_path_factory.mktemp("narrow")
    fp32, scaled, verified, mx = (str(d / n) for n in ("fp32.json", "scaled.json", "verified.json", "mx.json"))
    out = {
        "profile": _run(["profile", "--steps", "2", "--optimizer", "adam", "--out", fp32]),
        "profile fp16 scaled": _run(["profile", "--precision", "fp16", "--loss-scale", "1024", "--steps", "3",
                                     "--out", scaled]),
        "profile --explain --verify": _run(["profile", "--steps", "2", "--explain", "--verify", "--out", verified],
                                           code=None),
        "profile mxfp8": _run(["profile", "--steps", "2", "--format", "mxfp8_e4m3", "--out", mx]),
    }
    runs = {
        "show": ["show", fp32], "show --explain": ["show", fp32, "--explain"],
        "show verified": ["show", verified, "--explain"], "show bf16": ["show", fp32, "--format", "bf16"],
        "show mxfp8": ["show", mx],
        "recommend": ["recommend", fp32], "recommend --explain": ["recommend", fp32, "--explain"],
        "recommend scaled --explain": ["recommend", scaled, "--explain"],
        "schedule": ["schedule", fp32], "schedule scaled": ["schedule", scaled],
        "compare same": ["compare", fp32, fp32], "compare other": ["compare", fp32, scaled],
        "plot": ["plot", fp32, "--out", str(d / "fig.png")],
        "export": ["export", fp32, str(d / "tb")],
    }
    for name, args in runs.items():
        out[name] = _run(args, code=None)
    out["paths"] = {"fp32": fp32, "scaled": scaled}
    return out


@pytest.mark.parametrize("command", [
    "profile", "profile fp16 scaled", "profile --explain --verify", "profile mxfp8", "show", "show --explain",
    "show verified", "show bf16", "show mxfp8", "recommend", "recommend --explain", "recommend scaled --explain",
    "schedule", "schedule scaled", "compare same", "compare other", "plot", "export",
])
def test_every_command_fits_80_columns(outputs, command):
    _fits(outputs[command])


def test_the_schedule_shows_every_rule_s_figures_and_the_whole_check_line(outputs):
    text = outputs["schedule scaled"]
    assert "reproduce its recorded scale on every step and its skipped steps exactly" in " ".join(text.split())
    assert "1024" in text  # this run's settings' final scale, whole
    for header in ("skip", "recovery", "final S"):
        assert header in text


@pytest.mark.parametrize("columns", [99, 100, 119, 120, 160])
def test_the_schedule_table_is_drawn_whole_or_stacked_at_any_width(outputs, columns, tmp_path):
    from fp16probe.analysis.schedule import judge_schedules
    from fp16probe.presentation.terminal import Fitted, schedule_view
    from fp16probe.report import Report
    from rich.console import Console
    import io

    table = judge_schedules(Report.load(outputs["paths"]["scaled"]), "fp16")
    console = Console(width=columns, file=io.StringIO(), color_system=None)
    console.print(Fitted(lambda width: schedule_view(table, width)))
    text = console.file.getvalue()
    assert "…" not in text and max(len(line.rstrip()) for line in text.splitlines()) <= columns, text


def test_recommend_is_the_answer_and_the_paste_line_alone(outputs):
    lines = outputs["recommend"].splitlines()
    assert len(lines) <= 15, "\n".join(lines)
    assert any("GradScaler(" in line for line in lines)
    assert "quantity" not in outputs["recommend"]  # the evidence table waits for --explain
    explained = outputs["recommend --explain"]
    assert "quantity" in explained and "{'" not in explained  # the evidence, as words and numbers, no dict


def test_a_stacked_table_keeps_every_cell_whole_at_any_width():
    rows = [["a rather long rule name (hysteresis 2)", "12,345", "0.00245%", "not recovered", "1.311e+05"]]
    for width in (80, 40, 20):
        lines = stacked_table(["rule", "skipped", "mean", "recovery", "final S"], rows, width,
                              [("mean", "flushed share")])
        text = "\n".join(lines)
        for cell in rows[0][1:]:  # numbers whole on one line; a cell of words may wrap at its spaces
            assert cell in (text if cell[0].isdigit() else " ".join(text.split()))
        assert all(len(line) <= width for line in lines), text
