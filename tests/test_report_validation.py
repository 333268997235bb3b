"""Report loading checks every field: a bad report is one error line naming the field, exit 2, never accepted.

Each case here was accepted silently (or crashed with exit 4) before the loader checked
types and ranges: issue 15's "reports accepted that should not be" and its crashes.
"""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from fp16probe import Report, ReportError
from fp16probe.cli import EXIT_USAGE, app
from fp16probe.errors import ReportFieldError
from tests.fixtures.reports import tiny_report_json


@pytest.fixture(scope="module")
def valid() -> dict:
    """A real report (two steps of a tiny MLP, activation and weight gradients), as JSON."""
    return tiny_report_json()


def _set(d: dict, path: tuple, value) -> dict:
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


def _hist_path(d: dict) -> tuple:
    i = next(i for i, m in enumerate(d["modules"]) if m["histogram"]["bins"])
    return ("modules", i, "histogram")


def _load_text(tmp_path, text: str) -> Report:
    path = tmp_path / "r.json"
    path.write_text(text)
    return Report.load(path)


def _load(tmp_path, d: dict) -> Report:
    # json.dumps writes NaN and Infinity as the tokens a hand-edited or foreign file may hold
    return _load_text(tmp_path, json.dumps(d))


CASES = {
    # name: (edit of the valid report, the field the error must name, words of the error)
    "max_abs NaN": (lambda d: _set(d, _hist_path(d) + ("max_abs",), float("nan")), "max_abs", "finite"),
    "max_abs negative": (lambda d: _set(d, _hist_path(d) + ("max_abs",), -1.0), "max_abs", "finite number in [0"),
    "max_abs Infinity": (lambda d: _set(d, _hist_path(d) + ("max_abs",), float("inf")), "max_abs", "finite"),
    "max_abs 1e308": (lambda d: _set(d, _hist_path(d) + ("max_abs",), 1e308), "max_abs", "finite number in [0"),
    "max_abs outside its top bin": (lambda d: _set(d, _hist_path(d) + ("max_abs",), 1e-30), "max_abs",
                                    "highest occupied bin"),
    "max_abs a string": (lambda d: _set(d, _hist_path(d) + ("max_abs",), "1.0"), "max_abs", "finite number"),
    "count 10^400": (lambda d: _set(d, _hist_path(d) + ("zero",), 10**400), "zero", "an integer of 401 digits"),
    "count a float": (lambda d: _set(d, _hist_path(d) + ("zero",), 3.5), "zero", "non-negative integer"),
    "count true": (lambda d: _set(d, _hist_path(d) + ("nan",), True), ".nan", "non-negative integer"),
    "bin name not canonical": (lambda d: _set(d, _hist_path(d) + ("bins",), {"+5": 1}), "bins", "'+5'"),
    "found_inf 'false'": (lambda d: _set(d, ("trace", "found_inf", 0), "false"), "trace.found_inf[0]",
                          "true or false"),
    "found_inf 0": (lambda d: _set(d, ("trace", "found_inf", 0), 0), "trace.found_inf[0]", "true or false"),
    "step 10^400": (lambda d: _set(d, ("trace", "steps", 0), 10**400), "trace.steps[0]", "401 digits"),
    "step negative": (lambda d: _set(d, ("trace", "steps", 0), -1), "trace.steps[0]", "non-negative integer"),
    "scale NaN": (lambda d: _set(d, ("trace", "scale", 0), float("nan")), "trace.scale[0]", "finite"),
    "found_inf too short": (lambda d: _set(d, ("trace", "found_inf"), [False]), "trace.found_inf",
                            "1 entries for 2 steps"),
    "module_max too long": (lambda d: _set(d, ("trace", "module_max", "activation_grad", "0"), [0.0] * 3),
                            "module_max", "3 entries for 2 steps"),
    "module_max negative": (lambda d: _set(d, ("trace", "module_max", "activation_grad", "0", 1), -2.0),
                            "module_max", "finite number"),
    "ceiling too short": (lambda d: _set(d, ("trace", "ceiling"), [1.0]), "trace.ceiling", "1 entries for 2 steps"),
    "ceiling 10^400": (lambda d: _set(d, ("trace", "ceiling"), [1.0, 10**400]), "trace.ceiling[1]", "401 digits"),
    "ceiling 'nan'": (lambda d: _set(d, ("trace", "ceiling"), ["nan", 1.0]), "trace.ceiling[0]", "finite number"),
    "steps_seen a string": (lambda d: _set(d, ("metadata", "steps_seen"), "3"), "metadata.steps_seen",
                            "non-negative integer"),
    "device a number": (lambda d: _set(d, ("metadata", "device"), 5), "metadata.device", "a string"),
    "partial 'no'": (lambda d: _set(d, ("metadata", "partial"), "no"), "metadata.partial", "true or false"),
    "world_size 0": (lambda d: _set(d, ("metadata", "world_size"), 0), "metadata.world_size", "integer in [1"),
    "captured unknown kind": (lambda d: _set(d, ("metadata", "captured"), ["gradients"]), "metadata.captured[0]",
                              "one of activation_grad"),
    "hooked_modules a string": (lambda d: _set(d, ("metadata", "hooked_modules"), "0,2"),
                                "metadata.hooked_modules", "a list"),
    "extra a list": (lambda d: _set(d, ("metadata", "extra"), []), "metadata.extra", "an object"),
    "module kind unknown": (lambda d: _set(d, ("modules", 0, "kind"), "grad"), "modules[0].kind", "one of"),
    "module name a number": (lambda d: _set(d, ("modules", 0, "name"), 0), "modules[0].name", "a string"),
    "modules an object": (lambda d: _set(d, ("modules",), {}), "modules", "a list"),
    "duplicate module": (lambda d: _set(d, ("modules",), d["modules"] + [d["modules"][0]]), "recorded twice",
                         "modules["),
    "schema_version true": (lambda d: _set(d, ("schema_version",), True), "schema_version", "not supported"),
    "recommendation a list": (lambda d: _set(d, ("recommendation",), [1]), "recommendation", "an object"),
    "recommendation scale 10^400": (lambda d: _set(d, ("recommendation",), {"verdict": "constant", "scale": 10**400}),
                                    "recommendation.scale", "401 digits"),
    "recommendation worst_modules": (lambda d: _set(d, ("recommendation",), {"verdict": "constant",
                                                                              "worst_modules": [["a"]]}),
                                     "recommendation.worst_modules[0]", "[name, fraction] pair"),
    "recommendation fraction > 1": (lambda d: _set(d, ("recommendation",), {"verdict": "constant",
                                                                             "flushed_fraction_at_1": 2.0}),
                                    "flushed_fraction_at_1", "finite number in [0, 1]"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_field_is_one_error_naming_it(tmp_path, valid, case):
    edit, field, words = CASES[case]
    with pytest.raises(ReportError) as info:
        _load(tmp_path, edit(valid))
    message = str(info.value)
    assert "\n" not in message
    assert field in message and words in message, message
    assert str(tmp_path / "r.json") in message


def test_the_valid_report_loads(tmp_path, valid):
    """The cases above fail for their edit alone: the untouched report loads and round-trips."""
    report = _load(tmp_path, valid)
    assert json.loads(report.to_json()) == valid
    assert len(valid["trace"]["ceiling"]) == 2  # the overflow ceiling is there to be checked
    with_inf = _set(valid, ("trace", "ceiling"), ["inf", 1.0])
    assert _load(tmp_path, with_inf).trace.ceiling[0] == float("inf")


def test_field_errors_are_value_errors_too(valid):
    """Code that caught ValueError from Histogram.from_dict still catches it, and learns the field."""
    d = _set(valid, _hist_path(valid) + ("max_abs",), -1.0)
    from fp16probe.histogram import Histogram

    with pytest.raises(ValueError) as info:
        Histogram.from_dict(d["modules"][_hist_path(valid)[1]]["histogram"], path="h")
    assert isinstance(info.value, ReportFieldError) and info.value.field == "h.max_abs"


def test_deeply_nested_json_is_one_line_not_recursion_error(tmp_path, valid):
    deep = json.dumps(valid)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ReportError, match="nested too deeply") as info:
        _load_text(tmp_path, deep)
    assert "\n" not in str(info.value)


def test_nesting_that_json_reads_is_still_bounded(tmp_path, valid):
    """200 levels parse, but printing or re-saving them would recurse: refused at 32."""
    nested: list = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(ReportError, match=r"metadata\.extra: nested deeper than 32"):
        _load(tmp_path, _set(valid, ("metadata", "extra"), {"deep": nested}))


def test_integer_beyond_pythons_conversion_limit(tmp_path, valid):
    text = json.dumps(valid).replace('"zero": 0', '"zero": ' + "9" * 5000, 1)
    with pytest.raises(ReportError, match="not a readable report") as info:
        _load_text(tmp_path, text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("case", ["max_abs NaN", "found_inf 'false'", "duplicate module", "step 10^400",
                                  "max_abs 1e308"])
@pytest.mark.parametrize("command", ["show", "compare"])
def test_cli_gives_exit_2_and_one_line(tmp_path, valid, case, command, monkeypatch):
    """show and compare refuse a bad report (exit 2): a compare against it is an error, never a pass."""
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(valid))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(CASES[case][0](valid)))
    args = ["show", str(bad)] if command == "show" else ["compare", str(good), str(bad)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == EXIT_USAGE, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and CASES[case][1] in lines[0], result.stderr
