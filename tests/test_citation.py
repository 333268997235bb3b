"""CITATION.cff is valid CFF 1.2.0 and cites the sources the product rests on."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

import fp16probe

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "tests" / "data" / "cff-1.2.0-schema.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def cff() -> dict:
    return yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(SCHEMA, format_checker=jsonschema.FormatChecker())


def test_vendored_schema_is_cff_1_2_0():
    assert SCHEMA["$id"] == "https://citation-file-format.github.io/1.2.0/schema.json"
    assert set(SCHEMA["required"]) == {"authors", "cff-version", "message", "title"}


def test_citation_validates_against_the_cff_schema(cff):
    _validator().validate(cff)
    assert cff["cff-version"] == "1.2.0"
    assert cff["type"] == "software"


def test_citation_version_matches_the_package(cff):
    assert cff["version"] == fp16probe.__version__


def test_references_hold_lit011_and_the_nvidia_guide(cff):
    urls = {r.get("url") for r in cff["references"]}
    assert "https://arxiv.org/abs/1710.03740" in urls
    assert "https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html" in urls
    paper = next(r for r in cff["references"] if r.get("url") == "https://arxiv.org/abs/1710.03740")
    assert paper["title"] == "Mixed Precision Training"
    assert paper["authors"][0]["family-names"] == "Micikevicius"


@pytest.mark.parametrize("breakage", ["drop_authors", "bad_version", "bad_reference_type", "unknown_key"])
def test_schema_rejects_broken_citations(cff, breakage):
    bad = copy.deepcopy(cff)
    if breakage == "drop_authors":
        del bad["authors"]
    elif breakage == "bad_version":
        bad["cff-version"] = "1.2"
    elif breakage == "bad_reference_type":
        bad["references"][0]["type"] = "paper"
    else:
        bad["citation"] = "x"
    assert not _validator().is_valid(bad)


def test_citation_carries_a_year_and_no_invented_url(cff):
    """Exported BibTeX needs a year (date-released); a URL only once the project has a public one."""
    import datetime
    import tomllib

    released = cff["date-released"]
    released = released if isinstance(released, datetime.date) else datetime.date.fromisoformat(released)
    assert datetime.date(2026, 1, 1) <= released <= datetime.date.today()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    # repository-code and the package's Repository URL name the same place, or are both absent:
    # no public repository exists yet, and an invented address would send readers nowhere.
    assert cff.get("repository-code") == project.get("urls", {}).get("Repository")


@pytest.mark.parametrize("field, value", [("date-released", "30 November 2026"), ("repository-code", "not a url")])
def test_schema_rejects_a_bad_date_or_url(cff, field, value):
    assert not _validator().is_valid({**cff, field: value})
