"""Fixes a forward verdict pastes: keep named modules in fp32 inside an fp16 run."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fp16probe.errors import InputError
from fp16probe.running.inputs import map_tensors

__all__ = ["keep_in_fp32"]


_MARK = "_fp16probe_keep_fp32"


def _up(t: torch.Tensor) -> torch.Tensor:
    # .float() on fp32 too (it returns the tensor itself): an fp32 profile's forward audit sees the
    # cast, and knows the input the fp16 run would hand this module is fp32 here (the
    # emulated step, fp16probe.capture.emulate, holds fp16 values in fp32 tensors and sees it the same way).
    return t.float() if t.dtype in (torch.float16, torch.bfloat16, torch.float32) else t


def keep_in_fp32(model: nn.Module, names: Sequence[str], device_type: str = "cuda") -> nn.Module:
    """Run each named submodule of ``model`` in fp32 with autocast off, in place; return ``model``.

    The module's weights become fp32 and its floating inputs are cast up; its output stays
    fp32 (casting a value past 65504 back to fp16 would make it inf again), and the ops
    after it promote or cast as autocast does. Names and the state dict are unchanged (the
    module's ``forward`` is wrapped, not the module). ``device_type`` is the autocast device
    switched off inside. An unknown name raises InputError naming it.
    """
    modules = dict(model.named_modules())
    for name in names:
        module = modules.get(name)
        if module is None or not name:
            raise InputError(f"keep_in_fp32: {type(model).__name__} has no submodule {name!r}; "
                             "expected names as model.named_modules() gives them")
        if getattr(module, _MARK, False):
            continue
        module.float()
        # A partial of the bound method, not a closure: copy.deepcopy(model) then rebinds it to
        # the copy's module (a closure would keep calling the original's, and its weights would
        # get the copy's gradients).
        module.forward = functools.partial(_fp32_forward, module.forward, device_type)  # type: ignore[method-assign]
        setattr(module, _MARK, True)
    return model


def _fp32_forward(inner: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast(device_type, enabled=False):
        return inner(*map_tensors(args, _up), **map_tensors(kwargs, _up))
