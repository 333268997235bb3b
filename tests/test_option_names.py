"""One name per concept across commands: every output file is --out (-o); plot's old --output is
still taken, hidden from --help."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from fp16probe.cli import app
from tests.fixtures.reports import hand_report


def _options() -> dict[str, dict[str, object]]:
    group = typer.main.get_command(app)
    return {name: {o: p for p in cmd.params for o in p.opts if p.param_type_name == "option"}
            for name, cmd in group.commands.items()}


def test_every_command_that_writes_one_file_calls_it_out():
    options = _options()
    for command in ("profile", "plot"):
        assert "--out" in options[command] and "-o" in options[command], command
    assert all("--output" not in opts or opts["--output"].hidden for opts in options.values())


@pytest.mark.parametrize("flag", ["--out", "-o", "--output"])
def test_plot_takes_out_and_its_old_name(tmp_path, flag):
    report = tmp_path / "r.json"
    hand_report().save(report)
    result = CliRunner().invoke(app, ["plot", str(report), flag, str(tmp_path / "fig.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_plot_refuses_two_names_for_two_files_and_none(tmp_path):
    report = tmp_path / "r.json"
    hand_report().save(report)
    both = CliRunner().invoke(app, ["plot", str(report), "--out", "a.png", "--output", "b.png"])
    assert both.exit_code == 2 and both.output.count("\n") == 1 and "give one" in both.output
    none = CliRunner().invoke(app, ["plot", str(report)])
    assert none.exit_code == 2 and "--out FILE" in none.output
    assert "--output" not in CliRunner().invoke(app, ["plot", "--help"]).output
