"""``no_single_scale`` judged by the emulated step: a flush the gradients do not feel leaves a constant S.

The histograms call a model ``no_single_scale`` when at every S either more than the threshold's share of
gradient values flushes or a step overflows. Whether that flush matters is what the emulated step measures:
where every parameter's gradient at the least bad S is within 5% of fp32, the verdict is ``constant`` at that S
with the caveat ``flush_no_effect``; where the flush is felt, the verdict stays. Both checked against real CPU
fp16 autocast at that S, written in plain torch.

The first model is the issue's Llama with a massive activation in its fp32 residual stream (a BOS token
whose embedding holds 10^3 in four channels, as trained LLMs' do): the issue reported the emulated step 100% off
on ``q_proj.weight`` against 0.24% real; on this one they agree to 0.002 points, and the question was the
verdict: "no single loss scale fits" and "train in bf16", on gradients a real fp16 step puts 0.1% off.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp16probe
from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.answer import short_answer
from tests.test_trust import TinyInputs

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[1, :4] = 1e3  # the BOS token's massive activation
    return model


def _llama_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 1
    return {"input_ids": ids, "labels": ids}


def _real_worst(model: nn.Module, loss_of, log2_scale: int) -> tuple[float, dict[str, float]]:
    """The worst parameter's relative error of a real CPU fp16 autocast step at S = 2^log2_scale (inf if not finite)."""
    ref_model, low_model = copy.deepcopy(model), copy.deepcopy(model)
    loss_of(ref_model).backward()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of(low_model)
    (loss * torch.full((1,), 2.0**log2_scale)).backward()
    errors = {}
    for (n, p), q in zip(ref_model.named_parameters(), low_model.parameters()):
        if p.grad is None or float(p.grad.norm()) == 0:
            continue
        g = q.grad.double() / 2.0**log2_scale
        errors[n] = math.inf if not torch.isfinite(g).all() else float((g - p.grad.double()).norm() / p.grad.double().norm())
    return max(errors.values()), errors


def test_a_flush_the_gradients_do_not_feel_leaves_a_constant_scale():
    model, batch = _llama(), _llama_batch()
    report = fp16probe.profile(copy.deepcopy(model), [batch], lambda out, b: out.loss, steps=1, target="cpu")
    rec = report.recommendation
    assert analyze(report, "fp16").verdict == "no_single_scale"  # the histograms' verdict, before the emulated step
    assert rec.verdict == "constant" and rec.log2_scale is not None
    caveat = next(c for c in rec.caveats if c.code == "flush_no_effect")
    assert caveat.data["flushed_fraction"] > caveat.data["threshold"] and caveat.data["log2_scale"] == rec.log2_scale
    assert caveat.data["zeroed"] == 0
    text = "\n".join(x.text for x in short_answer(report, rec))
    assert "no single loss scale" not in text and "train in bf16" not in text
    assert "the flush costs nothing measurable" in text
    # the real fp16 step at that S: finite, every parameter within 5% (written: 0.10% worst, q_proj 0.096%; the
    # emulated step 0.095% on q_proj)
    worst, errors = _real_worst(model, lambda m: m(**batch).loss, rec.log2_scale)
    assert worst < rec.evidence["emulated"]["tolerance"], errors
    q = [e for n, e in errors.items() if "q_proj" in n]
    assert max(q) < 0.01


_W = 2.0 ** -torch.linspace(0, 18, 4)  # per-output loss weights 1 .. 2^-18: output gradients span 36 bits


def _weighted_mse(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(out.float() * _W, batch[1] * _W)


def test_a_flush_the_gradients_feel_stays_no_single_scale():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(4)]
    torch.manual_seed(0)
    model = TinyInputs()  # tests/test_trust.py's MLP, whose loss there is this one (weighted_mse(18))
    report = fp16probe.profile(copy.deepcopy(model), batches, _weighted_mse, steps=len(batches), target="cpu")
    rec = report.recommendation
    assert analyze(report, "fp16").verdict == "no_single_scale"
    assert rec.verdict != "constant" and not any(c.code == "flush_no_effect" for c in rec.caveats), rec.verdict
    # The real fp16 step at that S: within 5% in L2 (the 2^-18 output's share of each norm is tiny), but it zeroes
    # weight-gradient values fp32 has nonzero, more than the threshold's share: under Adam those are lost updates.
    k = int(rec.log2_scale if rec.log2_scale is not None else rec.evidence["backward_log2_scale"])
    ref_model, low_model = copy.deepcopy(model), copy.deepcopy(model)
    _weighted_mse(ref_model(batches[0][0]), batches[0]).backward()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _weighted_mse(low_model(batches[0][0]), batches[0])
    (loss * torch.full((1,), 2.0**k)).backward()
    zeroed = sum(int(((p.grad != 0) & (q.grad == 0)).sum()) for p, q in zip(ref_model.parameters(), low_model.parameters()))
    nonzero = sum(int((p.grad != 0).sum()) for p in ref_model.parameters())
    assert zeroed > rec.thresholds["max_flushed_fraction"] * nonzero, (zeroed, nonzero)
