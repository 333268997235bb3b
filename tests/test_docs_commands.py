"""Every command shown in README.md and docs/*.md works as shown, so the docs cannot go stale.

A command is a line in a fenced block (unlabelled, ``bash``, ``sh``, ``shell`` or ``console``)
that starts with ``fp16probe``, ``python``, ``torchrun`` or ``pip``. Runnable ones are run in
order, one temporary folder per file (a later command may read what an earlier one wrote),
with this checkout first on the path, and must exit 0. The others are checked as far as they
can be without running them: a usage line with placeholders (``MODEL``, ``REPORT``, ``[options]``,
``...``) names a real command and only options its ``--help`` lists; ``pip install`` names real
extras; a benchmark or the test suite itself names a file that exists. A new docs page is
picked up by the glob: nothing to register.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_COMMAND = re.compile(r"^(?:\$ )?((?:fp16probe|python|torchrun|pip) .*|fp16probe)$")
_PLACEHOLDER = re.compile(r"(?<![\w.-])(?:[A-Z][A-Z_]{2,}|T)(?![\w.-])|\[|\.\.\.")
_SHELLS = ("", "bash", "sh", "shell", "console")
_SLOW = ("bench/", "gpu_check")  # minutes, or a GPU: the benchmarks are smoke-tested elsewhere
_EXTRAS = {"--to wandb": "wandb", "--to mlflow": "mlflow", "export": "tensorboard"}


def commands(page: Path) -> list[str]:
    """The command lines of a page's shell blocks, in order (a trailing comment dropped)."""
    found, lang = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            lang = line[3:].strip() if lang is None else None
            continue
        if lang in _SHELLS:
            m = _COMMAND.match(line.strip())
            if m:
                found.append(re.sub(r"\s+#.*$", "", m.group(1)).strip())
    return found


def _words(cmd: str) -> list[str]:
    """Shell words; a usage line's prose (an apostrophe) is split at spaces."""
    try:
        return shlex.split(cmd)
    except ValueError:
        return cmd.split()


def _kind(cmd: str) -> str:
    if cmd.startswith("pip "):
        return "pip"
    if cmd.startswith("python -m pytest") or any(s in cmd for s in _SLOW):
        return "file"
    words = _words(cmd.split("&&")[0])
    if any(_PLACEHOLDER.search(w) for w in words[1:]) or cmd.startswith("torchrun"):
        return "usage"
    return "run"


def _fp16probe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "100", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "fp16probe", *args], capture_output=True, text=True,
                          env=env, cwd=cwd or ROOT, timeout=300)


def test_every_page_with_commands_is_found():
    pages = {p.name for p in PAGES if commands(p)}
    assert {"README.md", "cli.md", "user-guide.md"} <= pages
    readme = commands(ROOT / "README.md")
    # the quick start, exactly as a newcomer copies it
    assert 'pip install torch==2.13.0 -e ".[dev]" && fp16probe profile' in readme
    assert "python -m pytest -q -n auto" in readme  # the whole suite, the command .ci/run runs:
    assert "python3 -m pytest -q -n auto\n" in (ROOT / ".ci" / "run").read_text()
    assert 'python -m pytest -q -n auto -m "not slow"' in readme  # the fast tier a newcomer can wait for


def test_usage_lines_name_real_commands_and_options():
    helps: dict[str, str] = {}
    for page in PAGES:
        for cmd in commands(page):
            if _kind(cmd) != "usage":
                continue
            words = _words(cmd)
            if words[0] == "torchrun":
                words = words[words.index("fp16probe"):]
            sub = words[1] if len(words) > 1 and not words[1].startswith("-") else ""
            if sub not in helps:
                out = _fp16probe(*([sub] if sub else []), "--help")
                assert out.returncode == 0, f"{page.name}: `{cmd}`: {out.stderr}"
                helps[sub] = out.stdout
            for option in (w.split("=")[0].strip("[]|") for w in words[2:] if w.lstrip("[").startswith("--")):
                for alternative in option.split("|"):
                    assert alternative in helps[sub], f"{page.name}: `{cmd}`: {alternative} is not an option"


def test_pip_lines_name_real_extras_and_other_files_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for page in PAGES:
        for cmd in commands(page):
            kind = _kind(cmd)
            if kind == "pip":
                for group in re.findall(r"\.\[([\w,-]+)\]", cmd):
                    assert set(group.split(",")) <= extras, f"{page.name}: `{cmd}`"
            elif kind == "file":
                for word in _words(cmd):
                    if word.endswith(".py"):
                        assert (ROOT / word).is_file(), f"{page.name}: `{cmd}`: no {word}"


def _in_process(cmd: str) -> list[str] | None:
    """The arguments of an ``fp16probe`` command simple enough to run in this process (no torch start-up)."""
    plain = cmd.removesuffix("> /dev/null").strip()
    if not plain.startswith("fp16probe ") or any(c in plain for c in "|&;<>$`"):
        return None
    return _words(plain)[1:]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(_kind(c) == "run" for c in commands(p))],
                         ids=lambda p: p.name)
def test_runnable_commands_run(page, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fp16probe.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # docs.examples.my_model, as from the repository root
    monkeypatch.setenv("COLUMNS", "100")
    shell_prelude = (f'fp16probe() {{ "{sys.executable}" -m fp16probe "$@"; }}\n'
                     f'python() {{ "{sys.executable}" "$@"; }}\nset -e -o pipefail\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "100", "NO_COLOR": "1", "MPLBACKEND": "Agg"}
    (tmp_path / "docs").mkdir()  # where a page's command writes a figure, away from the checkout's
    ran = 0
    for cmd in commands(page):
        if _kind(cmd) != "run":
            continue
        needs = [mod for flag, mod in _EXTRAS.items() if flag in cmd and cmd.startswith("fp16probe export")]
        if any(importlib.util.find_spec(m) is None for m in needs):
            continue  # an extra not installed here; CI's dev extra has it
        args = _in_process(cmd)
        if args is not None:
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, f"{page.name}: `{cmd}` exited {result.exit_code}:\n{result.output[-2000:]}"
            ran += 1
            continue
        script = cmd.replace("python docs/", f"python {ROOT}/docs/")
        out = subprocess.run(["bash", "-c", shell_prelude + script], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=600)
        assert out.returncode == 0, f"{page.name}: `{cmd}` exited {out.returncode}:\n{out.stderr[-2000:]}"
        ran += 1
    assert ran
