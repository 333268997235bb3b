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


def test_dry_run_with_the_300_s_budget_writes_figures_and_skips_only_the_cuda_parts(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--budget", "300", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    status = {name: part["status"] for name, part in got["parts"].items()}
    assert status == {"sync": "skipped", "engine": "ok", "amp": "ok", "overhead": "ok", "forward_headroom": "ok", "shadow_step": "ok",
                      "autocast_ops": "ok", "emulation": "ok", "verify": "skipped", "pytest": "skipped",
                      "bench": "skipped"}
    assert got["dry_run"] is True and "cpu" in got["device"] and got["budget_s"] == 300
    parts = got["parts"]
    assert all(all(v.values()) for k, v in parts["engine"]["cases"].items())
    assert "many_at_once_scaled" in parts["engine"]["cases"]
    assert parts["amp"]["mismatched"] == [] and parts["amp"]["precision"] == "fp16-autocast"
    # the sync loop itself ran (on the CPU, without the debug mode): it reaches the ceiling's fold
    assert parts["sync"]["ceiling_folds_in_backward"] > 0 and parts["sync"]["hook_errors"] == 0
    assert parts["sync"]["replayed_forwards"] == 1
    over = parts["overhead"]
    assert set(over["ratio_to_plain"]) == {"one_read_limit", "probe_every1", "probe_every10"}
    assert all(r > 0 for r in over["ratio_to_plain"].values()) and over["clock"] == "wall time (dry run)"
    assert all("budget_s" in p for p in parts.values() if p["status"] != "skipped")
    assert parts["forward_headroom"]["probe_with_forward_over_without"] > 0
    shadow = parts["shadow_step"]  # one fp32 rerun in each timed round with shadows, none without
    assert shadow["timed_shadowed_steps"] == 1 and shadow["probe_with_shadow_over_without"] > 0
    assert parts["autocast_ops"]["device"] == "cpu" and parts["autocast_ops"]["checked"] > 0
    emulation = parts["emulation"]  # on the CPU: against CPU autocast
    assert set(emulation["models"]) == {"conv", "transformer", "mlp-200", "demo"}
    # values within 0.1%, where the CPU's kernels do not round partial sums (bench/emulation.py: then error sizes)
    assert all(m["status"] == "ok" and m["cost"]["ratio"] > 0 for m in emulation["models"].values())
    assert all(m["emulated_vs_real"] <= 1e-3 for m in emulation["models"].values() if m["values_compared"])


def test_a_part_over_its_budget_is_killed_and_recorded(tmp_path):
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--dry-run", "--isolate", "--only", "engine", "--part-budget", "engine=0.05",
                           "--out", str(out)])
    got = json.loads(out.read_text())
    assert code == 1 and got["parts"]["engine"]["status"] == "timed_out"
    assert got["parts"]["engine"]["seconds"] < 30


def test_the_slow_bench_part_runs_the_benchmark(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK", bench.Sizes(**(bench.QUICK.__dict__ | {"step_rounds": 1, "engine_rounds": 1,
                                                                              "models": ("conv",)})))
    got = gpu_check.check_bench("cpu", tmp_path, dry_run=True)
    assert got["status"] == "ok" and "LIMIT 1-read" in got["table"]


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
