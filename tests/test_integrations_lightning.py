"""The Lightning callback: real Trainer.fit steps on a tiny model, fp32 and 16-mixed on the CPU.

Lightning turns ``precision="16-mixed"`` into bf16 on the CPU, but its MixedPrecision plugin
accepts a real ``torch.amp.GradScaler("cpu")``; handing it over explicitly runs the real
fp16 path (fp16 autocast, scaled backward, unscale, scaler step) on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("fp16probe.analysis.recommend", reason="the analyzer writes the recommendation")

from pytorch_lightning.plugins.precision import MixedPrecision  # noqa: E402

from fp16probe import Report  # noqa: E402
from fp16probe.integrations import RECOMMENDATION_NAME, REPORT_NAME  # noqa: E402
from fp16probe.integrations.lightning import Fp16ProbeCallback, lightning_scaler  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, seen: list | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
        self.seen = seen

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).float(), y)

    def on_after_backward(self):
        if self.seen is not None:  # gradients as Lightning leaves them here (scaled under fp16)
            self.seen.append(self.net[4].weight.grad.detach().float().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def _fit(tmp_path, module, callback, **kw):
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[callback], **kw,
    )
    trainer.fit(module, _data())
    return trainer


@pytest.mark.slow
def test_real_fit_writes_report_and_recommendation(tmp_path):
    callback = Fp16ProbeCallback(every=2)
    trainer = _fit(tmp_path, Tiny(), callback)
    assert lightning_scaler(trainer) is None and callback.probe is None
    report = Report.load(tmp_path / REPORT_NAME)
    assert report.recommendation == callback.report.recommendation is not None
    assert (tmp_path / RECOMMENDATION_NAME).read_text().strip()
    assert report.metadata.steps_total == 4 and report.metadata.steps_seen == 2
    extra = report.workload.to_dict()
    assert extra["trainer"] == "lightning" and extra["global_step"] == 4 and extra["loss_scaled"] is False
    assert extra["trainer_settings"]["accumulate_grad_batches"] == 1 and extra["trainer_settings"]["precision"]
    assert report.module("net.2").histogram.total == 2 * 4 * 32  # two sampled steps, batch 4
    assert report.module("net.4.weight", "weight_grad").histogram.total == 2 * 32


@pytest.mark.slow
def test_16_mixed_with_a_real_grad_scaler_records_unscaled_gradients(tmp_path):
    seen: list[torch.Tensor] = []
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    callback = Fp16ProbeCallback(every=1)
    trainer = _fit(tmp_path, Tiny(seen), callback, plugins=[plugin])
    assert lightning_scaler(trainer) is scaler
    report = callback.report
    assert report.metadata.grad_scaler and report.metadata.precision == "fp16-autocast"
    assert report.workload.loss_scaled is True
    assert report.workload.trainer_settings["precision"] == "16-mixed"
    assert report.trace.scale == (2.0**10,) * 4
    assert len(seen) == 4
    # on_after_backward saw scaled gradients; the Probe recorded them divided by the scale
    last = report.module("net.4.weight", "weight_grad").histogram
    from fp16probe.capture.engine import histogram
    from fp16probe.capture.recorder import histogram_from

    unscaled = [g * 2.0**-10 for g in seen]
    want = [histogram_from(histogram(g)[0].tolist(), int(histogram(g)[1])) for g in unscaled]
    assert last == sum(want[1:], want[0])
    scaled_max = max(float(g.abs().max()) for g in seen)
    assert last.max_abs == pytest.approx(scaled_max * 2.0**-10)


@pytest.mark.slow
def test_16_mixed_reruns_training_step_in_fp32_and_leaves_training_as_it_was(tmp_path):
    """The callback's fp32 reruns give the live fp16 fit a verdict; the weights equal an unprobed fit's."""
    from fp16probe.analysis.recommend import analyze

    def fit(callbacks):
        torch.manual_seed(1)
        module = Tiny()
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                             callbacks=callbacks, plugins=[plugin])
        trainer.fit(module, _data())
        return module

    callback = Fp16ProbeCallback(every=1)
    probed = fit([callback])
    plain = fit([])
    report = callback.report
    assert report.metadata.precision == "fp16-autocast"
    assert report.shadow is not None and report.shadow.trace.steps == (0, 1, 2)
    assert analyze(report).evidence["shadow_steps"] == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(probed.state_dict().values(), plain.state_dict().values()))
