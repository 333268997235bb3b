"""Untrusted reports and models are safe to show (issue 32).

A report is a CI artifact that may come from an untrusted branch, and module names come from
code the user may not have written. Each case of the issue's "What was seen" is a test here;
the hypothesis test at the end sends hostile strings through every report field that reaches
an output, into every output (terminal, Markdown summary, JUnit, annotations, SVG, HTML).
"""

from __future__ import annotations

import copy
import json
import re
import xml.dom.minidom
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from typer.testing import CliRunner

import fp16probe
from fp16probe import Probe
from fp16probe.cli import app
from fp16probe.errors import ProbeError
from fp16probe.presentation import escape

# What must never reach an output from data: C0 (but newline and tab, which outputs use for
# their own layout), DEL, C1, bidi marks/overrides/isolates, line separators, lone surrogates.
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
EVIL = ("\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\\x1b]0;title\x07\x1b[1A\x1b[2K\u202e\x9b31m"
        "\n::add-mask::secret <script>alert(1)</script> <img src=x onerror=alert(1)> $x^2$ | ** [a](http://e) \ud800")


def _dcolon_lines(text: str) -> list[str]:
    """Lines GitHub would read as a workflow command, but the gate's own annotations."""
    own = ("::warning title=fp16probe compare::", "::error title=fp16probe compare")
    return [ln for ln in text.splitlines() if ln.lstrip().startswith("::") and not ln.startswith(own)]


@pytest.fixture(scope="module")
def base_dict() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    report = fp16probe.profile(model, [(x, y)] * 2, lambda out, b: ((out - b[1]) ** 2).mean() * 1e-6, steps=2)
    return json.loads(report.to_json())


def _hostile(d: dict, value: str = EVIL, notes: int = 2) -> dict:
    d = copy.deepcopy(d)
    for m in d["modules"]:
        if m["name"] == "0":
            m["name"] = "0" + value
    d["metadata"]["hooked_modules"] = [m["name"] for m in d["modules"] if m["kind"] == "activation_grad"]
    d["metadata"]["model_class"] = "Evil" + value
    d["metadata"]["device"] = "cpu" + value
    d["metadata"]["partial"] = True
    d["metadata"]["extra"]["notes"] = ["note" + value] * notes
    d["metadata"]["extra"]["stopped"] = "error" + value
    return d


def _write(tmp_path: Path, d: dict, name: str = "h.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def _run(args: list[str], **env: str):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "80", **env})


def _assert_clean(text: str, where: str) -> None:
    bad = UNSAFE.findall(text)
    assert not bad, f"{where}: {bad[:5]}"
    assert not _dcolon_lines(text), f"{where}: {_dcolon_lines(text)[:3]}"


# -- 1, 2: terminal escapes and forged workflow commands -------------------------------------
@pytest.mark.parametrize("command", [["show"], ["show", "--explain"], ["recommend"], ["schedule"]])
def test_terminal_shows_no_escape_and_no_command_line(base_dict, tmp_path, command):
    path = _write(tmp_path, _hostile(base_dict))
    result = _run([*command, path])
    assert result.exit_code == 0, result.output
    _assert_clean(result.output, " ".join(command))
    if command[0] == "show":
        assert "\\x1b]8;;http://evil" in result.output  # shown, visibly escaped
        assert "\\::add-mask" not in result.output and "\\n::add-mask::secret" in result.output


def test_compare_outputs_are_clean_and_written_with_a_surrogate(base_dict, tmp_path):
    base = _write(tmp_path, base_dict, "base.json")
    cur = _write(tmp_path, _hostile(base_dict))
    md, junit = tmp_path / "s.md", tmp_path / "j.xml"
    result = _run(["compare", base, cur, "--summary", md, "--junit", junit], GITHUB_ACTIONS="true")
    assert result.exit_code in (0, 1), result.output  # was exit 4 (UnicodeEncodeError), neither file written
    _assert_clean(result.output, "compare")
    annotations = [ln for ln in result.stdout.splitlines() if ln.startswith("::")]
    assert annotations and all(ln.startswith(("::warning title=", "::error title=")) for ln in annotations)
    assert all("%0A::add-mask" in ln for ln in annotations if "add-mask" in ln)
    summary = md.read_text(encoding="utf-8")
    _assert_clean(summary, "summary")
    assert "<script>" not in summary and "<img" not in summary and "&lt;script&gt;" in summary
    assert "[a](http://e)" not in summary and "\\[a\\](http://e)" in summary  # no link
    xml.dom.minidom.parseString(junit.read_bytes())
    _assert_clean(junit.read_text(encoding="utf-8"), "junit")


def test_a_wrapped_word_never_starts_a_line_with_two_colons(base_dict, tmp_path):
    d = copy.deepcopy(base_dict)
    d["metadata"]["extra"]["notes"] = ["x" * 70 + " ::stop-commands::token"]
    result = _run(["show", _write(tmp_path, d)])
    assert result.exit_code == 0
    assert "\\::stop-commands::token" in result.output  # wrapping put it first on its line: guarded
    _assert_clean(result.output, "show")


def test_pasted_code_never_takes_a_device_that_is_not_a_device_type(base_dict, tmp_path):
    d = copy.deepcopy(base_dict)
    d["metadata"]["device"] = 'cuda", init_scale=1.0); import os; os.system("id"); ("'
    result = _run(["recommend", _write(tmp_path, d)])
    assert result.exit_code == 0
    assert "os.system" not in "".join(ln for ln in result.output.splitlines() if "GradScaler(" in ln or '"c' in ln)
    assert 'GradScaler(\n    "cuda"' in result.output or 'GradScaler("cuda"' in result.output


# -- 3: SVG and HTML ---------------------------------------------------------------------------
@pytest.mark.slow
def test_plot_of_a_hostile_name_is_valid_svg(base_dict, tmp_path):
    svg = tmp_path / "x.svg"
    result = _run(["plot", _write(tmp_path, _hostile(base_dict)), "-o", svg])
    assert result.exit_code == 0, result.output
    text = svg.read_text(encoding="utf-8")
    xml.dom.minidom.parseString(text)
    _assert_clean(text, "svg")


def test_notebook_html_escapes_report_text(base_dict):
    from fp16probe.report import Report

    page = Report.from_dict(_hostile(base_dict))._repr_html_()
    _assert_clean(page, "html")
    assert "<script>" not in page and "<img src=x" not in page


# -- 4: bounded reads, exit 2 for every malformed field, capped lists ---------------------------
@pytest.mark.parametrize("args", [["show", "/dev/zero"], ["compare", "BASE", "/dev/zero"]])
def test_a_device_is_refused_in_one_line(base_dict, tmp_path, args):
    args = [str(_write(tmp_path, base_dict)) if a == "BASE" else a for a in args]
    result = _run(args)
    assert result.exit_code == 2, result.output
    assert "/dev/zero: not a regular file" in result.output and len(result.output.strip().splitlines()) == 1


def test_the_size_cap_names_itself_and_the_variable(base_dict, tmp_path):
    result = _run(["show", _write(tmp_path, base_dict)], FP16PROBE_MAX_REPORT_MB="0.001")
    assert result.exit_code == 2
    assert "larger than the 1,048 bytes" in result.output and "FP16PROBE_MAX_REPORT_MB" in result.output


@pytest.mark.parametrize("field,value", [(("metadata", "extra", "notes"), -1),
                                         (("recommendation", "format"), None),
                                         (("metadata", "extra", "stopped"), 5)])
def test_a_wrong_typed_field_is_exit_2_naming_it(base_dict, tmp_path, field, value):
    d = copy.deepcopy(base_dict)
    d["metadata"]["partial"] = True
    target = d
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    for command in (["show"], ["recommend"], ["compare", _write(tmp_path, base_dict, "base.json")]):
        result = _run([*command, _write(tmp_path, d)])
        assert result.exit_code == 2, result.output
        assert ".".join(field) in result.output


def test_twenty_thousand_notes_print_ten_and_a_count(base_dict, tmp_path):
    d = copy.deepcopy(base_dict)
    d["metadata"]["extra"]["notes"] = [f"n{i}" for i in range(20_000)]
    result = _run(["show", _write(tmp_path, d)])
    assert result.exit_code == 0
    assert "note: n9\n" in result.output and "note: n10\n" not in result.output
    assert "and 19,990 more notes" in result.output and len(result.output) < 20_000


# -- 5: run faults ------------------------------------------------------------------------------
class _BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message")


class _Flaky(nn.Module):
    """Raises an exception whose str() raises (``mode="str"``), or deletes a probed layer (``"delete"``), at call 3."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.a, self.b, self.mode, self.calls = nn.Linear(8, 8), nn.Linear(8, 4), mode, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3 and self.mode == "str":
            raise _BadStr()
        if self.calls == 3 and self.mode == "delete":
            del self.a
        return self.b(torch.tanh(self.a(x) if hasattr(self, "a") else x))


def _flaky_profile(mode: str):
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    return fp16probe.profile(_Flaky(mode), [(x, y)] * 4, lambda out, b: ((out - b[1]) ** 2).mean(), steps=4)


def test_an_exception_whose_str_raises_keeps_the_partial_report():
    with pytest.raises(fp16probe.errors.ModelError) as info:
        _flaky_profile("str")
    assert "BadStr (its message could not be read: str() raised RuntimeError)" in str(info.value)
    assert info.value.report is not None and info.value.report.metadata.steps_seen == 2


def test_a_module_removed_mid_run_is_one_error_with_the_report_kept(tmp_path):
    with pytest.raises(fp16probe.errors.ModelError, match=r"removed 1 hooked module\(s\) during the run \('a'\)"):
        _flaky_profile("delete")
    try:
        _flaky_profile("delete")
    except fp16probe.errors.ModelError as e:
        report = e.report
    assert report.capture.removed_modules == ("a",) and report.metadata.steps_seen == 4
    assert report.recommendation is not None  # kept: the error says why not to trust it
    path = tmp_path / "r.json"
    report.save(path)
    result = _run(["show", path])
    assert result.exit_code == 0, result.output
    assert "removed 1 hooked module(s) during the run (a)" in result.output


def test_a_step_recorded_before_stop_is_still_closed_after_it():
    """start/stop around part of a step (a micro-batch), then step(): the step holds data and counts."""
    model = nn.Linear(4, 2)
    probe = Probe(model)
    for _ in range(2):
        probe.start()
        model(torch.randn(2, 4)).sum().backward()
        probe.stop()
        probe.step()
    assert probe.report().metadata.steps_seen == 2
    with pytest.raises(ProbeError, match=r"step\(\) after stop\(\)"):
        probe.step()  # nothing recorded since: an empty step


def test_step_after_stop_raises_the_probe_error():
    model = nn.Linear(4, 2)
    probe = Probe(model).start()
    model(torch.randn(2, 4)).sum().backward()
    probe.step()
    probe.stop()
    with pytest.raises(ProbeError, match=r"step\(\) after stop\(\)"):
        probe.step()
    assert probe.report().metadata.steps_seen == 1


# -- the one rule ---------------------------------------------------------------------------------
def test_escape_rule_units():
    assert escape.text("a\x1b[2Kb\u202ec\ud800\n") == "a\\x1b[2Kb\\u202ec\\ud800\\n"
    assert escape.text(escape.text("\x9b")) == "\\x9b"  # idempotent
    assert escape.guard_line("  ::error::x") == "  \\::error::x"
    assert escape.guard_line("\x1b[1m::x") == "\x1b[1m\\::x"
    assert escape.guard_line("a ::x") == "a ::x"
    assert escape.workflow_data("50%\r\n::x\x1b") == "50%25%0D%0A::x\\x1b"
    assert escape.markdown("<b>|[x](y)") == "&lt;b&gt;\\|\\[x\\](y)"


# -- fuzz: report fields x every output ------------------------------------------------------------
_HOSTILE = st.text(alphabet=st.sampled_from(list("\x00\x07\x1b\x9b\u202e\u2066\ud800\n\r\t:%<>&|`$[]() a.")),
                   min_size=1, max_size=12)
_FIELDS = [("model_class",), ("device",), ("stopped",), ("note",), ("module",)]


@pytest.mark.slow
@settings(max_examples=8, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(value=_HOSTILE, field=st.sampled_from(_FIELDS))
def test_fuzz_no_control_character_or_command_line_reaches_any_output(base_dict, tmp_path_factory, value, field):
    from fp16probe.report import Report

    tmp = tmp_path_factory.mktemp("fuzz")
    d = copy.deepcopy(base_dict)
    md = d["metadata"]
    md["partial"] = True
    md["extra"]["stopped"] = "error"
    if field == ("module",):
        for m in d["modules"]:
            if m["name"] == "0":
                m["name"] = value
        md["hooked_modules"] = [m["name"] for m in d["modules"] if m["kind"] == "activation_grad"]
    elif field == ("note",):
        md["extra"]["notes"] = [value, "::" + value]
    elif field == ("stopped",):
        md["extra"]["stopped"] = value
    else:
        md[field[0]] = value
    path, base = _write(tmp, d), _write(tmp, base_dict, "base.json")
    show = _run(["show", path, "--explain"])
    assert show.exit_code == 0, show.output
    _assert_clean(show.output, "show")
    summary, junit = tmp / "s.md", tmp / "j.xml"
    compare = _run(["compare", base, path, "--summary", summary, "--junit", junit], GITHUB_ACTIONS="true")
    assert compare.exit_code in (0, 1), compare.output
    _assert_clean(compare.output, "compare (terminal and annotations)")
    _assert_clean(summary.read_text(encoding="utf-8"), "summary")
    xml.dom.minidom.parseString(junit.read_bytes())
    _assert_clean(junit.read_text(encoding="utf-8"), "junit")
    # SVG: test_plot_of_a_hostile_name_is_valid_svg (a figure takes seconds to draw)
    _assert_clean(Report.from_dict(d)._repr_html_(), "html")
