"""Small models that fail in fp16 the ways real ones do, for the examples in docs/fp16-run.md."""

from __future__ import annotations

import torch
from torch import nn


class HotMLP(nn.Module):
    """A feed-forward block whose hidden values reach about 1e5, as a trained T5's do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 64)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(64, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(4e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def abs_mean_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """A loss autocast leaves in fp16 (abs and mean are on no fp32 list)."""
    return output.abs().mean()
