"""torch.compile: what the Probe can see without changing what the compiled model computes.

A forward hook that dynamo traces becomes part of the compiled program: reading a module's
output (an ``amax``), registering a gradient hook on it or entering a torch function mode
inside the compiled region makes inductor fuse differently (the outputs must exist in
memory, in their autocast dtype) or break the graph, and the trained weights change. So every
forward-path hook of the Probe returns at once while dynamo traces it
(:func:`tracing`), which dynamo folds away: the compiled graph is the one it builds without
the Probe. It notes that it was traced (:class:`CompileSeen`), a side effect dynamo replays
outside the graph, so the report says which capture it could not make.

What stays under torch.compile, unchanged: each parameter's accumulated gradient (its
post-accumulate-grad hook runs in the eager autograd engine, after the compiled backward),
the loss scale and the history; and the fp32 reruns, which run the uncompiled model
(:func:`eager`, ``torch.compiler.set_stance("force_eager")``), so a rerun's flipped autocast
state makes dynamo neither recompile nor fall back. What is lost: the output gradients and
forward maxima of the modules inside the compiled region, which the fp32 reruns still record.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fp16probe.capture.collector import Collected, Collector

__all__ = ["CompileNotice", "CompileSeen", "compiled_modules", "eager", "runs_compiled", "tracing"]


def tracing() -> bool:
    """Whether dynamo is tracing the code that calls this (a hook inside a compiled region)."""
    return torch.compiler.is_compiling()


def _dynamo() -> Any:
    """``torch._dynamo`` where something imported it (``torch.compile`` does), else None: nothing runs compiled.

    Not imported here: importing it sets ``TORCHINDUCTOR_CACHE_DIR`` in ``os.environ`` and adds a
    warnings filter, which a profile of an uncompiled model would leave behind.
    """
    return sys.modules.get("torch._dynamo")


def is_compiled_wrapper(module: Any) -> bool:
    """Whether ``module`` is a ``torch.compile(model)`` wrapper (``OptimizedModule``)."""
    dynamo = _dynamo()
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def runs_compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs compiled code: a ``torch.compile`` wrapper, or ``module.compile()``."""
    return is_compiled_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


def compiled_modules(model: nn.Module) -> tuple[str, ...]:
    """The names (``""``: the model) of ``model``'s modules whose calls run compiled, outermost only."""
    found: list[str] = []
    for name, module in model.named_modules():
        if runs_compiled(module) and not any(f == "" or name.startswith(f"{f}.") for f in found):
            found.append(name)
    return tuple(found)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run every compiled function inside eagerly: no compile, no recompile, the cached graphs untouched."""
    if _dynamo() is None:  # nothing was compiled in this process
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


class CompileSeen:
    """Set by a Probe hook that dynamo traced (``traced``): a module of the model runs compiled.

    A hook does ``if tracing(): seen.traced = True; return``; dynamo replays the attribute's
    store after each call of the compiled code, outside the graph, which it leaves as it was.
    """

    def __init__(self) -> None:
        self.traced = False


class CompileNotice(Collector):
    """Say when the Probe starts, or at the first step dynamo traced its hooks, what torch.compile leaves out.

    A warning (once) and the report's ``capture.compiled_modules`` / ``capture.compile_traced``:
    module outputs inside compiled code are not read (the output gradients and forward maxima of
    those modules); weight gradients, the scale and the fp32 reruns (run uncompiled) are.
    """

    key = "compiled"

    def __init__(self, model: nn.Module, seen: CompileSeen) -> None:
        self.model = model
        self.seen = seen
        self.names: tuple[str, ...] = ()
        self._told = False

    def start(self) -> None:
        """Find the modules that run compiled now, and say so."""
        self.names = compiled_modules(self.model)
        if self.names:
            self._tell(", ".join(repr(n) if n else "the model" for n in self.names) + " runs compiled")

    def close_step(self, sampled: bool) -> None:
        """Say so at the first step whose forward dynamo traced (a model compiled after the Probe started)."""
        if self.seen.traced:
            self._tell("torch.compile traced the model's forward")

    def _tell(self, what: str) -> None:
        if self._told:
            return
        self._told = True
        replayed = is_compiled_wrapper(self.model)
        warnings.warn(f"fp16probe: {what}: module outputs inside compiled code are not read (reading them would "
                      "change what the compiler builds); weight gradients and the loss scale are, and the fp32 "
                      "reruns run uncompiled" + ("" if replayed else " where the loop calls probe.shadow(fn), or "
                                                 "give the Probe the torch.compile(model) wrapper"), stacklevel=3)

    def collect(self, got: Collected) -> dict[str, Any]:
        """Note the compiled modules and whether a hook was traced."""
        got.notes.update(compiled_modules=self.names, compile_traced=self.seen.traced)
        return {}
