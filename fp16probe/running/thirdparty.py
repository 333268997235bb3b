"""Hold back what other libraries write to stderr while a model loads and runs.

Importing transformers with torchao installed logs "Failed to load ....so" lines and torch's
pytree deprecations; a Mixture-of-Experts forward logs whole tracebacks from torch's fake-tensor
meta kernels (which then fall back and succeed). None of it is about the user's answer, and it
buries the one error line a refusal promises. :func:`held_back` swaps ``sys.stderr`` and the
stream of every logging handler that writes to it for a buffer, counts the lines and the
loggers they came from, and restores everything on exit. The buffer keeps working after the
block: a handler created inside it (a library imported there) writes through to the real
stderr from then on.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["HeldBack", "held_back"]


@dataclass
class HeldBack:
    """What was held back: the text, and the top-level packages whose loggers wrote it."""

    text: str = ""
    sources: list[str] = field(default_factory=list)

    @property
    def lines(self) -> int:
        """How many lines were held back."""
        return len(self.text.splitlines())


class _Buffer(io.TextIOBase):
    """A stream that keeps what is written while holding, then writes through to ``real``."""

    def __init__(self, real: TextIO) -> None:
        self.real = real
        self.held = io.StringIO()
        self.holding = True

    def write(self, s: str) -> int:
        if self.holding:
            return self.held.write(s)
        return self.real.write(s)

    def flush(self) -> None:
        if not self.holding:
            self.real.flush()

    def isatty(self) -> bool:
        return False


class _Source(logging.Filter):
    """Note the package of each record a held-back handler emits; never drops one."""

    def __init__(self, sources: list[str]) -> None:
        super().__init__()
        self.sources = sources

    def filter(self, record: logging.LogRecord) -> bool:
        top = record.name.split(".")[0] or "root"
        if top not in self.sources:
            self.sources.append(top)
        return True


def _stderr_handlers(real: Any) -> list[logging.StreamHandler[Any]]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is real]


@contextlib.contextmanager
def held_back(enabled: bool = True) -> Iterator[HeldBack]:
    """Hold back third-party stderr output (Python warnings, log records, prints) inside the block.

    Yields a :class:`HeldBack` filled in when the block ends (also when it raises). Our own
    output must go to a stream bound before the block (``make_console`` binds ``sys.stderr``
    when it is made). ``enabled=False`` (``--debug``) lets everything through as it happens.
    """
    result = HeldBack()
    if not enabled:
        yield result
        return
    real = sys.stderr
    buffer = _Buffer(real)
    source = _Source(result.sources)
    swapped = [(h, h.setStream(buffer)) for h in _stderr_handlers(real)]  # type: ignore[arg-type]
    last_resort = logging.lastResort
    for h in [h for h, _ in swapped] + ([last_resort] if last_resort is not None else []):
        h.addFilter(source)
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        # fp16probe's own warnings (a hook that failed) are the tool's lines: they still show.
        own = str(message).startswith("fp16probe")
        shown(message, category, filename, lineno, real if own and file is None else file, line)

    warnings.showwarning = show
    sys.stderr = buffer  # type: ignore[assignment]
    try:
        yield result
    finally:
        sys.stderr = real
        warnings.showwarning = shown
        buffer.holding = False
        for h, old in swapped:
            if old is not None:
                h.setStream(old)
        for h in [h for h, _ in swapped] + ([last_resort] if last_resort is not None else []):
            h.removeFilter(source)
        result.text = buffer.held.getvalue()
