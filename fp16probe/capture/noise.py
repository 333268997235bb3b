"""The fp32 gradients' batch-to-batch noise, per parameter: the sampling noise SGD already tolerates.

k fp32 steps of the same weights on k of the profile's batches; per parameter the sums
``sum_b ||g_b - g_mean||^2`` and ``sum_b ||g_b||^2`` (float64, on the gradients' device, one
host transfer). ``sqrt(spread / (k - 1) / (square / k))`` is then one batch's noise as a share of
a batch gradient's RMS norm, the same denominator as the emulated step's relative error: the
unbiased sample variance of the batch gradient (McCandlish et al., "An Empirical Model of
Large-Batch Training", arXiv:1812.06162, estimate the noise scale tr(Sigma)/|G|^2 from the same
kind of small-batch gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.capture.emulate import reference_step

__all__ = ["measure_noise"]


def measure_noise(model: nn.Module, runs: Sequence[Callable[[], torch.Tensor]], names: Sequence[str]
                  ) -> dict[str, Any]:
    """fp32 steps on ``runs`` (one per batch): per parameter in ``names`` ``[spread, square]`` (see the module docstring).

    The model's weights, buffers, ``.grad`` and random state are as they were afterwards (each
    step is :func:`fp16probe.capture.emulate.reference_step`'s). Synchronises once, at the end.
    """
    sums: dict[str, torch.Tensor] = {}
    squares: dict[str, torch.Tensor] = {}
    for run in runs:
        grads = reference_step(model, run).grads
        for n in names:
            g = grads.get(n)
            if g is None:
                continue
            g64 = g.detach().double()
            sums[n] = sums[n] + g64 if n in sums else g64.clone()
            squares[n] = squares[n] + g64.square().sum() if n in squares else g64.square().sum()
    k = len(runs)
    rows = []
    for n in names:
        if n not in sums:
            rows.append(torch.zeros(2, dtype=torch.float64))
            continue
        square = squares[n]
        spread = (square - sums[n].square().sum() / k).clamp(min=0.0)  # sum_b ||g_b||^2 - k ||mean||^2
        rows.append(torch.stack([spread, square]).cpu())
    host = torch.stack(rows).tolist() if rows else []
    return {"batches": k, "params": [[float(a), float(b)] for a, b in host],
            "source": "fp16probe.capture.noise: fp32 steps of the profile's weights on its first batches; per "
                      "parameter sum_b ||g_b - mean||^2 and sum_b ||g_b||^2"}
