"""Policy-gradient objectives for causal LMs (GRPO, PPO's clipped surrogate), computed as the frameworks do.

GRPO is from Shao et al., arXiv 2402.03300 (record :data:`fp16probe.sources.GRPO`); the terms follow
verl's ``core_algos`` and TRL's ``GRPOTrainer``:

* advantages: per group of G completions of one prompt, ``A_i = (r_i - mean) / (std + eps)``
  (``group=True``); PPO here has no critic: the baseline is the batch's mean reward,
  ``A_i = r_i - mean`` (``group=False``);
* ratio ``rho = exp(logp - logp_old)``, surrogate ``max(-A rho, -A clip(rho, 1-eps, 1+eps))`` per token;
* optional KL to a reference by the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``, weight ``beta``;
* optional entropy bonus, weight ``entropy_coef`` (subtracted);
* aggregation over completion tokens: ``"token-mean"`` (DAPO) or ``"seq-mean"``.

Numbers only; no words (analysis/presentation split).
"""

from __future__ import annotations

import torch

__all__ = ["AGGREGATIONS", "advantages", "policy_loss", "token_logprobs"]

AGGREGATIONS = ("token-mean", "seq-mean")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return per-token log-probabilities of ``input_ids[:, 1:]`` and the entropies, both ``[B, T-1]``.

    ``log_softmax`` and ``gather`` run in the logits' dtype, as autocast leaves them.
    """
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def advantages(rewards: torch.Tensor, group_size: int, *, group: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Return one advantage per completion; ``rewards`` is ``[B]`` with ``B`` a multiple of ``group_size``."""
    r = rewards.float()
    if not group:
        return r - r.mean()
    if r.numel() % group_size:
        raise ValueError("rewards do not split into groups")
    g = r.view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).reshape(-1)


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                clip_eps: float = 0.2, ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                aggregation: str = "token-mean") -> torch.Tensor:
    """Return the scalar loss over the completion tokens ``mask`` (``[B, T]``, 1 on completion tokens)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}")
    m = mask.to(logp.dtype)
    a = adv.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - logp_old)
    per_token = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    if ref_logp is not None and beta:
        d = ref_logp - logp
        per_token = per_token + beta * (torch.exp(d) - d - 1)
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    if aggregation == "token-mean":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
