"""Check a report's JSON, field by field, before anything is built from it.

A report file is input: it may be truncated, edited by hand, produced by a buggy tool or
built to fool ``compare``. Each function here checks one part of it (types, ranges,
lengths, duplicates, nesting) and raises :class:`~fp16probe.errors.ReportFieldError`
naming the field, what was expected and what was found, in one line. The ``from_dict``
constructors of the report's data classes call them; nothing here builds objects.

Plain host-side data: nothing here touches a model or a device.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Mapping

from fp16probe.errors import ReportFieldError
from fp16probe.recommendation import citations_from_json

__all__ = [
    "AUTOCAST_TARGETS",
    "GRAD_SCALER_ARGS",
    "MAX_COUNT",
    "MAX_DEPTH",
    "REGIMES",
    "SCALER_DEVICES",
    "check_depth",
    "check_evidence",
    "check_extra",
    "check_first_step",
    "check_grad_scaler_kwargs",
    "check_histogram",
    "check_history",
    "check_kind",
    "check_metadata",
    "check_module",
    "check_modules",
    "check_recommendation",
    "check_steps_agree",
    "check_trace",
]

MAX_COUNT = 2**63 - 1
"""The largest count or integer a report may hold: an int64, what the probe counts in."""

MAX_DEPTH = 32
"""The deepest nesting of free-form JSON (``metadata.extra``, ``recommendation``); fp16probe writes 6."""

FP32_MAX = 2.0**128 * (1 - 2.0**-24)

_KINDS = ("activation_grad", "weight_grad", "activation")

# -- the tokens code to paste is built from (presentation.paste renders it; nothing else may go in) --
AUTOCAST_TARGETS = ("cuda", "cpu")
"""The devices whose autocast rules a prediction applies (``capture.autocast_rules.TARGETS``): the
``device_type`` of a pasted ``keep_in_fp32`` line."""

REGIMES = ("autocast", "pure_fp16")
"""How the target run computes in fp16 (``capture.autocast_rules.REGIMES``)."""

SCALER_DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu", "mtia", "xla", "npu")
"""The device types a pasted ``torch.amp.GradScaler`` line may name."""

GRAD_SCALER_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
"""``torch.amp.GradScaler``'s keyword arguments, in its signature's order: the only keys a recommendation's
``grad_scaler_kwargs`` may hold."""
_METADATA_STRINGS = ("fp16probe_version", "torch_version", "device", "model_class")
_METADATA_OPTIONAL_STRINGS = ("precision", "param_dtype", "created", "regime")
_METADATA_COUNTS = {"steps_seen": 0, "steps_total": 0, "every": 1, "world_size": 1}
_METADATA_BOOLS = ("grad_scaler", "partial")
# metadata.extra is free-form, but these keys are read by every summary as they are typed here.
_EXTRA_STRINGS = ("stopped", "inputs", "loss", "model_kind", "model_source", "target", "regime")
_EXTRA_STRING_LISTS = ("notes",)
_EXTRA_COUNT_LISTS = ("nonfinite_loss_steps",)
_EXTRA_BOOLS = ("inputs_synthetic", "loss_synthetic")
_EXTRA_COUNTS = ("steps_requested",)


def _fail(path: str, expected: str, got: Any) -> ReportFieldError:
    shown = _type_name(got) if isinstance(got, (dict, list)) else repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return ReportFieldError(path, f"{path}: expected {expected}, got {shown}")


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), type(v).__name__)


def _object(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise _fail(path, "an object", v)
    return v


def _list(v: Any, path: str) -> list[Any]:
    if not isinstance(v, list):
        raise _fail(path, "a list", v)
    return v


class _Shown:
    """A value shown by its type alone (a whole object or list would be too long to quote)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _int(v: Any, path: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    what = "a non-negative integer below 2^63" if (lo, hi) == (0, MAX_COUNT) else f"an integer in [{lo}, {hi}]"
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail(path, what, v)
    if not lo <= v <= hi:
        raise _fail(path, what, v if abs(v) < 10**30 else _Shown(f"an integer of {len(str(abs(v)))} digits"))
    return v


def _number(v: Any, path: str, hi: float = FP32_MAX) -> float:
    """A finite non-negative number no larger than ``hi``."""
    what = f"a finite number in [0, {hi:.4g}]"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(path, what, v)
    if isinstance(v, int) and v > hi:  # float() of 10**400 would raise OverflowError
        raise _fail(path, what, v if v < 10**30 else _Shown(f"an integer of {len(str(v))} digits"))
    f = float(v)
    if not (math.isfinite(f) and 0.0 <= f <= hi):
        raise _fail(path, what, v)
    return f


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):  # "false" is a non-empty string, and bool("false") is True
        raise _fail(path, "true or false", v)
    return v


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise _fail(path, "a string", v)
    return v


def check_depth(v: Any, path: str, limit: int = MAX_DEPTH) -> None:
    """Refuse free-form JSON nested deeper than ``limit`` (iteratively: no recursion to overflow)."""
    stack = [(v, 0)]
    while stack:
        node, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= limit:
            raise ReportFieldError(path, f"{path}: nested deeper than {limit} levels; fp16probe writes at most 6")
        stack.extend((c, depth + 1) for c in children)


def check_histogram(d: Any, path: str, min_exp: int, max_exp: int) -> None:
    """Check one histogram's JSON: counts, bins in [min_exp, max_exp], ``max_abs`` in the top occupied bin."""
    d = _object(d, path)
    for key in ("bins", "zero", "inf", "nan", "max_abs"):
        if key not in d:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
    bins = _object(d["bins"], f"{path}.bins")
    top = None
    for key, c in bins.items():
        where = f"{path}.bins[{key!r}]"
        try:
            e = int(key)
        except ValueError:
            e = None
        if e is None or str(e) != key or not min_exp <= e <= max_exp:
            raise _fail(f"{path}.bins", f"bin names that are integers in [{min_exp}, {max_exp}]", key)
        if _int(c, where) and (top is None or e > top):
            top = e
    for key in ("zero", "inf", "nan"):
        _int(d[key], f"{path}.{key}")
    max_abs = _number(d["max_abs"], f"{path}.max_abs")
    # max_abs is the largest finite |x| counted, so it lies in the highest occupied bin
    # (2^(top-1), 2^top]; a value anywhere else was not measured.
    if top is None and max_abs != 0.0:
        raise _fail(f"{path}.max_abs", "0 for a histogram with no nonzero finite values", d["max_abs"])
    if top is not None and not math.ldexp(1.0, top - 1) < max_abs <= math.ldexp(1.0, top):
        raise _fail(f"{path}.max_abs", f"a value in (2^{top - 1}, 2^{top}], the highest occupied bin", d["max_abs"])


def check_module(d: Any, path: str = "module") -> None:
    """Check one module record's JSON, but for its histogram (``Histogram.from_dict`` checks that)."""
    d = _object(d, path)
    for key in ("name", "kind", "module_type", "order", "histogram"):
        if key not in d:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
    _str(d["name"], f"{path}.name")
    if d["kind"] not in _KINDS:
        raise _fail(f"{path}.kind", f"one of {', '.join(_KINDS)}", d["kind"])
    _str(d["module_type"], f"{path}.module_type")
    _int(d["order"], f"{path}.order", -MAX_COUNT, MAX_COUNT)


def check_modules(modules: Any, path: str = "modules") -> None:
    """Check the list of module records: each record, and no module recorded twice for one kind."""
    seen: dict[tuple[str, str], int] = {}
    for i, m in enumerate(_list(modules, path)):
        check_module(m, f"{path}[{i}]")
        key = (m["name"], m["kind"])
        if key in seen:
            raise ReportFieldError(
                f"{path}[{i}]",
                f"{path}[{i}]: module {m['name']!r} ({m['kind']}) is recorded twice (also {path}[{seen[key]}]); "
                "a report holds one record per module and kind",
            )
        seen[key] = i


def check_trace(d: Any, path: str = "trace") -> None:
    """Check the per-step trace: step numbers, one entry per step in every list, values in range.

    The per-step histograms themselves are left to ``Histogram.from_dict``.
    """
    d = _object(d, path)
    for key in ("steps", "histograms", "module_max", "scale", "found_inf"):
        if key not in d:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
    steps = _list(d["steps"], f"{path}.steps")
    for i, s in enumerate(steps):
        _int(s, f"{path}.steps[{i}]")
    n = len(steps)

    def per_step(v: Any, where: str) -> list[Any]:
        seq = _list(v, where)
        if len(seq) != n:
            raise ReportFieldError(where, f"{where} has {len(seq)} entries for {n} steps")
        return seq

    for kind, hs in _object(d["histograms"], f"{path}.histograms").items():
        if kind not in _KINDS:
            raise _fail(f"{path}.histograms", f"kinds among {', '.join(_KINDS)}", kind)
        per_step(hs, f"{path}.histograms[{kind!r}]")
    for kind, per_module in _object(d["module_max"], f"{path}.module_max").items():
        if kind not in _KINDS:
            raise _fail(f"{path}.module_max", f"kinds among {', '.join(_KINDS)}", kind)
        for name, vals in _object(per_module, f"{path}.module_max[{kind!r}]").items():
            where = f"{path}.module_max[{kind!r}][{name!r}]"
            for i, v in enumerate(per_step(vals, where)):
                _number(v, f"{where}[{i}]")
    for i, s in enumerate(per_step(d["scale"], f"{path}.scale")):
        if s is not None:
            _number(s, f"{path}.scale[{i}]", hi=sys.float_info.max)
    for i, f in enumerate(per_step(d["found_inf"], f"{path}.found_inf")):
        _bool(f, f"{path}.found_inf[{i}]")
    if d.get("ceiling") is not None:  # absent in reports written before the overflow ceiling
        for i, c in enumerate(per_step(d["ceiling"], f"{path}.ceiling")):
            if c != "inf":  # a step that saw a non-finite value
                _number(c, f"{path}.ceiling[{i}]")
    if d.get("ceiling") is not None:  # absent in reports made before the overflow ceiling
        for i, c in enumerate(per_step(d["ceiling"], f"{path}.ceiling")):
            if c != "inf":  # a step whose gradients held inf or NaN
                _number(c, f"{path}.ceiling[{i}]")


def check_steps_agree(metadata: Any, trace: Any) -> None:
    """Check that ``metadata.steps_seen`` counts the trace's steps (an edited or forged count is refused)."""
    if not (isinstance(metadata, Mapping) and isinstance(trace, Mapping)):
        return  # the parts' own checks say what is wrong with them
    seen, steps = metadata.get("steps_seen"), trace.get("steps")
    if isinstance(steps, Mapping) and type(steps.get("count")) is int:  # packed (fp16probe.columns)
        steps = range(steps["count"])
    if type(seen) is int and isinstance(steps, (list, range)) and seen != len(steps):
        raise ReportFieldError(
            "metadata.steps_seen",
            f"metadata.steps_seen is {seen} but the trace holds {len(steps)} step(s); the two must agree",
        )


def check_kind(kind: Any, path: str) -> None:
    """Check a record kind used as a key (a trace's ``histograms`` and ``module_max``)."""
    if kind not in _KINDS:
        raise _fail(path, f"kinds among {', '.join(_KINDS)}", kind)


def check_first_step(v: Any, path: str) -> int:
    """Check a history's first step number."""
    return _int(v, path)


def check_history(d: Any, path: str = "history") -> None:
    """Check the per-step history: a first step, one entry per step in every list, values in range."""
    d = _object(d, path)
    for key in ("first_step", "scale", "grad_max"):
        if key not in d:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
    _int(d["first_step"], f"{path}.first_step")
    scale = _list(d["scale"], f"{path}.scale")
    n = len(scale)
    for i, s in enumerate(scale):
        if s is not None:
            _number(s, f"{path}.scale[{i}]", hi=sys.float_info.max)
    for key in ("grad_max", "ceiling", "forward_max"):
        if d.get(key) is None:
            if key == "grad_max":
                raise ReportFieldError(f"{path}.{key}", f"{path}.{key} must be a list")
            continue
        seq = _list(d[key], f"{path}.{key}")
        if len(seq) != n:
            raise ReportFieldError(f"{path}.{key}", f"{path}.{key} has {len(seq)} entries for {n} steps")
        for i, v in enumerate(seq):
            if v is not None and v not in ("inf", "nan"):
                _number(v, f"{path}.{key}[{i}]", hi=sys.float_info.max)


def check_metadata(d: Any, path: str = "metadata") -> None:
    """Check the metadata's fields: strings, counts, booleans, lists of names, a free-form ``extra``."""
    d = _object(d, path)
    for key in _METADATA_STRINGS:
        if key not in d:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
        _str(d[key], f"{path}.{key}")
    for key in _METADATA_OPTIONAL_STRINGS:
        if key in d:
            _str(d[key], f"{path}.{key}")
    if d.get("target") is not None and d["target"] not in ("cuda", "cpu"):
        raise _fail(f"{path}.target", "cuda, cpu or null", d["target"])
    if "regime" in d and d["regime"] not in ("autocast", "pure_fp16"):
        raise _fail(f"{path}.regime", "autocast or pure_fp16", d["regime"])
    for key, lo in _METADATA_COUNTS.items():
        if key in d:
            _int(d[key], f"{path}.{key}", lo)
    for key in _METADATA_BOOLS:
        if key in d:
            _bool(d[key], f"{path}.{key}")
    if "captured" in d:
        for i, k in enumerate(_list(d["captured"], f"{path}.captured")):
            if k not in _KINDS:
                raise _fail(f"{path}.captured[{i}]", f"one of {', '.join(_KINDS)}", k)
    if "hooked_modules" in d:
        for i, name in enumerate(_list(d["hooked_modules"], f"{path}.hooked_modules")):
            _str(name, f"{path}.hooked_modules[{i}]")
    if "extra" in d:
        check_depth(_object(d["extra"], f"{path}.extra"), f"{path}.extra")
        check_extra(d["extra"], f"{path}.extra")


def check_extra(extra: Mapping[str, Any], path: str = "metadata.extra") -> None:
    """Check the keys of ``metadata.extra`` that summaries read: strings, lists of strings or steps, flags, counts."""
    checks: list[tuple[Iterable[str], Any]] = [(_EXTRA_STRINGS, _str), (_EXTRA_BOOLS, _bool), (_EXTRA_COUNTS, _int)]
    for keys, check in checks:
        for key in keys:
            if extra.get(key) is not None:
                check(extra[key], f"{path}.{key}")
    for keys, check in ((_EXTRA_STRING_LISTS, _str), (_EXTRA_COUNT_LISTS, _int)):
        for key in keys:
            if extra.get(key) is not None:
                for i, v in enumerate(_list(extra[key], f"{path}.{key}")):
                    check(v, f"{path}.{key}[{i}]")


def _optional(v: Any, path: str, check: Any, *args: Any) -> None:
    if v is not None:
        check(v, path, *args)


def _fraction(v: Any, path: str) -> None:
    _number(v, path, hi=1.0)


def check_recommendation(d: Any, path: str = "recommendation") -> None:
    """Check a stored recommendation's JSON: its numbers, lists and objects, and how deep it nests.

    The verdict's value is left to ``Recommendation.from_dict``, which names the known ones.
    """
    d = _object(d, path)
    check_depth(d, path)
    _str(d.get("verdict"), f"{path}.verdict")
    for key in ("log2_scale", "headroom_bits"):
        _optional(d.get(key), f"{path}.{key}", _int, -1100, 1100)
    _optional(d.get("overflow_steps_at_scale"), f"{path}.overflow_steps_at_scale", _int)
    _optional(d.get("scale"), f"{path}.scale", _number, sys.float_info.max)
    for key in ("flushed_fraction_at_1", "flushed_fraction_at_scale"):
        _optional(d.get(key), f"{path}.{key}", _fraction)
    for key in ("grad_scaler_kwargs", "evidence", "thresholds", "growth_interval_table"):
        _optional(d.get(key), f"{path}.{key}", _object)
    _optional(d.get("grad_scaler_kwargs"), f"{path}.grad_scaler_kwargs", check_grad_scaler_kwargs)
    _optional(d.get("evidence"), f"{path}.evidence", check_evidence)
    citations_from_json(d.get("citations", []), f"{path}.citations")  # records, or an older report's sentences
    for i, c in enumerate(_list(d.get("caveats", []), f"{path}.caveats")):
        if not isinstance(c, str):  # {"code", "data"}; older reports stored the sentence
            _str(_object(c, f"{path}.caveats[{i}]").get("code"), f"{path}.caveats[{i}].code")
            _optional(c.get("data"), f"{path}.caveats[{i}].data", _object)
    if d.get("worst_modules") is not None:
        for i, pair in enumerate(_list(d["worst_modules"], f"{path}.worst_modules")):
            where = f"{path}.worst_modules[{i}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise _fail(where, "a [name, fraction] pair", pair)
            _str(pair[0], f"{where}[0]")
            _fraction(pair[1], f"{where}[1]")
    for key in ("format", "text"):  # required: every reader of a recommendation uses them
        _str(d.get(key), f"{path}.{key}")
    if "kind" in d:
        _str(d["kind"], f"{path}.kind")


def check_grad_scaler_kwargs(d: Any, path: str = "grad_scaler_kwargs") -> Mapping[str, Any]:
    """Check GradScaler's keyword arguments as GradScaler takes them and return them; they become code to paste.

    Only :data:`GRAD_SCALER_ARGS` keys; ``init_scale`` a positive finite number, ``growth_factor`` above 1,
    ``backoff_factor`` in (0, 1), ``growth_interval`` a whole number from 1, ``enabled`` true or false.
    """
    checked = _object(d, path)
    for key, v in checked.items():
        where = f"{path}.{key}"
        if key not in GRAD_SCALER_ARGS:
            raise ReportFieldError(where, f"{path}: {_quoted(key)} is not an argument of torch.amp.GradScaler "
                                          f"(expected {', '.join(GRAD_SCALER_ARGS)})")
        if key == "enabled":
            _bool(v, where)
        elif key == "growth_interval":
            _int(v, where, 1, 2**31 - 1)
        else:
            f = _number(v, where, sys.float_info.max)
            lo, hi = {"init_scale": (0.0, math.inf), "growth_factor": (1.0, math.inf), "backoff_factor": (0.0, 1.0)}[key]
            if not lo < f < hi:
                raise _fail(where, f"a number in ({lo:g}, {hi:g})", v)
    return checked


def _quoted(key: str) -> str:
    shown = repr(key)
    return shown if len(shown) <= 40 else shown[:37] + "..."


# Evidence fields the outputs read, by type (the others are free-form, nesting checked).
_EVIDENCE_NUMBERS = ("max_abs", "flushed_fraction_at_1", "flushed_fraction_at_scale", "format_span_bits")
_EVIDENCE_INTS = {"largest_safe_log2_scale": (-1100, 1100), "backward_log2_scale": (-1100, 1100),
                  "log2_scale_without_loss_cap": (-1100, 1100), "per_tensor_scale_log2": (-1100, 1100),
                  "profiled_steps": (0, MAX_COUNT), "nonzero_values": (0, MAX_COUNT),
                  "forward_overflow_count": (0, MAX_COUNT), "forward_flushing_count": (0, MAX_COUNT),
                  "forward_tensors": (0, MAX_COUNT), "simulated_growth_interval": (1, MAX_COUNT)}
_EVIDENCE_STRINGS = ("backward_verdict", "insufficient_reason", "ceiling_source", "forward_source", "fix_code")
_EVIDENCE_BOOLS = ("simulated_candidates_tied", "loss_fp16", "simulated_meets_threshold", "growth_interval_from_study")
_EVIDENCE_OBJECTS = ("emulated", "by_kind", "insufficient_data", "before_loss_cap")
_EVIDENCE_STRING_LISTS = ("fix_modules", "fix_top_level", "custom_functions")
_EVIDENCE_RECORD_LISTS = ("forward_overflow", "forward_low_headroom", "forward_flushing")
_EVIDENCE_PAIR_LISTS = ("limiting_modules", "flushing_modules_at_scale", "per_tensor_scales")
# The emulated step's fields the outputs read (analysis.effect writes them).
_EMULATED_NUMBERS = ("tolerance", "error", "module_output_error", "first_parameter_error")
_EMULATED_STRINGS = ("module", "first_parameter", "target", "regime")


def check_evidence(d: Any, path: str = "evidence") -> None:
    """Check the evidence fields the outputs read, each as the analysis writes it (null allowed where it writes null).

    A device or regime that code to paste or its words name must be one fp16probe knows
    (:data:`AUTOCAST_TARGETS`, :data:`REGIMES`).
    """
    d = _object(d, path)
    for key in _EVIDENCE_NUMBERS:
        _optional(d.get(key), f"{path}.{key}", _number)
    for key, (lo, hi) in _EVIDENCE_INTS.items():
        _optional(d.get(key), f"{path}.{key}", _int, lo, hi)
    for key in _EVIDENCE_STRINGS:
        _optional(d.get(key), f"{path}.{key}", _str)
    for key in _EVIDENCE_BOOLS:
        _optional(d.get(key), f"{path}.{key}", _bool)
    for key in _EVIDENCE_OBJECTS:
        _optional(d.get(key), f"{path}.{key}", _object)
    for key in _EVIDENCE_STRING_LISTS:
        if d.get(key) is not None:
            for i, v in enumerate(_list(d[key], f"{path}.{key}")):
                _str(v, f"{path}.{key}[{i}]")
    for key in _EVIDENCE_RECORD_LISTS:
        if d.get(key) is not None:
            for i, v in enumerate(_list(d[key], f"{path}.{key}")):
                _object(v, f"{path}.{key}[{i}]")
    for key in _EVIDENCE_PAIR_LISTS:
        if d.get(key) is not None:
            for i, v in enumerate(_list(d[key], f"{path}.{key}")):
                if not _list(v, f"{path}.{key}[{i}]"):
                    raise _fail(f"{path}.{key}[{i}]", "a [name, ...] row", v)
                _str(v[0], f"{path}.{key}[{i}][0]")
    _choice(d.get("target"), f"{path}.target", AUTOCAST_TARGETS)
    _choice(d.get("fix_device"), f"{path}.fix_device", AUTOCAST_TARGETS)
    _choice(d.get("regime"), f"{path}.regime", REGIMES)
    em = d.get("emulated")
    if em is not None:
        where = f"{path}.emulated"
        for key in _EMULATED_NUMBERS:
            _optional(em.get(key), f"{where}.{key}", _number)
        for key in _EMULATED_STRINGS:
            _optional(em.get(key), f"{where}.{key}", _str)
        _optional(em.get("log2_scale"), f"{where}.log2_scale", _int, -1100, 1100)
        _optional(em.get("fix_holds"), f"{where}.fix_holds", _bool)
        _optional(em.get("fix"), f"{where}.fix", _object)
        _choice(em.get("target"), f"{where}.target", AUTOCAST_TARGETS)
        _choice(em.get("regime"), f"{where}.regime", REGIMES)
        fix = em.get("fix")
        if fix is not None:
            for i, v in enumerate(_list(fix.get("keep_fp32", []), f"{where}.fix.keep_fp32")):
                _str(v, f"{where}.fix.keep_fp32[{i}]")


def _choice(v: Any, path: str, choices: tuple[str, ...]) -> None:
    if v is not None and v not in choices:
        raise _fail(path, " or ".join(choices), v)
