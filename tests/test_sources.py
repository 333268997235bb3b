"""Citations are records a report stores (authors, title, arXiv id or URL), written as a line in presentation.

An older report stored each citation as the sentence it showed; it still loads, validates and is
shown as stored. Every field of a stored record comes from a file, so it is shown escaped.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from fp16probe.analysis.recommend import analyze
from fp16probe.errors import ReportError
from fp16probe.presentation.cite import PAPER, cite
from fp16probe.report import Report
from fp16probe.recommendation import Citation
from fp16probe.sources import GRADSCALER, MIXED_PRECISION_TRAINING, NVIDIA_GUIDE_URL
from tests.test_report_fixture import DATA
from tests.test_report_schema import report_schema


@pytest.fixture(scope="module")
def demo() -> Report:
    report = Report.load(DATA / "report-v1-demo.json")
    return Report.from_dict({**report.to_dict(), "recommendation": analyze(report, "fp16").to_dict()})


def test_a_record_is_written_as_authors_title_identifier_note_url():
    assert cite(MIXED_PRECISION_TRAINING) == \
        'Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740 (ICLR 2018)'
    assert PAPER == 'Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740'  # inside a sentence
    line = cite(GRADSCALER)
    assert line.startswith('PyTorch, "torch.amp.GradScaler" (defaults: init_scale=65536.0, growth_factor=2.0')
    assert line.endswith(", https://docs.pytorch.org/docs/stable/amp.html#gradient-scaling")


def test_the_report_stores_records_and_reads_them_back(demo):
    stored = demo.to_dict()["recommendation"]["citations"]
    assert stored[0] == {"authors": "Micikevicius et al.", "title": "Mixed Precision Training",
                         "arxiv": "1710.03740", "note": "ICLR 2018"}
    assert any(c.get("url") == NVIDIA_GUIDE_URL for c in stored)
    again = Report.from_dict(json.loads(demo.to_json()))
    assert again.recommendation.citations == demo.recommendation.citations
    assert all(isinstance(c, Citation) for c in again.recommendation.citations)
    errors = list(jsonschema.Draft202012Validator(report_schema()).iter_errors(json.loads(demo.to_json())))
    assert errors == []


def test_an_older_reports_sentences_load_validate_and_show_as_stored(demo):
    d = json.loads(demo.to_json())
    old = "LIT-011: Micikevicius et al., Mixed Precision Training, arXiv 1710.03740 (ICLR 2018)"
    d["recommendation"]["citations"] = [old]
    assert list(jsonschema.Draft202012Validator(report_schema()).iter_errors(d)) == []
    rec = Report.from_dict(d).recommendation
    assert rec.citations == (old,) and cite(rec.citations[0]) == old
    assert rec.to_dict()["citations"] == [old]  # kept as it was, not rewritten


@pytest.mark.parametrize("bad, field", [
    ({"title": "No authors", "arxiv": "1"}, "recommendation.citations[0].authors"),
    ({"authors": "A", "title": 3, "arxiv": "1"}, "recommendation.citations[0].title"),
    ({"authors": "A", "title": "T", "url": ["x"]}, "recommendation.citations[0].url"),
    (7, "recommendation.citations[0]"),
])
def test_a_broken_record_is_refused_naming_its_field(demo, bad, field):
    d = json.loads(demo.to_json())
    d["recommendation"]["citations"] = [bad]
    with pytest.raises(ReportError) as err:
        Report.from_dict(d)
    assert f"{field}: expected" in str(err.value)  # one line naming the field
    assert list(jsonschema.Draft202012Validator(report_schema()).iter_errors(d))


def test_the_schema_wants_an_identifier_or_a_url(demo):
    d = json.loads(demo.to_json())
    d["recommendation"]["citations"] = [{"authors": "A", "title": "T"}]
    assert list(jsonschema.Draft202012Validator(report_schema()).iter_errors(d))


def test_a_hostile_record_is_shown_escaped(demo):
    d = json.loads(demo.to_json())
    evil = copy.deepcopy(d["recommendation"]["citations"][0])
    evil["title"] = "Mixed\x1b]0;pwned\x07 Precision\u202e"
    evil["note"] = "\x1b[2J<script>x</script>"
    d["recommendation"]["citations"] = [evil]
    rec = Report.from_dict(d).recommendation
    line = cite(rec.citations[0])
    assert "\x1b" not in line and "\x07" not in line and "\u202e" not in line
    page = Report.from_dict(d)._repr_html_()
    assert "<script>" not in page and "\x1b" not in page
    assert "Mixed\\x1b]0;pwned\\x07 Precision" in page  # the stored record is what the page shows, escaped


def test_citations_that_are_not_a_list_are_refused(demo):
    d = json.loads(demo.to_json())
    d["recommendation"]["citations"] = "Micikevicius et al."
    with pytest.raises(ReportError, match=r"recommendation\.citations: expected a list"):
        Report.from_dict(d)
    assert list(jsonschema.Draft202012Validator(report_schema()).iter_errors(d))
