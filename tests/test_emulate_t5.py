"""T5's ReLU feed-forward: the emulated step agrees with real CPU fp16 autocast over batches, not batch by batch.

On a small T5 with ``feed_forward_proj="relu"`` the real and the emulated step are each about 1% off fp32, but
on one batch either may be up to 2.6 times the other (the issue's 2.75% against 1.35%; one seed with dropout
1.66% against 0.60%). The cause is the model, not the emulation: the two runs' forward outputs first differ by
one fp16 ulp where the CPU's fp16 matmul accumulates in another order, and ReLU turns such flips into mask flips
whose gradients move a ``wi`` gradient by about 1% of its norm (docs/fp16-run.md). Which units flip is a
realisation of the rounding, so each run's error is a draw; what the emulated step must match is its size over
batches. Dropout adds nothing of its own: the spread is the same without it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fp16probe.capture.emulate import emulated_step

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

S = 16.0
BATCHES = 6


def _t5(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.T5Config(feed_forward_proj="relu", d_model=64, d_ff=256, num_layers=2, num_decoder_layers=2,
                                num_heads=4, d_kv=16, vocab_size=512, dropout_rate=dropout, decoder_start_token_id=0,
                                pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).train()


def _loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(123)  # the same dropout masks in every run of the batch
    return model(input_ids=ids, labels=labels).loss


def _grads(model: torch.nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {n: p.grad.double() / scale for n, p in model.named_parameters() if p.grad is not None}


def _error(g: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor]) -> float:
    num = sum(float((g[n].double() - ref[n]).square().sum()) for n in ref)  # type: ignore[union-attr]
    return math.sqrt(num / sum(float(r.square().sum()) for r in ref.values()))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_emulated_error_matches_the_real_one_over_batches(dropout):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _t5(dropout)
        ratios = []
        for b in range(BATCHES):
            g = torch.Generator().manual_seed(100 + b)
            ids, labels = torch.randint(0, 512, (4, 32), generator=g), torch.randint(0, 512, (4, 32), generator=g)
            ref_model = copy.deepcopy(model)
            _loss(ref_model, ids, labels).backward()
            ref = _grads(ref_model)
            real_model = copy.deepcopy(model)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(real_model, ids, labels)
            (loss * torch.full((1,), S)).backward()
            real = _error(_grads(real_model, S), ref)
            em_model = copy.deepcopy(model)
            step = emulated_step(em_model, lambda: _loss(em_model, ids, labels), format="fp16", target="cpu", scale=S)
            ratios.append(_error({n: step.grads[n] for n in ref}, ref) / real)
    finally:
        torch.set_num_threads(threads)
    # written (torch 2.13 CPU): emulated/real per batch 0.65-1.44 without dropout, 0.75-2.56 with it;
    # geometric means 0.97 and 1.10
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    assert 0.75 < mean < 1.35, ratios
    assert all(0.3 < r < 4 for r in ratios), ratios
