"""The RL objectives (fp16probe.running.rl) against an independent per-token loop, and under a real fp16 step."""

from __future__ import annotations

import math

import pytest
import torch

from fp16probe.running import rl
from fp16probe.sources import GRPO


def _reference(logp, old, ref, rewards, mask, G, eps, beta, ent, ent_coef, agg, group=True):
    """Per-sequence, per-token loops in Python floats: the formulas of verl's core_algos written out."""
    B, T = mask.shape
    advs = []
    for i in range(B):
        if group:
            grp = [float(r) for r in rewards[(i // G) * G:(i // G + 1) * G]]
            mean = sum(grp) / G
            std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
            advs.append((float(rewards[i]) - mean) / (std + 1e-6))
        else:
            advs.append(float(rewards[i]) - sum(float(r) for r in rewards) / B)
    rows, tot, n = [], 0.0, 0
    for i in range(B):
        s, k = 0.0, 0
        for t in range(T):
            if not mask[i, t]:
                continue
            rho = math.exp(float(logp[i, t]) - float(old[i, t]))
            a = advs[i]
            v = max(-a * rho, -a * min(max(rho, 1 - eps), 1 + eps))
            d = float(ref[i, t]) - float(logp[i, t])
            v += beta * (math.exp(d) - d - 1) - ent_coef * float(ent[i, t])
            s, k = s + v, k + 1
        rows.append(s / max(k, 1))
        tot, n = tot + s, n + k
    return tot / n if agg == "token-mean" else sum(rows) / B


@pytest.mark.parametrize("agg", rl.AGGREGATIONS)
@pytest.mark.parametrize("group", [True, False])
def test_loss_matches_independent_loop(agg, group):
    g = torch.Generator().manual_seed(3)
    B, T, G = 8, 7, 4
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios beyond the clip too
    ref = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    adv = rl.advantages(rewards, G, group=group)
    got = rl.policy_loss(logp, old, adv.double(), mask, clip_eps=0.2, ref_logp=ref, beta=0.05,
                         entropy=ent, entropy_coef=0.01, aggregation=agg)
    want = _reference(logp, old, ref, rewards, mask, G, 0.2, 0.05, ent, 0.01, agg, group)
    assert got.item() == pytest.approx(want, rel=1e-5)


def test_token_logprobs_match_log_softmax_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    logp, ent = rl.token_logprobs(logits, ids)
    for b in range(2):
        for t in range(4):
            p = torch.softmax(logits[b, t].double(), -1)
            assert logp[b, t].item() == pytest.approx(math.log(p[ids[b, t + 1]].item()), abs=1e-5)
            assert ent[b, t].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def test_real_fp16_grpo_step_on_a_causal_lm():
    """A real GRPO step under CPU fp16 autocast and GradScaler: the loss is finite, equals fp32's closely."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    G, prompt_len, new = 4, 4, 6
    prompts = torch.randint(0, 64, (2, prompt_len))
    with torch.no_grad():
        ids = model.generate(prompts.repeat_interleave(G, 0), max_new_tokens=new, do_sample=True,
                             pad_token_id=0, generation_config=transformers.GenerationConfig(do_sample=True))
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.long)
    mask[:, prompt_len - 1:] = 1
    rewards = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(1))  # synthetic
    adv = rl.advantages(rewards, G)
    with torch.no_grad():
        old32, _ = rl.token_logprobs(model(ids).logits.float(), ids)
    loss32 = rl.policy_loss(rl.token_logprobs(model(ids).logits.float(), ids)[0], old32, adv, mask)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(ids).logits
        assert logits.dtype == torch.float16
        logp, _ = rl.token_logprobs(logits, ids)
        loss16 = rl.policy_loss(logp, old32.half(), adv, mask)
    assert torch.isfinite(loss16)
    assert loss16.float().item() == pytest.approx(loss32.item(), abs=5e-3)
    scaler.scale(loss16).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 10  # no inf/nan found: the step was taken
    assert GRPO.arxiv == "2402.03300"


def _planted_gpt2(transformers):
    """A tiny GPT-2, weights rounded through bf16 ("bf16-pretrained"), one MLP down-projection output past 65504."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        model.transformer.h[0].mlp.c_proj.bias[5] = 1.0e5  # a massive activation, exact in bf16's range
    return model


def _fp16_grpo_loss(model, ids, mask, adv):
    with torch.no_grad():
        old, _ = rl.token_logprobs(model(ids).logits.float(), ids)
    with torch.autocast("cpu", dtype=torch.float16):
        logp, _ = rl.token_logprobs(model(ids).logits, ids)
        return rl.policy_loss(logp, old.to(logp.dtype), adv, mask)


def test_planted_activation_breaks_fp16_rl_loss_and_keep_in_fp32_fixes_it():
    transformers = pytest.importorskip("transformers")
    import fp16probe

    model = _planted_gpt2(transformers)
    ids = torch.randint(0, 64, (8, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(8, 9, dtype=torch.long)
    mask[:, 3:] = 1
    adv = rl.advantages(torch.randn(8, generator=torch.Generator().manual_seed(1)), 4)
    assert not torch.isfinite(_fp16_grpo_loss(model, ids, mask, adv))
    fp16probe.keep_in_fp32(model, ["transformer.h.0.mlp.c_proj"], device_type="cpu")
    assert torch.isfinite(_fp16_grpo_loss(model, ids, mask, adv))
