"""A 2-rank gloo training run under a framework callback where rank 1 raises, for tests/test_callback_rank_faults.py.

Usage: torchrun --nproc-per-node 2 tests/callback_rank_worker.py {hf,lightning} OUT_DIR [FAIL_AT]
The model's forward raises on rank 1 at training forward FAIL_AT (1-based; 0: never), after
noting the time in OUT_DIR/fault_time; with FAIL_IN=loss, backward, clip, step or scheduler (the Trainer only),
the Trainer's compute_loss, the backward of that forward's output, its gradient clipping (max_grad_norm), the
optimizer's step or the LR scheduler's step raises there instead. Each rank writes OUT_DIR/exit.RANK (its exit code and
the time it ended), OUT_DIR/error.RANK (the first line of what training raised) and trace.RANK; rank 0's
callback writes its report into OUT_DIR.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

STEPS = 5
BATCH = 4
RANK = int(os.environ.get("RANK", "0"))
FAIL_IN = os.environ.get("FAIL_IN", "forward")


def fault(out: Path) -> RuntimeError:
    """Note the time of the fault and return the error rank 1 raises."""
    (out / "fault_time").write_text(str(time.time()))
    return RuntimeError("the model broke on purpose")


class Net(nn.Module):
    """6 -> 2 whose forward raises on rank 1 at training forward ``fail_at``."""

    def __init__(self, out: Path, fail_at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        self.out, self.fail_at, self.forwards = out, fail_at, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self.training and torch.is_grad_enabled():
            self.forwards += 1
            if RANK == 1 and self.forwards == self.fail_at and FAIL_IN == "forward":
                raise fault(self.out)
        y = self.net(x)
        if RANK == 1 and self.forwards == self.fail_at and FAIL_IN == "backward" and torch.is_grad_enabled():
            y.register_hook(lambda grad: (_ for _ in ()).throw(fault(self.out)))  # raises inside backward
        return {"logits": y} if labels is None else {"loss": F.mse_loss(y, labels), "logits": y}


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7 + RANK)
    return [{"x": torch.randn(6, generator=g), "labels": torch.randn(2, generator=g) * 1e-3} for _ in range(n)]


def run_hf(out: Path, fail_at: int, timeout: int) -> None:
    from transformers import Trainer, TrainingArguments

    from fp16probe.integrations.huggingface import Fp16ProbeCallback

    class FailingTrainer(Trainer):
        """compute_loss raises on rank 1 at training step ``fail_at``, after the forward, with FAIL_IN=loss."""

        def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(model, inputs, *args, **kwargs)  # the forward ran and agreed
            if RANK == 1 and FAIL_IN == "loss" and self.state.global_step + 1 == fail_at:
                raise fault(out)
            return loss

        def _clip_grad_norm(self, model):  # type: ignore[no-untyped-def]
            """Gradient clipping (max_grad_norm) raises on rank 1 at training step ``fail_at`` with FAIL_IN=clip."""
            if RANK == 1 and FAIL_IN == "clip" and self.state.global_step + 1 == fail_at:
                raise fault(out)
            return super()._clip_grad_norm(model)

    class FailingSGD(torch.optim.SGD):
        """The optimizer's step raises on rank 1 at step ``fail_at`` with FAIL_IN=step."""

        steps = 0

        def step(self, closure=None):  # type: ignore[no-untyped-def]
            self.steps += 1
            if RANK == 1 and FAIL_IN == "step" and self.steps == fail_at:
                raise fault(out)
            return super().step(closure)

    class FailingSchedule(torch.optim.lr_scheduler.LambdaLR):
        """The LR scheduler's step raises on rank 1 after optimizer step ``fail_at`` with FAIL_IN=scheduler."""

        calls = -1  # LambdaLR's __init__ steps it once

        def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls += 1
            if RANK == 1 and FAIL_IN == "scheduler" and self.calls == fail_at:
                raise fault(out)
            return super().step(*args, **kwargs)

    # TrainingArguments(use_cpu=True) does not hand ddp_timeout to the process group it makes (transformers
    # 5.25; on a GPU it does): make it here, with that timeout, as a GPU run would have it
    from datetime import timedelta

    torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, use_cpu=True,
                             report_to="none", ddp_backend="gloo", ddp_timeout=timeout, save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, learning_rate=0.1,
                             max_grad_norm=1.0)
    model = Net(out, fail_at)
    opt = FailingSGD(model.parameters(), lr=0.1)
    FailingTrainer(model=model, args=args, train_dataset=rows(BATCH * STEPS * 2),
                   optimizers=(opt, FailingSchedule(opt, lambda step: 1.0 / (1 + step))),
                   callbacks=[Fp16ProbeCallback(output_dir=out)]).train()


def run_lightning(out: Path, fail_at: int, timeout: int) -> None:
    from datetime import timedelta

    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from fp16probe.integrations.lightning import Fp16ProbeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net(out, fail_at)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(batch["x"], batch["labels"])["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    # SHADOW_EVERY=0: no fp32 reruns, whose forwards (outside DDP, before the real one) would count too
    shadow = {"shadow_every": int(os.environ["SHADOW_EVERY"])} if os.environ.get("SHADOW_EVERY") else {}
    data = DataLoader(rows(BATCH * STEPS * 2), batch_size=BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_steps=STEPS, logger=False,
                         strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=timeout)),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Fp16ProbeCallback(dirpath=out, **shadow)])
    trainer.fit(Module(), data)


def main() -> None:
    which, out = sys.argv[1], Path(sys.argv[2])
    fail_at = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    timeout = int(os.environ.get("FP16PROBE_DIST_TIMEOUT", "60"))
    code = 0
    try:
        (run_hf if which == "hf" else run_lightning)(out, fail_at, timeout)
    except Exception as e:
        code = 1
        (out / f"error.{RANK}").write_text(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        (out / f"trace.{RANK}").write_text(traceback.format_exc())
    finally:
        (out / f"exit.{RANK}").write_text(f"{code} {time.time()}")
    sys.exit(code)


if __name__ == "__main__":
    main()
