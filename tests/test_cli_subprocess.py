"""The real entry point in a fresh interpreter: ``python -m fp16probe`` for each MODEL kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"

pytestmark = pytest.mark.slow  # each call starts an interpreter and imports torch


def fp16probe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(FIXTURES)])
    env["NO_COLOR"] = "1"
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run([sys.executable, "-m", "fp16probe", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_demo_then_show_recommend_compare(tmp_path):
    """The README's first command, then the other commands on its report (show: see test_cli)."""
    run = fp16probe("profile", "--steps", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    report = tmp_path / "fp16probe-report.json"
    assert json.loads(report.read_text())["metadata"]["model_class"] == "DemoNet"
    rec = fp16probe("recommend", report, "--json", cwd=tmp_path)
    assert rec.returncode == 0
    assert json.loads(rec.stdout)["grad_scaler_code"].startswith("scaler = torch.amp.GradScaler(")
    assert fp16probe("compare", report, report, cwd=tmp_path).returncode == 0


def test_import_string_with_weights_and_json(tmp_path):
    sys.path.insert(0, str(FIXTURES))
    try:
        from cli_models import TinyMLP as Tiny
    finally:
        sys.path.remove(str(FIXTURES))
    torch.save(Tiny().state_dict(), tmp_path / "w.pt")
    run = fp16probe("profile", "cli_models:TinyMLP", "--weights", "w.pt", "--input-shape", "4,8",
                    "--steps", "2", "--json", "--out", "r.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["workload"]["weights"] == "w.pt"


def test_export_archive_and_pickle_refusal(tmp_path):
    sys.path.insert(0, str(FIXTURES))
    try:
        from cli_models import TinyMLP
    finally:
        sys.path.remove(str(FIXTURES))
    torch.export.save(torch.export.export(TinyMLP(), (torch.randn(2, 8),)), str(tmp_path / "m.pt2"))
    run = fp16probe("profile", "m.pt2", "--steps", "1", "--out", "r.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # A truncated archive: torch.export.load logs a whole traceback before it raises.
    (tmp_path / "cut.pt2").write_bytes((tmp_path / "m.pt2").read_bytes()[:1000])
    cut = fp16probe("profile", "cut.pt2", "--steps", "1", "--out", "c.json", cwd=tmp_path)
    assert cut.returncode == 3
    assert cut.stderr.count("\n") == 1 and cut.stderr.startswith("error: MODEL cut.pt2: cannot read it")
    torch.save(TinyMLP(), tmp_path / "whole.pt")
    refused = fp16probe("profile", "whole.pt", "--input-shape", "2,8", cwd=tmp_path)
    assert refused.returncode == 3
    assert refused.stderr.count("\n") == 1 and "--trust-checkpoint" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_huggingface_gpt2_folder(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=101, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    run = fp16probe("profile", "gpt2", "--steps", "1", "--out", "r.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    extra = json.loads((tmp_path / "r.json").read_text())["workload"]
    assert "token ids in [0, 101)" in extra["inputs"]
    assert extra["loss"].startswith("the model's own loss: cross-entropy of each next token")
    assert extra["family"] == "causal_lm" and extra["loss_synthetic"] is True


def test_bad_usage_exit_2(tmp_path):
    run = fp16probe("show", "missing.json", cwd=tmp_path)
    assert run.returncode == 2
    assert "missing.json" in run.stderr
