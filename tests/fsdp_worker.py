"""A tiny FSDP2 (``fully_shard``) training run for tests/test_fsdp.py, on the CPU with gloo.

Usage: torchrun --nproc-per-node 2 tests/fsdp_worker.py OUT_DIR
Rank 0 writes OUT_DIR/merged.json; every rank writes its own OUT_DIR/rank{r}.json.
The model, batches and steps are ddp_worker's, so the single-process reference is the same.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import ddp_worker  # noqa: E402


def main(out: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    from fp16probe.capture.distributed import init_from_env, is_distributed

    assert init_from_env() and is_distributed(), "launch with torchrun --nproc-per-node 2"
    model = ddp_worker.make_model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    ddp_worker.train_and_save(model, model, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
