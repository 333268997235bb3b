"""Weight updates lost without fp32 master weights: measured by casting, against the rule of thumb.

Unlike the rest of the analysis stage this reads tensors (a model's weights and updates),
so it syncs with the host once per parameter: call it outside the training loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from fp16probe.analysis.whatif import fraction
from fp16probe.errors import AnalysisError
from fp16probe.formats import Format, get_format

__all__ = ["ParameterUpdateLoss", "WeightUpdateLoss", "weight_update_loss"]


@dataclass(frozen=True)
class ParameterUpdateLoss:
    """One parameter: how many of its nonzero updates vanish when added in the format."""

    name: str
    elements: int
    nonzero_updates: int
    lost: int
    rule_lost: int

    @property
    def lost_fraction(self) -> float:
        """Return the share of nonzero updates that vanish."""
        return fraction(self.lost, self.nonzero_updates)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["lost_fraction"] = self.lost_fraction
        return d


@dataclass(frozen=True)
class WeightUpdateLoss:
    """Updates lost when weights are kept in ``format`` without fp32 master copies.

    ``lost`` counts elements with a nonzero update u where ``fmt(fmt(w) + fmt(u)) == fmt(w)``,
    measured by casting; ``rule_lost`` counts the rule of thumb of Micikevicius et al. (arXiv:1710.03740),
    ``|w| >= 2^(mantissa bits + 1) |u|`` (2^11 for fp16), for comparison.
    """

    format: str
    parameters: tuple[ParameterUpdateLoss, ...]

    @property
    def elements(self) -> int:
        """Return the sum over parameters."""
        return sum(p.elements for p in self.parameters)

    @property
    def nonzero_updates(self) -> int:
        """Return the sum over parameters."""
        return sum(p.nonzero_updates for p in self.parameters)

    @property
    def lost(self) -> int:
        """Return the sum over parameters."""
        return sum(p.lost for p in self.parameters)

    @property
    def rule_lost(self) -> int:
        """Return the sum over parameters."""
        return sum(p.rule_lost for p in self.parameters)

    @property
    def lost_fraction(self) -> float:
        """Return the share of nonzero updates that vanish."""
        return fraction(self.lost, self.nonzero_updates)

    @property
    def rule_lost_fraction(self) -> float:
        """Return the share of nonzero updates the rule of thumb predicts lost."""
        return fraction(self.rule_lost, self.nonzero_updates)

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form."""
        return {
            "format": self.format,
            "elements": self.elements,
            "nonzero_updates": self.nonzero_updates,
            "lost": self.lost,
            "lost_fraction": self.lost_fraction,
            "rule_lost": self.rule_lost,
            "rule_lost_fraction": self.rule_lost_fraction,
            "parameters": [p.to_dict() for p in self.parameters],
        }
        # fp16probe.presentation.answer.weight_update_words words it.


def weight_update_loss(
    weights: torch.nn.Module | Mapping[str, torch.Tensor],
    updates: Mapping[str, torch.Tensor] | None = None,
    *,
    lr: float | None = None,
    format: str | Format = "fp16",
) -> WeightUpdateLoss:
    """Count the parameter elements whose update would vanish in ``format`` without fp32 master weights.

    ``updates`` maps parameter names to the optimizer's update tensors (new minus old
    weight). Without it, the update is plain SGD's ``-lr * grad`` from each parameter's
    ``.grad`` (a Module is required then); parameters without a gradient are left out.
    This reads tensors (one host sync per parameter); call it outside the training loop.
    """
    fmt = format if isinstance(format, Format) else get_format(format)
    named: dict[str, torch.Tensor]
    if isinstance(weights, torch.nn.Module):
        named = {n: p for n, p in weights.named_parameters() if p.requires_grad}
    else:
        named = dict(weights)
    if updates is None:
        if lr is None:
            raise AnalysisError("give the optimizer's updates or a learning rate (lr=...) to derive SGD's -lr*grad")
        updates = {n: -float(lr) * p.grad for n, p in named.items() if p.grad is not None}
        if not updates:
            raise AnalysisError("no parameter has a .grad: run a backward pass first, or pass updates=...")
    ratio = math.ldexp(1.0, fmt.mantissa_bits + 1)
    rows = []
    for name, u in updates.items():
        if name not in named:
            raise AnalysisError(f"update for {name!r} has no matching weight: expected names from {sorted(named)[:5]}...")
        w = named[name].detach().float()
        u = u.detach().float()
        if u.shape != w.shape:
            raise AnalysisError(f"update for {name!r} has shape {tuple(u.shape)}, weight has {tuple(w.shape)}")
        w_low = w.to(fmt.dtype)
        summed = (w_low.float() + u.to(fmt.dtype).float()).to(fmt.dtype)
        moved = u != 0
        lost = moved & (summed.float() == w_low.float())
        rule = moved & (w.abs() >= ratio * u.abs())
        rows.append(ParameterUpdateLoss(name, w.numel(), int(moved.sum()), int(lost.sum()), int(rule.sum())))
    return WeightUpdateLoss(fmt.name, tuple(rows))
