"""measure_mismatch against plain torch: real CPU autocast forwards vs fp32 (log_softmax in fp32 over
the logits cast up, as RL trainers compute it)."""

from __future__ import annotations

import copy

import pytest
import torch

from fp16probe.running.mismatch import measure_mismatch
from fp16probe.running.fixes import keep_in_fp32

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained_llama() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    data = (torch.arange(32).repeat(4, 1) * torch.tensor([[1], [3], [5], [7]])) % 128
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(20):  # trained here for real, briefly: the loss falls on a learnable pattern
        opt.zero_grad()
        loss = model(input_ids=data, labels=data).loss
        loss.backward()
        opt.step()
    return model.eval(), data


def _real_mean_abs(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype | None) -> float:
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        if dtype is None:
            return 0.0
        with torch.autocast("cpu", dtype=dtype):
            low = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    t = ids[:, 1:].unsqueeze(-1)
    return float((low.gather(-1, t) - ref.gather(-1, t)).abs().mean())


def test_ratio_and_contributors_match_real_autocast(trained_llama: tuple[torch.nn.Module, torch.Tensor]) -> None:
    model, ids = trained_llama
    result = measure_mismatch(model, ids, target="cpu")
    real16 = _real_mean_abs(model, ids, torch.float16)
    realbf = _real_mean_abs(model, ids, torch.bfloat16)
    assert result.ratio_mean_abs is not None
    assert result.ratio_mean_abs == pytest.approx(realbf / real16, rel=0.10), (result.ratio_mean_abs, realbf / real16)
    assert result.fp16.mean_abs == pytest.approx(real16, rel=0.10)
    assert result.fp16.kl >= 0 and result.bf16.kl > result.fp16.kl
    # every leaf module kept alone in fp32 in a real autocast run: the tool's largest contributor moves it most
    leaves = [n for n, m in model.named_modules() if n and next(m.parameters(recurse=False), None) is not None]
    drops = {}
    for name in leaves:
        kept = keep_in_fp32(copy.deepcopy(model), [name], device_type="cpu")
        drops[name] = real16 - _real_mean_abs(kept, ids, torch.float16)
    best = max(drops, key=lambda n: drops[n])
    assert result.contributors[0].module == best, (result.contributors, sorted(drops.items(), key=lambda x: -x[1])[:4])
    assert result.contributors[0].drop == pytest.approx(drops[best], rel=0.25)


def test_completion_mask_counts_only_masked_tokens(trained_llama: tuple[torch.nn.Module, torch.Tensor]) -> None:
    model, ids = trained_llama
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 20:] = True
    result = measure_mismatch(model, ids, mask, target="cpu", candidates=0)
    assert result.fp16.tokens == 4 * 12 and result.contributors == ()
    with pytest.raises(ValueError):
        measure_mismatch(model, ids, torch.zeros_like(mask), target="cpu", candidates=0)
