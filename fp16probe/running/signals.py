"""SIGINT, SIGTERM and SIGHUP during a profile: the first one stops the loop, later ones never abort the write.

A Ctrl-C stops the loop with a partial report of the steps finished. A second Ctrl-C
(people press it twice), or the SIGTERM torchrun sends to the other ranks when one
stops, used to land in the middle of making or writing that report and lose it. Under
:func:`stop_signals`, only the first signal raises, and only while the run is *armed*
(from the start until the loop ends); every later signal is noted in ``received`` and
the command line exits with the first one's code once the report is written. SIGKILL
(``kill -9``) still ends the process at once, as nothing can catch it.

SIGHUP (a closed terminal or ssh session) is handled like SIGTERM, with its own exit
code, 129. A signal for which the caller installed a handler of its own (or ``nohup``'s
ignore) is left alone.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Hangup", "STOP_SIGNALS", "StopSignals", "Terminated", "active", "stop_signals"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during :func:`fp16probe.profile`; handled like Ctrl-C (a partial report)."""


class Hangup(Terminated):
    """SIGHUP arrived (the terminal or ssh session closed); handled like SIGTERM, exit code 129."""


# signal -> (the exception the first one raises, the stop reason a report records, the exit code)
STOP_SIGNALS: dict[int, tuple[type[KeyboardInterrupt], str, int]] = {
    signal.SIGINT: (KeyboardInterrupt, "interrupted", 130),
    signal.SIGTERM: (Terminated, "terminated", 143),
}
if hasattr(signal, "SIGHUP"):
    STOP_SIGNALS[signal.SIGHUP] = (Hangup, "hangup", 129)

_DEFAULTS = (signal.SIG_DFL, signal.default_int_handler)


class StopSignals:
    """The signals received while a run lasted, and whether the next one still stops the loop."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.armed = True
        self._keep = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.armed and len(self.received) == 1:
            raise STOP_SIGNALS[signum][0]()

    def disarm(self) -> None:
        """The loop is over: from now on a signal is noted, never raised, so the report gets written."""
        self.armed = False

    @property
    def exit_code(self) -> int | None:
        """The first signal's exit code (130, 143, 129), or None when none arrived."""
        return STOP_SIGNALS[self.received[0]][2] if self.received else None

    def install(self) -> None:
        """Take over each stop signal whose handler is still Python's default (main thread only)."""
        for signum in STOP_SIGNALS:
            previous = signal.getsignal(signum)
            if previous in _DEFAULTS:
                self._previous[signum] = previous
                signal.signal(signum, self._handle)

    def keep(self) -> None:
        """At :meth:`restore`, ignore the stop signals instead (a command about to exit).

        torchrun sends SIGTERM to the other ranks as soon as one exits, and a signal can land
        between the restore and the exit; either would kill a process that has written its
        report with the signal's default action, losing its exit code. Python resets its own
        handlers to the default at exit, but leaves an ignored signal ignored.
        """
        self._keep = True

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced (or ignore the signals, after :meth:`keep`)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if self._keep else previous)
        self._previous.clear()


_active: list[StopSignals] = []


def active() -> StopSignals | None:
    """The shield in force (the command line's, or :func:`fp16probe.profile`'s own), if any."""
    return _active[-1] if _active else None


@contextmanager
def stop_signals() -> Iterator[StopSignals]:
    """Install the shield for the block, or reuse the one already in force (signals go to the main thread only)."""
    current = active()
    if current is not None:
        yield current
        return
    shield = StopSignals()
    if threading.current_thread() is threading.main_thread():
        shield.install()
    _active.append(shield)
    try:
        yield shield
    finally:
        _active.remove(shield)
        shield.restore()
