"""The batches a profile feeds the model: the caller's own, the demo's, or synthetic ones.

Library code: it returns data and raises :class:`InputError` whose ``parameter`` names the
parameter (``input_shape=...``); the command line maps it to its flag.
A batch reaches the model by one rule: a tensor is the input, a mapping is keyword
arguments, and a tuple or list is ``(inputs, targets...)`` as a DataLoader yields it
(the first element is the input: a tensor, or a tuple of positional inputs).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp16probe.capture.probe import iter_tensors
from fp16probe.errors import InputError, ModelLoadError, first_line, message_of
from fp16probe.running import families
from fp16probe.running.loading import DEMO, HF, LoadedModel, quiet_transformers, read_hf_config, resolve_import

__all__ = [
    "DTYPES",
    "Batches",
    "call_model",
    "check_inputs_before_load",
    "describe_batch",
    "make_batches",
    "map_tensors",
    "move_to",
    "parse_shape",
    "pick_device",
]

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
}
# One synthetic batch may take at most this share of the memory free where it is made:
# beyond it the run would swap or die with a C++ trace instead of a one-line error.
MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class Batches:
    """An iterator of batches and how it was made (for the report's metadata).

    Synthetic batches made for a model family also say what their labels are
    (``labels``), the model's own loss on them (``loss``), the family, and notes.
    """

    iterator: Iterator[Any]
    description: str
    synthetic: bool
    labels: str | None = None
    loss: str | None = None
    family: str | None = None
    notes: tuple[str, ...] = field(default=())


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``"8,3,32,32"`` (or ``8x3x32x32``) into a shape."""
    parts = [p for p in re.split(r"[,x\s]+", text.strip().strip("()[]")) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise InputError(f"input_shape={text!r}: expected positive integers separated by commas, e.g. 8,3,32,32",
                         parameter="input_shape")
    return shape


def pick_device(name: str) -> torch.device:
    """Resolve ``auto``/``cpu``/``cuda`` to a device that exists here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device='cuda': no CUDA device is available here; use cpu or auto", parameter="device")
    return torch.device(name)


def _check_allocatable(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before the run, a synthetic batch that cannot fit in memory."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    free = _free_memory(device)
    if numel >= 2**62 or (free is not None and nbytes > MEMORY_SHARE * free):
        where = "" if free is None else f" ({free / 2**30:.1f} GiB free on {device})"
        raise InputError(
            f"input_shape={','.join(map(str, shape))}: one batch of {numel:.3g} {str(dtype).removeprefix('torch.')} "
            f"values needs {nbytes / 2**30:.3g} GiB{where}; choose a smaller shape", parameter="input_shape"
        )


def _free_memory(device: torch.device) -> int | None:
    """Bytes free where a batch will live, or None when it cannot be told."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type != "cpu":
            return None
        with open("/proc/meminfo", encoding="ascii") as f:  # Linux: MemAvailable counts reclaimable cache
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError, RuntimeError):
        return None


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
    """Choose the batches: ``batches`` (an import string) if given, the demo's data, or synthetic inputs.

    The shape, the dtype and the seed are a :class:`~fp16probe.running.request.ProfileRequest`'s,
    checked when it was made; here one batch is checked to fit in memory.
    """
    if batches is not None:
        fn = resolve_import(batches, parameter="batches")
        try:
            source = fn() if callable(fn) else fn
            iterator = iter(source)
        except Exception as e:
            raise InputError(f"batches={batches!r}: calling it raised {type(e).__name__}: {message_of(e)}",
                             parameter="batches") from e
        return Batches(_to_device(iterator, device), f"--batches {batches}", synthetic=False)
    if loaded.kind == DEMO and input_shape is None:
        from fp16probe.running.demo import demo_batches

        return Batches(_to_device(demo_batches(seed=seed), device), "demo data (fp16probe.running.demo)", synthetic=False)
    gen = torch.Generator().manual_seed(seed)
    if input_shape is None and loaded.example_inputs is not None:
        args, kwargs = loaded.example_inputs
        desc = "synthetic: random values shaped like the archive's example inputs"
        return Batches(_to_device(_like_examples(args, kwargs, gen), device), desc, synthetic=True)
    if loaded.kind == HF:
        plan = families.hf_plan(type(loaded.model), hf_setting(loaded.model),
                                shape=parse_shape(input_shape) if input_shape else None, vocab_size=vocab_size)
        for key, value in plan.configure.items():
            setattr(loaded.model.config, key, value)
        return _from_plan(plan, device, seed)
    vocab = vocab_size or loaded.vocab_size
    if vocab is not None and (input_shape is None or input_dtype in ("int64", "long", "int32")):
        shape = parse_shape(input_shape) if input_shape else (families.BATCH, families.SEQUENCE)
        _check_allocatable(shape, torch.int64, device)
        desc = f"synthetic: uniform random token ids in [0, {vocab}) of shape {list(shape)}"
        return Batches(_to_device(_token_batches(shape, vocab, gen, loaded.has_loss), device), desc, synthetic=True)
    if input_shape is None:
        return _from_plan(families.module_plan(loaded.model), device, seed)
    shape = parse_shape(input_shape)
    dtype = DTYPES[input_dtype]
    if not dtype.is_floating_point and vocab is None:
        raise InputError(f"vocab_size=N is needed: {input_dtype} inputs are ids, drawn in [0, N)", parameter="vocab_size")
    _check_allocatable(shape, dtype, device)
    if dtype.is_floating_point:
        desc = f"synthetic: standard normal {input_dtype} of shape {list(shape)}"
        it = (torch.randn(shape, generator=gen).to(dtype) for _ in itertools.count())
    else:
        desc = f"synthetic: uniform random ids in [0, {vocab}) of shape {list(shape)}"
        it = (torch.randint(0, vocab, shape, generator=gen, dtype=dtype) for _ in itertools.count())
    return Batches(_to_device(it, device), desc, synthetic=True)


def check_inputs_before_load(
    spec: str | None,
    device: torch.device,
    *,
    input_shape: str | None = None,
    input_dtype: str = "float32",
    vocab_size: int | None = None,
    batches: str | None = None,
) -> None:
    """Refuse, before a (possibly large) model is loaded, inputs that cannot work.

    Checks what needs the device but no model: one batch of ``input_shape`` fits in memory,
    and for a Hugging Face folder without batches, that its config says enough to draw
    synthetic inputs for its class (or the error names what its forward() wants).
    """
    if batches is not None:
        return
    if input_shape is not None:
        dtype = DTYPES[input_dtype]
        _check_allocatable(parse_shape(input_shape), dtype if dtype.is_floating_point else torch.int64, device)
    if not spec or not os.path.isdir(spec):
        return
    config_file = Path(spec) / "config.json"
    if not config_file.is_file():
        return  # load_model says what is missing
    raw = read_hf_config(config_file)
    archs = raw.get("architectures") or []
    if not archs or raw.get("auto_map"):
        return  # AutoModel or remote code: the class is known only once it is loaded
    try:
        import transformers
    except ImportError:
        return  # load_model says how to install it
    cls = getattr(transformers, archs[0], None)
    config_class = getattr(cls, "config_class", None)
    if isinstance(cls, type) and isinstance(config_class, type):
        try:  # the config alone, with its class's defaults: no weights are read
            with quiet_transformers():
                config = config_class.from_dict(dict(raw))
        except Exception as e:
            raise ModelLoadError(f"{config_file}: {config_class.__name__} cannot read it: {first_line(e)}") from e
        plan = families.hf_plan(cls, _setting_of(config), shape=parse_shape(input_shape) if input_shape else None,
                                vocab_size=vocab_size)
        for shape_, dtype_ in plan.shapes:
            _check_allocatable(shape_, dtype_, device)


def hf_setting(model: nn.Module) -> Any:
    """Read one setting of a Hugging Face model's config (None when it has none)."""
    return _setting_of(getattr(model, "config", None))


def _setting_of(config: Any) -> Any:
    def get(key: str) -> Any:
        try:
            return getattr(config, key, None)
        except Exception:  # a config property that cannot answer for this model
            return None

    return get


def _from_plan(plan: families.Plan, device: torch.device, seed: int) -> Batches:
    """Batches drawn by a family's plan, after checking that one of them fits in memory."""
    for shape, dtype in plan.shapes:
        _check_allocatable(shape, dtype, device)
    return Batches(_to_device(families.iter_plan(plan, seed), device), plan.inputs, synthetic=True,
                   labels=plan.labels, loss=plan.loss, family=plan.family, notes=plan.notes)


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
        yield move_to(batch, device)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor inside ``obj`` (tensors, mappings, tuples, lists); keep anything else."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def move_to(obj: Any, device: torch.device) -> Any:
    """Move every tensor inside a batch to ``device``."""
    return map_tensors(obj, lambda t: t.to(device))


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


def describe_batch(batch: Any) -> str:
    """Name a batch's tensors by shape and dtype, for error messages."""
    shapes = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in iter_tensors(batch)]
    return "inputs " + ", ".join(shapes[:4]) if shapes else type(batch).__name__
