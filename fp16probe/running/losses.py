"""The loss a profile backpropagates: the caller's, the demo's, the model's own, or a default.

A loss is a function ``(output, batch) -> scalar tensor``. Library code: errors name the
parameter (``loss=...``); the command line maps parameter names to its flags. Which loss
a run without one gets, per model family, is :mod:`fp16probe.running.families`' business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fp16probe.errors import InputError
from fp16probe.running import families
from fp16probe.running.loading import DEMO, LoadedModel, resolve_import

__all__ = ["DEFAULT_LOSS_TEXT", "NAMED_LOSSES", "Loss", "as_loss", "check_loss_spec", "make_loss"]

DEFAULT_LOSS_TEXT = (
    "default: the model's own .loss when the output has one, else the batch's own targets when they fit the "
    "output (cross-entropy for class ids, mean squared error for values), else cross-entropy against uniformly "
    "random labels when the output is class logits [batch, classes], else the mean of squares of the outputs"
)
NAMED_LOSSES = families.NAMED_LOSSES


@dataclass(frozen=True)
class Loss:
    """A loss function ``(output, batch) -> scalar`` and where it came from."""

    fn: Callable[[Any, Any], torch.Tensor]
    description: str
    synthetic: bool

    def outcome(self) -> Loss:
        """The loss as the run computed it: a loss that chooses at its first call says which way it went."""
        decided = getattr(self.fn, "decided", None)
        if isinstance(decided, tuple) and len(decided) == 2:
            return Loss(self.fn, decided[0], synthetic=decided[1])
        return self


def check_loss_spec(loss: str | None) -> None:
    """Refuse, before anything loads, a ``loss`` that is neither a built-in name nor an import string."""
    if loss is not None and loss not in NAMED_LOSSES and ":" not in loss:
        raise InputError(
            f"loss={loss!r}: expected a built-in loss ({', '.join(NAMED_LOSSES)}) or an import string "
            "package.module:function for a function (output, batch) -> scalar loss", parameter="loss"
        )


def make_loss(loaded: LoadedModel, loss: str | None, batches: Any = None, *, seed: int = 0) -> Loss:
    """Choose the loss: ``loss`` (a built-in name or an import string), the demo's, the family's, or the default.

    ``batches`` (a :class:`~fp16probe.running.inputs.Batches`) tells whether the labels in
    them were drawn for a model family, whose own loss then goes with them.
    """
    if loss is not None:  # the request checked its spelling
        if loss in NAMED_LOSSES:
            chosen = named(loss, seed)
            if getattr(batches, "synthetic", False):
                chosen.fn.invented_targets = getattr(batches, "labels", None)
            return chosen
        fn = resolve_import(loss, parameter="loss")
        if not callable(fn):
            raise InputError(f"loss={loss!r} is a {type(fn).__name__}, expected a function (output, batch) -> loss",
                             parameter="loss")
        return Loss(fn, f"--loss {loss}", synthetic=False)
    if loaded.kind == DEMO:
        from fp16probe.running.demo import demo_loss

        return Loss(demo_loss, "demo: mean squared error against the demo's targets", synthetic=False)
    family_loss = getattr(batches, "loss", None)
    if family_loss:
        # The model computes its own loss on labels fp16probe drew: the loss is the task's,
        # the labels are invented, so the run records it as synthetic.
        return Loss(_own_loss, f"{family_loss}, on invented labels: {batches.labels}", synthetic=True)
    chosen = as_loss(None, seed=seed)
    if getattr(batches, "synthetic", False):
        chosen.fn.invented_targets = getattr(batches, "labels", None) or "drawn by fp16probe"
    return chosen


def named(name: str, seed: int = 0) -> Loss:
    """The built-in loss ``name`` (cross_entropy, nll, bce_with_logits, mse, l1, smooth_l1)."""
    fn = families.named_loss(name, seed)
    what, against = NAMED_LOSSES[name][1], NAMED_LOSSES[name][2]
    return Loss(fn, f"--loss {name}: {what} against the batch's targets, else {against}", synthetic=False)


def _own_loss(output: Any, batch: Any) -> torch.Tensor:
    own = families.own_loss(output)
    if own is None:
        raise InputError("the model returned no .loss although the batch carried labels; pass loss=",
                         parameter="loss")
    return own


def as_loss(fn: Callable[[Any, Any], torch.Tensor] | Loss | str | None, *, seed: int = 0) -> Loss:
    """Wrap a Python loss function, a built-in loss's name, or None (the default) as a :class:`Loss`.

    The default (``fn=None``) chooses at its first call, by the output: the model's own
    ``.loss``, cross-entropy against random labels for class logits, or the mean of
    squares; :meth:`Loss.outcome` then says which, and whether it was invented.
    """
    if isinstance(fn, Loss):
        return fn
    if isinstance(fn, str):
        if fn not in NAMED_LOSSES:
            raise InputError(f"loss_fn={fn!r}: expected a function or one of {', '.join(NAMED_LOSSES)}",
                             parameter="loss_fn")
        return named(fn, seed)
    if fn is not None:
        if not callable(fn):
            raise InputError(f"loss_fn={fn!r}: expected a function (output, batch) -> scalar loss", parameter="loss_fn")
        return Loss(fn, getattr(fn, "__qualname__", type(fn).__name__), synthetic=False)
    return Loss(families.DecidingLoss(seed), DEFAULT_LOSS_TEXT, synthetic=True)
