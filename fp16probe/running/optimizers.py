"""The optimizers a profile (and its verification) can run by name."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "make_optimizer"]

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """Build the optimizer named ``name`` (``sgd``, ``adam``, ``adamw``) over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS[name](params, lr=lr)
