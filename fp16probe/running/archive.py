"""Read a ``torch.export`` archive (``.pt2``) without running any code from the file.

``torch.export.load`` can execute what the file holds: a weight or constant whose payload
config says ``use_pickle`` is read with ``torch.load(weights_only=False)``; sample inputs
that a weights-only load refuses are retried with ``weights_only=False``; custom and opaque
constants are unpickled; AOTInductor models are native shared libraries; symbolic shape
expressions go through ``sympy.sympify`` (which evaluates Python); the graph's
``guards_code`` is ``exec``-ed by ``ExportedProgram.module()``; and a graph node may name any
callable reachable from ``torch`` (``torch.os.system``, for one) and call it on forward.

:func:`read_archive` reads the same archive format piece by piece and refuses each of those
before it could run: payloads are tensors read as raw bytes, sample inputs go through a
weights-only load, expressions must be arithmetic over shape symbols, and every graph node
must call an operator. An archive that needs more raises :class:`ArchiveNeedsTrust`; the
caller decides whether the user consented (``--trust-checkpoint``) to ``torch.export.load``.
"""

from __future__ import annotations

import io
import json
import math
import operator
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fp16probe.errors import ModelLoadError, first_line

__all__ = ["ArchiveNeedsTrust", "read_archive"]


class ArchiveNeedsTrust(ModelLoadError):
    """An archive that can only be loaded by running code from it (pickle, native code, eval)."""


# Names sympy expressions in an archive may use: shape symbols (s0, u3, zuf0...), the
# functions torch's deserializer hands to sympify, and sympy's own arithmetic.
_SYMPY_NAMES = frozenset({
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt",
    "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv",
    "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
    "Max", "Min", "Abs", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Xor",
    "oo", "zoo", "nan", "pi", "E", "True", "False", "floor", "ceiling", "sqrt", "Integer",
    "Rational", "Float", "Piecewise", "ITE", "Symbol",
    # assumptions, as in Symbol('s31', positive=True, integer=True), which export writes
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero",
    "nonzero", "rational", "commutative", "even", "odd",
})
_SYMBOL = re.compile(r"[a-z][a-z0-9]*_?\d+\Z")
_TOKEN = re.compile(
    r"\s*(?:(\d+\.\d*(?:e[+-]?\d+)?|\d+(?:e[+-]?\d+)?)"  # a number
    r"|([A-Za-z_]\w*)"  # a name: checked against the lists above
    r"|'([a-z][a-z0-9]*_?\d+)'"  # a symbol's name as a string literal
    r"|(\*\*|//|[<>=!]=|[-+*/%(),<>&|~^=]))"  # an operator
)


def read_archive(path: Path) -> tuple[Any, tuple[str, ...]]:
    """Load the ExportedProgram in ``path`` without unpickling; return it and notes.

    Raises ArchiveNeedsTrust for an archive that needs code from the file to load, and
    ModelLoadError for one that cannot be read at all.
    """
    internals = _torch_internals(path)
    pkg, serialize, schema = internals
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        names = set(reader.get_all_records())
    except Exception as e:
        raise ModelLoadError(
            f"MODEL {path}: cannot read it as a torch.export archive (not a zip written by torch.export.save, "
            f"or truncated): {first_line(e)}"
        ) from e

    def read(name: str) -> bytes:
        try:
            return bytes(reader.get_record(name))
        except Exception as e:
            raise ModelLoadError(f"MODEL {path}: the archive's {name} cannot be read: {first_line(e)}") from e

    if pkg.ARCHIVE_FORMAT_PATH not in names or pkg.ARCHIVE_VERSION_PATH not in names:
        raise ArchiveNeedsTrust(
            f"MODEL {path}: an archive in torch.export's older format, whose loader falls back to unpickling"
        )
    fmt = read(pkg.ARCHIVE_FORMAT_PATH).decode(errors="replace")
    version = read(pkg.ARCHIVE_VERSION_PATH).decode(errors="replace")
    if fmt != pkg.ARCHIVE_FORMAT_VALUE or version != pkg.ARCHIVE_VERSION_VALUE:
        raise ModelLoadError(
            f"MODEL {path}: archive format {fmt!r} version {version!r}, this torch {torch.__version__} reads "
            f"{pkg.ARCHIVE_FORMAT_VALUE!r} version {pkg.ARCHIVE_VERSION_VALUE!r}; export it again with this torch"
        )
    if any(n.startswith(pkg.AOTINDUCTOR_DIR) for n in names):
        raise ArchiveNeedsTrust(f"MODEL {path}: the archive holds AOTInductor-compiled native code")
    model_file = pkg.MODELS_FILENAME_FORMAT.format("model")
    if model_file not in names:
        raise ModelLoadError(
            f"MODEL {path}: the archive holds no exported program named 'model' ({model_file} is missing); "
            "save it with torch.export.save(ep, path)"
        )
    for legacy in (f"{pkg.WEIGHTS_DIR}model.pt", f"{pkg.CONSTANTS_DIR}model.pt"):
        if legacy in names:
            raise ArchiveNeedsTrust(f"MODEL {path}: the archive keeps {legacy} as a pickle (an older layout)")

    program_json = _json(read(model_file), model_file, path)
    guards = program_json.get("guards_code") or [] if isinstance(program_json, dict) else []
    for expr in _expr_strings(program_json):
        if not _is_plain_arithmetic(expr):
            raise ArchiveNeedsTrust(
                f"MODEL {path}: a shape expression in the archive is not plain arithmetic ({expr[:60]!r}) "
                "and loading it would evaluate it as Python"
            )
    weights_cfg = _payload_config(read, names, pkg.WEIGHTS_CONFIG_FILENAME_FORMAT.format("model"), path, schema, serialize)
    constants_cfg = _payload_config(read, names, pkg.CONSTANTS_CONFIG_FILENAME_FORMAT.format("model"), path, schema, serialize)
    for what, cfg in (("weight", weights_cfg), ("constant", constants_cfg)):
        for fqn, meta in cfg.config.items():
            if meta.use_pickle:
                raise ArchiveNeedsTrust(f"MODEL {path}: the {what} {fqn!r} is stored as a pickle (use_pickle)")
            if what == "constant" and not meta.path_name.startswith(pkg.TENSOR_CONSTANT_FILENAME_PREFIX):
                raise ArchiveNeedsTrust(
                    f"MODEL {path}: the constant {fqn!r} is a Python object ({meta.path_name}), read by unpickling"
                )
    inputs_file = pkg.SAMPLE_INPUTS_FILENAME_FORMAT.format("model")
    example = None
    if inputs_file in names:
        raw = read(inputs_file)
        if raw:
            example = _weights_only(raw, path)

    try:
        with _QuietExport():
            archive = pkg.PT2ArchiveReader(str(path))
            program = serialize._bytes_to_dataclass(schema.ExportedProgram, json.dumps(program_json).encode())
            state_dict = pkg._load_state_dict(archive, "model")
            constants = pkg._load_constants(archive, "model")
            ep = serialize.ExportedProgramDeserializer(None).deserialize(program, state_dict, constants, example)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"MODEL {path}: cannot read it as a torch.export archive (corrupt, or saved by another torch?): "
            f"{type(e).__name__}: {first_line(e)}"
        ) from e
    _check_graph(ep, path, serialize)
    notes = []
    if guards:
        notes.append(f"the archive's {len(guards)} input guard(s) are Python code and were not run")
    return ep, tuple(notes)


def _torch_internals(path: Path) -> tuple[Any, Any, Any]:
    """The torch modules the safe reader builds on (private: pinned to the torch it was written for)."""
    try:
        import torch._export.serde.schema as schema
        import torch._export.serde.serialize as serialize
        import torch.export.pt2_archive._package as pkg

        for name in ("_load_state_dict", "_load_constants", "PT2ArchiveReader", "ARCHIVE_FORMAT_PATH"):
            getattr(pkg, name)
        for name in ("ExportedProgramDeserializer", "_bytes_to_dataclass", "_dict_to_dataclass", "_SYM_OPS"):
            getattr(serialize, name)
    except (ImportError, AttributeError) as e:
        raise ArchiveNeedsTrust(
            f"MODEL {path}: torch {torch.__version__} lacks the archive internals fp16probe reads .pt2 files "
            f"with without unpickling ({e})"
        ) from e
    return pkg, serialize, schema


def _json(raw: bytes, name: str, path: Path) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ModelLoadError(f"MODEL {path}: the archive's {name} is not valid JSON: {first_line(e)}") from e


def _payload_config(read: Any, names: set[str], name: str, path: Path, schema: Any, serialize: Any) -> Any:
    if name not in names:
        raise ModelLoadError(f"MODEL {path}: the archive lacks {name}; save it again with torch.export.save")
    try:
        return serialize._dict_to_dataclass(schema.PayloadConfig, _json(read(name), name, path))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"MODEL {path}: the archive's {name} is malformed: {first_line(e)}") from e


def _expr_strings(node: Any) -> Iterator[str]:
    """Every ``expr_str`` in the program's JSON (what torch would hand to ``sympy.sympify``)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "expr_str" and isinstance(value, str):
                    yield value
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)


def _is_plain_arithmetic(expr: str) -> bool:
    """Whether ``expr`` is numbers, shape symbols, known sympy functions and operators only."""
    pos = 0
    text = expr.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            return False
        name = m.group(2)
        if name is not None and name not in _SYMPY_NAMES and not _SYMBOL.match(name):
            return False
        pos = m.end()
    return True


def _weights_only(raw: bytes, path: Path) -> Any:
    try:
        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ArchiveNeedsTrust(
            f"MODEL {path}: the archive's sample inputs hold Python objects beyond tensors (read by unpickling)"
        ) from e
    except Exception as e:
        raise ModelLoadError(f"MODEL {path}: the archive's sample inputs cannot be read: {first_line(e)}") from e
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)):
        raise ModelLoadError(
            f"MODEL {path}: the archive's sample inputs are a {type(value).__name__}, expected (args, kwargs)"
        )
    return value


def _check_graph(ep: Any, path: Path, serialize: Any) -> None:
    """Refuse a graph node that calls anything but an operator (any torch-reachable callable could run)."""
    ops = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
    plain = set(serialize._SYM_OPS) | {operator.getitem, math.trunc}
    for module in ep.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            target = node.target
            if node.op == "call_function" and (isinstance(target, ops) or _in(target, plain)):
                continue
            shown = getattr(target, "__qualname__", None) or repr(target)
            raise ArchiveNeedsTrust(
                f"MODEL {path}: graph node {node.name!r} calls {shown!r} ({node.op}), which is not a torch operator"
            )


def _in(target: Any, allowed: set[Any]) -> bool:
    try:
        return target in allowed
    except TypeError:  # an unhashable target is no operator
        return False


class _QuietExport:
    """Silence torch.export's logger while reading (it logs whole tracebacks before raising)."""

    def __enter__(self) -> None:
        import logging

        self._loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export")]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.ERROR)

    def __exit__(self, *exc: Any) -> None:
        for lg, level in zip(self._loggers, self._levels):
            lg.setLevel(level)
