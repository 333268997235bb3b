"""Every loss scaler: the Probe reads the scale in force and records unscaled gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16probe import Probe, ProbeError
from fp16probe.capture.scale import scale_source


class DeepSpeedStyleScaler:
    """The attributes DeepSpeed's DynamicLossScaler keeps (deepspeed/runtime/fp16/loss_scaler.py)."""

    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000, min_scale: float = 1.0) -> None:
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = 2
        self.cur_hysteresis = 2

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale).backward()

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


class MegatronStyleScaler:
    """Megatron's DynamicGradScaler keeps the scale as a tensor behind the ``scale`` property."""

    def __init__(self, initial_scale: float) -> None:
        self._scale = torch.tensor([initial_scale], dtype=torch.float)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()


class DeepSpeedStyleOptimizer:
    """A DeepSpeed fp16 optimizer wrapper carries its scaler as ``loss_scaler``."""

    def __init__(self, scaler: DeepSpeedStyleScaler) -> None:
        self.loss_scaler = scaler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g) * 1e-3) for _ in range(3)]


def _run(scaler, scale_of_step) -> tuple:
    """Three steps with the loss multiplied by ``scale_of_step(i)``; the modules' histograms and trace."""
    model = _model()
    with Probe(model, scaler=scaler) as probe:
        for i, (x, y) in enumerate(_batches()):
            model.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            (loss * scale_of_step(i)).backward()
            probe.step()
    report = probe.report()
    return (
        {(m.name, m.kind): m.histogram for m in report.modules},
        report.trace.histograms,
        report.trace.ceiling,
        report.trace.scale,
    )


def test_deepspeed_style_scaler_and_float_scale_give_the_unscaled_histograms():
    plain, plain_trace, plain_ceiling, _ = _run(None, lambda i: 1.0)
    assert sum(h.total for h in plain.values()) > 0

    ds = DeepSpeedStyleScaler(init_scale=2.0**12)
    scales = [2.0**12, 2.0**13, 2.0**11]

    def ds_scale(i: int) -> float:
        ds.cur_scale = scales[i]  # the scaler moves between steps, as after update_scale()
        return ds.loss_scale

    got = _run(ds, ds_scale)
    assert got[:3] == (plain, plain_trace, plain_ceiling)
    assert got[3] == tuple(scales)

    fixed = _run(2.0**10, lambda i: 2.0**10)
    assert fixed[:3] == (plain, plain_trace, plain_ceiling)
    assert fixed[3] == (2.0**10,) * 3


@pytest.mark.parametrize(
    "make",
    [
        lambda: (MegatronStyleScaler(2.0**9), 2.0**9),
        lambda: (DeepSpeedStyleOptimizer(DeepSpeedStyleScaler(2.0**7)), 2.0**7),
        lambda: (torch.tensor(2.0**5), 2.0**5),
        lambda: ((lambda: 2.0**6), 2.0**6),
    ],
    ids=["megatron", "deepspeed-optimizer", "tensor", "callable"],
)
def test_other_scalers_are_read(make):
    plain = _run(None, lambda i: 1.0)
    scaler, scale = make()
    got = _run(scaler, lambda i: scale)
    assert got[:3] == plain[:3] and got[3] == (scale,) * 3


def test_a_grad_scaler_before_its_first_scale_means_unscaled():
    scaler = torch.amp.GradScaler("cpu")
    assert scale_source(scaler).tensor() is None
    assert scale_source(torch.amp.GradScaler("cpu", enabled=False)).tensor() is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (object(), "cannot read a loss scale from scaler=object"),
        (True, "ambiguous"),
        (0.0, "finite positive"),
        (float("inf"), "finite positive"),
        (torch.ones(3), "3 elements"),
        ("65536", "cannot read a loss scale"),
    ],
)
def test_an_unreadable_scaler_is_refused_at_construction(bad, match):
    with pytest.raises(ProbeError, match=match):
        Probe(_model(), scaler=bad)
