"""``Probe.step()`` closes a step atomically with respect to KeyboardInterrupt.

Python delivers Ctrl-C between bytecodes of whatever Python code runs. Here a tracer
raises KeyboardInterrupt at the N-th line or call that fp16probe's own code executes inside
``step()``, for every N, and the partial report must then be loadable and hold exactly
what the run holds either just before that ``step()`` or just after it: no "76 entries for
75 steps", no step counted twice.
Not at a ``with`` line: the tracer reports that line again as the block exits, before
``__exit__`` runs, and raising there would leak a held lock; CPython delivers signals only
after a call returns, so a real Ctrl-C cannot land there.
"""

from __future__ import annotations

import linecache
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe import Probe, Report

PACKAGE_DIR = str(Path(fp16probe.__file__).resolve().parent)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, probe: Probe, steps: int, interrupt_at: int | None = None,
           last_step: bool = True) -> int:
    """Run ``steps`` probed steps; interrupt the last ``step()`` at event ``interrupt_at``.

    Returns the number of fp16probe lines and calls the last ``step()`` ran (when not interrupted).
    """
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    executed = 0
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        if i < steps - 1:
            probe.step()
            continue
        if not last_step:
            break
        counter = [0]

        def local(frame, event, arg):
            if event == "line" and not linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with "):
                tick()
            return local

        def tick():
            if counter[0] == interrupt_at:
                raise KeyboardInterrupt
            counter[0] += 1

        def tracer(frame, event, arg):
            if not frame.f_code.co_filename.startswith(PACKAGE_DIR):
                return None
            tick()  # on entering a function of fp16probe
            return local

        sys.settrace(tracer)
        try:
            probe.step()
        finally:
            sys.settrace(None)
        executed = counter[0]
    return executed


def _content(report: Report) -> dict:
    d = report.to_dict()
    d["metadata"].pop("created", None)
    d["metadata"].pop("partial", None)
    return d


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
@pytest.mark.parametrize("every", [1, 2])
def test_a_keyboard_interrupt_anywhere_in_step_leaves_a_loadable_report(tmp_path, every):
    model = _model()
    with Probe(model, every=every) as probe:
        _train(model, probe, 4, last_step=False)
    before = _content(probe.report(partial=True))
    model = _model()
    with Probe(model, every=every) as probe:
        total = _train(model, probe, 4)
    after = _content(probe.report())
    assert total > 20  # the tracer sees step()'s own code
    bad = []
    for n in range(total):
        model = _model()
        probe = Probe(model, every=every).start()
        try:
            _train(model, probe, 4, interrupt_at=n)
        except KeyboardInterrupt:
            pass
        else:
            bad.append((n, "not interrupted"))
            continue
        finally:
            probe.stop()
        report = probe.report(partial=True)
        path = report.save(tmp_path / "partial.json")
        loaded = Report.load(path)
        assert len(loaded.trace.steps) == len(loaded.trace.scale) == len(loaded.trace.found_inf)
        if _content(loaded) not in (before, after):
            bad.append((n, "differs"))
    assert bad == []


def test_step_can_be_retried_after_an_interrupt_without_counting_twice():
    """An interrupt before the commit leaves the step open; the next step() closes it once."""
    model = _model()
    with Probe(model) as probe:
        _train(model, probe, 3)
    expected = _content(probe.report())
    model = _model()
    with Probe(model) as probe:
        with pytest.raises(KeyboardInterrupt):
            _train(model, probe, 3, interrupt_at=5)  # early in close_step, before the commit
        probe.step()
        got = probe.report()
    assert _content(got) == expected


@pytest.mark.parametrize("granularity", ["module", "op"])
def test_the_compiled_close_keeps_what_the_torch_close_keeps(monkeypatch, granularity):
    """On the CPU a step closes in one compiled pass (engine.close_table) into the totals buffer it
    replaced the step before; the report equals the torch close's, module totals and every step's
    trace, also while op capture adds rows as it finds ops."""
    from fp16probe.capture import engine

    if not engine.compiled_close(engine.new_table(1)):
        pytest.skip("the compiled close is the numba engine's")

    def run() -> dict:
        model = _model()
        with Probe(model, granularity=granularity) as probe:
            _train(model, probe, 6)
        return _content(probe.report())

    compiled = run()
    monkeypatch.setattr(engine, "compiled_close", lambda table: False)
    assert run() == compiled
    assert len(compiled["trace"]["steps"]) == 6
