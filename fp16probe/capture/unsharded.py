"""An unsharded fp32 copy of an FSDP2 (``fully_shard``) model: what the fp32 reruns run under FSDP2.

Under FSDP2 each rank holds a shard of every parameter (a ``DTensor``); the module's own forward
hooks all-gather them in ``MixedPrecisionPolicy.param_dtype`` (fp16: no fp32 weights to rerun
with) and its backward reduce-scatters the gradients. A rerun through the sharded module would
compute in fp16 and add to the shards' gradients. :class:`UnshardedCopy` is instead a plain module
tree of the model's own classes, with the same module names, each parameter whole and in fp32,
each buffer a copy, and none of FSDP2's hooks or state: a forward and backward on it run on this
rank alone, in fp32, touching nothing of training's.

Its weights are refreshed before each rerun (:meth:`UnshardedCopy.refresh`): each sharded
parameter's ``full_tensor()``, an all-gather in fp32. That is a collective: every rank refreshes
at the same rerun, in the same parameter order, as the reruns come on the same scheduled steps of
every rank's replayed forward (the only rerun under FSDP2: ``Probe.shadow(fn)`` would call the
sharded model). Its cost is the model's full fp32 weights and, while a rerun runs, their gradients,
on every rank (docs/live-training.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["UnshardedCopy", "fsdp2_low_precision", "is_fsdp2"]

# The hook dictionaries of nn.Module: emptied in the copy (FSDP2's forward hooks all-gather and reshard).
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
# What fully_shard adds to a module's __dict__ besides its hooks (its state, under contract()'s keys).
_FSDP_KEYS = ("_fsdp_use_orig_params", "_is_fsdp_managed_module")


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without torch.distributed or without FSDP2
        return None
    return FSDPModule


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it is sharded by FSDP2 (``fully_shard``)."""
    cls = _fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def fsdp2_low_precision(model: nn.Module) -> bool:
    """Whether an FSDP2 module in ``model`` computes in fp16 or bf16 (its ``MixedPrecisionPolicy.param_dtype``)."""
    cls = _fsdp_module_class()
    if cls is None:
        return False
    for m in model.modules():
        if isinstance(m, cls):
            try:  # FSDP2's state is private: read it defensively, an unknown layout says nothing
                group = m._get_fsdp_state()._fsdp_param_group
                dtype = None if group is None else group.mp_policy.param_dtype
            except (AttributeError, RuntimeError):
                continue
            if dtype in (torch.float16, torch.bfloat16):
                return True
    return False


def _plain_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 swaps in ``FSDP<Class>(FSDPModule, Class)``."""
    fsdp = _fsdp_module_class()
    cls = type(module)
    if fsdp is not None and issubclass(cls, fsdp):
        return next(c for c in cls.__mro__[1:] if issubclass(c, nn.Module) and not issubclass(c, fsdp))
    return cls


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local device and global shape (a DTensor's shard lives on this rank's device)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return torch.empty(tuple(t.shape), dtype=torch.float32, device=local.device)


class UnshardedCopy:
    """A plain fp32 copy of an FSDP2 model (see the module docstring): ``module`` is its root."""

    def __init__(self, model: nn.Module) -> None:
        self._params: list[tuple[torch.Tensor, nn.Parameter]] = []  # (live, copy), in the model's order
        self._buffers: list[tuple[nn.Module, str, nn.Module]] = []  # (live module, name, copy module)
        self._modules: list[tuple[nn.Module, nn.Module]] = []  # (live, copy)
        self._memo: dict[int, Any] = {}
        self.module: nn.Module = self._copy(model)
        self._memo = {}

    def _copy(self, live: nn.Module) -> nn.Module:
        if id(live) in self._memo:  # a module used twice stays one module
            return self._memo[id(live)]
        cls = _plain_class(live)
        mine = cls.__new__(cls)
        self._memo[id(live)] = mine
        state = {k: v for k, v in live.__dict__.items()
                 if not k.startswith("__composable_api_state_key") and k not in _FSDP_KEYS}
        for k in _HOOKS:
            if k in state:
                state[k] = OrderedDict()
        state["_parameters"] = {}
        state["_buffers"] = {}
        state["_modules"] = {}
        mine.__dict__.update(state)
        for name, p in live._parameters.items():
            if p is None:
                mine._parameters[name] = None
            elif id(p) in self._memo:  # a tied parameter stays tied
                mine._parameters[name] = self._memo[id(p)]
            else:
                copy = nn.Parameter(_whole(p), requires_grad=p.requires_grad)
                self._memo[id(p)] = copy
                mine._parameters[name] = copy
                self._params.append((p, copy))
        for name, b in live._buffers.items():
            mine._buffers[name] = None if b is None else b.detach().clone()
            if b is not None:
                self._buffers.append((live, name, mine))
        for name, child in live._modules.items():
            mine._modules[name] = None if child is None else self._copy(child)
        self._modules.append((live, mine))
        return mine

    def refresh(self) -> None:
        """Copy training's weights, buffers and train/eval modes into the copy; every rank at once (a collective)."""
        with torch.no_grad():
            for live, mine in self._params:
                whole = live.full_tensor() if hasattr(live, "full_tensor") else live
                mine.copy_(whole)
            for live_module, name, mine_module in self._buffers:
                b = getattr(live_module, name)
                if isinstance(b, torch.Tensor):
                    mine_module._buffers[name].copy_(b)
        for live, mine in self._modules:
            mine.training = live.training
