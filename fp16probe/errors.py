"""The exception hierarchy: everything fp16probe raises derives from Fp16ProbeError."""

from __future__ import annotations

import importlib
from typing import Any


class Fp16ProbeError(RuntimeError):
    """Base class of every error fp16probe raises on purpose.

    ``parameter`` names the parameter of :func:`fp16probe.profile` (or of a helper, or a
    ProfileRequest field) the error is about, and the message names it as Python spells it,
    ``input_shape='5,x': expected ...`` or ``pass loss=``; :meth:`spelled` respells it there.
    ``report`` is set when a run failed part-way (see :func:`fp16probe.profile`): the partial
    Report of the steps finished before the failure, so nothing collected is lost.
    ``reported_elsewhere`` is set on a rank other than 0 when rank 0 prints the error.
    """

    report: object | None = None
    # Under torch.distributed: rank 0 prints this error for every rank, so this rank's
    # command line exits with its code without a line of its own.
    reported_elsewhere: bool = False

    def __init__(self, message: str = "", parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter

    def spelled(self, names: dict[str, str]) -> str:
        """The message with its parameter spelled as ``names`` spells it (the command line: as its flag)."""
        name = names.get(self.parameter or "")
        before, head, after = str(self).partition(f"{self.parameter}=")
        if not head or name is None:
            return str(self)
        return f"{before}{name} {after.lstrip()}".rstrip()  # steps=0 -> --steps 0, verify= x -> --verify x


class UnknownFormatError(Fp16ProbeError, ValueError):
    """A number-format name that fp16probe does not know."""


class ReportError(Fp16ProbeError):
    """A report file that cannot be read: missing, malformed, truncated or of another schema."""


class ProbeError(Fp16ProbeError):
    """A Probe used in a way it cannot serve (nothing to hook, wrong state)."""


class AnalysisError(Fp16ProbeError, ValueError):
    """An analysis asked of a report that cannot answer it, or with parameters out of range."""


class ModelLoadError(Fp16ProbeError):
    """A model that could not be loaded, or whose loading was refused as unsafe."""


class ModelError(Fp16ProbeError):
    """The model (or the loss, an optimizer, user code) raised while it ran; the message names the step."""


class InputError(Fp16ProbeError, ValueError):
    """Input the command line cannot use: a missing file, a bad shape, a model that rejects it."""


class MissingExtraError(InputError, ImportError):
    """An optional dependency that a feature needs is not installed: names the pip extra that brings it."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(f"{feature} needs {package}, which fp16probe installs only with its {extra} extra: "
                         f"pip install 'fp16probe[{extra}]' (or pip install {package})")
        self.package, self.extra = package, extra


class ReportFieldError(ReportError, ValueError):
    """One field of a report that has the wrong type, is out of range or contradicts another.

    ``field`` names it as a path into the JSON, e.g. ``modules[3].histogram.max_abs``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its class name when the message is empty), for one-line errors."""
    text = message_of(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def message_of(e: BaseException) -> str:
    """``str(e)``, or a line naming its class when ``str()`` itself raises (a model's own exception may)."""
    try:
        return str(e)
    except Exception as inner:
        return f"{type(e).__name__} (its message could not be read: str() raised {type(inner).__name__})"


def require(module: str, extra: str, what: str) -> Any:
    """Import an optional package (a tracker, a framework), or raise one line naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Fp16ProbeError(
            f"{what} needs the {module.split('.')[0]!r} package, which is not installed ({e}); "
            f"install it with: pip install 'fp16probe[{extra}]'"
        ) from e
