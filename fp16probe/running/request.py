"""One path from settings to a report: a frozen :class:`ProfileRequest` and :func:`profile_request`.

The command line fills a request from its flags and calls :func:`profile_request`; what was
the CLI's own set-up (device choice, seeding, the checks before anything loads, loading the
model, its batches and its loss) lives here, in the order torchinfo's ``summary()`` reads:
check the request, resolve the device, load, make the inputs and the loss, run. Library code:
errors name the request's fields (``steps=...``), which the command line maps to its flags.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp16probe.report import ALL_GRADS

__all__ = ["ProfileRequest", "profile_request"]


@dataclass(frozen=True)
class ProfileRequest:
    """Everything ``fp16probe profile`` needs, as plain values; :meth:`check` refuses what cannot work.

    ``model`` is an import string, a folder, an archive or None (the demo); ``batches`` and
    ``loss`` import strings or a built-in loss name. ``format`` None resolves to bf16 for a
    bf16 run and fp16 otherwise, once, here; ``kind`` is ``all``, ``activation_grad`` or
    ``weight_grad``.
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
    steps: int = 10
    device: str = "auto"
    precision: str = "fp32"
    loss_scale: float | None = None
    optimizer: str | None = None
    lr: float = 1e-3
    format: str | None = None
    kind: str = ALL_GRADS
    granularity: str = "module"
    modules: tuple[str, ...] = ()
    seed: int = 0
    verify: bool = False
    target: str | None = None
    recipe: str | None = None  # a scaled format's recipe (docs/block-formats.md)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format is None:  # resolved once: every layer below takes the name it is given
            object.__setattr__(self, "format", "bf16" if self.precision == "bf16" else "fp16")

    def check(self) -> None:
        """Refuse, before the model loads, settings that cannot work (InputError naming the field)."""
        from fp16probe.running.losses import check_loss_spec
        from fp16probe.running.profile import check_recipe, check_settings

        check_recipe(str(self.format), self.recipe)
        check_settings(steps=self.steps, precision=self.precision, scaler=self.loss_scale,
                       optimizer=self.optimizer, lr=self.lr, format=str(self.format), kind=self.kind,
                       verify=self.verify, target=self.target or "cuda")
        check_loss_spec(self.loss)


Progress = Callable[[int, bool], contextlib.AbstractContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def _no_progress(total: int, main: bool) -> Iterator[Callable[[int], None]]:
    yield lambda done: None


def profile_request(request: ProfileRequest, *, on_notes: Callable[[list[str]], None] | None = None,
                    progress: Progress = _no_progress, on_distributed: Callable[[], None] | None = None) -> Any:
    """Load, feed and profile what ``request`` names; return the Report (None on ranks other than 0).

    ``on_notes`` hears, on rank 0 before the run, what loading and the inputs changed (also
    kept in the report); ``progress(total, main)`` makes the context whose ``update(done)`` is
    called after each step; ``on_distributed`` is called once torch.distributed is set up
    (``FP16PROBE_DIST_TIMEOUT`` bounds its collectives, see docs/faults.md). Errors are
    :func:`fp16probe.profile`'s.
    """
    import torch

    from fp16probe.capture import distributed
    from fp16probe.running.inputs import check_inputs_before_load, make_batches, pick_device
    from fp16probe.running.loading import load_model, quiet_transformers
    from fp16probe.running.losses import make_loss
    from fp16probe.running.profile import profile

    from fp16probe.running.ranks import timeout_s

    r = request
    r.check()
    is_dist = distributed.init_from_env(timeout=timeout_s())
    if is_dist and on_distributed is not None:
        on_distributed()
    rank = distributed.rank()
    dev = pick_device(r.device)
    if is_dist and dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if 0 <= r.seed < 2**63:  # make_batches refuses any other seed in one line
        torch.manual_seed(r.seed + rank)  # a factory's initialisation and dropout repeat from run to run
    check_inputs_before_load(r.model, dev, input_shape=r.input_shape, input_dtype=r.input_dtype,
                             vocab_size=r.vocab_size, batches=r.batches)
    loaded = load_model(r.model, weights=r.weights, trust_checkpoint=r.trust_checkpoint,
                        trust_remote_code=r.trust_remote_code)
    batch_src = make_batches(loaded, dev, input_shape=r.input_shape, input_dtype=r.input_dtype,
                             vocab_size=r.vocab_size, batches=r.batches,
                             seed=r.seed + rank)  # each rank draws its own synthetic batches
    loss_src = make_loss(loaded, r.loss, batch_src, seed=r.seed + rank)
    notes = [*loaded.notes, *batch_src.notes]
    if on_notes is not None and rank == 0:
        on_notes(notes)
    extra: dict[str, Any] = {"model_kind": loaded.kind, "model_source": loaded.source, "notes": notes,
                             **loaded.extra, **r.extra}
    if batch_src.family is not None:
        extra["family"] = batch_src.family
    if is_dist:
        extra["batches_per_rank"] = ("synthetic inputs seeded with --seed + rank" if batch_src.synthetic
                                     else "each rank ran the batches it was given")
    # a Hugging Face model's warnings (a loss_type it falls back from) would bury the summary
    quiet = quiet_transformers() if loaded.kind == "huggingface" else contextlib.nullcontext()
    with quiet, progress(r.steps, rank == 0) as update:
        return profile(loaded.model, batch_src, loss_src, steps=r.steps, precision=r.precision,
                       scaler=r.loss_scale, optimizer=r.optimizer, lr=r.lr, format=r.format, kind=r.kind,
                       device=dev, on_step=update, verify=r.verify, extra=extra,
                       modules=list(r.modules) or None, granularity=r.granularity, target=r.target,
                       recipe=r.recipe)
