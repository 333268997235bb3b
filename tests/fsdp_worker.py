"""A tiny FSDP2 (``fully_shard``) training run for tests/test_fsdp.py, on the CPU with gloo.

Usage: torchrun --nproc-per-node 2 tests/fsdp_worker.py OUT_DIR
Rank 0 writes OUT_DIR/merged.json; every rank writes its own OUT_DIR/rank{r}.json.
The model, batches and steps are ddp_worker's, so the single-process reference is the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import ddp_worker  # noqa: E402


def main(out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from fp16probe import Probe
    from fp16probe.capture.distributed import gather_report, init_from_env, is_distributed, rank

    assert init_from_env() and is_distributed(), "launch with torchrun --nproc-per-node 2"
    model = ddp_worker.make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Probe(model).start()
    for step in range(ddp_worker.STEPS):
        opt.zero_grad()
        x, y = ddp_worker.batch(step, rank())
        F.mse_loss(model(x), y).backward()
        opt.step()
        probe.step()
    probe.stop()
    probe.report().save(out / f"rank{rank()}.json")
    merged = gather_report(probe)
    if rank() == 0:
        merged.save(out / "merged.json")
    else:
        assert merged is None
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
