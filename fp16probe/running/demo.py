"""The built-in demo: a deep, narrow MLP whose activation gradients fall below FP16's range.

It is the classic vanishing-gradient set-up: each tanh layer is initialised with a gain
below one, so the gradient shrinks by a roughly constant factor per layer on its way back,
and a mean-reduced loss over a large batch makes it small to begin with. Nothing here
states how much underflows: ``fp16probe profile`` with no MODEL measures it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["DEMO_BATCH", "DEMO_DEPTH", "DEMO_WIDTH", "DemoNet", "demo_batches", "demo_loss"]

DEMO_DEPTH = 16
DEMO_WIDTH = 64
DEMO_BATCH = 256
DEMO_GAIN = 0.4  # per-layer gain of the initialisation: below 1, so gradients shrink layer by layer


class DemoNet(nn.Sequential):
    """A DEMO_DEPTH-layer tanh MLP initialised with a small gain (a vanishing-gradient net)."""

    def __init__(self, depth: int = DEMO_DEPTH, width: int = DEMO_WIDTH, gain: float = DEMO_GAIN,
                 seed: int = 0) -> None:
        layers: list[nn.Module] = []
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 1))
        super().__init__(*layers)
        g = torch.Generator().manual_seed(seed)
        for m in self:
            if isinstance(m, nn.Linear):
                # Standard deviation gain / sqrt(fan_in): each layer scales signals by ~gain.
                with torch.no_grad():
                    m.weight.normal_(0.0, gain / m.in_features**0.5, generator=g)
                    m.bias.zero_()


def demo_batches(width: int = DEMO_WIDTH, batch: int = DEMO_BATCH, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(x, y)`` regression batches forever; ``y`` is a fixed random linear teacher of ``x``."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(width, 1, generator=g) / width**0.5
    while True:
        x = torch.randn(batch, width, generator=g)
        yield x, x @ teacher


def demo_loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error against the batch's target."""
    return torch.nn.functional.mse_loss(output, batch[1].to(output.device))
