"""The overflow ceiling as a collector: :class:`~fp16probe.capture.ceiling.CeilingHooks` on every sampled
step, the autocast dtype tracking they read (:mod:`fp16probe.capture.ops`), and the trace's per-step ceilings."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fp16probe.capture import ops
from fp16probe.capture.ceiling import CHANNEL, CeilingHooks, step_ceilings
from fp16probe.capture.collector import Collected, Collector
from fp16probe.capture.compiled import tracing
from fp16probe.capture.recorder import iter_tensors

__all__ = ["CeilingCollector"]


class CeilingCollector(Collector):
    """The overflow ceiling's hooks, the dtype tracking they read, and the trace's per-step ceilings."""

    key = "ceiling"

    def __init__(self, probe: Any) -> None:
        rec = self.recorder = probe.recorder
        self.probe = probe
        self.hooks = CeilingHooks(lambda: rec.enabled and rec.sampling, rec.inv_scale,
                                  lambda v: rec.note_max(CHANNEL, v), rec.note_error)
        rec.cover = self.hooks.cover
        # Work out autocast's dtypes while a module-granularity forward runs, so the ceiling
        # leaves out gradients that stay fp32 (see fp16probe.capture.ops). A model that trains
        # as .half() computes every gradient in fp16: nothing is left out then.
        self._tracking: Any = None
        if probe.granularity == "module" and probe.regime == "autocast":
            self._tracking = ops.new_capture(rec, False, probe.target)
            self._tracking.wanted = self.hooks.begin_forward  # marks reused while the graph repeats

    def sample(self, handles: list[Any]) -> None:
        """Track dtypes, watch the model's output and hook the graph's nodes."""
        if self._tracking is not None:
            # Dtype tracking only: marks the nodes whose gradient autocast keeps in fp32
            # (norm internals) so the overflow ceiling leaves them out, as op capture does.
            handles.extend(ops.attach(self.probe.model, (), self.recorder, capture=self._tracking))
        handles.append(self.probe.model.register_forward_hook(_ceiling_hook(self.hooks)))
        handles.append(self.hooks)  # its remove() unhooks nodes that outlive a graph
        # Weight gradients counted at the end of backward cover their AccumulateGrad nodes;
        # under DDP they are counted after the all-reduce, so not there.
        self.hooks.counted_params = self.probe.collector("modules").counted_params()

    def close_step(self, sampled: bool) -> None:
        """Fold the step's gradients; leave the tracking mode if a forward was cut short."""
        if self._tracking is not None:
            self._tracking.reset()
        self.hooks.close_step()

    def discard_step(self) -> None:
        """Fold pending values into the step being dropped."""
        self.close_step(False)

    def flush(self) -> None:
        """Fold what the open step's nodes saw into the recorder's maxima."""
        self.hooks.flush()

    def collect(self, got: Collected) -> dict[str, Any]:
        """Put each step's ceiling in the trace: the nodes' maximum or the histograms', inf on inf/NaN."""
        self.hooks.flush()
        trace = got.trace
        n = len(trace)
        step_max = [max([hs[i].max_abs for k, hs in trace.histograms.items() if k != "activation"], default=0.0)
                    for i in range(n)]
        got.trace = dataclasses.replace(
            trace, ceiling=step_ceilings(got.maxima.get(CHANNEL, (0.0,) * n), step_max, trace.found_inf))
        return {}


def _ceiling_hook(ceiling: CeilingHooks):
    def hook(module: Any, args: Any, output: Any) -> None:
        if tracing():  # inside torch.compile: the compiled program stays as it is (compiled.py)
            return
        # Outside any torch function mode: the walk makes no tensor.
        with torch._C.DisableTorchFunction():
            ceiling.watch(iter_tensors(output), model_output=True)

    return hook
