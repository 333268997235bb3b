"""Errors name their parameter as data; the command line respells it as its flag."""

from __future__ import annotations

import pytest

from fp16probe import InputError
from fp16probe.cli import EXIT_USAGE, PARAMETER_FLAGS
from tests.fixtures.cli import one_error_line, prepare_cli_env, run


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)


def test_an_error_names_its_parameter_as_data_and_the_cli_respells_only_that():
    e = InputError("lr=nan: expected a finite positive learning rate; the model said steps=3", parameter="lr")
    assert str(e).startswith("lr=nan")  # the library's spelling
    assert e.spelled(PARAMETER_FLAGS) == "--lr nan: expected a finite positive learning rate; the model said steps=3"
    assert InputError("verify= checks fp32", parameter="verify").spelled(PARAMETER_FLAGS) == "--verify checks fp32"
    assert InputError("nothing to do; pass loss=", parameter="loss").spelled(PARAMETER_FLAGS) == "nothing to do; pass --loss"
    assert InputError("steps=0: no parameter given").spelled(PARAMETER_FLAGS) == "steps=0: no parameter given"


def test_a_parameter_in_user_text_is_left_alone_on_the_command_line(tmp_path):
    """Only the error's own parameter becomes a flag: text the user's code wrote keeps its ``lr=``."""
    (tmp_path / "odd_batches.py").write_text("def make():\n    raise ValueError('no data for lr=0.1')\n")
    result = run("profile", "cli_models:TinyMLP", "--batches", "odd_batches:make", "--steps", "1")
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result) == ("error: --batches 'odd_batches:make': calling it raised ValueError: "
                                      "no data for lr=0.1")
