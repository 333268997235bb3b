"""Live logging under DDP for tests/test_live_logging.py, launched by torchrun on the CPU (gloo).

Usage: torchrun --nproc-per-node 2 tests/live_ddp_worker.py OUT_DIR
Every rank joins LiveLogger's merge each interval; rank 0 alone writes TensorBoard events to
OUT_DIR/tb and, at the end, the merged report to OUT_DIR/merged.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import ddp_worker  # noqa: E402


def main(out: Path) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp16probe import Probe
    from fp16probe.capture.distributed import gather_report, init_from_env, rank
    from fp16probe.integrations.live import LiveLogger

    assert init_from_env(), "launch with torchrun --nproc-per-node 2"
    model = ddp_worker.make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Probe(model).start()
    writers = []
    if rank() == 0:
        from torch.utils.tensorboard import SummaryWriter

        writers = [SummaryWriter(str(out / "tb"))]
    live = LiveLogger(probe, writers, log_every=2, is_main=rank() == 0, recommend=False)
    for step in range(ddp_worker.STEPS):
        opt.zero_grad()
        x, y = ddp_worker.batch(step, rank())
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        probe.step()
        live.step()
    live.close()
    for w in writers:
        w.close()
    probe.stop()
    merged = gather_report(probe)
    if rank() == 0:
        merged.save(out / "merged.json")
        (out / "reports.txt").write_text(str(live.reports))
    dist.barrier()  # no rank tears gloo down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
