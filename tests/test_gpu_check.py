"""The prepared GPU check runs its CPU-safe parts here, as a dry run, so it cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpu_check  # noqa: E402
from bench import run as bench  # noqa: E402


def test_dry_run_writes_figures_and_skips_only_the_cuda_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK", bench.Sizes(**(bench.QUICK.__dict__ | {"step_rounds": 1, "engine_rounds": 1,
                                                                              "models": ("conv",)})))
    out = tmp_path / "gpu_check.json"
    # --verify is left out here (a full profile run; the CLI tests cover it) and checked by its flags below.
    assert gpu_check.main(["--dry-run", "--out", str(out), "--skip", "verify"]) == 0
    got = json.loads(out.read_text())
    status = {name: part["status"] for name, part in got["parts"].items()}
    assert status == {"sync": "skipped", "engine": "ok", "amp": "ok", "verify": "skipped", "pytest": "skipped",
                      "bench": "ok"}
    assert got["dry_run"] is True and "cpu" in got["device"]
    assert all(all(v.values()) for v in got["parts"]["engine"]["cases"].values())
    assert got["parts"]["amp"]["mismatched"] == [] and got["parts"]["amp"]["precision"] == "fp16-autocast"
    assert "LIMIT 1-read" in got["parts"]["bench"]["table"]


def test_a_wrong_count_fails_the_engine_part(monkeypatch):
    from fp16probe.capture import engine

    real = engine.count_into

    def off_by_one(x, counts, keys, row, **kw):  # only on the path under test, not the CPU reference
        real(x, counts, keys, row, **kw)
        if engine.CPU_ENGINE == "device":
            counts[row, 0] += 1

    monkeypatch.setattr(engine, "count_into", off_by_one)
    assert gpu_check.check_engine("cpu", 1 << 10)["status"] == "failed"


def test_the_verify_command_line_is_one_the_cli_accepts():
    from fp16probe.cli import app

    help_text = CliRunner().invoke(app, ["profile", "--help"], terminal_width=200).output
    for flag in ("--device", "--steps", "--verify", "--out", "--json"):
        assert flag in help_text


def test_without_a_gpu_the_real_run_refuses(monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert gpu_check.main(["--out", "/nonexistent/never-written.json"]) == 2
    assert "--dry-run" in capsys.readouterr().err
