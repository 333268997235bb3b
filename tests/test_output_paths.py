"""Two outputs on one path are refused before any work; summaries appended at once are all kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp16probe.cli import EXIT_USAGE
from tests.fixtures.cli import one_error_line, prepare_cli_env, run

DEMO = Path(__file__).parent / "data" / "report-v1-demo.json"


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)


@pytest.mark.parametrize("out,plot", [("x.png", "x.png"), ("x.svg", "./sub/../x.svg")])
def test_profile_refuses_the_figure_on_the_reports_path(out, plot):
    result = run("profile", "--steps", "1", "--out", out, "--plot", plot)
    assert result.exit_code == EXIT_USAGE, result.output
    line = one_error_line(result)
    assert "--plot" in line and "--out" in line
    assert not Path(out).exists()


def test_compare_refuses_the_summary_on_the_junit_path():
    result = run("compare", DEMO, DEMO, "--summary", "ci.txt", "--junit", "ci.txt")
    assert result.exit_code == EXIT_USAGE, result.output
    assert "--junit" in one_error_line(result)
    assert not Path("ci.txt").exists()


_APPENDER = """
import sys, time
from fp16probe.report import append_text
start, name = float(sys.argv[1]), sys.argv[2]
time.sleep(max(0.0, start - time.time()))
for i in range(40):
    append_text("summary.md", f"{name} {i}\\n")
"""


@pytest.mark.slow
def test_four_processes_appending_at_once_keep_every_summary(tmp_path):
    """Four real processes append 40 summaries each to one file, starting at the same moment: all 160 are kept.
    Before, each append read the file, added to it and renamed a copy over it, and concurrent ones lost lines."""
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    start = time.time() + 8  # every process imported and waiting by then, on a loaded machine too
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, str(start), f"p{k}"], cwd=tmp_path, env=env)
             for k in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert sorted(lines) == sorted(f"p{k} {i}" for k in range(4) for i in range(40))
    assert list(tmp_path.iterdir()) == [tmp_path / "summary.md"]  # no lock file left behind
