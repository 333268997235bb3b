"""Turn the MODEL argument of ``fp16probe profile`` into an ``nn.Module``, safely.

MODEL is one of: nothing (the built-in demo), an import string ``package.module:factory``
(with ``weights`` for a state_dict or Lightning checkpoint), a Hugging Face
``save_pretrained`` folder, a ``torch.export`` archive (``.pt2``) or a whole pickled module.
Unpickling a whole module runs code from the file, so it happens only when the caller
passes ``trust_checkpoint=True``; nothing here ever falls back to an unsafe load by itself.
Every failure raises :class:`ModelLoadError` with what went wrong and what to do.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fp16probe.errors import InputError, ModelLoadError, first_line

__all__ = [
    "LoadedModel",
    "is_import_string",
    "load_model",
    "load_state_dict_file",
    "module_file",
    "quiet_transformers",
    "read_hf_config",
    "resolve_import",
]

DEMO = "demo"
IMPORT = "import"
HF = "huggingface"
EXPORT = "torch.export"
PICKLE = "pickled-module"

_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_UNSAFE_HINT = (
    "unpickling it can run arbitrary code from the file; if you trust where it came from, "
    "pass --trust-checkpoint, otherwise save model.state_dict() and pass "
    "MODEL=package.module:factory --weights FILE"
)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to profile, and what the command line needs to feed it.

    ``notes`` say what loading changed or assumed (a stripped key prefix, a program run as
    exported); the command line prints them and the report keeps them. ``example_inputs`` are ``(args, kwargs)`` that the source itself records (a
    ``torch.export`` archive does); ``vocab_size`` is set for models that take token ids.
    """

    model: nn.Module
    kind: str
    source: str
    notes: tuple[str, ...] = ()
    vocab_size: int | None = None
    has_loss: bool = False
    example_inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


def is_import_string(spec: str) -> bool:
    """Whether ``spec`` reads as ``package.module:attribute`` (and is not an existing path)."""
    return bool(_IMPORT_RE.match(spec)) and not Path(spec).exists()


def load_model(
    spec: str | None,
    *,
    weights: str | os.PathLike[str] | None = None,
    trust_checkpoint: bool = False,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load MODEL (see the module docstring); raise ModelLoadError or InputError on failure."""
    if spec is None or spec == "":
        if weights is not None:
            raise InputError("--weights needs a MODEL import string (package.module:factory) to build the model")
        from fp16probe.running.demo import DemoNet

        return LoadedModel(DemoNet(), DEMO, "fp16probe.running.demo:DemoNet")
    if is_import_string(spec):
        return _load_import(spec, weights, trust_checkpoint)
    path = Path(spec)
    if not path.exists():
        raise InputError(
            f"MODEL {spec!r}: no such file or folder, and not an import string; expected a path to a "
            "checkpoint/.pt2/Hugging Face folder or package.module:factory"
        )
    if weights is not None:
        raise InputError(
            f"--weights applies to an import-string MODEL, not to the file {spec!r}; pass the "
            "factory as MODEL (package.module:factory) and the state_dict as --weights"
        )
    if path.is_dir():
        return _load_hf(path, trust_remote_code)
    if path.suffix == ".pt2":
        return _load_export(path, trust_checkpoint)
    return _load_pickled(path, trust_checkpoint)


# -- import strings ------------------------------------------------------------------


def module_file(module_name: str) -> Path | None:
    """The source file an import of ``module_name`` would run, found as :func:`resolve_import` finds it; None if not found.

    Found on the import path without importing anything (no package's ``__init__`` runs), so an
    output can be checked against it before any code of the user's runs. A module already
    imported answers with its own ``__file__``.
    """
    from importlib.machinery import PathFinder

    loaded = sys.modules.get(module_name)
    if loaded is not None:
        where = getattr(loaded, "__file__", None)
        return Path(where) if where else None
    cwd = os.getcwd()
    search: list[str] | None = [cwd, *[p for p in sys.path if p != cwd]]
    spec = None
    for part in module_name.split("."):
        if search is None:
            return None
        try:
            spec = PathFinder.find_spec(part, search)
        except (ImportError, OSError, ValueError):
            return None
        if spec is None:
            return None
        search = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    if spec is None or not spec.origin or not spec.has_location:
        return None
    return Path(spec.origin)


def resolve_import(spec: str, parameter: str | None = None) -> Any:
    """Import ``package.module:attr.sub`` (MODEL, or the ``parameter`` it is) and return the attribute.

    Like ``python -m``, the current directory is importable, so a script's own module
    can be named from where it runs.
    """
    what = f"{parameter}={spec!r}" if parameter else f"MODEL {spec!r}"
    if ":" not in spec:
        raise InputError(f"{what}: expected an import string package.module:name", parameter=parameter)
    module_name, attr = spec.split(":", 1)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ModelLoadError(
            f"{what}: cannot import {module_name!r} ({e}); check the spelling and that it is "
            "importable from the current directory or PYTHONPATH", parameter=parameter
        ) from e
    except Exception as e:  # a module that fails while importing: user code
        raise ModelLoadError(
            f"{what}: importing {module_name!r} raised {type(e).__name__}: {first_line(e)}", parameter=parameter
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ModelLoadError(
                f"{what}: {module_name!r} has no attribute {attr!r}; check the name after the colon", parameter=parameter
            ) from e
    return obj


def _load_import(spec: str, weights: Any, trust: bool) -> LoadedModel:
    obj = resolve_import(spec)
    if isinstance(obj, nn.Module):
        model = obj
    elif callable(obj):
        try:
            model = obj()
        except Exception as e:
            raise ModelLoadError(
                f"MODEL {spec!r}: calling the factory raised {type(e).__name__}: {first_line(e)}; "
                "the factory must build the model with no arguments"
            ) from e
    else:
        raise ModelLoadError(f"MODEL {spec!r} is a {type(obj).__name__}, expected an nn.Module class or factory")
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"MODEL {spec!r} returned a {type(model).__name__}, expected a torch.nn.Module"
        )
    notes: list[str] = []
    if weights is not None:
        state = load_state_dict_file(weights, trust_checkpoint=trust)
        notes.append(_apply_state_dict(model, state, Path(weights)))
    return LoadedModel(model, IMPORT, spec, notes=tuple(n for n in notes if n),
                       has_loss=False, extra={"weights": str(weights)} if weights else {})


def load_state_dict_file(path: str | os.PathLike[str], *, trust_checkpoint: bool = False) -> dict[str, torch.Tensor]:
    """Read a state_dict from ``.safetensors``, ``.pt``/``.pth``/``.bin`` or a Lightning ``.ckpt``."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--weights {str(path)!r}: no such file; expected a .pt/.pth/.safetensors/.ckpt state_dict")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise ModelLoadError(
                f"{path}: reading .safetensors needs the safetensors package; pip install 'fp16probe[hf]'"
            ) from e
        try:
            return dict(load_file(str(path), device="cpu"))
        except Exception as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file (corrupt or truncated?): {first_line(e)}") from e
    obj = _torch_load(path, trust_checkpoint, what="--weights")
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]  # a Lightning checkpoint, or a training checkpoint that keeps one
    if isinstance(obj, nn.Module):
        raise ModelLoadError(
            f"{path} holds a whole module, not a state_dict; pass it as MODEL (with --trust-checkpoint) "
            "or save model.state_dict() instead"
        )
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ModelLoadError(
            f"{path}: expected a state_dict (a mapping of names to tensors), found a {type(obj).__name__}; "
            "save model.state_dict() with torch.save or safetensors"
        )
    return dict(obj)


def _torch_load(path: Path, trust: bool, what: str) -> Any:
    """torch.load with weights_only=True; the unsafe load only when the caller opted in."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        if not _is_refusal(e):
            kind = _not_a_checkpoint(path)
            if kind is not None:
                raise ModelLoadError(f"{what} {path}: {kind}") from e
            raise ModelLoadError(
                f"{what} {path}: cannot read it as a torch checkpoint (corrupt or truncated?): {first_line(e)}"
            ) from e
        if not trust:
            raise ModelLoadError(
                f"{what} {path}: refused, the file holds Python objects beyond tensors and {_UNSAFE_HINT}"
            ) from e
    try:  # only reached with trust_checkpoint=True: the caller opted in to running the file's code
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise ModelLoadError(f"{what} {path}: loading it failed: {type(e).__name__}: {first_line(e)}") from e


def _not_a_checkpoint(path: Path) -> str | None:
    """What a file torch.load could not read is instead, said with what to do (None: nothing known, or unreadable).

    Read from the file's first bytes and zip listing only: nothing in it is run.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
            if any(n.endswith("/constants.pkl") or "/code/__torch__/" in n for n in names):
                return ("a TorchScript archive (torch.jit.save), not a checkpoint: fp16probe profiles a Python "
                        "nn.Module; give its module:Class (with --weights for a state_dict) instead")
    except (OSError, zipfile.BadZipFile):
        return None
    text = head.lstrip()
    if text.startswith(b"{") and b'"schema_version"' in head and b'"metadata"' in head:
        return "a fp16probe report (JSON), not a model: read it with fp16probe show, or profile the model it describes"
    return None


def _is_refusal(e: BaseException) -> bool:
    """Whether weights_only loading stopped at a Python object (as opposed to a corrupt file)."""
    text = str(e)
    return isinstance(e, pickle.UnpicklingError) and ("safe_globals" in text or "Unsupported global" in text)


def _apply_state_dict(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> str:
    """Load ``state`` strictly; strip one common key prefix (Lightning's ``model.``) if that makes it fit."""
    expected = model.state_dict()
    note = ""
    if set(state) != set(expected):
        prefixes = {k.split(".", 1)[0] for k in state if "." in k}
        if len(prefixes) == 1 and all("." in k for k in state):
            prefix = prefixes.pop() + "."
            stripped = {k[len(prefix):]: v for k, v in state.items()}
            if set(stripped) == set(expected):
                state, note = stripped, f"stripped the key prefix {prefix!r} from {path.name}"
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(expected[k].shape)}"
        for k in expected
        if k in state and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatch {_few(shapes)} (file vs model)")
        raise ModelLoadError(
            f"--weights {path}: the state_dict does not match the model: {'; '.join(parts)}; "
            "check that MODEL builds the same architecture the weights were saved from"
        )
    try:
        model.load_state_dict(state, strict=True)
    except Exception as e:
        raise ModelLoadError(f"--weights {path}: load_state_dict failed: {first_line(e)}") from e
    return note


# -- Hugging Face ----------------------------------------------------------------------


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hold transformers' warnings and progress bars back while the block runs.

    They would bury the summary on stderr (a config's token ids outside a tiny
    vocabulary, a loss_type it falls back from); a failure still reaches the user as one
    error line. The command line keeps them quiet for a whole Hugging Face run.
    """
    import transformers

    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def read_hf_config(config_file: Path) -> dict[str, Any]:
    """Read a Hugging Face ``config.json`` as data; a malformed one raises ModelLoadError in one line."""
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"{config_file}: not readable JSON: {first_line(e)}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file}: holds a JSON {type(raw).__name__}, expected an object of settings")
    checks = {
        "architectures": lambda v: isinstance(v, list) and all(isinstance(a, str) and a for a in v),
        "auto_map": lambda v: isinstance(v, dict),
        "model_type": lambda v: isinstance(v, str),
    }
    for key, ok in checks.items():
        if key in raw and raw[key] is not None and not ok(raw[key]):
            expected = {"architectures": "a list of class names", "auto_map": "an object",
                        "model_type": "a string"}[key]
            raise ModelLoadError(f"{config_file}: {key} is {json.dumps(raw[key])[:60]}, expected {expected}")
    for key in ("vocab_size", "num_labels", "num_channels", "max_position_embeddings", "n_positions",
                "pad_token_id", "decoder_start_token_id", "image_size"):
        value = raw.get(key)
        least = 0 if key.endswith("token_id") else 1
        sizes = value if key == "image_size" and isinstance(value, list) and len(value) == 2 else [value]
        if value is not None and not all(_is_int(v) and least <= v < 2**31 for v in sizes):
            expected = "an integer >= 0" if least == 0 else "a positive integer"
            raise ModelLoadError(f"{config_file}: {key} is {json.dumps(value)[:60]}, expected {expected}")
    return raw


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_hf(path: Path, trust_remote_code: bool) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InputError(
            f"MODEL {str(path)!r} is a folder without config.json; expected a Hugging Face "
            "save_pretrained folder (or pass a checkpoint file or an import string)"
        )
    raw = read_hf_config(config_file)
    if raw.get("auto_map") and not trust_remote_code:
        raise ModelLoadError(
            f"MODEL {str(path)!r}: the model's code lives in the folder (config.json has auto_map) and running "
            "it executes that code; pass --trust-remote-code if you trust it"
        )
    try:
        import transformers
    except ImportError as e:
        raise ModelLoadError(
            f"MODEL {str(path)!r} is a Hugging Face folder, which needs transformers; pip install 'fp16probe[hf]'"
        ) from e
    archs = raw.get("architectures") or []
    cls = transformers.AutoModel
    if archs and not raw.get("auto_map"):
        cls = getattr(transformers, archs[0], None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise ModelLoadError(
                f"{config_file}: architectures names {archs[0]!r}, which is not a model class of transformers "
                f"{transformers.__version__}; fix config.json or upgrade transformers"
            )
    try:
        with quiet_transformers():
            model = cls.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=trust_remote_code
            )
    except Exception as e:
        raise ModelLoadError(
            f"MODEL {str(path)!r}: transformers could not load it ({type(e).__name__}: {first_line(e)})"
        ) from e
    config = model.config
    vocab = getattr(config, "vocab_size", None)
    name = type(model).__name__
    has_loss = name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM"))
    return LoadedModel(
        model, HF, str(path), vocab_size=int(vocab) if vocab else None, has_loss=has_loss,
        extra={"hf_class": name},
    )


# -- torch.export and pickles ------------------------------------------------------------


def _load_export(path: Path, trust: bool) -> LoadedModel:
    from fp16probe.running.archive import ArchiveNeedsTrust, read_archive

    notes = ["torch.export program; runs as exported (train/eval mode fixed at export)"]
    try:
        ep, archive_notes = read_archive(path)
        notes.extend(archive_notes)
    except ArchiveNeedsTrust as e:
        if not trust:
            raise ModelLoadError(
                f"{e}: refused, loading it would run code from the file; if you trust where it came from, pass "
                "--trust-checkpoint, otherwise export it again with torch.export.save (tensors only) or save "
                "model.state_dict() and pass MODEL=package.module:factory --weights FILE"
            ) from e
        ep = _load_export_trusted(path)
        notes.append(f"loaded with --trust-checkpoint through torch.export.load ({first_line(e).removeprefix(f'MODEL {path}: ')})")
    try:
        # unflatten restores the submodule hierarchy, so per-module activation gradients exist.
        model: nn.Module = torch.export.unflatten(ep)
    except Exception as e:
        # check_guards=False: the guards are Python code from the file (exec-ed otherwise).
        model = ep.module(check_guards=trust)
        notes.append(f"module hierarchy not restored ({type(e).__name__}); only whole-model hooks")
    example = getattr(ep, "example_inputs", None)
    return LoadedModel(model, EXPORT, str(path), notes=tuple(notes),
                       example_inputs=(tuple(example[0]), dict(example[1])) if example else None)


def _load_export_trusted(path: Path) -> Any:
    """torch.export.load, which may unpickle: only with --trust-checkpoint."""
    # torch.export.load logs the whole traceback of a failed read as a warning before it
    # raises; the error below says it in one line.
    export_log = logging.getLogger("torch.export")
    level = export_log.level
    export_log.setLevel(logging.ERROR)
    try:
        return torch.export.load(str(path))
    except Exception as e:
        raise ModelLoadError(
            f"MODEL {path}: cannot read it as a torch.export archive (corrupt, or saved by another torch?): "
            f"{type(e).__name__}: {first_line(e)}"
        ) from e
    finally:
        export_log.setLevel(level)


def _load_pickled(path: Path, trust: bool) -> LoadedModel:
    obj = _torch_load(path, trust, what="MODEL")
    if isinstance(obj, nn.Module):
        return LoadedModel(obj, PICKLE, str(path), notes=("whole pickled module, loaded with --trust-checkpoint",))
    if isinstance(obj, Mapping):
        raise ModelLoadError(
            f"MODEL {path} is a state_dict: weights without an architecture; pass the model's factory as "
            f"MODEL (package.module:factory) and this file as --weights"
        )
    raise ModelLoadError(f"MODEL {path} holds a {type(obj).__name__}, expected a pickled torch.nn.Module")


def _few(items: list[str], n: int = 3) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" (+{len(items) - n} more)" if len(items) > n else "")
