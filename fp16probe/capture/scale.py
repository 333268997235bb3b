"""Read the loss scale in force from whatever scales the loss, without a host sync.

Gradients seen in backward are ``scale x`` the true ones when the loss was scaled; the
Probe records them unscaled, so it must know the scale of every step. Loss scalers keep it
in different places:

- ``torch.amp.GradScaler`` (and ``torch.cuda.amp.GradScaler``): the ``_scale`` device
  tensor (``get_scale()`` would synchronise); None until the first ``scale()``, and
  nothing when the scaler is disabled.
- DeepSpeed (0.19): ``DynamicLossScaler`` / ``LossScaler`` carry the float attribute
  ``cur_scale``; the fp16 optimizer (``engine.optimizer``) the property ``loss_scale``, the
  *current dynamic* scale; older optimizer wrappers carry the scaler as ``loss_scaler``. The
  engine's own ``loss_scale()`` is the *configured static* scale (0 under dynamic scaling),
  so an engine is read through its optimizer.
- Megatron's ``DynamicGradScaler`` / ``ConstantGradScaler``: the tensor property ``scale``.
- apex-style scalers: ``loss_scale`` (a float, a tensor or a method returning one).
- A plain number or tensor (a fixed scale; a tensor is read each step, so it may change
  in place), or a callable taking no arguments that returns the scale each step.

Anything else is refused at construction (:func:`scale_source` raises ProbeError): a
scaler the Probe silently ignored would make every histogram ``scale`` times too large. A
method or callable is called once there too, so one that returns a method, or 0 (a DeepSpeed
engine's static scale under dynamic scaling), is refused before training, not at the first hook.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from fp16probe.errors import ProbeError

__all__ = ["ScaleSource", "scale_source"]


class ScaleSource:
    """The loss scale in force, as a device tensor, read once per step.

    ``read()`` returns a 0-d or 1-element tensor (or None when the gradients are not
    scaled at this step); ``describe`` names where the scale comes from, for the report.
    """

    def __init__(self, read: Callable[[], torch.Tensor | None], describe: str) -> None:
        self._read = read
        self.describe = describe

    def tensor(self) -> torch.Tensor | None:
        """The scale in force now, detached (a fresh tensor or the scaler's own)."""
        s = self._read()
        return None if s is None else s.detach()


def _number_tensor(value: Any, what: str) -> torch.Tensor:
    """A host float as a tensor: no device is touched, so no synchronisation."""
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ProbeError(f"{what} is {value!r}; a loss scale must be a finite positive number")
    return torch.tensor(v, dtype=torch.float32)


def _value_tensor(value: Any, what: str) -> torch.Tensor | None:
    """A scale read from a scaler: a tensor as is, a number as a host tensor."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ProbeError(f"{what} is a tensor of {value.numel()} elements; a loss scale has one")
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return _number_tensor(value, what)
    raise ProbeError(f"{what} returned {type(value).__name__}; a loss scale is a number or a one-element tensor")


def _checked_now(read: Callable[[], Any], what: str) -> None:
    """Call a scale reader once at construction; refuse one that returns a method, a non-number or 0."""
    try:
        value = read()
    except Exception:  # a reader that needs training to have started: checked at its first step instead
        return
    if callable(value) and not isinstance(value, torch.Tensor):
        raise ProbeError(f"{what} returned a {type(value).__name__}, not a scale: call it "
                         "(e.g. scaler=lambda: engine.optimizer.loss_scale), or pass the scaler object itself")
    _value_tensor(value, what)


def _is_grad_scaler(obj: Any) -> bool:
    classes = [torch.amp.GradScaler]
    legacy = getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)
    if isinstance(legacy, type):
        classes.append(legacy)
    return isinstance(obj, tuple(classes))


def scale_source(scaler: Any) -> ScaleSource | None:
    """How to read the loss scale from ``scaler``; None for no scaler; ProbeError if unreadable."""
    if scaler is None:
        return None
    if _is_grad_scaler(scaler):

        def grad_scaler() -> torch.Tensor | None:
            if not scaler.is_enabled():
                return None
            return getattr(scaler, "_scale", None)  # None until scaler.scale(): not scaled yet

        return ScaleSource(grad_scaler, f"{type(scaler).__name__}._scale")
    if isinstance(scaler, bool):
        raise ProbeError(
            "scaler=True/False is ambiguous: pass the loss scaler object itself "
            "(a torch.amp.GradScaler, a DeepSpeed or Megatron scaler), the scale as a number, or None"
        )
    if isinstance(scaler, torch.Tensor):
        _value_tensor(scaler, "the scale tensor")
        return ScaleSource(lambda: scaler, "a scale tensor")
    if isinstance(scaler, numbers.Real):
        fixed = _number_tensor(scaler, "scaler")
        return ScaleSource(lambda: fixed, f"a fixed scale {float(scaler):g}")
    name = type(scaler).__name__
    # A DeepSpeed fp16 optimizer (or any wrapper) that carries its scaler.
    inner = getattr(scaler, "loss_scaler", None)
    if inner is not None and inner is not scaler and not hasattr(scaler, "cur_scale"):
        return scale_source(inner)
    engine_optimizer = getattr(scaler, "optimizer", None)
    if engine_optimizer is not None and callable(getattr(scaler, "loss_scale", None)):
        # A DeepSpeed engine: its loss_scale() is the configured static scale; the scale in
        # force lives on its fp16 optimizer.
        try:
            source = scale_source(engine_optimizer)
        except ProbeError as e:
            raise ProbeError(
                f"cannot read the loss scale in force from {name}: its loss_scale() is the configured "
                f"static scale, and its optimizer ({type(engine_optimizer).__name__}) has no readable scale "
                "(`loss_scale`, `cur_scale` or `loss_scaler`); pass the loss scaler itself, e.g. scaler=engine.optimizer"
            ) from e
        if source is not None:
            return ScaleSource(source._read, f"{name}.optimizer: {source.describe}")
    if hasattr(scaler, "cur_scale"):  # DeepSpeed: a float attribute, updated in place
        _value_tensor(scaler.cur_scale, f"{name}.cur_scale")
        return ScaleSource(lambda: _value_tensor(scaler.cur_scale, f"{name}.cur_scale"), f"{name}.cur_scale")
    for attr in ("scale", "loss_scale"):  # Megatron: tensor property `scale`; apex: `loss_scale`
        try:
            value = getattr(scaler, attr)
        except Exception:  # a property that fails before training starts
            continue
        if isinstance(value, (torch.Tensor, numbers.Real)) and not isinstance(value, bool):
            _value_tensor(value, f"{name}.{attr}")
            return ScaleSource(lambda attr=attr: _value_tensor(getattr(scaler, attr), f"{name}.{attr}"), f"{name}.{attr}")
        if attr == "loss_scale" and callable(value):  # apex's LossScaler.loss_scale()
            _checked_now(value, f"{name}.loss_scale()")
            return ScaleSource(lambda: _value_tensor(scaler.loss_scale(), f"{name}.loss_scale()"), f"{name}.loss_scale()")
    if isinstance(getattr(scaler, "_scale", None), torch.Tensor):
        return ScaleSource(lambda: scaler._scale, f"{name}._scale")
    if callable(scaler) and not isinstance(scaler, type):
        _checked_now(scaler, f"the scale callable {name}")
        return ScaleSource(lambda: _value_tensor(scaler(), f"the scale callable {name}"), f"a callable ({name})")
    raise ProbeError(
        f"cannot read a loss scale from scaler={name}: expected a torch.amp.GradScaler, a scaler with "
        "`cur_scale` (DeepSpeed), `scale` or `loss_scale` (Megatron, apex), a number, a one-element "
        "tensor, or a function returning the scale; pass one of those, or scaler=None if the loss is not scaled"
    )
