"""The overflow ceiling: the largest gradient backward makes anywhere, unscaled, per step."""

from __future__ import annotations

import json
import math

import torch
from torch import nn

from fp16probe import Probe, Report
from fp16probe.report import StepTrace


class Scaled(nn.Module):
    """Functional code after the last module: the output gradient is 2^20 x what modules see."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * 2.0**-20


def _every_gradient_max(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Reference: max |g| over the output's gradient, every intermediate and every weight grad."""
    model.zero_grad()
    h1 = model.a(x)
    r = torch.relu(h1)
    h2 = model.b(r)
    out = h2 * 2.0**-20
    for t in (h1, r, h2, out):
        t.retain_grad()
    ((out - y) ** 2).mean().backward()
    grads = [t.grad for t in (h1, r, h2, out)] + [p.grad for p in model.parameters()]
    return max(g.abs().max().item() for g in grads)


def test_ceiling_sees_the_gradient_at_the_output_that_module_hooks_miss():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(32, 8), torch.randn(32, 4) * 2.0**-20
    with Probe(model) as probe:
        for _ in range(2):
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            probe.step()
    report = probe.report()
    expected = _every_gradient_max(model, x, y)
    assert report.trace.ceiling == (expected, expected)
    module_max = max(max(report.trace.global_max(k)) for k in ("activation_grad", "weight_grad"))
    assert expected > 2.0**15 * module_max  # the blind spot is real: 2^20 at the output


def test_watch_adds_the_loss_side_gradients():
    torch.manual_seed(0)
    model, x = nn.Linear(4, 4), torch.randn(8, 4)
    with Probe(model) as probe:
        loss = (model(x) * 2.0**-12).sum()  # loss-side code outside the model
        probe.watch(loss)
        loss.backward()
        probe.step()
    # d loss / d (out * 2^-12) = 1: only the walk from the loss sees it.
    assert probe.report().trace.ceiling == (1.0,)
    model.zero_grad()
    with Probe(model) as probe:
        (model(x) * 2.0**-12).sum().backward()
        probe.step()
    grads = [2.0**-12, model.weight.grad.abs().max().item(), model.bias.grad.abs().max().item()]
    assert probe.report().trace.ceiling == (max(grads),)
    assert max(grads) < 2.0**-6


def test_ceiling_is_unscaled_by_the_grad_scaler_and_inf_on_overflow():
    torch.manual_seed(0)
    model, x, y = Scaled(), torch.randn(32, 8), torch.randn(32, 4) * 2.0**-20
    reference = _every_gradient_max(model, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    bad = x.clone()
    bad[0, 0] = math.inf  # the second step's backward holds inf/NaN
    with Probe(model, scaler=scaler) as probe:
        for batch in (x, bad):
            model.zero_grad()
            scaler.scale(((model(batch) - y) ** 2).mean()).backward()
            probe.step()
    report = probe.report()
    assert report.trace.ceiling[0] == reference
    assert report.trace.ceiling[1] == math.inf and report.trace.found_inf[1]
    text = report.to_json()
    assert '"inf"' in text
    back = Report.from_dict(json.loads(text))
    assert back.trace.ceiling == (reference, math.inf)


def test_reports_without_a_ceiling_load_with_none():
    d = StepTrace(steps=(0,), scale=(None,), found_inf=(False,)).to_dict()
    assert "ceiling" not in d
    assert StepTrace.from_dict(d).ceiling is None
    merged = Report.from_dict(
        {"schema_version": 1, "metadata": {"fp16probe_version": "0", "torch_version": "0", "device": "cpu",
                                           "model_class": "M"}, "modules": [], "trace": d}
    )
    assert merged.trace.ceiling is None


def test_a_module_whose_forward_is_bypassed_is_named():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q = torch.randn(2, 5, 8)
    with Probe(mha) as probe:
        out, _ = mha(q, q, q)
        out.square().sum().backward()
        probe.step()
    report = probe.report()
    assert report.metadata.extra["unrecorded_modules"] == ["out_proj"]
    # The ceiling still sees out_proj's weight gradient and the attention internals.
    assert report.trace.ceiling[0] >= mha.out_proj.weight.grad.abs().max().item() > 0
