"""The composite action in .github/actions/fp16probe-gate runs as GitHub would run it.

A small runner executes the action's ``run`` steps with bash (``-eo pipefail``, as GitHub
does), resolving ``${{ inputs.* }}`` and ``${{ steps.*.outputs.* }}`` and honouring the
two conditions the action uses; ``uses`` steps (the artifact upload) are recorded, with
the files they would upload. The ``fp16probe`` it calls is this checkout's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fp16probe.cli import EXIT_OK, app

ROOT = Path(__file__).resolve().parents[1]
ACTION = ROOT / ".github" / "actions" / "fp16probe-gate" / "action.yml"
FIXTURES = Path(__file__).parent / "fixtures"
PROFILE = "--batches cli_models:tiny_batches --steps 2 --loss cli_models:{loss}"


def run_action(inputs: dict[str, str], cwd: Path) -> dict:
    action = yaml.safe_load(ACTION.read_text(encoding="utf-8"))
    assert action["runs"]["using"] == "composite"
    values = {name: str(spec.get("default", "")) for name, spec in action["inputs"].items()}
    unknown = set(inputs) - set(values)
    assert not unknown, f"the action has no inputs {unknown}"
    values.update(inputs)
    missing = [n for n, spec in action["inputs"].items() if spec.get("required") and not values[n]]
    assert not missing, missing

    shim = cwd / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "fp16probe").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fp16probe "$@"\n')
    (shim / "fp16probe").chmod(0o755)
    summary = cwd / "step_summary.md"
    base_env = {
        **os.environ,
        "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(FIXTURES), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "GITHUB_ACTIONS": "true",
        "GITHUB_STEP_SUMMARY": str(summary),
        "NO_COLOR": "1",
    }
    outputs: dict[str, dict[str, str]] = {}
    uploads, log = [], []
    failed = False

    def resolve(text: str) -> str:
        def one(m: re.Match) -> str:
            expr = m.group(1).strip()
            if expr.startswith("inputs."):
                return values[expr[len("inputs."):]]
            step, _, key = expr[len("steps."):].partition(".outputs.")
            return outputs.get(step, {}).get(key, "")
        return re.sub(r"\$\{\{(.*?)\}\}", one, str(text))

    for step in action["runs"]["steps"]:
        cond = step.get("if")
        if cond == "always()":
            pass
        elif cond == "inputs.install != ''":
            if failed or values["install"] == "":
                continue
        elif cond is None:
            if failed:
                continue
        else:
            raise AssertionError(f"the test runner does not know the condition {cond!r}")
        if "uses" in step:
            assert step["uses"].startswith("actions/upload-artifact@")
            folder = cwd / resolve(step["with"]["path"])
            uploads.append(sorted(p.name for p in folder.iterdir()) if folder.is_dir() else [])
            continue
        gh_output = cwd / "github_output"
        gh_output.write_text("")
        env = {**base_env, "GITHUB_OUTPUT": str(gh_output),
               **{k: resolve(v) for k, v in step.get("env", {}).items()}}
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", resolve(step["run"])],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        log.append((step["name"], proc.returncode, proc.stdout, proc.stderr))
        if "id" in step:
            outputs[step["id"]] = dict(line.split("=", 1) for line in gh_output.read_text().splitlines() if "=" in line)
        failed = failed or proc.returncode != 0
    return {"failed": failed, "log": log, "uploads": uploads, "outputs": outputs,
            "summary": summary.read_text() if summary.exists() else ""}


@pytest.fixture
def baseline(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    path = tmp_path / "baseline.json"
    args = ["profile", "cli_models:TinyMLP", *PROFILE.format(loss="mse_loss").split(), "--out", str(path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_OK, result.output
    return path


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
def test_action_passes_an_equal_run_and_uploads_everything(tmp_path, baseline):
    run = run_action({"baseline": str(baseline), "model": "cli_models:TinyMLP", "install": "",
                      "profile-args": PROFILE.format(loss="mse_loss")}, tmp_path)
    assert not run["failed"], run["log"]
    assert run["outputs"]["compare"]["code"] == "0"
    assert run["uploads"] == [["current.json", "figures.png", "junit.xml"]]
    assert "fp16probe compare: passed" in run["summary"] and run["summary"].endswith("\n\n")
    root = ET.parse(tmp_path / "fp16probe-gate" / "junit.xml").getroot()
    assert root.tag == "testsuites" and root.get("failures") == "0"


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
def test_action_fails_a_regression_after_uploading(tmp_path, baseline):
    run = run_action({"baseline": str(baseline), "model": "cli_models:TinyMLP", "install": "",
                      "profile-args": PROFILE.format(loss="small_loss")}, tmp_path)
    assert run["failed"]
    assert run["outputs"]["compare"]["code"] == "1"
    names = [name for name, *_ in run["log"]]
    assert names[-1] == "Fail on a regression" and run["log"][-1][1] == 1
    assert run["uploads"] == [["current.json", "figures.png", "junit.xml"]]  # uploaded before the job failed
    compare_out = next(out for name, _, out, _ in run["log"] if name == "Compare against the baseline")
    assert "::error title=fp16probe compare%3A " in compare_out
    assert "::warning" in compare_out and "different loss" in compare_out
    assert "FAILED" in run["summary"]


def test_readme_documents_the_action():
    # The README leads with a pointer; the user guide holds the action's documentation.
    assert "docs/user-guide.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    readme = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    assert "uses: ./.github/actions/fp16probe-gate" in readme
    action = yaml.safe_load(ACTION.read_text(encoding="utf-8"))
    for name in action["inputs"]:
        assert f"`{name}`" in readme, name
