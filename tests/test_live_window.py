"""LiveLogger brings over only the steps since its last interval (issue 20): constant cost per interval."""

from __future__ import annotations

import torch
from torch import nn

from fp16probe import Probe
from fp16probe.integrations.live import LiveLogger


class _Sink:
    def __init__(self) -> None:
        self.series = []

    def write(self, series) -> None:
        self.series.append(series)

    def close(self) -> None:
        pass


def test_each_interval_brings_over_only_its_new_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)  # overflows now and then
    probe = Probe(model, scaler=scaler, every=2).start()
    sink = _Sink()
    live = LiveLogger(probe, sink, log_every=5, recommend=False)
    windows = []
    original = probe.report
    probe.report = lambda **k: windows.append(original(**k)) or windows[-1]
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        x = torch.randn(4, 8, generator=g) * 1e3
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        probe.step()
        live.step()
    assert len(windows) == 6
    for i, w in enumerate(windows):  # each holds its own five steps, no more
        assert w.capture.trace_since_step == (None if i == 0 else 5 * i)
        assert w.history.steps == tuple(range(5 * i, 5 * i + 5))
        assert w.trace.steps == tuple(s for s in range(5 * i, 5 * i + 5) if s % 2 == 0)
    # the module totals stay whole: the last window counts every sampled step's weight gradients
    assert windows[-1].histogram("weight_grad").total == 15 * sum(p.numel() for p in model.parameters())
    live.close()
    full = original()
    sent = sorted(s for series in sink.series for s in series.steps())
    # every sampled step once, and every skipped step (the skip ledger's, sampled or not)
    skips = {e.step for e in full.section("skips").steps}
    assert skips - set(full.trace.steps)  # a skipped step that was not sampled is sent too
    assert sent == sorted(set(sent)) == sorted(set(full.trace.steps) | skips)
    skipped = {st: v for series in sink.series for (tag, st, v) in series.scalars if tag.endswith("/skipped_steps")}
    running = 0
    for step, f in zip(full.trace.steps, full.trace.found_inf):  # the count runs on across windows
        running += f
        assert skipped[step] == running
    assert any(full.trace.found_inf)
