"""Measure the train-inference log-probability mismatch of a causal LM (see docs/mismatch.md).

The low-precision forwards run by the emulated step's rules (:func:`fp16probe.capture.emulate.emulating`)
for the ``target`` device's autocast (or a ``.half()`` model); the log-probabilities are taken in
float64 over the logits (see :mod:`fp16probe.analysis.mismatch`). Numbers only: :mod:`fp16probe.analysis.mismatch`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp16probe.analysis.mismatch import MismatchStats, mismatch_stats, ratio
from fp16probe.capture.emulate import emulating

__all__ = ["Contribution", "MismatchResult", "measure_mismatch"]


@dataclass(frozen=True)
class Contribution:
    """One module kept in fp32: the fp16 mean |Δlogp| without and with it kept, and its output error."""

    module: str
    rel_output_error: float  # ||out_fp16 - out_fp32|| / ||out_fp32|| (the cheap ranking)
    mean_abs_kept: float  # fp16 mean |Δlogp| with this module alone in fp32
    drop: float  # fp16 mean |Δlogp| minus mean_abs_kept


@dataclass(frozen=True)
class MismatchResult:
    """fp16 and bf16 mismatch against fp32, their ratios, and the largest contributors (by drop)."""

    target: str
    regime: str
    fp16: MismatchStats
    bf16: MismatchStats
    ratio_mean_abs: float | None  # bf16 / fp16
    ratio_p99_abs: float | None
    ratio_max_abs: float | None
    ratio_kl: float | None
    contributors: tuple[Contribution, ...]


def _logits(out: Any) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    if isinstance(out, tuple):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError("the model's output has no logits tensor")
    return logits


def _log_probs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
               format: str | None, target: str, regime: str, keep: Sequence[str] = (),
               reference: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad():
        if format is None:
            logits = _logits(model(**kwargs))
            outputs: dict[str, torch.Tensor] = {}
        else:
            with emulating(model, format=format, target=target, regime=regime, keep_fp32=keep,
                           reference_outputs=reference) as em:
                logits = _logits(model(**kwargs))
            outputs = em.outputs
        return torch.log_softmax(logits[:, :-1].double(), dim=-1), outputs


def _reference_outputs(model: nn.Module, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    outs: dict[str, torch.Tensor] = {}
    names = {id(m): n for n, m in model.named_modules() if n}

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        out = output[0] if isinstance(output, tuple) and output else output
        if name is not None and name not in outs and isinstance(out, torch.Tensor) and out.is_floating_point():
            outs[name] = out.detach().float()

    hook = nn.modules.module.register_module_forward_hook(keep)
    try:
        _log_probs(model, input_ids, attention_mask, format=None, target="cpu", regime="autocast")
    finally:
        hook.remove()
    return outs


def measure_mismatch(model: nn.Module, input_ids: torch.Tensor, completion_mask: torch.Tensor | None = None, *,
                     attention_mask: torch.Tensor | None = None, target: str = "cuda", regime: str = "autocast",
                     candidates: int | None = None) -> MismatchResult:
    """The per-token log-probability mismatch of fp16 and bf16 against fp32 for a causal LM.

    Args:
        model: a causal LM in fp32 (its forward returns logits or an object with ``.logits``);
            put it in ``eval()`` mode for a deterministic measurement.
        input_ids: [batch, length] token ids; each position's realised next token is the next id.
        completion_mask: [batch, length] bool, which tokens count (default all but the first).
        attention_mask: passed to the model where given.
        target: the device whose autocast rules the low forwards follow (``"cuda"``, ``"cpu"``).
        regime: ``"autocast"`` or ``"pure_fp16"`` (a ``.half()`` model).
        candidates: how many leaf modules with parameters are measured directly, each kept alone
            in fp32 (one forward each): None, all of them; a number, that many ranked by their
            relative output error under fp16. That ranking is cheap but weak: on a trained tiny
            Llama it left out ``lm_head``, which carries about 95% of the fp16 mismatch there.

    Returns a :class:`MismatchResult`; ``contributors`` sorted by drop, largest first.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError("input_ids must be [batch, length] with length >= 2")
    if completion_mask is None:
        completion_mask = torch.ones_like(input_ids, dtype=torch.bool)
    mask = completion_mask.bool()[:, 1:]
    targets = input_ids[:, 1:]
    ref_outputs = _reference_outputs(model, input_ids, attention_mask)
    ref, _ = _log_probs(model, input_ids, attention_mask, format=None, target=target, regime=regime)
    low16, errors = _log_probs(model, input_ids, attention_mask, format="fp16", target=target, regime=regime,
                               reference=ref_outputs)
    lowbf, _ = _log_probs(model, input_ids, attention_mask, format="bf16", target=target, regime=regime)
    fp16 = mismatch_stats("fp16", ref, low16, targets, mask)
    bf16 = mismatch_stats("bf16", ref, lowbf, targets, mask)
    leaves = {n for n, m in model.named_modules()
              if n and next(m.parameters(recurse=False), None) is not None}
    rel = {n: math.sqrt(float(e[0]) / float(e[1])) for n, e in errors.items() if n in leaves and float(e[1]) > 0}
    ranked = sorted(rel, key=lambda n: -rel[n])
    if candidates is not None:
        ranked = ranked[:max(candidates, 0)]
    contribs = []
    for name in ranked:
        kept, _ = _log_probs(model, input_ids, attention_mask, format="fp16", target=target, regime=regime,
                             keep=(name,))
        k = mismatch_stats("fp16", ref, kept, targets, mask).mean_abs
        contribs.append(Contribution(module=name, rel_output_error=rel[name], mean_abs_kept=k,
                                     drop=fp16.mean_abs - k))
    contribs.sort(key=lambda c: -c.drop)
    return MismatchResult(target=target, regime=regime, fp16=fp16, bf16=bf16,
                          ratio_mean_abs=ratio(bf16.mean_abs, fp16.mean_abs),
                          ratio_p99_abs=ratio(bf16.p99_abs, fp16.p99_abs),
                          ratio_max_abs=ratio(bf16.max_abs, fp16.max_abs),
                          ratio_kl=ratio(bf16.kl, fp16.kl), contributors=tuple(contribs))
