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
        return a, b, self.gain  # two outputs of one node, and the parameter itself (no grad_fn: a tensor hook)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = _Split()
        self.act = nn.GELU()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, g = self.split(x)
        h = self.act(a + (b * 3.0).t().contiguous().t())
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


class _Second(nn.Module):
    """Returns the second output of a two-output node (``output_nr`` 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.first, second = h.chunk(2, dim=1)
        return second


def test_the_pre_hook_reads_its_own_output_of_a_node():
    """The module's output is output 1 of a ``chunk`` node whose output 0 gets another gradient."""
    torch.manual_seed(0)
    model = _Second()
    x = torch.randn(5, 8)
    with Probe(model, modules=["(model)"]) as probe:
        for _ in range(2):  # the first step and a later one
            model.zero_grad(set_to_none=True)
            out = model(x)
            assert out.output_nr == 1 and out.grad_fn is model.first.grad_fn
            out.retain_grad()
            ((model.first * 2.0**-8).sum() + (out * 2.0**8).pow(2).sum()).backward()
            want = out.grad.clone()
            probe.step()
    got = next(m.histogram for m in probe.report().modules if m.kind == "activation_grad")
    c, k = engine.histogram(torch.cat([want.reshape(-1)] * 2))
    assert got.counts == histogram_from(c.tolist(), int(k)).counts


@pytest.mark.parametrize("n", [100, None])  # both sides of the aminmax switch
def test_forward_maximum_is_the_largest_magnitude_on_both_paths(n):
    from fp16probe.capture import recorder as recorder_module
    from fp16probe.capture.recorder import Recorder

    n = n or recorder_module._AMINMAX_FROM + 1

    cases = [torch.randn(n).half() * 100, -torch.rand(n), torch.randn(n).to(torch.bfloat16)]
    with_nan, with_inf = torch.randn(n), torch.randn(n)
    with_nan[n // 2], with_inf[3] = float("nan"), -float("inf")
    for x in cases + [with_nan, with_inf]:
        rec = Recorder({"activation_grad": True})
        rec.enabled = rec.forward = True
        rec.note_forward("m", x)
        got, want = rec.forward_maxima()[0]["m"], float(x.float().abs().max())
        assert got == want or (got != got and want != want), (x.dtype, got, want)
