"""--help is clean (no type placeholders, nothing cut, choices whole) and starts without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import get_args

import pytest
from typer.testing import CliRunner

from fp16probe import cli

COMMANDS = [name for name in (c.name or c.callback.__name__ for c in cli.app.registered_commands)]


def _help(*args: str) -> str:
    result = CliRunner().invoke(cli.app, [*args, "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_clean_at_80_columns(command):
    text = _help(*([command] if command else []))
    assert "<bool>" not in text
    assert "…" not in text  # nothing cut with an ellipsis
    assert max(len(line) for line in text.splitlines()) <= 80
    for line in text.splitlines():  # a choice list <a|b|c> is never wrapped mid-word
        opened = line.rfind("<")
        assert opened == -1 or ">" in line[opened:], line
    formats = "<fp16|bf16|fp8_e4m3|fp8_e5m2>"
    if command in ("profile", "show"):  # these also take the scaled formats
        formats = "<fp16|bf16|fp8_e4m3|fp8_e5m2|mxfp8_e4m3|mxfp8_e5m2|nvfp4>"
    known = [formats, "<activation_grad|weight_grad>", "<float32|float16|bfloat16|int64|int32>"]
    for choices in known:
        if choices.split("|")[0] + "|" in text:
            assert choices in text


def test_profile_help_names_the_built_in_losses_and_safe_inputs():
    text = " ".join(_help("profile").split())
    assert "cross_entropy" in text and "mse" in text
    assert "--trust-checkpoint" in text and ".pt2" in text


def test_cli_choices_match_the_library():
    from fp16probe.formats import FORMATS
    from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD

    assert cli.FORMAT_NAMES == tuple(FORMATS)
    assert get_args(cli.Kind) == ("all", ACTIVATION_GRAD, WEIGHT_GRAD)


@pytest.mark.parametrize("args", [["--help"], ["profile", "--help"], ["show", "--help"]])
def test_help_does_not_import_torch(args):
    """--help needs only typer; torch costs seconds to import (the target is --help under 0.5 s)."""
    code = (
        "import sys\n"
        "from fp16probe.cli import app\n"
        f"try:\n    app({args!r}, prog_name='fp16probe')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "heavy = [m for m in ('torch', 'numpy', 'rich', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "COLUMNS": "80"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr


def test_import_fp16probe_is_lazy_but_complete():
    code = (
        "import sys, fp16probe\n"
        "assert 'torch' not in sys.modules\n"
        "missing = [n for n in fp16probe.__all__ if not hasattr(fp16probe, n)]\n"
        "assert not missing, missing\n"
        "assert fp16probe.Probe.__module__ == 'fp16probe.capture.probe'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
