"""A live fp16 loop on a model compiled by inductor: the Probe leaves the compiled program and training as they
are (issue 39, item 2).

Real CPU fp16 autocast with a real ``GradScaler("cpu")``, ``torch.compile`` with its default backend. The
probed run's final weights must equal the unprobed compiled run's bit for bit, dynamo must build the same graphs
with no recompile (``error_on_recompile``) and no graph break, the fp32 reruns must run, uncompiled, and the
verdict from them must be within one power of two of an fp32 ``fp16probe.profile`` of the same model and batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.answer import compile_notes
from tests.fixtures.loops import finish_step

pytestmark = pytest.mark.slow  # inductor compiles C++ kernels: several seconds a run on 2 cores

STEPS = 5  # reruns at steps 0, 1, 2 and 4 (the early schedule)


class _Net(nn.Module):
    """A tiny MLP that returns its loss, small enough that fp16 flushes some gradients at S = 1."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.body(x).float(), y) * 1e-4


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(STEPS)]


def _train(how: str | None):
    """Train the compiled model ``STEPS`` steps: unprobed (None), the Probe given the compiled wrapper
    (``"wrapper"``: its forward is replayed), or the Probe given the model and the loop calling
    ``probe.shadow(fn)`` (``"shadow_fn"``). Returns the final weights, dynamo's counters and the report."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _Net()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    probe = None if how is None else Probe(compiled if how == "wrapper" else model, scaler=scaler)
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if probe is not None:
            probe.start()
        for batch in _batches():
            if how == "shadow_fn":
                probe.shadow(lambda: compiled(**batch))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = compiled(**batch)
            finish_step(loss, opt, scaler, probe)
    report = None
    if probe is not None:
        probe.stop()
        report = probe.report()
    ours = [str(w.message) for w in said if str(w.message).startswith("fp16probe:")]
    return ([p.detach().clone() for p in model.parameters()], {k: dict(v) for k, v in counters.items()},
            report, ours)


@pytest.fixture(scope="module")
def unprobed():
    return _train(None)


@pytest.fixture(scope="module")
def fp32_scale() -> int:
    torch.manual_seed(0)
    report = fp16probe.profile(_Net(), _batches(), lambda out, batch: out, steps=STEPS, precision="fp32",
                               optimizer="sgd", lr=0.1)
    return report.recommendation.log2_scale


@pytest.mark.parametrize("how", ["wrapper", "shadow_fn"])
def test_inductor_training_is_bit_identical_with_the_probe_and_its_reruns_do_not_recompile(how, unprobed,
                                                                                            fp32_scale):
    weights, graphs, _, _ = unprobed
    probed_weights, probed_graphs, report, said = _train(how)
    assert all(torch.equal(a, b) for a, b in zip(weights, probed_weights))
    assert probed_graphs["stats"]["unique_graphs"] == graphs["stats"]["unique_graphs"] == 1
    assert not probed_graphs.get("graph_break")
    runs = report.shadow_runs
    assert runs.steps == (0, 1, 2, 4) and not runs.discarded and runs.off is None, runs
    assert report.shadow.metadata.precision == "fp32"
    rec = analyze(report)
    assert rec.verdict in ("constant", "dynamic") and abs(rec.log2_scale - fp32_scale) <= 1, (rec, fp32_scale)
    # it says what it leaves out, when it starts and in the report; no module is blamed for it
    assert len(said) == 1 and "not read" in said[0], said
    assert report.capture.compile_traced and not report.capture.unrecorded_modules
    assert report.capture.compiled_modules == (("",) if how == "wrapper" else ())
    assert compile_notes(report) and "not read" in compile_notes(report)[0]
    # the weight gradients are still counted, every step
    assert report.histogram("weight_grad").total > 0 and len(report.trace.steps) == STEPS


def test_a_forward_inside_compiled_code_is_not_replayed_and_the_report_says_how_to_get_reruns(unprobed):
    """The Probe on the model, compiled after, and no probe.shadow(fn): no reruns, and the reason given."""
    weights, _, report, said = _train("model")
    assert all(torch.equal(a, b) for a, b in zip(unprobed[0], weights))
    assert report.shadow_runs.steps == () and "probe.shadow(fn)" in report.shadow_runs.off
    assert said and "probe.shadow(fn)" in said[0]
