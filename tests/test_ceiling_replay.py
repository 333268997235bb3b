"""The overflow ceiling replays its hook set by position while the graph repeats, with the same maxima.

A replayed step skips the Python walk of the autograd graph's metadata: it hooks the nodes
the last full walk hooked, found by their position in walk order. These tests hold it to
the full walk (replay switched off) and to a brute-force hook on every node.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.capture import ceiling as ceiling_module
from tests.test_ceiling import _AttnBlock, _brute_force_max, _ConvNet, _NormNet


class _Deep(nn.Module):
    """Many small layers (the walk's worst case) with a functional scale after the last."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.ReLU())])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * 2.0**7


CASES = [
    (_Deep, lambda: torch.randn(16, 8)),
    (_AttnBlock, lambda: torch.randn(4, 6, 16)),
    (_ConvNet, lambda: torch.randn(4, 3, 8, 8)),
    (_NormNet, lambda: torch.randn(4, 5, 16) * 0.05),
]


def _run(model: nn.Module, batches: list[torch.Tensor], brute: bool = False):
    """Ceiling per step; with ``brute`` also the brute-force max (the loss side is one scalar mean)."""
    expected = []
    with Probe(model) as probe:
        for x in batches:
            model.zero_grad(set_to_none=True)
            out = model(x).float()
            # brute: only a scalar gradient outside the model's graph; else data-dependent maxima
            loss = out.mean() if brute else out.pow(2).mean()
            if brute:
                seen = _brute_force_max(loss)
            loss.backward()
            if brute:
                expected.append(max(float(m) for m in seen))
            probe.step()
    return probe.report().trace.ceiling, probe.collector("ceiling").hooks, expected


@pytest.mark.parametrize("make, make_x", CASES, ids=[c[0].__name__ for c in CASES])
def test_replayed_steps_give_the_full_walks_ceiling(make, make_x, monkeypatch):
    torch.manual_seed(0)
    model = make()
    batches = [make_x() for _ in range(5)]
    got, ceiling, _ = _run(model, batches)
    # Every step after the first; _NormNet's tracked first forward has the tracking's cast
    # views in its graph, so step 2 walks in full and steps 3 to 5 replay its plan.
    assert ceiling.forwards_replayed == (3 if make is _NormNet else 4)
    monkeypatch.setattr(ceiling.__class__, "_replay", lambda self, *a: False)
    full, walked, _ = _run(model, batches)
    assert walked.forwards_replayed == 0
    assert got == full and len(set(got)) > 1
    assert ceiling.nodes_hooked == walked.nodes_hooked  # the same hooks, by position


@pytest.mark.parametrize("make, make_x", CASES[:3], ids=[c[0].__name__ for c in CASES[:3]])
def test_replayed_steps_equal_a_brute_force_max_over_every_node(make, make_x):
    torch.manual_seed(0)
    got, ceiling, expected = _run(make(), [make_x() for _ in range(4)], brute=True)
    assert ceiling.forwards_replayed == 3
    assert got == tuple(expected)


class _Branch(_Deep):
    """_Deep with another graph on demand (one more op at the end)."""

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        out = super().forward(x)
        return torch.tanh(out) * 2.0**3 if extra else out


def test_another_graph_or_a_gradient_left_in_place_walks_in_full():
    torch.manual_seed(0)
    model = _Branch()
    steps = [(False, True), (False, True), (True, True), (False, False), (False, True), (False, True)]
    batches = [torch.randn(16, 8) for _ in steps]

    def run(replay: bool):
        with Probe(model) as probe:
            if not replay:
                probe.collector("ceiling").hooks._replay = lambda *a: False
            for x, (extra, set_to_none) in zip(batches, steps):
                model.zero_grad(set_to_none=set_to_none)
                model(x, extra).pow(2).mean().backward()
                probe.step()
        return probe.report().trace.ceiling, probe.collector("ceiling").hooks.forwards_replayed

    got, replayed = run(True)
    # Step 2 replays step 1's plan; step 3 is another graph (walked in full, tracked again at
    # step 4); step 4 starts with the gradients step 3 left (a new plan); step 5 starts
    # without them (no replay: the weights' nodes are decided otherwise); step 6 replays.
    assert replayed == 2
    assert got == run(False)[0]


def test_a_later_walk_in_a_replayed_step_undoes_the_replay():
    """probe.watch(loss) after a replayed forward: the full walk runs first, nothing is missed."""
    torch.manual_seed(0)
    model = _ConvNet()
    batches = [torch.randn(4, 3, 8, 8) for _ in range(4)]
    got, expected = [], []
    with Probe(model) as probe:
        for i, x in enumerate(batches):
            model.zero_grad(set_to_none=True)
            out = model(x)
            loss = (out * 2.0**9).pow(2).mean()  # the loss side's gradients are the largest
            if i == 2:  # steps 1 and 2 had one walk each: step 2 replays, step 3 watches after it
                assert probe.collector("ceiling").hooks._replayed is not None
                probe.watch(loss)
                assert probe.collector("ceiling").hooks._replayed is None
            seen = _brute_force_max(loss)
            loss.backward()
            expected.append(max(float(m) for m in seen))
            probe.step()
    got = probe.report().trace.ceiling
    assert got[2] == expected[2]  # watched: every node
    assert all(g <= e for g, e in zip(got, expected))  # unwatched: the model's side only
    assert probe.collector("ceiling").hooks.forwards_replayed == 1  # step 2; step 3's replay was undone, step 4 follows it


def test_replay_costs_less_than_the_walk():
    """The point of it: a replayed forward does not read node metadata (counted here by a spy)."""
    torch.manual_seed(0)
    model = _Deep()
    calls = []
    real = ceiling_module._mark_mirrors
    with Probe(model) as probe:
        ceiling_module._mark_mirrors = lambda *a: calls.append(1) or real(*a)
        try:
            for _ in range(4):
                model.zero_grad(set_to_none=True)
                model(torch.randn(16, 8)).mean().backward()
                probe.step()
        finally:
            ceiling_module._mark_mirrors = real
    assert calls == [1]  # the first step's full walk only
