"""The command line when runs fail or are stopped: one line, a documented exit code, nothing collected lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp16probe.cli import EXIT_HANGUP, EXIT_INTERRUPTED, EXIT_LOAD, EXIT_TERMINATED, EXIT_USAGE
from fp16probe.report import Report
from tests.fixtures.cli import FIXTURES, one_error_line, prepare_cli_env, run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--input-shape", "5,8", "--steps", "2"]
REAL = ["--batches", "cli_models:tiny_batches", "--loss", "cli_models:mse_loss"]


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)



@pytest.mark.parametrize("args,expect", [
    (["--out", "/proc/fp16probe-r.json"], "error: --out /proc/fp16probe-r.json: cannot write there"),
    (["--precision", "fp16", "--loss-scale", "inf"], "error: --loss-scale inf: expected a finite positive"),
    (["--optimizer", "sgd", "--lr", "nan"], "error: --lr nan: expected a finite positive"),
    (["--optimizer", "sgd", "--lr", "-1"], "error: --lr -1.0: expected a finite positive"),
    (["--seed", str(2**70)], f"error: --seed {2**70}: expected a whole number in [0, 2**63)"),
    (["--input-shape", "100000,100000"], "error: --input-shape 100000,100000: one batch of 1e+10 float32 values"),
    (["--input-shape", f"{10**30},8"], f"error: --input-shape {10**30},8: one batch of 8e+30 float32 values"),
])
def test_what_can_be_checked_before_the_run_is(args, expect, monkeypatch):
    """One line, exit 2, and the run never started."""
    import fp16probe.running.profile as running_profile

    monkeypatch.setattr(running_profile, "run_profile", lambda *a, **k: pytest.fail("ran before checking"))
    base = ["cli_models:TinyMLP", "--input-shape", "5,8"]
    result = run("profile", *base, "--steps", "2", *args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith(expect)


@pytest.mark.parametrize("model,args,code,expect,steps_kept", [
    ("faulty_models:fails_at_step_3", REAL, EXIT_LOAD,
     "error: step 3: the forward raised RuntimeError: the model broke on purpose; the 2 step(s) before it", 2),
    ("faulty_models:KeyErrorModel", REAL, EXIT_LOAD, "error: step 1: the forward raised KeyError: 'gain'", None),
    ("faulty_models:BackwardFails", REAL, EXIT_LOAD,
     "error: step 1: the backward raised ValueError: backward broke on purpose", None),
    ("cli_models:TinyMLP", ["--batches", "faulty_models:failing_batches", "--loss", "cli_models:mse_loss"],
     EXIT_USAGE, "error: step 3: the batches raised OSError: the data file vanished; the 2 step(s) before it", 2),
    ("faulty_models:meta_model", TINY, EXIT_LOAD, "error: Linear has parameters on the meta device", None),
    ("faulty_models:exiting_factory", TINY, EXIT_LOAD, "error: user code called sys.exit(0)", None),
    ("faulty_models:exiting_model", REAL, EXIT_LOAD,
     "error: step 2: the forward called sys.exit(0); the 1 step(s) before it", 1),
])
def test_user_code_failing_is_the_models_fault_and_keeps_the_steps_before(model, args, code, expect, steps_kept):
    result = run("profile", model, *args, "--steps", "5", "--out", "r.json")
    assert result.exit_code == code, result.output
    assert one_error_line(result).startswith(expect)
    if steps_kept is None:
        assert not Path("r.json").exists()
    else:
        report = Report.load("r.json")
        assert report.metadata.partial and report.metadata.steps_seen == steps_kept
        assert report.metadata.extra["stopped"] == "error"


def test_a_model_that_removes_a_hooked_module_is_one_error_and_keeps_its_report():
    result = run("profile", "faulty_models:DropsLayer", "--input-shape", "5,8", "--steps", "4", "--out", "r.json")
    assert result.exit_code == EXIT_LOAD, result.output
    assert one_error_line(result).startswith("error: the model removed 1 hooked module(s) during the run ('a')")
    report = Report.load("r.json")
    assert report.capture.removed_modules == ("a",) and report.metadata.steps_seen == 4


@pytest.mark.parametrize("stop,code,what", [
    ("KeyboardInterrupt", EXIT_INTERRUPTED, "interrupted"),
    ("Terminated", EXIT_TERMINATED, "terminated (SIGTERM)"),
    ("Hangup", EXIT_HANGUP, "hung up (SIGHUP)"),
])
def test_a_stop_before_the_first_step_says_no_report_was_written(stop, code, what, tmp_path):
    module = f"stops_with_{stop.lower()}"  # one module per case: an import is cached for the session
    (tmp_path / f"{module}.py").write_text(f"from fp16probe.running.signals import Hangup, Terminated\n\n"
                                           f"def make():\n    raise {stop}()\n")
    result = run("profile", "cli_models:TinyMLP", "--batches", f"{module}:make", "--steps", "2", "--out", "r.json")
    assert result.exit_code == code, result.output
    assert one_error_line(result) == f"error: {what} before the first step finished; no report written"
    assert not Path("r.json").exists()


@pytest.mark.slow
def test_sigterm_writes_a_partial_report_and_exits_143(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(FIXTURES)]), NO_COLOR="1")
    proc = subprocess.run(
        [sys.executable, "-m", "fp16probe", "profile", "cli_models:TinyMLP", "--batches", "faulty_models:sigterm_batches",
         "--loss", "cli_models:mse_loss", "--steps", "5", "--out", "r.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_TERMINATED == 143, proc.stderr
    report = Report.load(tmp_path / "r.json")
    assert report.metadata.partial and report.metadata.steps_seen == 2
    assert report.metadata.extra["stopped"] == "terminated"


def test_plot_that_fails_mid_write_keeps_the_old_figure(monkeypatch):
    """A full disk while drawing: one line, exit 2, and the figure from before is untouched."""
    import errno

    from fp16probe.presentation import figures

    assert run("profile", "cli_models:TinyMLP", *TINY, "--out", "r.json").exit_code == 0
    assert run("plot", "r.json", "-o", "fig.png").exit_code == 0
    before = Path("fig.png").read_bytes()

    def full_disk(report, path, **kwargs):
        Path(path).write_bytes(before[:100])  # what a write cut short leaves behind
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(figures, "save_figures", full_disk)
    result = run("plot", "r.json", "-o", "fig.png")
    assert result.exit_code == EXIT_USAGE
    assert one_error_line(result).startswith("error: --out fig.png: cannot write it (No space left on device)")
    assert Path("fig.png").read_bytes() == before
    assert sorted(p.name for p in Path(".").iterdir()) == ["fig.png", "r.json"]
