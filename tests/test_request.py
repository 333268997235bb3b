"""The request: every setting resolved and checked once, its errors naming the parameter as data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16probe import InputError, profile
from fp16probe.cli import EXIT_USAGE, PARAMETER_FLAGS
from fp16probe.running.request import ProfileRequest
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


def test_a_bad_kind_is_one_input_error_from_the_request():
    with pytest.raises(InputError) as e:
        ProfileRequest(kind="grads")
    assert e.value.parameter == "kind"
    assert e.value.spelled(PARAMETER_FLAGS).startswith("--kind 'grads': expected one of all, activation_grad")
    model = nn.Linear(8, 4)
    with pytest.raises(InputError, match=r"^kind='grads'") as again:
        profile(model, [torch.randn(2, 8)], steps=1, kind="grads")
    assert again.value.parameter == "kind" and model.weight.grad is None  # refused before anything ran
    assert again.traceback[-1].name == "_check_run"  # the request's check, not one further down


@pytest.mark.parametrize("entry", ["cli", "library"])
def test_the_settings_are_checked_once_per_run(entry, monkeypatch):
    checks = []
    original = ProfileRequest._check_run
    monkeypatch.setattr(ProfileRequest, "_check_run", lambda self: checks.append(self) or original(self))
    if entry == "cli":
        result = run("profile", "cli_models:TinyMLP", "--input-shape", "5,8", "--steps", "1", "--kind", "weight_grad")
        assert result.exit_code == 0, result.output
    else:
        profile(nn.Linear(8, 4), [torch.randn(2, 8)], steps=1, kind="weight_grad")
    assert [c.kind for c in checks] == ["weight_grad"]


@pytest.mark.parametrize("kwargs,parameter,match", [
    ({"seed": 2**70}, "seed", r"seed=1180591620717411303424: expected a whole number in \[0, 2\*\*63\)"),
    ({"seed": -1}, "seed", r"seed=-1"),
    ({"input_dtype": "int8"}, "input_dtype", r"input_dtype='int8': expected one of float32"),
    ({"input_shape": "0,8"}, "input_shape", r"input_shape='0,8': expected positive integers"),
    ({"format": "fp17"}, "format", r"format='fp17': expected one of fp16, bf16, fp8_e4m3, fp8_e5m2, mxfp8_e4m3"),
    ({"target": "tpu"}, "target", r"target='tpu': expected one of cuda, cpu"),
    ({"format": "nvfp4", "plot": "fig.png"}, "plot", r"plot=fig.png: the figures draw fp16/bf16/fp8 histograms"),
])
def test_the_request_refuses_what_cannot_work(kwargs, parameter, match):
    with pytest.raises(InputError, match=match) as e:
        ProfileRequest(**kwargs)
    assert e.value.parameter == parameter


def test_the_format_is_resolved_once():
    assert ProfileRequest().format == "fp16"
    assert ProfileRequest(precision="bf16").format == "bf16"
    assert ProfileRequest(format="half").format == "fp16"  # an alias, named once for every layer below


def test_plot_with_a_scaled_format_is_refused_before_the_model_loads():
    result = run("profile", "no_such_pkg_q:Model", "--format", "nvfp4", "--plot", "fig.png")
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith("error: --plot fig.png: the figures draw fp16/bf16/fp8 histograms")


def test_an_analysis_error_names_the_kind_flag_on_the_command_line(tmp_path, monkeypatch):
    """An analysis error about the kind reaches the command line as --kind, the library as kind=."""
    from fp16probe import Fp16ProbeError, Probe
    from fp16probe.analysis.recommend import analyze

    model = nn.Linear(4, 4)
    with Probe(model, weight_grads=False) as probe:
        model(torch.randn(2, 4)).sum().backward()
        probe.step()
    report = probe.report()
    with pytest.raises(Fp16ProbeError, match=r"or pass kind='all'$") as e:
        analyze(report, kind="weight_grad")
    assert e.value.parameter == "kind"
    report.save(tmp_path / "r.json")
    monkeypatch.chdir(tmp_path)
    result = run("recommend", "r.json", "--kind", "weight_grad")
    assert one_error_line(result).endswith("or pass --kind 'all'")
