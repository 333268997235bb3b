"""DeepSpeed as it is today (0.19): the engine, its fp16 optimizer and its loss scalers.

The engine's ``loss_scale()`` is the *configured static* scale (0 under dynamic scaling); the
scale in force is the fp16 optimizer's ``loss_scale`` property (``loss_scale_config.cur_scale``),
and DeepSpeed's ``DynamicLossScaler`` / ``LossScaler`` carry ``cur_scale``. What cannot be read
is refused when the Probe is made, not at the first hook. The stand-ins carry exactly the
attributes DeepSpeed 0.19.8 has; with DeepSpeed installed its own classes are checked too.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.capture.scale import scale_source
from fp16probe.errors import ProbeError


class _Optimizer:
    """DeepSpeed's FP16_Optimizer as far as the scale goes: a property reading its config."""

    def __init__(self, scale: float | None) -> None:
        self.loss_scale_config = types.SimpleNamespace(use_grad_scaling=scale is not None, cur_scale=scale)

    @property
    def loss_scale(self) -> float | None:
        cfg = self.loss_scale_config
        return cfg.cur_scale if cfg.use_grad_scaling else None


class _Engine:
    """DeepSpeedEngine as far as the scale goes: loss_scale() is the configured static scale."""

    def __init__(self, optimizer: object, static: float = 0.0) -> None:
        self.optimizer = optimizer
        self._static = static

    def loss_scale(self) -> float:
        return self._static


def test_the_engine_is_read_through_its_optimizer_current_dynamic_scale():
    opt = _Optimizer(2.0**12)
    source = scale_source(_Engine(opt))
    assert float(source.tensor()) == 2.0**12 and "optimizer" in source.describe
    opt.loss_scale_config.cur_scale = 2.0**11  # a backoff: read again at the next step
    assert float(source.tensor()) == 2.0**11
    assert float(scale_source(opt).tensor()) == 2.0**11  # the optimizer itself, as before


def test_what_cannot_be_read_is_refused_at_construction():
    engine = _Engine(_Optimizer(2.0**12))
    model = nn.Linear(2, 2)
    with pytest.raises(ProbeError, match="returned a method"):
        Probe(model, scaler=lambda: engine.loss_scale)  # the README's old advice
    with pytest.raises(ProbeError, match="finite positive"):
        Probe(model, scaler=engine.loss_scale)  # the static scale: 0 under dynamic scaling
    with pytest.raises(ProbeError, match="optimizer"):
        Probe(model, scaler=_Engine(object()))


def test_deepspeed_own_classes():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    dynamic = DynamicLossScaler(init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False)
    source = scale_source(dynamic)
    assert float(source.tensor()) == 2**16
    dynamic.cur_scale = 2**15  # as its update_scale() does in place on an overflow (it needs a process group)
    assert float(source.tensor()) == 2**15
    assert float(scale_source(LossScaler(scale=128)).tensor()) == 128
    # its fp16 optimizer's property and its engine, without their set-up (no fp16 device here)
    opt = object.__new__(FP16_Optimizer)
    opt.loss_scale_config = types.SimpleNamespace(use_grad_scaling=True, cur_scale=2.0**10)
    opt.custom_loss_scaler = False
    assert float(scale_source(opt).tensor()) == 2.0**10
    engine = object.__new__(DeepSpeedEngine)
    object.__setattr__(engine, "optimizer", opt)
    object.__setattr__(engine, "_config", types.SimpleNamespace(float16_config=types.SimpleNamespace(loss_scale=0)))
    assert engine.loss_scale() == 0  # DeepSpeed's own method: the static scale
    assert float(scale_source(engine).tensor()) == 2.0**10


def test_a_probe_on_the_engine_records_unscaled_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with Probe(model) as plain:
        model(x).pow(2).mean().backward()
        plain.step()
    model.zero_grad()
    opt = _Optimizer(2.0**8)
    with Probe(model, scaler=_Engine(opt)) as scaled:
        (model(x).pow(2).mean() * opt.loss_scale).backward()
        scaled.step()
    assert [m.histogram for m in scaled.report().modules] == [m.histogram for m in plain.report().modules]
