"""The collector protocol: a collector registered only here reaches the report, its JSON and ``show``;
older report files, which kept the collectors' results in ``metadata.extra``, load into the sections."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fp16probe import Probe, Report
from fp16probe.capture.collector import Collected, Collector, register_collector, unregister_collector
from fp16probe.cli import app
from fp16probe.sections import register_section, unregister_section


@dataclass(frozen=True)
class OutputPeak:
    """The largest |output| of the model over the sampled steps, and how many forwards and steps it saw."""

    forwards: int
    steps: int
    peak: float

    def to_dict(self) -> dict[str, Any]:
        return {"forwards": self.forwards, "steps": self.steps, "peak": self.peak}

    @classmethod
    def from_dict(cls, d: Any, *, path: str = "peak") -> "OutputPeak":
        return cls(int(d["forwards"]), int(d["steps"]), float(d["peak"]))


class PeakCollector(Collector):
    """Keeps the peak on the device (no host sync in the hook); one transfer at collect."""

    key = "peak"

    def __init__(self, probe: Probe) -> None:
        self.model = probe.model
        self.forwards = self.steps = 0
        self.open_forwards = 0
        self.peak = self.open_peak = None  # device scalars: the closed steps', the open step's

    def sample(self, handles: list[Any]) -> None:
        handles.append(self.model.register_forward_hook(self._hook))

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        top = output.detach().abs().amax()
        self.open_peak = top if self.open_peak is None else torch.maximum(self.open_peak, top)
        self.open_forwards += 1

    def close_step(self, sampled: bool) -> None:
        self.forwards += self.open_forwards
        if self.open_peak is not None:
            self.peak = self.open_peak if self.peak is None else torch.maximum(self.peak, self.open_peak)
        self.open_forwards, self.open_peak = 0, None
        self.steps += int(sampled)

    def discard_step(self) -> None:
        self.open_forwards, self.open_peak = 0, None

    def collect(self, got: Collected) -> dict[str, Any]:
        return {"peak": OutputPeak(self.forwards, self.steps, 0.0 if self.peak is None else float(self.peak))}


@pytest.fixture
def peak_registered():
    register_section("peak", OutputPeak.from_dict)
    register_collector(PeakCollector)
    try:
        yield
    finally:
        unregister_collector(PeakCollector)
        unregister_section("peak")


def _train(model: nn.Module, probe: Probe, xs: list[torch.Tensor], discard: int | None = None) -> float:
    peak = 0.0
    for i, x in enumerate(xs):
        out = model(x)
        out.pow(2).mean().backward()
        if i == discard:
            probe.discard_step()
        else:
            peak = max(peak, float(out.detach().abs().max()))
            probe.step()
    return peak


def test_a_collector_registered_here_reaches_the_report_its_json_and_show(tmp_path, peak_registered):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = [torch.randn(5, 4) * (4 if i == 1 else 1) for i in range(4)]  # the dropped step holds the largest
    with Probe(model) as probe:
        expected = _train(model, probe, xs, discard=1)
    report = probe.report()
    assert report.sections["peak"] == OutputPeak(forwards=3, steps=3, peak=expected)  # the dropped step is not counted
    assert report.section("peak") is report.sections["peak"]
    path = report.save(tmp_path / "r.json")
    assert json.loads(path.read_text())["sections"]["peak"] == {"forwards": 3, "steps": 3, "peak": expected}
    again = Report.load(path)
    assert again.sections["peak"] == report.sections["peak"] and again.to_dict() == report.to_dict()
    shown = CliRunner().invoke(app, ["show", str(path)])
    assert shown.exit_code == 0, shown.output
    assert f"peak: forwards=3, steps=3, peak={expected}" in shown.output
    data = json.loads(CliRunner().invoke(app, ["show", str(path), "--json"]).stdout)
    assert data["sections"]["peak"]["forwards"] == 3


def test_a_section_this_version_does_not_know_is_kept_as_json(tmp_path, peak_registered):
    model = nn.Linear(3, 2)
    with Probe(model) as probe:
        _train(model, probe, [torch.randn(2, 3)])
    path = probe.report().save(tmp_path / "r.json")
    unregister_section("peak")
    raw = Report.load(path)
    assert raw.sections["peak"] == {"forwards": 1, "steps": 1, "peak": pytest.approx(raw.sections["peak"]["peak"])}
    assert json.loads(raw.to_json())["sections"] == json.loads(path.read_text())["sections"]


def test_without_a_registration_no_section_and_no_hook():
    model = nn.Linear(3, 2)
    with Probe(model) as probe:
        _train(model, probe, [torch.randn(2, 3)])
        plain = len(model._forward_hooks)
        assert probe.collector("peak") is None
    assert probe.report().sections == {}
    register_collector(PeakCollector)
    try:
        with Probe(model) as probe:
            assert len(model._forward_hooks) == plain + 1 and probe.collector("peak") is not None
    finally:
        unregister_collector(PeakCollector)


class _Skipping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        self.unused, self.unused_act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _as_older_report(d: dict[str, Any]) -> dict[str, Any]:
    """The same report as versions before sections wrote it: the collectors' results in metadata.extra."""
    old = json.loads(json.dumps(d))
    extra = old["metadata"]["extra"]
    fwd = old.pop("forward")
    extra["forward_max"] = {"modules": fwd["modules"], "first_overflow_step": fwd["first_overflow_step"],
                            "step_max": fwd["step_max"], "source": "the largest |output| of each hooked module"}
    extra["shadow"] = old.pop("shadow_runs")
    notes = old.pop("capture")
    extra.update({k: v for k, v in notes.items() if k != "granularity"})
    extra["target"] = old["metadata"].pop("target")
    extra["regime"] = old["metadata"].pop("regime", "autocast")
    return old


def test_an_older_report_file_loads_its_results_into_the_sections(tmp_path):
    torch.manual_seed(0)
    model = _Skipping()
    with Probe(model, target="cpu", shadow_every=1) as probe:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(5, 4)).float().pow(2).mean()
            probe.shadow(lambda: model(torch.randn(5, 4)).pow(2).mean())
            loss.backward()
            probe.step()
    report = probe.report(extra={"mine": 1})
    new = report.to_dict()
    assert report.capture.gradient_free_modules == ("unused_act",) and report.capture.unrecorded_modules == ("unused",)
    assert report.shadow_runs.count == 2 and report.forward.module_max
    assert set(new["metadata"]["extra"]) == {"mine"}  # only the caller's own metadata
    old = _as_older_report(new)
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Report.load(tmp_path / "old.json")
    assert loaded.forward == report.forward and loaded.shadow_runs == report.shadow_runs
    assert loaded.capture == report.capture and loaded.metadata == report.metadata
    assert loaded.to_dict() == new
