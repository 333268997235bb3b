"""The published JSON Schema of the report: shipped with the package, valid, and true of real reports.

Real reports are written by the tool here (the CLI, ``fp16probe.profile``, a Probe with op
capture and activations, a rank merge) and by earlier versions (tests/data). The schema is
looser than the loader (it cannot say that max_abs lies in the top bin, or that lists have
one entry per step), but every bad field it can express, it rejects as the loader does.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import fp16probe
from fp16probe import Probe
from fp16probe.cli import EXIT_OK, app
from fp16probe.recommendation import Verdict
from fp16probe.report import KINDS

DATA = Path(__file__).parent / "data"


def report_schema() -> dict:
    return json.loads(resources.files("fp16probe").joinpath("schema/report.schema.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = report_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def _probe_report(**options) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    with Probe(model, **options) as probe:
        for _ in range(2):
            (model(torch.randn(3, 4)).pow(2).mean() * 1e-6).backward()
            model.zero_grad()
            probe.step()
    return probe.report()


@pytest.fixture(scope="module")
def real_reports(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("schema")
    reports = {p.name: json.loads(p.read_text()) for p in sorted(DATA.glob("report-v1-*.json"))
               if "schema_version" in json.loads(p.read_text())}
    assert len(reports) >= 2
    cli = out / "cli.json"
    result = CliRunner().invoke(app, ["profile", "--steps", "2", "--out", str(cli)])
    assert result.exit_code == EXIT_OK, result.output
    reports["cli demo"] = json.loads(cli.read_text())
    from fp16probe.running.demo import DemoNet, demo_batches, demo_loss

    api = fp16probe.profile(DemoNet(), demo_batches(), demo_loss, steps=2, verify=True)
    assert api.verification is not None
    reports["profile()"] = json.loads(api.to_json())
    op = _probe_report(granularity="op", activations=True)
    reports["op + activations"] = json.loads(op.to_json())
    reports["merged ranks"] = json.loads(op.merge(_probe_report()).to_json())
    return reports


def test_the_schema_ships_with_the_package():
    schema = report_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["schema_version"]["const"] == fp16probe.report.SCHEMA_VERSION
    assert schema["$defs"]["kind"]["enum"] == list(KINDS)
    verdicts = schema["$defs"]["recommendation"]["properties"]["verdict"]["enum"]
    assert verdicts == [v.value for v in Verdict]


def test_real_reports_validate(validator, real_reports):
    for name, report in real_reports.items():
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(report)]
        assert errors == [], name
    assert any(r.get("recommendation") for r in real_reports.values())
    assert any(r["trace"].get("ceiling") for r in real_reports.values())
    assert any(r.get("verification") for r in real_reports.values())
    assert any("activation" in r["trace"]["histograms"] for r in real_reports.values())


def _cases():
    from tests.test_report_validation import CASES

    return CASES


# Bad fields that the loader refuses but JSON Schema cannot express: a value that depends on
# another field (the top bin, the number of steps), uniqueness by two keys, nesting depth,
# and Python's own int-conversion limits.
NOT_EXPRESSIBLE = {"max_abs outside its top bin", "found_inf too short", "module_max too long",
                   "duplicate module", "ceiling too short", "max_abs NaN", "max_abs Infinity", "scale NaN"}


@pytest.mark.parametrize("case", sorted(set(_cases()) - NOT_EXPRESSIBLE))
def test_schema_rejects_what_the_loader_rejects(validator, real_reports, case):
    edit = _cases()[case][0]
    bad = edit(copy.deepcopy(real_reports["profile()"]))
    assert not validator.is_valid(bad), case


@pytest.mark.parametrize("case", ["max_abs NaN", "max_abs Infinity", "scale NaN"])
def test_non_finite_numbers_are_not_json(real_reports, case):
    """NaN and Infinity are not JSON numbers: a strict parser refuses them before any schema runs."""
    text = json.dumps(_cases()[case][0](copy.deepcopy(real_reports["profile()"])))

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    with pytest.raises(ValueError, match="is not JSON"):
        json.loads(text, parse_constant=refuse)
