"""A long run's report (issue 40 item 5): per-module maxima kept per block of steps, exactly; long arrays
decoded as the file is read; older reports load as before."""

from __future__ import annotations

import base64
import json
import zlib

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fp16probe import columns, reading
from fp16probe.analysis.replay import simulate
from fp16probe.analysis.whatif import what_if
from fp16probe.cli import app
from fp16probe.errors import InputError, ReportError
from fp16probe.report import Report
from tests.test_columns import DATA, NAMES, long_report

STEPS, BOUND = 1000, 64  # 1000 steps, at most 64 entries a module: blocks of 16 steps, the last one 8


@pytest.fixture(scope="module")
def report() -> Report:
    return long_report(STEPS)


@pytest.fixture
def blocked(report, monkeypatch) -> Report:
    monkeypatch.setattr(columns, "MODULE_STEPS", BOUND)
    return Report.from_dict(json.loads(report.to_json()))


def test_each_modules_entry_is_the_exact_max_over_its_block_and_every_step_is_kept(report, blocked):
    trace = blocked.trace
    assert trace.module_block == 16
    for name in NAMES:
        full = list(report.trace.module_max["activation_grad"][name])
        kept = list(trace.module_max["activation_grad"][name])
        assert kept == [max(full[j:j + 16]) for j in range(0, STEPS, 16)]  # 63 blocks, plain Python's max
    assert trace.module_span(0) == (0, 15) and trace.module_span(62) == (992, 999)
    # every whole-model per-step figure is kept for every step
    assert trace.histograms == report.trace.histograms and trace.scale == report.trace.scale
    assert trace.found_inf == report.trace.found_inf and trace.ceiling == report.trace.ceiling
    assert blocked.history == report.history
    # the GradScaler replay reads those alone: the same to the step
    assert simulate(blocked, "fp16", horizon=3000) == simulate(report, "fp16", horizon=3000)


def test_a_blocked_trace_is_written_again_as_it_was_read(blocked):
    again = json.loads(blocked.to_json())
    assert again["trace"]["module_block"] == 16
    assert Report.from_dict(again).trace.module_max == blocked.trace.module_max


def test_what_if_counts_a_modules_overflowing_blocks(report, blocked):
    table = what_if(blocked, "fp16", log2_scales=range(10, 30))
    assert table.module_block == 16 and json.loads(json.dumps(table.to_dict()))["module_block"] == 16
    full = np.asarray(report.trace.module_max["activation_grad"]["head"])
    for row in table.modules["head"]:
        over = torch.isinf(torch.from_numpy(full * 2.0**row.log2_scale).half()).numpy()  # torch's cast, the oracle
        blocks = sum(bool(over[j:j + 16].any()) for j in range(0, STEPS, 16))
        assert row.overflow_steps == blocks <= int(over.sum())


def test_show_says_what_is_kept_per_block(blocked, tmp_path):
    path = tmp_path / "long.json"
    blocked.save(path)
    result = CliRunner().invoke(app, ["show", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "max over each block of 16 steps (63 blocks over the 1,000 steps)" in text


def test_blocked_reports_are_not_merged(blocked):
    with pytest.raises(InputError, match="per block of 16 steps"):
        blocked.merge(blocked)


@pytest.mark.parametrize("value", [0, -1, "16", True, 1001, 2.0])
def test_a_bad_module_block_is_refused_naming_it(report, tmp_path, value):
    d = json.loads(report.to_json())  # one entry a step: any module_block but 1 disagrees with it
    d["trace"]["module_block"] = value
    with pytest.raises(ReportError, match=r"trace\.module_block|trace\.module_max\['activation_grad'\]\.values"):
        Report.from_dict(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output


@pytest.mark.parametrize("name", ["report-v1-demo.json", "report-v1-fp16-weight.json"])
def test_older_reports_keep_one_entry_a_step(name, report):
    assert Report.load(DATA / name).trace.module_block == 1
    d = json.loads(report.to_json())  # packed, within the bound: no module_block written, as before
    assert "module_block" not in d["trace"]
    assert Report.from_dict(d).trace.module_block == 1


def test_long_arrays_are_decoded_as_the_file_is_read(report, tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "LIFT_FROM", 1000)
    path = tmp_path / "long.json"
    report.save(path)
    text, lifted = reading.read_report(path)
    big = [len(t) for t in lifted.values()]
    assert lifted and min(big) > 0 and all(len(s) < 1000 for s in _strings(json.loads(text)))
    assert all(isinstance(v, columns.Inflated) for v in lifted.values())  # inflated as read, within their sizes
    assert Report.load(path) == Report.from_dict(json.loads(path.read_text()))


def test_a_zlib_key_inside_another_string_is_not_lifted(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "LIFT_FROM", 16)
    data = base64.b64encode(zlib.compress(bytes(range(200)))).decode()
    doc = {'x"zlib': data, "y": ['"zlib": "' + data], "z": {"zlib": data}}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    text, lifted = reading.read_report(path)
    assert list(lifted) == ["#0"] and bytes(lifted["#0"]) == base64.b64decode(data)
    back = json.loads(text)
    assert back['x"zlib'] == data and back["y"] == doc["y"] and back["z"] == {"zlib": "#0"}


def test_data_that_inflates_past_its_declared_size_is_left_for_the_reader_to_refuse(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "LIFT_FROM", 16)
    bomb = {"dtype": "|u1", "count": 10, "zlib": base64.b64encode(zlib.compress(bytes(2**20))).decode()}
    path = tmp_path / "bomb.json"
    path.write_text(json.dumps({"a": bomb}))
    text, lifted = reading.read_report(path)
    assert lifted == {} and json.loads(text) == {"a": bomb}
    with pytest.raises(ReportError, match="holds other than 10 values"):
        columns.unpack(json.loads(text)["a"], "a")


def test_a_lifted_field_that_is_not_base64_is_refused_naming_it(report, tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "LIFT_FROM", 1000)
    d = json.loads(report.to_json())
    text = d["trace"]["histograms"]["activation_grad"]["counts"]["zlib"]
    d["trace"]["histograms"]["activation_grad"]["counts"]["zlib"] = text[:2000] + "!" + text[2001:]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 2 and "counts.zlib" in result.output and "Traceback" not in result.output


def _strings(v: object) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [s for x in v.values() for s in _strings(x)]
    if isinstance(v, list):
        return [s for x in v for s in _strings(x)]
    return []

