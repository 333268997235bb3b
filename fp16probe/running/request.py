"""A frozen :class:`ProfileRequest`: every setting of a profile, resolved and checked once, before anything loads.

The command line fills one from its flags and :func:`fp16probe.profile` from its arguments;
the run takes the values it holds as they are. Library code: errors name the request's field
(``steps=...``) in their ``parameter``, which the command line maps to its flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp16probe.analysis.blockformats import parse_recipe
from fp16probe.capture.autocast_rules import TARGETS
from fp16probe.errors import AnalysisError, InputError, UnknownFormatError
from fp16probe.formats import FORMATS, SCALED_FORMATS, get_format
from fp16probe.report import ALL_GRADS, KINDS
from fp16probe.running.inputs import DTYPES, parse_shape
from fp16probe.running.losses import check_loss_spec
from fp16probe.running.optimizers import OPTIMIZERS

__all__ = ["MAX_TRIAL_STEPS", "PRECISIONS", "ProfileRequest", "check_recipe"]

PRECISIONS = ("fp32", "fp16", "bf16")
MAX_TRIAL_STEPS = 100_000  # a trial costs 6 x this many training steps (fp16probe.running.trial)


@dataclass(frozen=True)
class ProfileRequest:
    """Everything ``fp16probe profile`` needs, as plain values; making one refuses what cannot work.

    ``model`` is an import string, a folder, an archive or None (the demo); ``batches`` and
    ``loss`` import strings or a built-in loss name; ``loss_scale`` and ``optimizer`` may also be
    a GradScaler and a torch optimizer (from :func:`fp16probe.profile`). ``format`` None
    resolves to bf16 for a bf16 run and fp16 otherwise, once, here; ``kind`` is ``all``,
    ``activation_grad`` or ``weight_grad``; ``plot`` is where the caller will draw the figures.
    """

    model: str | None = None
    weights: Path | None = None
    trust_checkpoint: bool = False
    trust_remote_code: bool = False
    input_shape: str | None = None
    input_dtype: str = "float32"
    vocab_size: int | None = None
    batches: str | None = None
    loss: str | None = None
    objective: str | None = None  # an RL objective's name (fp16probe.running.objective.OBJECTIVES)
    steps: int = 10
    device: str = "auto"
    precision: str = "fp32"
    loss_scale: Any = None
    optimizer: Any = None
    lr: float = 1e-3
    format: str | None = None
    kind: str = ALL_GRADS
    granularity: str = "module"
    modules: tuple[str, ...] = ()
    seed: int = 0
    verify: bool = False
    trial: int | None = None  # optimizer steps of the training trial (fp16probe.running.trial); None: no trial
    target: str | None = None
    recipe: str | None = None  # a scaled format's recipe (docs/block-formats.md)
    plot: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        fmt = self.format or ("bf16" if self.precision == "bf16" else "fp16")
        try:
            fmt = fmt if fmt in SCALED_FORMATS else get_format(fmt).name  # an alias (half, float16) named once
        except UnknownFormatError:
            raise InputError(f"format={fmt!r}: expected one of {', '.join({**FORMATS, **SCALED_FORMATS})}",
                             parameter="format") from None
        object.__setattr__(self, "format", fmt)
        self._check_run()
        check_recipe(fmt, self.recipe)
        check_loss_spec(self.loss)
        self._check_objective()
        if self.input_shape is not None:
            parse_shape(self.input_shape)
        if self.input_dtype not in DTYPES:
            raise InputError(f"input_dtype={self.input_dtype!r}: expected one of {', '.join(DTYPES)}",
                             parameter="input_dtype")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InputError(f"seed={self.seed!r}: expected a whole number in [0, 2**63), e.g. 0", parameter="seed")
        if self.plot is not None and fmt in SCALED_FORMATS:
            raise InputError(f"plot={self.plot}: the figures draw fp16/bf16/fp8 histograms, and {fmt} answers with "
                             "its per-layer table instead; drop it", parameter="plot")

    def _check_objective(self) -> None:
        from fp16probe.running.objective import OBJECTIVES

        if self.objective is None:
            return
        if self.objective not in OBJECTIVES:
            raise InputError(f"objective={self.objective!r}: expected one of {', '.join(OBJECTIVES)} "
                             "(an RL post-training loss on completions sampled from a causal LM)",
                             parameter="objective")
        if self.loss is not None:
            raise InputError(f"objective={self.objective!r} brings its own loss; give it or a loss "
                             f"({self.loss!r}), not both", parameter="objective")

    def _check_run(self) -> None:
        """Refuse settings the run cannot take (InputError naming :func:`fp16probe.profile`'s parameter)."""
        steps, precision, scaler, optimizer, lr = self.steps, self.precision, self.loss_scale, self.optimizer, self.lr
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InputError(f"steps={steps!r}: expected a positive whole number of steps, e.g. 10", parameter="steps")
        if precision not in PRECISIONS:
            raise InputError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}",
                             parameter="precision")
        if scaler is not None and not (hasattr(scaler, "scale") and hasattr(scaler, "get_scale")):
            if isinstance(scaler, bool) or not isinstance(scaler, (int, float)):
                raise InputError(f"scaler={scaler!r}: expected a loss scale (a number such as 1024) or a GradScaler",
                                 parameter="scaler")
            if precision == "fp32":
                raise InputError("scaler= applies to fp16 and bf16 runs (an fp32 run is the unscaled reference)",
                                 parameter="scaler")
            if not (math.isfinite(scaler) and scaler > 0):
                raise InputError(f"scaler={scaler}: expected a finite positive loss scale such as 1024",
                                 parameter="scaler")
            if scaler >= torch.finfo(torch.float32).max:
                raise InputError(f"scaler={scaler:g}: beyond float32's range; expected a loss scale such as 1024",
                                 parameter="scaler")
        if optimizer not in (None, *OPTIMIZERS) and not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError(f"optimizer={optimizer!r}: expected one of {', '.join(OPTIMIZERS)} or a torch optimizer",
                             parameter="optimizer")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise InputError(f"lr={lr!r}: expected a finite positive learning rate such as 1e-3", parameter="lr")
        if self.target is not None and self.target not in TARGETS:
            raise InputError(f"target={self.target!r}: expected one of {', '.join(TARGETS)} (the device whose fp16 "
                             "autocast rules the prediction applies)", parameter="target")
        if self.kind not in (ALL_GRADS,) + KINDS:
            raise InputError(f"kind={self.kind!r}: expected one of {', '.join((ALL_GRADS,) + KINDS)}", parameter="kind")
        if self.verify and precision != "fp32":
            raise InputError(f"verify= checks a prediction made from the fp32 reference: profile in fp32, not "
                             f"{precision}", parameter="verify")
        self._check_trial()
        if self.verify and self.format not in ("fp16", "bf16"):
            raise InputError(f"verify= runs the recommendation under torch.autocast, which computes in fp16 or bf16 "
                             f"only, not {self.format}", parameter="verify")

    def _check_trial(self) -> None:
        """Refuse a trial length that is not a positive whole number, or a trial the run cannot train."""
        trial = self.trial
        if trial is None:
            return
        if isinstance(trial, bool) or not isinstance(trial, int) or not 1 <= trial <= MAX_TRIAL_STEPS:
            raise InputError(f"trial={trial!r}: expected a whole number of training steps in [1, {MAX_TRIAL_STEPS}], "
                             "e.g. 200", parameter="trial")
        if self.precision != "fp32":
            raise InputError(f"trial= trains fp32 beside the answer's precision from an fp32 profile: profile in fp32, "
                             f"not {self.precision}", parameter="trial")
        if self.format not in ("fp16", "bf16"):
            raise InputError(f"trial= trains under torch.autocast, which computes in fp16 or bf16 only, not "
                             f"{self.format}", parameter="trial")


def check_recipe(format: str, recipe: str | None) -> None:
    """Refuse a ``recipe`` that ``format`` has not."""
    if format not in SCALED_FORMATS:
        if recipe is not None:
            raise InputError(f"recipe={recipe!r} applies to the scaled formats ({', '.join(SCALED_FORMATS)}), "
                             f"not {format}", parameter="recipe")
        return
    try:
        parse_recipe(SCALED_FORMATS[format].family, recipe)
    except AnalysisError as e:
        raise InputError(str(e), parameter="recipe") from None
