"""The run behind the schedule table in docs/live-training.md: real fp16 steps, the Probe left on.

    python docs/live_training_demo.py live-demo.json   # about 10 s on a CPU
    fp16probe schedule live-demo.json

A small MLP trained under CPU fp16 autocast with a real ``torch.amp.GradScaler("cpu")``
(init_scale=2^8, growth_interval=20), its loss multiplied by 2^-16 so that its gradients sit
low in fp16's range and a low scale flushes them, and its inputs growing over the run so the
gradients drift. ``Probe(model, scaler=scaler, every=10)`` records every step's scale,
found_inf and largest gradient, and ``probe.shadow`` reruns its schedule of steps in fp32 for
the flushed shares.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from fp16probe import Probe


def run(path: str, steps: int = 400) -> None:
    """Train, probe, and save the report to ``path``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * 2.0**16)  # undoes the loss's 2^-16 for the update
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=20)
    probe = Probe(model, scaler=scaler, every=10).start()
    g = torch.Generator().manual_seed(1)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y) * 2.0**-16

    for step in range(steps):
        x = torch.randn(16, 16, generator=g) * (1 + step / 100)
        y = torch.randint(0, 10, (16,), generator=g)
        probe.shadow(lambda x=x, y=y: loss_of(x, y))  # fp32 rerun on the shadow schedule; else returns at once
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        probe.step()
    probe.stop()
    probe.report().save(path)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "live-demo.json")
