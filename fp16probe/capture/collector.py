"""The collector protocol: one measurement the Probe runs, from attaching to its section of the report.

A collector is built from the Probe (its model, recorder and settings) by a factory, which
returns None when the settings leave it off. The Probe calls, in registration order:

- ``start()`` when it starts (hooks that live for the whole run) and ``stop()`` when it stops;
- ``sample(handles)`` at the start of each sampled step: register that step's hooks, appending
  each handle (anything with ``remove()``) to ``handles``; the Probe removes them when the
  sampling stops;
- ``close_step(sampled)`` at each step boundary (after the recorder's forward maxima are folded,
  before the recorder closes the step) and ``discard_step()`` when a step is dropped;
- ``flush()`` then ``collect(got)`` when a report is asked for (``flush`` on every collector
  before the recorder reads; ``collect`` after): return ``{section key: typed section}`` (see
  :mod:`fp16probe.sections`); it may refine ``got`` (the trace, the module records, the notes) for
  the collectors after it.

A new collector is one module and one :func:`register_collector` line; its section is registered
with :func:`fp16probe.sections.register_section`. Hooks must not synchronise with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fp16probe.report import ModuleStats, StepTrace

__all__ = ["COLLECTORS", "Collected", "Collector", "register_collector", "unregister_collector"]


@dataclass
class Collected:
    """What the recorder brought to the host, refined by each collector in turn, and the notes they add."""

    trace: StepTrace
    modules: tuple[ModuleStats, ...]
    maxima: Mapping[str, tuple[float, ...]]  # the recorder's per-step maxima by channel
    since_step: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)  # fields of fp16probe.sections.CaptureNotes
    sections: dict[str, Any] = field(default_factory=dict)  # what the collectors before returned


class Collector:
    """A collector that does nothing at every call; subclasses override what they need."""

    key = ""  # a name to find it by (Probe.collector)

    def start(self) -> None:
        """The Probe started: register what lives for the whole run."""

    def stop(self) -> None:
        """The Probe stopped: remove it. What was recorded stays."""

    def sample(self, handles: list[Any]) -> None:
        """A sampled step begins: register its hooks, appending their handles."""

    def close_step(self, sampled: bool) -> None:
        """A step ended (``sampled``: whether it was recorded)."""

    def discard_step(self) -> None:
        """The open step is dropped: forget what it recorded."""

    def flush(self) -> None:
        """A report is asked for: fold what the open step saw so far, before the recorder reads."""

    def collect(self, got: Collected) -> Mapping[str, Any]:
        """Bring what was recorded to the host: ``{section key: section}``."""
        return {}


Factory = Callable[[Any], "Collector | None"]  # the Probe -> its collector, None when off

COLLECTORS: list[Factory] = []  # beyond the built-in ones (fp16probe.capture.probe.BUILTIN), in order


def register_collector(factory: Factory) -> Factory:
    """Build a collector with ``factory(probe)`` in every Probe made from now on (after the built-in ones)."""
    COLLECTORS.append(factory)
    return factory


def unregister_collector(factory: Factory) -> None:
    """Stop building ``factory``'s collector in new Probes."""
    if factory in COLLECTORS:
        COLLECTORS.remove(factory)
