"""The README's worked examples: your own model, your own batches and your own loss.

``fp16probe profile docs.examples.my_model:build --batches docs.examples.my_model:batches
--loss docs.examples.my_model:loss`` runs them from the repository root (the current
directory is importable). Replace each function with yours.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F


def build() -> nn.Module:
    """The model: a deep tanh classifier over 32 features, 10 classes, initialised a little small
    (a per-layer gain of 0.5), so its early layers' gradients fade as a real deep net's can."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(32, 128), nn.Tanh()]
    for _ in range(8):
        layers += [nn.Linear(128, 128), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(128, 10))
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.5 / m.in_features**0.5)
    return model


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches, as a DataLoader yields them: (inputs, labels)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        yield torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)


def loss(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss you train with: (model output, batch) -> scalar."""
    return F.cross_entropy(output, batch[1], label_smoothing=0.1)
