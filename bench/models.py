"""Model pieces the benchmarks and tests share; nothing here imports fp16probe.

``bench/peak_memory.py`` measures other checkouts of fp16probe (``PYTHONPATH``) with these,
so they must not pull in this checkout's package.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2015, arXiv:1512.03385): two 3x3 conv-BN pairs and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + self.skip(x))


class HookMix(nn.Module):
    """Conv, batch norm, attention, layer norm and a head: every kind of hook the Probe uses.

    Takes ``[B, 3, S, S]`` images; the conv's ``channels * S * S`` values per sample are read
    as a sequence of ``dim``-wide tokens for the attention.
    """

    def __init__(self, channels: int, dim: int, heads: int, classes: int) -> None:
        super().__init__()
        self.dim = dim
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.act = nn.ReLU()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bn(self.conv(x)))
        seq = h.flatten(2).transpose(1, 2).reshape(x.shape[0], -1, self.dim)
        a, _ = self.attn(seq, seq, seq)
        return self.head(self.norm(a + seq)).mean(1)
