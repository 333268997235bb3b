"""fp16 autocast under DDP (2 gloo ranks, ``no_sync`` accumulation) or FSDP2, for tests/test_live_distributed.py.

Usage: LIVE_MICRO=N torchrun --nproc-per-node 2 tests/live_rerun_ddp_worker.py OUT_DIR {ddp,fsdp2}
Each rank trains without the Probe, then with it, and writes OUT_DIR/identical{r}.txt (whether the final weights
are bit-identical) and OUT_DIR/rank{r}.json (its report); rank 0 also the merged report, OUT_DIR/merged.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 3
MICRO = int(os.environ.get("LIVE_MICRO", "2"))  # micro-batches per optimizer step (DDP: all but the last under no_sync)


class LossNet(nn.Module):
    """A small MLP that returns its loss, so the Probe replays its forward for the fp32 reruns."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, x, y):
        return F.mse_loss(self.body(x).float(), y) * 1e-4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return LossNet()


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def train(how: str, probed: bool) -> tuple[list[torch.Tensor], object]:
    """Train STEPS optimizer steps of MICRO micro-batches; return the final (full) weights and the Probe or None."""
    import contextlib

    from fp16probe import Probe
    from fp16probe.capture.distributed import rank
    from tests.fixtures.loops import step_optimizer

    model = make_model()
    if how == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.float16)
        for layer in model.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mp_policy=policy)
        runner = fully_shard(model, mp_policy=policy)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    # accumulation=MICRO: each rerun step replays the MICRO micro-batches, each loss / MICRO (the Probe's default
    # divisor), as the loop backpropagates them
    probe = Probe(model, scaler=scaler, accumulation=MICRO).start() if probed else None
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = batch(step, micro, rank())
            last = micro == MICRO - 1
            sync = contextlib.nullcontext() if last or how != "ddp" else runner.no_sync()
            with sync:  # FSDP2 computes in its policy's fp16; DDP under CPU fp16 autocast
                with torch.autocast("cpu", dtype=torch.float16, enabled=how == "ddp"):
                    loss = runner(x, y) / MICRO
                scaler.scale(loss).backward()
        step_optimizer(opt, scaler, probe)
    if probe is not None:
        probe.stop()
    weights = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    return weights, probe


def main(out: Path, how: str) -> None:
    import torch.distributed as dist

    from fp16probe.capture.distributed import gather_report, init_from_env, rank

    assert init_from_env(), "launch with torchrun --nproc-per-node 2"
    plain, _ = train(how, probed=False)
    weights, probe = train(how, probed=True)
    (out / f"identical{rank()}.txt").write_text(str(all(torch.equal(a, b) for a, b in zip(plain, weights))))
    probe.report().save(out / f"rank{rank()}.json")
    merged = gather_report(probe)
    if rank() == 0:
        merged.save(out / "merged.json")
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
