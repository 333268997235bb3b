"""A tiny DDP training run for tests/test_distributed.py, launched by torchrun on the CPU (gloo).

Usage: torchrun --nproc-per-node 2 tests/ddp_worker.py OUT_DIR
Rank 0 writes OUT_DIR/merged.json; every rank writes its own OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 3
BATCH = 5
WORLD = 2


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 2))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 2, generator=g) * 1e-3


def loss_of(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return F.mse_loss(model(x), y)


def main(out: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp16probe.capture.distributed import init_from_env, is_distributed

    assert init_from_env() and is_distributed(), "launch with torchrun --nproc-per-node 2"
    model = make_model()
    train_and_save(DDP(model), model, out)


def train_and_save(runner: nn.Module, model: nn.Module, out: Path) -> None:
    """Train ``runner`` (the wrapped ``model``) STEPS steps under a Probe on ``model``; save each
    rank's report and rank 0's merged one into ``out``, then leave the process group."""
    import torch.distributed as dist

    from fp16probe import Probe
    from fp16probe.capture.distributed import gather_report, rank

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Probe(model).start()
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank())
        F.mse_loss(runner(x), y).backward()
        opt.step()
        probe.step()
    probe.stop()
    probe.report().save(out / f"rank{rank()}.json")
    merged = gather_report(probe)
    if rank() == 0:
        merged.save(out / "merged.json")
    else:
        assert merged is None
    # Leave together: a rank tearing gloo down while the other still talks to it can abort
    # ("terminate called without an active exception", seen once on a loaded machine).
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main(Path(sys.argv[1]))
