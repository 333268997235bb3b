"""The train-inference log-probability mismatch as numbers (no words; see docs/mismatch.md).

Per counted token t with realised next token y_t: Δ_t = log p_low(y_t) − log p_fp32(y_t), both
log-probabilities taken by ``log_softmax`` over the model's logits in float64 (RL trainers take
``logits.float().log_softmax(-1)``; float64 keeps fp32's own rounding, about 1e-7, out of Δ and
keeps the KL, about 1e-8 for fp16, from going negative). ``kl`` is KL(p_fp32 ‖ p_low) summed exactly over the
vocabulary at each counted position, averaged over the counted positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MismatchStats", "mismatch_stats", "ratio"]


@dataclass(frozen=True)
class MismatchStats:
    """One low format's mismatch against fp32 over the counted tokens (nats)."""

    format: str
    tokens: int
    mean_abs: float  # mean |Δ_t|
    p99_abs: float  # 99th percentile of |Δ_t| (linear interpolation)
    max_abs: float  # max |Δ_t|
    kl: float  # mean over positions of KL(p_fp32 ‖ p_low), exact over the vocabulary


def mismatch_stats(format: str, logp_ref: torch.Tensor, logp_low: torch.Tensor, targets: torch.Tensor,
                   mask: torch.Tensor) -> MismatchStats:
    """Statistics of one format's mismatch.

    ``logp_ref``/``logp_low``: [batch, positions, vocab] fp32 log-probabilities predicting the
    token after each position; ``targets``: [batch, positions] the realised next tokens;
    ``mask``: [batch, positions] bool, which positions count. Synchronises once per number.
    """
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        raise ValueError("the completion mask counts no token")
    ref = logp_ref.double()
    low = logp_low.double()
    idx = targets.unsqueeze(-1)
    delta = (low.gather(-1, idx) - ref.gather(-1, idx)).squeeze(-1)[m].abs()
    kl_pos = (ref.exp() * (ref - low)).sum(-1)[m]
    return MismatchStats(format=format, tokens=n, mean_abs=float(delta.mean()),
                         p99_abs=float(torch.quantile(delta, 0.99)), max_abs=float(delta.max()),
                         kl=float(kl_pos.mean()))


def ratio(num: float, den: float) -> float | None:
    """num / den, or None where den is 0 (no mismatch to compare against)."""
    return num / den if den > 0 else None
