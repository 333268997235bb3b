"""The unsharded fp32 copy the FSDP2 reruns run on (fp16probe.capture.unsharded), checked on a plain model in one
process; tests/test_live_distributed.py runs it under FSDP2 on two ranks."""

from __future__ import annotations

import torch
from torch import nn

from fp16probe.capture.unsharded import UnshardedCopy, is_fsdp2


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.BatchNorm1d(6)
        self.shared = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([self.shared, nn.GELU(), self.shared])  # one module used twice
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids))
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_the_copy_mirrors_names_ties_and_values_without_hooks():
    live = Tied()
    seen = []
    live.shared.register_forward_hook(lambda m, a, o: seen.append(1))
    copy = UnshardedCopy(live)
    assert not is_fsdp2(live)
    assert [n for n, _ in copy.module.named_modules()] == [n for n, _ in live.named_modules()]
    assert [n for n, _ in copy.module.named_parameters()] == [n for n, _ in live.named_parameters()]
    assert copy.module.head.weight is copy.module.emb.weight and copy.module.blocks[0] is copy.module.blocks[2]
    assert all(p is not q for p, q in zip(copy.module.parameters(), live.parameters()))
    copy.refresh()
    ids = torch.randint(0, 10, (5,))
    live.eval()
    copy.refresh()
    assert not copy.module.training and not copy.module.norm.training
    n = len(seen)
    out = copy.module(ids)
    assert len(seen) == n  # the live module's hooks are not the copy's
    assert torch.equal(out, live(ids))
    out.sum().backward()
    assert all(p.grad is None for p in live.parameters()) and copy.module.emb.weight.grad is not None


def test_refresh_follows_training():
    live = Tied()
    copy = UnshardedCopy(live)
    with torch.no_grad():
        live.shared.weight.add_(1.0)
        live.norm.running_mean.fill_(3.0)
    copy.refresh()
    assert torch.equal(copy.module.shared.weight, live.shared.weight)
    assert torch.equal(copy.module.norm.running_mean, live.norm.running_mean)
    assert copy.module.norm.running_mean is not live.norm.running_mean
