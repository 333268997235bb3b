"""The recorder's thin per-tensor path counts what the general path counts.

After the first step a module output's gradient is counted by a pre-hook on the node that
made it and one kernel call into its row (plain CPU fp32, numba engine, no scaler); anything
else takes the general path. Both must give the same report, equal to the gradients
themselves counted directly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.capture import engine
from fp16probe.capture.recorder import histogram_from


class _Split(nn.Module):
    """A module with two outputs of one node (``chunk``), one non-contiguous output, and a leaf output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.gain = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b = self.lin(x).chunk(2, dim=1)
        return a, b * 3.0, self.gain  # the parameter itself: no grad_fn, a tensor hook


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = _Split()
        self.act = nn.GELU()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, g = self.split(x)
        h = self.act(a + b.t().contiguous().t())
        return self.head(h + g.sum() * 1e-3)


def _report(model: nn.Module, batches: list[torch.Tensor], thin: bool, monkeypatch) -> dict:
    if not thin:
        monkeypatch.setattr(engine, "thin_counter", lambda: None)
    with Probe(model, modules=["split", "split.lin", "act", "head"]) as probe:
        for x in batches:
            model.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            probe.step()
    monkeypatch.undo()
    return {(m.kind, m.name): m.histogram for m in probe.report().modules}


def test_thin_and_general_paths_give_the_same_report(monkeypatch):
    if engine.cpu_engine() != "numba":
        pytest.skip("the thin path is the numba engine's")
    torch.manual_seed(0)
    model = _Net()
    batches = [torch.randn(5, 8) for _ in range(3)]
    calls = []
    real = engine.thin_counter

    def spy():
        got = real()
        calls.append(got is not None)
        return got

    monkeypatch.setattr(engine, "thin_counter", spy)
    thin = _report(model, batches, True, monkeypatch)
    assert calls and all(calls)
    general = _report(model, batches, False, monkeypatch)
    assert thin == general
    assert thin[("activation_grad", "split")].total > 0


def test_each_output_of_a_node_counts_its_own_gradient():
    """Two outputs of one ``chunk`` node: each pre-hook reads its own ``grad_outputs[output_nr]``."""
    torch.manual_seed(0)
    model = _Split()
    x = torch.randn(5, 8)
    with Probe(model, modules=["(model)"]) as probe:
        a, b, g = model(x)
        for t in (a, b):
            t.retain_grad()
        ((a * 2.0**-8).sum() + (b * 2.0**8).sum() + g.sum()).backward()
        probe.step()
    got = next(m.histogram for m in probe.report().modules if m.kind == "activation_grad" and m.name == "(model)")
    c, k = engine.histogram(torch.cat([a.grad.reshape(-1), b.grad.reshape(-1), torch.ones(g.numel())]))
    assert got == histogram_from(c.tolist(), int(k))
