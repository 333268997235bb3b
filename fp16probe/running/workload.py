"""What ``fp16probe profile`` feeds a model: batches, a loss, and the loop that runs them.

Library code: it returns data and raises :class:`InputError`; the command line prints.
A batch reaches the model by one rule: a tensor is the input, a mapping is keyword
arguments, and a tuple or list is ``(inputs, targets...)`` as a DataLoader yields it
(the first element is the input: a tensor, or a tuple of positional inputs).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp16probe.errors import InputError
from fp16probe.running.loading import DEMO, LoadedModel, resolve_import
from fp16probe.capture.probe import iter_tensors

__all__ = [
    "Batches",
    "Loss",
    "RunResult",
    "RunSettings",
    "call_model",
    "default_loss",
    "make_batches",
    "make_loss",
    "parse_shape",
    "pick_device",
    "run_profile",
]

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
}
DEFAULT_TOKEN_SHAPE = (4, 32)  # batch x sequence for token-id models without --input-shape
DEFAULT_LOSS_TEXT = "default: mean of squares of the model's floating-point outputs"


@dataclass(frozen=True)
class Batches:
    """An iterator of batches and how it was made (for the report's metadata)."""

    iterator: Iterator[Any]
    description: str
    synthetic: bool


@dataclass(frozen=True)
class Loss:
    """A loss function ``(output, batch) -> scalar`` and where it came from."""

    fn: Callable[[Any, Any], torch.Tensor]
    description: str
    synthetic: bool


@dataclass(frozen=True)
class RunSettings:
    """How the profiling loop runs."""

    steps: int = 10
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | fp16 | bf16 (the latter two through autocast)
    loss_scale: float | None = None
    optimizer: str | None = None  # None: forward + backward only, weights unchanged
    lr: float = 1e-3


@dataclass(frozen=True)
class RunResult:
    """What the loop did: steps finished, whether Ctrl-C stopped it, non-finite losses."""

    steps_done: int
    interrupted: bool = False
    exhausted: bool = False
    nonfinite_loss_steps: tuple[int, ...] = ()
    losses: tuple[float, ...] = field(default=(), repr=False)
    # With an optimizer: the weights before the last step that updated them, and that
    # step's update (new minus old), for the weight-update check of LIT-011.
    weights_before: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    updates: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``"8,3,32,32"`` (or ``8x3x32x32``) into a shape."""
    parts = [p for p in re.split(r"[,x\s]+", text.strip().strip("()[]")) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise InputError(
            f"--input-shape {text!r}: expected positive integers separated by commas, e.g. 8,3,32,32"
        )
    return shape


def pick_device(name: str) -> torch.device:
    """Resolve ``auto``/``cpu``/``cuda`` to a device that exists here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available here; use --device cpu or auto")
    return torch.device(name)


def make_batches(
    loaded: LoadedModel,
    device: torch.device,
    *,
    input_shape: str | None = None,
    input_dtype: str = "float32",
    vocab_size: int | None = None,
    batches: str | None = None,
    seed: int = 0,
) -> Batches:
    """Choose the batches: ``--batches`` if given, the demo's data, or synthetic inputs."""
    if batches is not None:
        fn = resolve_import(batches, what="--batches")
        try:
            source = fn() if callable(fn) else fn
            iterator = iter(source)
        except Exception as e:
            raise InputError(f"--batches {batches!r}: calling it raised {type(e).__name__}: {e}") from e
        return Batches(_to_device(iterator, device), f"--batches {batches}", synthetic=False)
    if loaded.kind == DEMO and input_shape is None:
        from fp16probe.running.demo import demo_batches

        return Batches(_to_device(demo_batches(seed=seed), device), "demo data (fp16probe.running.demo)", synthetic=False)
    gen = torch.Generator().manual_seed(seed)
    vocab = vocab_size or loaded.vocab_size
    if input_shape is None and loaded.example_inputs is not None:
        args, kwargs = loaded.example_inputs
        desc = "synthetic: random values shaped like the archive's example inputs"
        return Batches(_to_device(_like_examples(args, kwargs, gen), device), desc, synthetic=True)
    if vocab is not None and (input_shape is None or input_dtype in ("int64", "long", "int32")):
        shape = parse_shape(input_shape) if input_shape else DEFAULT_TOKEN_SHAPE
        desc = f"synthetic: uniform random token ids in [0, {vocab}) of shape {list(shape)}"
        return Batches(_to_device(_token_batches(shape, vocab, gen, loaded.has_loss), device), desc, synthetic=True)
    if input_shape is None:
        raise InputError(
            "no inputs: pass --input-shape (e.g. --input-shape 8,64) or --batches package.module:function "
            "that yields real batches"
        )
    shape = parse_shape(input_shape)
    dtype = DTYPES.get(input_dtype)
    if dtype is None:
        raise InputError(f"--input-dtype {input_dtype!r}: expected one of {', '.join(DTYPES)}")
    if not dtype.is_floating_point and vocab is None:
        raise InputError(
            f"--input-dtype {input_dtype}: integer inputs need a range; pass --vocab-size N for ids in [0, N)"
        )
    if dtype.is_floating_point:
        desc = f"synthetic: standard normal {input_dtype} of shape {list(shape)}"
        it = (torch.randn(shape, generator=gen).to(dtype) for _ in itertools.count())
    else:
        desc = f"synthetic: uniform random ids in [0, {vocab}) of shape {list(shape)}"
        it = (torch.randint(0, vocab, shape, generator=gen, dtype=dtype) for _ in itertools.count())
    return Batches(_to_device(it, device), desc, synthetic=True)


def _token_batches(shape: tuple[int, ...], vocab: int, gen: torch.Generator, labels: bool) -> Iterator[dict]:
    while True:
        ids = torch.randint(0, vocab, shape, generator=gen)
        # A language-model head computes its own loss when given labels.
        yield {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


def _like_examples(args: tuple, kwargs: dict, gen: torch.Generator) -> Iterator[Any]:
    def fresh(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return torch.randn(t.shape, generator=gen).to(t.dtype)
        return t

    while True:
        new_args = tuple(fresh(a) for a in args)
        new_kwargs = {k: fresh(v) for k, v in kwargs.items()}
        yield new_kwargs if not new_args else ((new_args,) if not new_kwargs else (new_args, new_kwargs))


def _to_device(it: Iterable[Any], device: torch.device) -> Iterator[Any]:
    for batch in it:
        yield _move(batch, device)


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_move(v, device) for v in obj) if isinstance(obj, list) else tuple(_move(v, device) for v in obj)
    return obj


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run the model on one batch by the module docstring's rule."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)) and batch:
        inputs = batch[0]
        if isinstance(inputs, (tuple, list)):
            kwargs = batch[1] if len(batch) > 1 and isinstance(batch[1], Mapping) else {}
            return model(*inputs, **kwargs)
        if isinstance(inputs, Mapping):
            return model(**inputs)
        return model(inputs)
    raise InputError(
        f"a batch of type {type(batch).__name__} cannot be fed to the model; yield a tensor, a dict of "
        "keyword arguments, or a tuple (inputs, targets...)"
    )


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """The model's own ``.loss`` if it has one, else the mean of squares of its floating outputs."""
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.numel() == 1:
        return own.reshape(())
    terms = [t.float().pow(2).mean() for t in iter_tensors(output) if t.is_floating_point() and t.requires_grad]
    if not terms:
        raise InputError(
            "the model's output holds no floating-point tensor that needs a gradient; pass --loss "
            "package.module:function to compute a loss from (output, batch)"
        )
    return torch.stack(terms).sum()


def make_loss(loaded: LoadedModel, loss: str | None) -> Loss:
    """Choose the loss: ``--loss``, the demo's own, the model's ``.loss``, or the default."""
    if loss is not None:
        fn = resolve_import(loss, what="--loss")
        if not callable(fn):
            raise InputError(f"--loss {loss!r} is a {type(fn).__name__}, expected a function (output, batch) -> loss")
        return Loss(fn, f"--loss {loss}", synthetic=False)
    if loaded.kind == DEMO:
        from fp16probe.running.demo import demo_loss

        return Loss(demo_loss, "demo: mean squared error against the demo's targets", synthetic=False)
    if loaded.has_loss:
        return Loss(default_loss, "the model's own output .loss", synthetic=False)
    return Loss(default_loss, f"{DEFAULT_LOSS_TEXT} (unless the output has .loss)", synthetic=True)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


def make_optimizer(model: nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """Build the optimizer named on the command line."""
    params = [p for p in model.parameters() if p.requires_grad]
    classes = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    return classes[name](params, lr=lr)


def run_profile(
    model: nn.Module,
    batches: Batches,
    loss: Loss,
    settings: RunSettings,
    probe: Any,
    *,
    scaler: Any = None,
    on_step: Callable[[int], None] | None = None,
) -> RunResult:
    """Run ``settings.steps`` forward+backward passes under the probe; Ctrl-C stops early.

    The loss is checked for inf/NaN each step, which synchronises with the device
    once per step; a non-finite loss is recorded (a finding), never raised.
    """
    device = torch.device(settings.device)
    optimizer = make_optimizer(model, settings.optimizer, settings.lr) if settings.optimizer else None
    nonfinite: list[int] = []
    losses: list[float] = []
    before: dict[str, torch.Tensor] | None = None
    updates: dict[str, torch.Tensor] | None = None
    done = 0
    exhausted = False
    model.train()
    try:
        for step in range(settings.steps):
            try:
                batch = next(batches.iterator)
            except StopIteration:
                exhausted = True
                break
            with _autocast(device, settings.precision):
                try:
                    output = call_model(model, batch)
                except InputError:
                    raise
                except (RuntimeError, TypeError, ValueError, IndexError) as e:
                    raise InputError(
                        f"the model rejected the input ({_describe(batch)}): {type(e).__name__}: "
                        f"{_first_line(e)}; pass --input-shape/--input-dtype that forward() accepts, or --batches"
                    ) from e
                try:
                    value = loss.fn(output, batch)
                except InputError:
                    raise
                except Exception as e:
                    raise InputError(f"the loss ({loss.description}) raised {type(e).__name__}: {_first_line(e)}") from e
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise InputError(
                    f"the loss ({loss.description}) returned {type(value).__name__}, expected a scalar tensor"
                )
            value = value.reshape(())
            loss_val = float(value.detach().float())  # one host sync per step, outside every hook
            losses.append(loss_val)
            if not math.isfinite(loss_val):
                nonfinite.append(step)
            if not value.requires_grad:
                raise InputError(
                    f"the loss ({loss.description}) does not depend on any trainable parameter; "
                    "check that the model's parameters require grad"
                )
            (scaler.scale(value) if scaler is not None else value).backward()
            if optimizer is not None:
                snapshot = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
                if scaler is not None:
                    scale = scaler.get_scale()
                    scaler.step(optimizer)  # skips the step itself on inf/NaN gradients
                    scaler.update()
                    taken = scaler.get_scale() >= scale  # a skipped step backs the scale off
                else:
                    taken = math.isfinite(loss_val)
                    if taken:
                        optimizer.step()
                if taken:
                    before = snapshot
            model.zero_grad(set_to_none=True)
            probe.step()
            done += 1
            if on_step is not None:
                on_step(done)
    except KeyboardInterrupt:
        interrupted = True
    else:
        interrupted = False
    if before is not None:
        # Later steps were skipped, so the weights still hold the last taken step's result.
        updates = {n: p.detach() - before[n] for n, p in model.named_parameters() if n in before}
    return RunResult(done, interrupted=interrupted, exhausted=exhausted, nonfinite_loss_steps=tuple(nonfinite),
                     losses=tuple(losses), weights_before=before, updates=updates)


def _describe(batch: Any) -> str:
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in iter_tensors(batch)]
    return "inputs " + ", ".join(shapes[:4]) if shapes else type(batch).__name__


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
