"""What the framework callbacks write beside their report: the answer with its findings and caveats."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.integrations import RECOMMENDATION_NAME, REPORT_NAME, write_outputs
from fp16probe.report import Report
from fp16probe.sections import Workload
from fp16probe.presentation.verdict import verdict_text


def _report() -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with Probe(model) as probe:
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            probe.step()
    report = probe.report()
    md = report.metadata
    work = dataclasses.replace(report.workload or Workload(), notes=["fp16=True had no effect: the run was on the CPU"])
    # Judged for activation gradients alone: the analysis qualifies it with the narrowed-kind caveat.
    return dataclasses.replace(report, metadata=md, workload=work, recommendation=analyze(report, "fp16", kind="activation_grad"))


def test_the_recommendation_file_carries_the_caveats_and_findings(tmp_path):
    report = _report()
    rec = report.recommendation
    assert "narrowed_kind" in [c.code for c in rec.caveats]
    write_outputs(report, tmp_path)
    text = (tmp_path / RECOMMENDATION_NAME).read_text()
    flat = " ".join(text.split())
    for caveat in rec.caveats:
        assert "caveat: " + " ".join(str(caveat).split()) in flat
    assert "fp16=True had no effect: the run was on the CPU" in flat
    assert " ".join(verdict_text(rec).split()) in flat  # the reasoning follows the short answer
    assert flat.index("caveat:") < flat.index(" ".join(verdict_text(rec).split())[:60])
    assert max(len(line) for line in text.splitlines()) <= 80 or "://" in text
    assert Report.load(tmp_path / REPORT_NAME).recommendation == rec
