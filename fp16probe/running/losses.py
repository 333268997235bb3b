"""The loss a profile backpropagates: the caller's, the demo's, the model's own, or a default.

A loss is a function ``(output, batch) -> scalar tensor``. Library code: errors name the
parameter (``loss=...``); the command line maps parameter names to its flags.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fp16probe.capture.probe import iter_tensors
from fp16probe.errors import InputError
from fp16probe.running.loading import DEMO, LoadedModel, resolve_import

__all__ = ["DEFAULT_LOSS_TEXT", "Loss", "as_loss", "default_loss", "make_loss"]

DEFAULT_LOSS_TEXT = "default: mean of squares of the model's floating-point outputs"


@dataclass(frozen=True)
class Loss:
    """A loss function ``(output, batch) -> scalar`` and where it came from."""

    fn: Callable[[Any, Any], torch.Tensor]
    description: str
    synthetic: bool


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """Return the model's own ``.loss`` if it has one, else the mean of squares of its floating outputs."""
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.numel() == 1:
        return own.reshape(())
    terms = [t.float().pow(2).mean() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise InputError(
            "the model's output holds no floating-point tensor that needs a gradient; pass loss= "
            "(a function (output, batch) -> scalar loss, e.g. package.module:function)"
        )
    return torch.stack(terms).sum()


def make_loss(loaded: LoadedModel, loss: str | None) -> Loss:
    """Choose the loss: ``loss`` (an import string), the demo's own, the model's ``.loss``, or the default."""
    if loss is not None:
        fn = resolve_import(loss, what="loss=")
        if not callable(fn):
            raise InputError(f"loss={loss!r} is a {type(fn).__name__}, expected a function (output, batch) -> loss")
        return Loss(fn, f"--loss {loss}", synthetic=False)
    if loaded.kind == DEMO:
        from fp16probe.running.demo import demo_loss

        return Loss(demo_loss, "demo: mean squared error against the demo's targets", synthetic=False)
    return as_loss(None, has_loss=loaded.has_loss)


def as_loss(fn: Callable[[Any, Any], torch.Tensor] | Loss | None, *, has_loss: bool = False) -> Loss:
    """Wrap a Python loss function (or None: the default) as a :class:`Loss`."""
    if isinstance(fn, Loss):
        return fn
    if fn is not None:
        if not callable(fn):
            raise InputError(f"loss_fn={fn!r}: expected a function (output, batch) -> scalar loss")
        return Loss(fn, getattr(fn, "__qualname__", type(fn).__name__), synthetic=False)
    if has_loss:
        return Loss(default_loss, "the model's own output .loss", synthetic=False)
    return Loss(default_loss, f"{DEFAULT_LOSS_TEXT} (unless the output has .loss)", synthetic=True)
