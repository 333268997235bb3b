"""What the :class:`~fp16probe.capture.probe.Probe` is built from: its settings check, the built-in
collectors (the ``BUILTIN`` table, in the order the Probe runs them) and the report's metadata.

A collector beyond these registers itself (:func:`fp16probe.capture.collector.register_collector`).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fp16probe._version import __version__
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.compiled import CompileNotice
from fp16probe.capture.history import History
from fp16probe.capture.modules import ForwardHeadroom, ModuleHooks
from fp16probe.capture.ops import OpRecording
from fp16probe.capture.overflow import CeilingCollector
from fp16probe.capture.shadow import ShadowReruns
from fp16probe.capture.skips import SkipLedgerCollector
from fp16probe.errors import ProbeError
from fp16probe.report import ACTIVATION, ACTIVATION_GRAD, KINDS, WEIGHT_GRAD, Metadata
from fp16probe.sections import CaptureNotes

__all__ = ["BUILTIN", "GRANULARITIES", "capture_notes", "check_accumulation", "check_settings", "metadata_of"]

GRANULARITIES = ("module", "op")


def check_settings(model: Any, every: int, capturing: bool, granularity: str, regime: str, target: str | None,
                    shadow_every: int | None) -> None:
    """Refuse a setting the Probe cannot run with, naming it (ProbeError)."""
    if not isinstance(model, nn.Module):
        raise ProbeError(f"Probe needs a torch.nn.Module, got {type(model).__name__}")
    if int(every) < 1:
        raise ProbeError(f"every must be a positive number of steps, got {every!r}")
    if not capturing:
        raise ProbeError("nothing to capture: enable activation_grads, weight_grads, activations or forward")
    if granularity not in GRANULARITIES:
        raise ProbeError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if regime not in ("autocast", "pure_fp16"):
        raise ProbeError(f"regime must be 'autocast' or 'pure_fp16', got {regime!r}")
    if target not in (None, "cuda", "cpu"):
        raise ProbeError(f"target must be 'cuda', 'cpu' or None, got {target!r}")
    if shadow_every is not None and (isinstance(shadow_every, bool) or int(shadow_every) != shadow_every
                                     or shadow_every < 0):
        raise ProbeError(f"shadow_every must be a non-negative number of sampled steps (0: off), got {shadow_every!r}")
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ProbeError(
            f"{type(model).__name__} has tensors on the meta device (shapes only, no values), so there "
            "are no gradients to count; materialise them (model.to_empty(device=...) and initialise, "
            "or load weights) before probing"
        )


def check_accumulation(accumulation: Any, loss_divisor: Any) -> None:
    """Refuse an accumulation count that is not a positive integer, or a loss divisor that is not a
    positive finite number or a function (ProbeError)."""
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ProbeError(f"accumulation must be a positive number of micro-batches per step, got {accumulation!r}")
    if loss_divisor is None or callable(loss_divisor):
        return
    if isinstance(loss_divisor, bool) or not isinstance(loss_divisor, (int, float)) \
            or not 0 < loss_divisor < float("inf"):
        raise ProbeError(f"loss_divisor must be a positive number or a function of the forward's keyword "
                         f"arguments, got {loss_divisor!r}")


def _ops(probe: Any) -> Collector | None:
    wanted = probe.capture[ACTIVATION] or probe.capture[ACTIVATION_GRAD]
    return OpRecording(probe) if probe.granularity == "op" and wanted else None


def _ceiling(probe: Any) -> Collector | None:
    # The overflow ceiling covers every gradient backward makes, not only hooked modules'.
    return CeilingCollector(probe) if probe.capture[ACTIVATION_GRAD] or probe.capture[WEIGHT_GRAD] else None


def _shadow(probe: Any) -> Collector | None:
    every = probe.options["shadow_every"]
    return ShadowReruns(probe, every) if every and (probe.capture[ACTIVATION_GRAD] or probe.capture[WEIGHT_GRAD]) \
        else None


def _blocks(probe: Any) -> Collector | None:
    """The scaled-format collector when ``block_formats`` name one (else None: nothing registered)."""
    from fp16probe.blockscale import DelayedRecipe, families_for

    families = families_for(probe.options["block_formats"] or ())
    if not families:
        return None
    from fp16probe.capture.blockcapture import BlockCapture

    rec = probe.recorder
    return BlockCapture(probe.model, families, modules=probe.patterns,
                        delayed=tuple(probe.options["delayed_recipes"] or (DelayedRecipe(),)),
                        sampling=lambda: rec.enabled and rec.sampling, inv_scale=rec.inv_scale)


# The built-in collectors, in the order the Probe runs them: op capture's mode and the module hooks
# before the ceiling's walk from the model's output; the ceiling before the history, which reads its trace.
BUILTIN: tuple[Any, ...] = (
    lambda probe: CompileNotice(probe.model, probe.recorder.compile_seen),
    _ops,
    ModuleHooks,
    _ceiling,
    lambda probe: ForwardHeadroom(probe.recorder),
    lambda probe: History(probe) if probe.options["history"] else None,
    SkipLedgerCollector,  # after the history, whose section it reads
    _shadow,
    _blocks,
)


def metadata_of(probe: Any, got: Any, *, steps_seen: int, partial: bool, extra: Mapping[str, Any] | None) -> Metadata:
    """The report's metadata: the run as the Probe and its recorder saw it, and the caller's ``extra``."""
    param = next(probe.model.parameters(), None)
    return Metadata(
        fp16probe_version=__version__,
        torch_version=torch.__version__,
        device=got.device or (str(param.device) if param is not None else "cpu"),
        model_class=type(probe.model).__name__,
        precision=got.precision or "fp32",
        param_dtype=str(param.dtype) if param is not None else "none",
        steps_seen=steps_seen,
        steps_total=got.steps_total,
        every=probe.every,
        captured=tuple(k for k in KINDS if probe.capture[k]),
        hooked_modules=probe.hooked_modules,
        grad_scaler=probe.scaler is not None,
        world_size=1,
        partial=partial,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        target=probe.target,
        regime=probe.regime,
        extra=dict(extra or {}),
    )


def capture_notes(probe: Any, got: Any, view: Collected) -> CaptureNotes:
    """How the capture ran: sharding, granularity, the scale's source, hook errors and the collectors' notes."""
    rec = probe.recorder
    return CaptureNotes(
        weight_grads_sharded=rec.sharded_weight_grads, granularity=probe.granularity,
        trace_since_step=view.since_step, scale_source=None if rec.scale_source is None else rec.scale_source.describe,
        hook_errors=got.errors, first_hook_error=got.first_error if got.errors else None, **view.notes)
