"""``torch.compile``'d models give the plain run's weight-gradient counts; a plain accelerate loop its counts.

The README's "torch.compile and accelerate" section documents the calls checked here:
``Probe(model)`` then ``torch.compile(model)`` (or ``Probe`` on the compiled wrapper, whose
names carry dynamo's ``_orig_mod.`` prefix), and ``Probe(accelerator.unwrap_model(model),
scaler=accelerator.scaler)`` in an accelerate loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16probe import Probe


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _counts(report):
    """Every module's histogram and every step's, keyed without dynamo's wrapper prefix."""
    modules = {(m.name.removeprefix("_orig_mod."), m.kind): m.histogram for m in report.modules}
    return modules, {k: tuple(v) for k, v in report.trace.histograms.items()}


def _plain_run(wrap=lambda m: m, probe_wrapper=False):
    model = _mlp()
    runner = wrap(model)
    probe = Probe(runner if probe_wrapper else model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with probe:
        for x, y in _batches():
            nn.functional.mse_loss(runner(x), y).backward()
            opt.step()
            opt.zero_grad()
            probe.step()
    return probe.report()


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("probe_wrapper", [False, True], ids=["probe-model", "probe-compiled"])
def test_compiled_model_gives_the_plain_weight_gradient_counts_and_says_what_it_leaves_out(backend, probe_wrapper):
    """Under torch.compile module outputs are not read (capture/compiled.py; inductor: tests/test_compile_live.py)."""
    torch._dynamo.reset()
    plain = _plain_run()
    with pytest.warns(UserWarning, match="module outputs inside compiled code are not read"):
        compiled = _plain_run(lambda m: torch.compile(m, backend=backend), probe_wrapper)
    modules, steps = _counts(compiled)
    plain_modules, plain_steps = _counts(plain)
    assert {k: h for k, h in modules.items() if k[1] == "weight_grad"} == \
        {k: h for k, h in plain_modules.items() if k[1] == "weight_grad"}
    assert steps["weight_grad"] == plain_steps["weight_grad"]
    assert plain.histogram("activation_grad").nonzero_finite == 3 * 4 * (32 + 32 + 32 + 32 + 1)
    assert compiled.histogram("activation_grad").total == 0
    assert compiled.capture.compile_traced and not compiled.capture.unrecorded_modules
    names = {m.name for m in compiled.modules}
    assert all(n.startswith("_orig_mod.") for n in names) == probe_wrapper


def _scaled_runs(accelerate_loop: bool):
    """fp16 autocast with a real GradScaler("cpu") at 2^10: through accelerate, or by hand."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    data = _batches()
    if accelerate_loop:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        # accelerate makes no GradScaler on the CPU; give it one, as it keeps its own on a GPU
        accelerator.scaler = scaler
        model, opt = accelerator.prepare(model, opt)
        probe = Probe(accelerator.unwrap_model(model), scaler=accelerator.scaler)
        with probe:
            for x, y in data:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)  # scaler.scale(loss).backward()
                opt.step()  # AcceleratedOptimizer: scaler.step + scaler.update
                opt.zero_grad()
                probe.step()
        assert accelerator.scaler is scaler and opt.scaler is scaler
        return probe.report()
    probe = Probe(model, scaler=scaler)
    with probe:
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            probe.step()
    return probe.report()


def test_plain_accelerate_loop_gives_the_plain_counts():
    pytest.importorskip("accelerate")
    plain = _plain_run()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    assert accelerator.scaler is None  # fp32 on the CPU: nothing scales the loss
    probe = Probe(accelerator.unwrap_model(model), scaler=accelerator.scaler)
    with probe:
        for x, y in _batches():
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            probe.step()
    assert _counts(probe.report()) == _counts(plain)


def test_accelerate_loop_with_a_grad_scaler_gives_the_hand_written_counts():
    pytest.importorskip("accelerate")
    by_hand = _scaled_runs(accelerate_loop=False)
    through_accelerate = _scaled_runs(accelerate_loop=True)
    assert _counts(through_accelerate) == _counts(by_hand)
    assert through_accelerate.trace.scale == (1024.0, 1024.0, 1024.0)
