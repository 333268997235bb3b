"""Code to paste, built from checked tokens only.

Every line of code fp16probe asks a user to paste (the GradScaler line, the ``keep_in_fp32`` fix;
TransformerEngine's and torchao's in :mod:`fp16probe.presentation.blockview`) is assembled here
from values checked against what the call takes: a device type from a fixed set
(:data:`fp16probe.validation.SCALER_DEVICES`, :data:`~fp16probe.validation.AUTOCAST_TARGETS`),
module names through ``repr`` (a Python string literal whatever the name holds), numbers as
numbers. No stored string is ever formatted into code and no stored code is ever shown: a
report's ``fix_code`` is ignored. A value that does not fit gives no code (``None``), and the
caller says so in words.

Long calls wrap as Python is written (black's layout): the call on one line when it fits,
else one argument a line, a list of names one name a line, and a name longer than its line
split at dots into adjacent string literals, which Python joins back into the one name.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Mapping, Sequence, Union

from fp16probe.errors import ReportFieldError
from fp16probe.validation import AUTOCAST_TARGETS, SCALER_DEVICES, check_grad_scaler_kwargs

__all__ = ["FRAMEWORKS", "Arg", "call_text", "deepspeed_fp16_block", "form_notes", "framework_settings", "grad_scaler_args",
           "grad_scaler_call", "keep_in_fp32_call", "loss_in_fp32_call", "megatron_flags", "sharded_grad_scaler_call", "string_literal"]

Arg = Union[str, tuple[str, ...]]
"""An argument already written as Python: an expression, or the items of a list literal."""

_INDENT = "    "


def grad_scaler_args(kwargs: Mapping[str, Any]) -> dict[str, str] | None:
    """GradScaler's keyword arguments written as Python (``2.0**16``, ``2000``, ``False``); None when one does not fit.

    Only GradScaler's own arguments, each checked as GradScaler takes it
    (:func:`fp16probe.validation.check_grad_scaler_kwargs`).
    """
    try:
        check_grad_scaler_kwargs(dict(kwargs))
    except ReportFieldError:
        return None
    return {str(k): _number(v) for k, v in kwargs.items()}


def _number(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, int):
        return str(int(v))
    f = float(v)
    if f >= 1024 and math.log2(f).is_integer():
        return f"2.0**{int(math.log2(f))}"
    return repr(f)


def grad_scaler_call(kwargs: Mapping[str, Any], device: str, width: int | None = None) -> str | None:
    """``scaler = torch.amp.GradScaler("device", k=v, ...)``, split after commas when wider than ``width``.

    None when ``device`` is not one of :data:`~fp16probe.validation.SCALER_DEVICES` or an argument does not fit.
    """
    args = grad_scaler_args(kwargs)
    if args is None or device not in SCALER_DEVICES:
        return None
    parts = [f'"{device}"'] + [f"{k}={v}" for k, v in args.items()]  # a device from the fixed set
    head = "scaler = torch.amp.GradScaler("
    one = head + ", ".join(parts) + ")"
    if width is None or len(one) <= width:
        return one
    lines, current = [head], _INDENT
    for i, arg in enumerate(parts):  # a few short arguments: packed, as GradScaler's own docs write them
        piece = arg + ("," if i < len(parts) - 1 else ")")
        if current.strip() and len(current) + 1 + len(piece) > width:
            lines.append(current.rstrip())
            current = _INDENT
        current += ("" if not current.strip() else " ") + piece
    lines.append(current.rstrip())
    return "\n".join(lines)


def keep_in_fp32_call(modules: Any, device: Any, width: int | None = None) -> str | None:
    """``import fp16probe`` and ``fp16probe.keep_in_fp32(model, [names], device_type="device")``.

    None when ``modules`` is not a non-empty list of names or ``device`` not one of
    :data:`~fp16probe.validation.AUTOCAST_TARGETS`.
    """
    if (not isinstance(modules, (list, tuple)) or not modules or not all(isinstance(m, str) for m in modules)
            or device not in AUTOCAST_TARGETS):
        return None
    names = tuple(string_literal(m) for m in modules)
    call = call_text("fp16probe.keep_in_fp32", ["model", names, f'device_type="{device}"'], width)  # a fixed-set device
    return "import fp16probe\n" + call


def loss_in_fp32_call(device: Any) -> str | None:
    """``with torch.autocast('device', enabled=False): loss = loss_fn(output.float(), ...)``: the loss computed in
    fp32 on the model's output. None when ``device`` is not one of :data:`~fp16probe.validation.AUTOCAST_TARGETS`."""
    if device not in AUTOCAST_TARGETS:
        return None
    return f"with torch.autocast({device!r}, enabled=False): loss = loss_fn(output.float(), ...)"  # a fixed-set device


def string_literal(value: str) -> str:
    """``value`` as a Python string literal (``repr``: quotes, backslashes and invisible characters escaped)."""
    return repr(str(value))


def call_text(func: str, args: Sequence[Arg], width: int | None = None) -> str:
    """``func(args)`` as Python: one line when it fits ``width``, else one argument a line (black's layout).

    A list that does not fit its line has one item a line; an item that does not fit is a string
    literal split at dots into adjacent literals (Python joins them into one string).
    """
    def flat(arg: Arg) -> str:
        return arg if isinstance(arg, str) else "[" + ", ".join(arg) + "]"

    one = f"{func}({', '.join(flat(a) for a in args)})"
    if width is None or len(one) <= width:
        return one
    lines = [f"{func}("]
    for arg in args:
        line = f"{_INDENT}{flat(arg)},"
        if isinstance(arg, str) or len(line) <= width:
            lines.append(line)
            continue
        lines.append(f"{_INDENT}[")
        for item in arg:
            pieces = _pieces(item, width - 2 * len(_INDENT) - 1)
            lines += [f"{_INDENT * 2}{p}" for p in pieces[:-1]] + [f"{_INDENT * 2}{pieces[-1]},"]
        lines.append(f"{_INDENT}],")
    lines.append(")")
    return "\n".join(lines)


def _pieces(literal: str, room: int) -> list[str]:
    """A string literal as adjacent literals each at most ``room`` wide where it can be, split after dots."""
    if len(literal) <= room:
        return [literal]
    value = ast.literal_eval(literal)  # the literal string_literal wrote: its value back
    room = max(room, 8)
    out: list[str] = []
    current = ""
    for part in re.split(r"(?<=\.)", value):
        if len(repr(current + part)) <= room:
            current += part
            continue
        if current:
            out.append(current)
            current = ""
        for ch in part:  # a part longer than a line: split where it must be
            if current and len(repr(current + ch)) > room:
                out.append(current)
                current = ""
            current += ch
    if current or not out:
        out.append(current)
    return [repr(p) for p in out]


FRAMEWORKS = ("torch", "verl", "deepspeed", "megatron")
"""The frameworks whose own form of a loss-scaling rule :func:`framework_settings` writes."""

_RULE_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale")


def _rule(rule: Mapping[str, Any]) -> dict[str, Any] | None:
    """A replayed rule's fields, checked: finite positive numbers, integer interval and hysteresis; None otherwise."""
    try:
        r = {k: rule[k] for k in _RULE_KEYS}
    except (KeyError, TypeError):
        return None
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in r.values()):
        return None
    if (r["init_scale"] <= 0 or r["growth_factor"] <= 1 or not 0 <= r["backoff_factor"] < 1 or r["min_scale"] < 0
            or int(r["growth_interval"]) != r["growth_interval"] or r["growth_interval"] < 1
            or int(r["hysteresis"]) != r["hysteresis"] or r["hysteresis"] < 1):
        return None
    return r


def _grad_scaler_kwargs(rule: Mapping[str, Any]) -> dict[str, Any] | None:
    """GradScaler's four scale arguments for a rule (ShardedGradScaler takes the same); None for a rule with
    hysteresis, a floor or DeepSpeed's window counting, which GradScaler cannot follow."""
    r = _rule(rule)
    if r is None or r["hysteresis"] != 1 or r["min_scale"] != 0 or rule.get("deepspeed_window"):
        return None
    return {"init_scale": float(r["init_scale"]), "growth_factor": float(r["growth_factor"]),
            "backoff_factor": float(r["backoff_factor"]), "growth_interval": int(r["growth_interval"])}


def sharded_grad_scaler_call(rule: Mapping[str, Any], width: int | None = None) -> str | None:
    """FSDP's ``ShardedGradScaler(...)`` line (verl's scaler) for a rule, with its import; None when it does not fit.

    ShardedGradScaler takes GradScaler's four scale arguments; a rule with hysteresis or a floor
    cannot be written in it (None).
    """
    kwargs = _grad_scaler_kwargs(rule)
    args = None if kwargs is None else grad_scaler_args(kwargs)
    if args is None:
        return None
    return ("from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
            + call_text("scaler = ShardedGradScaler", [f"{k}={v}" for k, v in args.items()], width))


def _power_of_two(x: float) -> int | None:
    e = math.log2(x)
    return int(e) if e.is_integer() else None


def _floor(r: Mapping[str, Any]) -> float:
    """The floor a DeepSpeed or Megatron form writes: theirs must be above 0, so a rule with none gets their
    default, 1, which acts only when the scale would fall below 1 (:data:`FLOOR_NOTE`)."""
    return float(r["min_scale"]) or 1.0


FLOOR_NOTE = ("written with min loss scale 1 (DeepSpeed and Megatron require a floor above 0; the rule has none): "
              "the same steps unless the scale would fall below 1")
# DeepSpeed counts its window from the last overflow (analysis.replay.ScalerRule.deepspeed_window), the
# other frameworks count clean steps since the last overflow or growth.
DEEPSPEED_WINDOW_NOTE = ("DeepSpeed counts loss_scale_window from the last overflow: its first growth after each "
                         "overflow comes one clean step later than the rule's, the next ones every window")
MEGATRON_WINDOW_NOTE = ("Megatron counts loss-scale-window from the last overflow or growth: its first growth "
                        "after each overflow comes one clean step sooner than DeepSpeed's")


def form_notes(rule: Mapping[str, Any], framework: str) -> list[str]:
    """What a framework's form of ``rule`` does differently from the rule replayed (words, for the schedule)."""
    r = _rule(rule)
    if r is None or framework not in ("deepspeed", "megatron"):
        return []
    notes = [FLOOR_NOTE] if r["min_scale"] == 0 else []
    if framework == "deepspeed" and not rule.get("deepspeed_window"):
        notes.append(DEEPSPEED_WINDOW_NOTE)
    if framework == "megatron" and rule.get("deepspeed_window"):
        notes.append(MEGATRON_WINDOW_NOTE)
    return notes


def deepspeed_fp16_block(rule: Mapping[str, Any]) -> str | None:
    """DeepSpeed's ``"fp16"`` config block (dynamic scaling: ``loss_scale`` 0) as JSON; None when it does not fit.

    DeepSpeed's config grows by x2 and backs off by /2 only, its initial scale is a power of two
    (``initial_scale_power``) and its floor a whole number above 0 (``min_loss_scale``; a rule
    with no floor is written with 1): other rules are None.
    """
    r = _rule(rule)
    if r is None or r["growth_factor"] != 2 or r["backoff_factor"] != 0.5:
        return None
    power = _power_of_two(float(r["init_scale"]))
    floor = _floor(r)
    if power is None or power < 0 or not floor.is_integer():
        return None
    block = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": power,
                      "loss_scale_window": int(r["growth_interval"]), "hysteresis": int(r["hysteresis"]),
                      "min_loss_scale": int(floor)}}
    return json.dumps(block, indent=2)


def _json_number(x: float) -> int | float:
    return int(x) if x.is_integer() else x


def megatron_flags(rule: Mapping[str, Any]) -> str | None:
    """Megatron-LM's command-line flags for a rule; None when it does not fit.

    Megatron's dynamic scaler grows by x2 and backs off by /2 (fixed in its training set-up), so
    other factors are None; its floor must be above 0 (a rule with none is written with 1).
    """
    r = _rule(rule)
    if r is None or r["growth_factor"] != 2 or r["backoff_factor"] != 0.5:
        return None
    return (f"--fp16 --initial-loss-scale {_json_number(float(r['init_scale']))} "
            f"--loss-scale-window {int(r['growth_interval'])} --hysteresis {int(r['hysteresis'])} "
            f"--min-loss-scale {_json_number(_floor(r))}")


def framework_settings(rule: Mapping[str, Any], framework: str, device: str = "cuda",
                       width: int | None = None) -> str | None:
    """A rule written in ``framework``'s own form (one of :data:`FRAMEWORKS`); None when that form cannot express it.

    ``torch``: a ``torch.amp.GradScaler`` line; ``verl``: FSDP's ``ShardedGradScaler``;
    ``deepspeed``: the ``"fp16"`` config block; ``megatron``: command-line flags.
    """
    if framework == "torch":
        kwargs = _grad_scaler_kwargs(rule)
        return None if kwargs is None else grad_scaler_call(kwargs, device, width)
    if framework == "verl":
        return sharded_grad_scaler_call(rule, width)
    if framework == "deepspeed":
        return deepspeed_fp16_block(rule)
    if framework == "megatron":
        return megatron_flags(rule)
    return None
