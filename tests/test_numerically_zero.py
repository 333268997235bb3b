"""Parameters whose fp32 gradient is numerically zero never lead the answer nor enter a fix (issue 38, item 4).

An attention key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by every
key); each run computes its own rounding of it, so a relative error against fp32's is the ratio of two
roundings (fp16's 2^-11 against fp32's 2^-24): thousands of percent that say nothing about training.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe.analysis.effect import ROUNDOFF_MARGIN, ZERO_KEY, effect_at, judged
from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.answer import short_answer
from fp16probe.recommendation import Verdict


class SharpAttention(nn.Module):
    """One attention head with biased projections; a large query bias makes the attention sharp, and the key
    bias's fp32 rounding then sits above the noise floor (1e-7 of the model's gradient) that hid it before."""

    def __init__(self, d: int = 16, query_bias: float = 1000.0) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        with torch.no_grad():
            self.query.bias.mul_(query_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v


def _loss(out: torch.Tensor, batch: object) -> torch.Tensor:
    return out.pow(2).mean()


def _real_grads(model: nn.Module, x: torch.Tensor, log2_scale: int) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, torch.Tensor], float]:
    """fp32 and real CPU fp16 autocast gradients (unscaled) of one step from the same weights, and the
    largest |d loss / d key output| of the fp32 step: the terms the key bias's gradient sums."""
    model = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}
    def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.__setitem__("out", g.detach()))

    handle = model.key.register_forward_hook(keep)
    _loss(model(x), None).backward()
    handle.remove()
    ref = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        value = _loss(model(x), None)
    (value.float() * 2.0**log2_scale).backward()
    low = {n: p.grad.double() / 2.0**log2_scale for n, p in model.named_parameters()}
    return ref, low, float(seen["out"].abs().max())


@torch.no_grad()
def _relative(low: torch.Tensor, ref: torch.Tensor) -> float:
    return float((low - ref).norm() / ref.norm())


@pytest.mark.slow  # a profile with its emulated steps and noise batches: about 9 s CPU
def test_a_key_bias_of_fp32_rounding_neither_leads_nor_enters_the_fix():
    torch.manual_seed(1)
    model = SharpAttention()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 128, 16, generator=g) for _ in range(3)]
    report = fp16probe.profile(copy.deepcopy(model), batches, _loss, steps=3, target="cpu")
    rec = report.recommendation
    em = rec.evidence["emulated"]
    k = int(em["log2_scale"])

    # Plain torch: the key bias's fp32 gradient is rounding (2^-12 below the largest term it sums) and the real
    # fp16 run's is some 10^3 times larger still; the other parameters' real errors are ordinary.
    ref, low, key_out = _real_grads(model, batches[0], k)
    total = math.sqrt(sum(float(r.norm() ** 2) for r in ref.values()))
    assert float(ref["key.bias"].abs().max()) < 2.0**-12 * key_out
    assert float(ref["key.bias"].norm()) > 1e-7 * total  # above the old noise floor: judged before this change
    eps = torch.finfo(torch.float16).eps / torch.finfo(torch.float32).eps
    assert _relative(low["key.bias"], ref["key.bias"]) > eps / ROUNDOFF_MARGIN
    assert all(_relative(low[n], ref[n]) < 1.0 for n in ref if n != "key.bias")

    # The answer sets it aside, says so, and ranks, places and fixes by the others.
    assert em["numerically_zero"] == ["key.bias"]
    assert "key.bias" not in [name for name, *_ in em["worst_parameters"]]
    assert em["worst_parameters"][0][1] < 1.0
    assert em.get("first_parameter") != "key.bias" and "key" not in rec.evidence.get("fix_modules", [])
    text = "\n".join(line.text for line in short_answer(report, rec))
    assert "worst key.bias" not in text
    assert "set aside as numerically zero: 1 parameter(s) (key.bias)" in text


def _data(rows, zero=()):
    data = {"format": "fp16", "target": "cpu", "regime": "autocast", "batches": 1,
            "parameters": ["query.weight", "query.bias", "key.weight", "key.bias"],
            "settings": [{"log2_scale": 10, "keep_fp32": [], "loss_low": False, "params": rows, "outputs": []}]}
    return {**data, ZERO_KEY: list(zero)} if zero else data


def test_a_numerically_zero_parameter_makes_no_verdict_and_no_fix():
    """Hand-built rows ``[error^2, fp32^2, zeroed, nonzero, nonfinite]``: the key bias 2000x off its fp32
    gradient (fp16 rounding over fp32 rounding) made gradient_error with key as the module to keep in fp32;
    set aside, the step is harmless. 400x off (below 8192 / 16 = 512) stays judged."""
    fine = [1e-6, 1.0, 0, 10, 0]
    rows = [fine, fine, fine, [2000.0**2 * 1e-12, 1e-12, 0, 10, 0]]
    eff = effect_at(_data(rows), 10)
    assert eff.numerically_zero == ("key.bias",) and eff.harmless and eff.culprit is None
    assert [m.module for m in eff.modules] == ["query", "key"] and eff.modules[1].error < 0.01
    # the whole model's error keeps what the step measured
    assert eff.error == pytest.approx(math.sqrt((3e-6 + 2000.0**2 * 1e-12) / (3.0 + 1e-12)))
    rec = analyze(fp16probe.profile(nn.Linear(4, 2), [torch.randn(8, 4)], steps=1), "fp16")
    rec = dataclasses.replace(rec, verdict=Verdict.CONSTANT, log2_scale=10)
    out = judged(rec, _data(rows))  # before: gradient_error, keep key in fp32
    assert out.verdict is Verdict.CONSTANT and "fix_modules" not in out.evidence
    assert out.evidence["emulated"]["numerically_zero"] == ["key.bias"]

    kept = effect_at(_data([fine, fine, fine, [400.0**2 * 1e-12, 1e-12, 0, 10, 0]]), 10)
    assert kept.numerically_zero == () and kept.first_over.name == "key.bias"

    # A whole module far off at its own scale (a forward the target breaks) is error, not a zero: both judged.
    broken = [fine, fine, [2000.0**2 * 1e-12, 1e-12, 0, 10, 0], [2000.0**2 * 1e-12, 1e-12, 0, 10, 0]]
    assert effect_at(_data(broken), 10).numerically_zero == ()
    # A cancelled sum the target rounds to exact zeros is 100% off: only the histograms' names set it aside.
    zeroed = [fine, fine, fine, [1e-12, 1e-12, 10, 10, 0]]
    assert effect_at(_data(zeroed), 10).first_over.name == "key.bias"
    assert effect_at(_data(zeroed, zero=["key.bias"]), 10).harmless
    # inf/NaN is never set aside
    bad = [fine, fine, fine, [None, 1e-12, 0, 10, 3]]
    assert effect_at(_data(bad, zero=["key.bias"]), 10).numerically_zero == ()
