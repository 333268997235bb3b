"""The unsharded fp32 copy the FSDP2 reruns run on (fp16probe.capture.unsharded), checked on a plain model in one
process; tests/test_live_distributed.py runs it under FSDP2 on two ranks."""

from __future__ import annotations

import torch
from torch import nn

from fp16probe.capture.unsharded import UnshardedCopy, is_fsdp2
from tests.fixtures.loops import finish_step


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


class _LossNet(nn.Module):
    """Returns its loss, so the Probe replays its forward for the reruns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.body(x) if y is None else _loss(self.body(x), y)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y) * 1e-4


def _train(on_copy: bool, probed: bool, explicit: bool = False):
    """3 fp16 GradScaler steps (CPU autocast); with ``on_copy`` the reruns run on an unsharded copy, as under FSDP2."""
    from fp16probe import Probe
    from fp16probe.capture.shadow import _reference_probe

    model = _LossNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    probe = Probe(model, scaler=scaler).start() if probed else None
    if probe is not None and on_copy:
        probe.collector("shadow").shadow.rerun_on_copy(lambda m: _reference_probe(probe, weight_grads=False, model=m))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        if probe is not None and explicit:  # the loss outside the model: the loop gives it to probe.shadow
            probe.shadow(lambda x=x, y=y: _loss(model(x), y))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model(x), y) if explicit else model(x, y)
        finish_step(loss, opt, scaler, probe)
    if probe is not None:
        probe.stop()
    return [p.detach().clone() for p in model.parameters()], probe


def test_reruns_on_the_copy_record_what_reruns_on_the_model_do_and_leave_training_as_it_was():
    """The FSDP2 path in one process: the replayed forward reruns on the unsharded copy (made at the first rerun),
    and its fp32 reference equals the one a rerun on the model itself records; training is bit-identical."""
    plain, _ = _train(False, False)
    on_copy, probe = _train(True, True)
    _, direct = _train(False, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, on_copy))
    sh = probe.collector("shadow").shadow
    assert sh.copy is not None and sh.copy.module is not probe.model
    report, reference = probe.report(), direct.report()
    assert report.shadow_runs.steps == reference.shadow_runs.steps == (0, 1, 2)
    mine, theirs = report.shadow.histogram("activation_grad"), reference.shadow.histogram("activation_grad")
    assert mine.total > 0 and mine == theirs


def test_on_the_copy_probe_shadow_fn_is_refused_with_what_to_do():
    """Under FSDP2 fn() would call the sharded model: a loop whose loss is outside the model gets no rerun, and
    shadow_runs.off says why and what to do (off the copy the same loop is rerun through probe.shadow)."""
    _, probe = _train(True, True, explicit=True)
    runs = probe.report().shadow_runs
    assert runs.steps == () and "FSDP2" in runs.off and "probe.shadow" in runs.off and "loss" in runs.off, runs
    _, direct = _train(False, True, explicit=True)
    assert direct.report().shadow_runs.steps == (0, 1, 2)
