"""Fuzzing: mutated reports and random command lines end in a documented exit code, never exit 4.

Every outcome must be one of the README's exit codes (0, 1, 2, 3; 130 and 143 need a
signal) and every error exactly one ``error:`` line on stderr, with no traceback. Reports
are mutated field by field from a real one (types, values, deletions, duplicates, deep
nesting, truncation); command lines are drawn from each command's options with hostile
values. A report the loader accepts must also satisfy the published JSON Schema.

The analyzer's long-horizon replay costs about a second per report here; the fuzz runs it
with a short horizon (the same code, fewer simulated steps) to keep within the time budget.
"""

from __future__ import annotations

import copy
import functools
import json
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from typer.testing import CliRunner

from fp16probe import Report, ReportError
from fp16probe.cli import app
from tests.fixtures.reports import tiny_report_json

FIXTURES = Path(__file__).parent / "fixtures"
DOCUMENTED = {0, 1, 2, 3}
def fuzz(max_examples: int) -> settings:
    """Settings for a fuzz test: reproducible (derandomized), no deadline, no example database."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), database=None)


def _valid_report() -> dict:
    return tiny_report_json()


VALID = _valid_report()
SCHEMA = jsonschema.Draft202012Validator(json.loads(
    (Path(__file__).parents[1] / "fp16probe" / "schema" / "report.schema.json").read_text()))


def _paths(root) -> list[tuple]:
    out, stack = [], [((), root)]
    while stack:
        prefix, node = stack.pop()
        out.append(prefix)
        if isinstance(node, dict):
            stack.extend((prefix + (k,), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((prefix + (i,), v) for i, v in enumerate(node))
    return sorted(out, key=repr)


class Deep(str):
    """A placeholder for JSON nested ``depth`` levels, spliced into the text after json.dumps."""

    @classmethod
    def of(cls, depth: int) -> "Deep":
        return cls(f"__deep_{depth}__")


def _splice_deep(text: str) -> str:
    import re

    return re.sub(r'"__deep_(\d+)__"', lambda m: "[" * int(m.group(1)) + "]" * int(m.group(1)), text)


HOSTILE = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**400, 2**63, 2**63 - 1, -1, 0, 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -0.0, 5e-324, 3.5e38, float("nan"), float("inf")]),
    st.text(max_size=6),
    st.sampled_from(["false", "true", "inf", "nan", "[/bold]", "$\\frac{$", "-25", "+5", "", "activation"]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.sampled_from(["-25", "0", "x", "name"]), st.integers(-2, 5), max_size=2),
    st.integers(1, 3000).map(Deep.of),
)


@st.composite
def mutated_reports(draw, base: dict) -> str:
    """A report's JSON text after one to three edits (replace, delete, duplicate) and maybe a cut."""
    d = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(d) if p]
        path = draw(st.sampled_from(paths))
        parent = d
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "duplicate"]))
        if op == "replace":
            parent[path[-1]] = draw(HOSTILE)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[str(draw(st.integers(-200, 200)))] = copy.deepcopy(parent[path[-1]])
    text = _splice_deep(json.dumps(d))
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text


def _fast_analysis(monkeypatch) -> None:
    import fp16probe.analysis.recommend as recommend

    monkeypatch.setattr(recommend, "analyze", functools.partial(recommend.analyze, horizon=50, growth_intervals=(2000,)))


def _assert_documented(result, args) -> None:
    assert result.exit_code in DOCUMENTED, (args, result.exit_code, result.output[-2000:])
    assert "Traceback" not in result.output, (args, result.output[-2000:])
    if result.exit_code not in (0, 1):
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr[-2000:])


@pytest.fixture
def workdir(monkeypatch):
    with tempfile.TemporaryDirectory() as tmp:
        monkeypatch.chdir(tmp)
        monkeypatch.setenv("NO_COLOR", "1")
        monkeypatch.setenv("COLUMNS", "100")
        monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
        monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
        monkeypatch.syspath_prepend(str(FIXTURES))
        _fast_analysis(monkeypatch)
        Path("valid.json").write_text(json.dumps(VALID))
        yield Path(tmp)


@fuzz(400)
@given(text=mutated_reports(VALID))
def test_loader_accepts_only_schema_valid_reports_and_refuses_in_one_line(text):
    """Fast, no analysis: the loader either refuses with one ReportError line, or the file meets the schema."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.json"
        path.write_text(text)
        try:
            report = Report.load(path)
        except ReportError as e:
            assert "\n" not in str(e) and str(path) in str(e)
            return
    assert isinstance(report, Report)
    assert SCHEMA.is_valid(json.loads(text)), [e.message for e in SCHEMA.iter_errors(json.loads(text))][:3]


# The commands that read reports, on a report without a per-step trace (the analysis is
# then quick) so that many mutations reach it; the trace itself is fuzzed by the loader test.
NO_TRACE = {**VALID, "trace": {"steps": [], "histograms": {}, "module_max": {}, "scale": [], "found_inf": []}}


@fuzz(60)
@given(text=mutated_reports(NO_TRACE), command=st.sampled_from(["show", "recommend", "compare", "show-json"]))
def test_commands_on_mutated_reports_exit_as_documented(workdir, text, command):
    Path("bad.json").write_text(text)
    args = {"show": ["show", "bad.json"], "show-json": ["show", "bad.json", "--json"],
            "recommend": ["recommend", "bad.json", "--json"], "compare": ["compare", "valid.json", "bad.json"]}[command]
    result = CliRunner().invoke(app, args)
    _assert_documented(result, args)


VALUES = ["-1", "0", "1", "2", "3", "nan", "inf", "-inf", "1e309", str(2**70), "", "x", "fp16", "bf16",
          "fp8_e4m3", "8,64", "5,8", "100000,100000", "10**30,8", "0,8", "a,b", "cpu", "cuda", "sgd", "adam",
          "[/bold]", "$\\frac{$", "valid.json", "missing.json", "/", "out/", "r.png", "r.txt", "fc*",
          "cli_models:TinyMLP", "cli_models:tiny_batches", "cli_models:mse_loss", "nope:missing",
          "activation_grad", "weight_grad", "module", "op", "fp32"]
OPTIONS = {
    "profile": ["--input-shape", "--input-dtype", "--vocab-size", "--device", "--precision", "--loss-scale",
                "--optimizer", "--lr", "--format", "--kind", "--granularity", "--modules", "--out", "--seed",
                "--weights", "--batches", "--loss", "--plot", "--json", "--bogus"],
    "show": ["--format", "--kind", "--top", "--json", "--bogus"],
    "recommend": ["--format", "--kind", "--device", "--json"],
    "plot": ["--out", "--output", "--format", "--kind"],
    "compare": ["--max-flushed-increase", "--max-flushed-increase-at-scale", "--max-module-increase",
                "--max-scale-shift", "--worst", "--allow-new-overflow", "--allow-worse-verdict",
                "--require-same-workload", "--format", "--kind", "--summary", "--junit", "--json"],
}
FLAGS = {"--json", "--allow-new-overflow", "--allow-worse-verdict", "--require-same-workload"}
STEPS = st.sampled_from(["1", "1", "2", "0", "-1", "x"])  # never a long run


@st.composite
def command_lines(draw) -> list[str]:
    command = draw(st.sampled_from(["profile", "profile", "profile", *sorted(OPTIONS)]))
    args = [command]
    if command == "profile":
        args += [draw(st.sampled_from(["cli_models:TinyMLP", "cli_models:TinyMLP", "nope:missing", "missing.pt"])),
                 "--steps", draw(STEPS), "--input-shape", draw(st.sampled_from(["5,8", "5,8", "5,8"] + VALUES))]
    elif command == "compare":
        args += [draw(st.sampled_from(["valid.json", "missing.json", "/"])), draw(st.sampled_from(["valid.json", "x"]))]
    else:
        args.append(draw(st.sampled_from(["valid.json", "valid.json", "missing.json", "/", ""])))
    for option in draw(st.lists(st.sampled_from(OPTIONS[command]), max_size=4)):
        args.append(option)
        if option not in FLAGS and option != "--bogus":
            args.append(draw(st.sampled_from(VALUES)))
    return args


@fuzz(50)
@given(args=command_lines())
def test_random_command_lines_exit_as_documented(workdir, args):
    result = CliRunner().invoke(app, args)
    _assert_documented(result, args)


def test_the_fuzz_can_fail(workdir, monkeypatch):
    """The assertion catches an internal error: a crash planted in the loader is exit 4 and fails it."""
    monkeypatch.setattr(Report, "load", classmethod(lambda cls, path: 1 / 0))
    result = CliRunner().invoke(app, ["show", "valid.json"])
    assert result.exit_code == 4
    with pytest.raises(AssertionError):
        _assert_documented(result, ["show", "valid.json"])

