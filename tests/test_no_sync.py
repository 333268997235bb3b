"""No host synchronisation inside the Probe's hooks.

On the CPU there is no device to wait for, so the CPU test catches the calls that would
synchronise on an accelerator: while a probed forward and backward run, the Tensor methods
that bring a value to the host are replaced by a wrapper that records (and raises) when
it is called from fp16probe's own code. On a CUDA machine a second test runs probed steps
under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import fp16probe
from bench.models import HookMix
from fp16probe import Probe
from fp16probe.capture import engine as histogram_module

PACKAGE_DIR = str(Path(fp16probe.__file__).resolve().parent)

# Tensor methods that copy a value to the host (or size an output from data, which does
# the same on an accelerator).
SYNCING_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
    "__format__",
    "__repr__",
    "nonzero",
    "masked_select",
    "unique",
)
SYNCING_FUNCTIONS = ("nonzero", "masked_select", "unique", "bincount")  # bincount sizes its output from data


class SyncCalled(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _device_code_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Check the engine that runs on accelerators (``index_add_`` into the row), run on the CPU.

    On the CPU the numba kernel reads the tensor's memory through ``.numpy()`` and the
    torch engine uses ``bincount``; a CPU tensor has no device to synchronise with, and
    accelerators take neither path.
    """
    from fp16probe.capture import engine as histogram

    monkeypatch.setattr(histogram, "CPU_ENGINE", "device")


def _called_from_package() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE_DIR):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[list[str]]:
    """Record every syncing call made from fp16probe's code while the block runs."""
    calls: list[str] = []
    saved = []

    def guard(owner: object, name: str) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))

        def wrapper(*args, **kwargs):
            if _called_from_package():
                calls.append(name)
                raise SyncCalled(f"fp16probe called {name} during a probed step")
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    try:
        for name in SYNCING_METHODS:
            guard(torch.Tensor, name)
        for name in SYNCING_FUNCTIONS:
            guard(torch, name)
        yield calls
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _Net() -> nn.Module:
    """Every kind of hook the Probe uses (bench/models.HookMix, shared with bench/gpu_check.py): [B, 3, 4, 4] in."""
    return HookMix(channels=4, dim=8, heads=2, classes=3)


def _probed_steps(model: nn.Module, x: torch.Tensor, probe: Probe, steps: int, *, guard: bool) -> list[str]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    calls: list[str] = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ctx = forbid_host_sync() if guard else contextlib.nullcontext([])
        with ctx as seen:
            model(x).square().mean().backward()
        calls += seen
        opt.step()
        with forbid_host_sync() if guard else contextlib.nullcontext([]) as seen:
            probe.step()
        calls += seen
    return calls


@pytest.mark.parametrize("activations", [False, True])
def test_hooks_never_bring_values_to_the_host(activations: bool) -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 3, 4, 4)
    with Probe(model, activations=activations) as probe:
        calls = _probed_steps(model, x, probe, 3, guard=True)
    assert calls == []
    report = probe.report()  # after the steps, syncing is allowed and expected
    assert "hook_errors" not in report.metadata.extra
    assert report.histogram("activation_grad").total > 0
    assert report.histogram("weight_grad").total > 0
    # The overflow ceiling's node hooks ran inside the guard too, and saw every step.
    assert report.trace.ceiling is not None and len(report.trace.ceiling) == 3
    assert all(c >= _step_max(report.trace, "activation_grad")[i] > 0 for i, c in enumerate(report.trace.ceiling))


def test_no_sync_with_a_grad_scaler_under_autocast_and_sampling() -> None:
    """The unscaling path (the scaler's device scalar) and attach/detach at every=2 never sync."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 3, 4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    calls: list[str] = []
    with Probe(model, scaler=scaler, every=2) as probe:
        for _ in range(4):
            opt.zero_grad(set_to_none=True)
            with forbid_host_sync() as seen:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                probe.step()
            calls += seen
            scaler.step(opt)
            scaler.update()
    assert calls == []
    report = probe.report()
    assert "hook_errors" not in report.metadata.extra
    assert report.trace.steps == (0, 2) and report.trace.scale == (65536.0, 65536.0)
    assert report.histogram("weight_grad").total > 0


def test_no_sync_in_the_per_step_history_and_the_fp32_reruns() -> None:
    """Every step's scale and largest gradient (unsampled steps too) and a shadow rerun stay on the device."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 3, 4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    calls: list[str] = []
    with Probe(model, scaler=scaler, every=3, shadow_every=2) as probe:
        for _ in range(6):
            opt.zero_grad(set_to_none=True)
            with forbid_host_sync() as seen:
                probe.shadow(lambda: model(x).float().square().mean())
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                probe.step()
            calls += seen
            scaler.step(opt)
            scaler.update()
    assert calls == []
    report = probe.report()
    assert "hook_errors" not in report.metadata.extra
    assert report.trace.steps == (0, 3)
    assert len(report.history) == 6 and report.history.scale == (65536.0, 65536.0, 131072.0, 131072.0,
                                                                   262144.0, 262144.0)
    assert all(g is not None and g > 0 for g in report.history.grad_max)
    assert report.shadow is not None and report.shadow.trace.steps == (0, 3)


def test_a_syncing_history_read_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard sees a sync in the per-step history's end-of-backward read."""
    real = torch._foreach_norm

    def syncing(tensors, *args, **kwargs):
        tensors[0].abs().amax().item()
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr("fp16probe.capture.history.torch._foreach_norm", syncing)
    torch.manual_seed(0)
    model = _Net()
    with Probe(model, every=2) as probe, pytest.warns(RuntimeWarning, match="hook failed"):
        calls = _probed_steps(model, torch.randn(2, 3, 4, 4), probe, 2, guard=True)
    assert "item" in calls


def test_no_sync_with_gradient_accumulation_and_a_watched_loss() -> None:
    """Micro-batches: later walks re-hook nodes, the weight counts' maximum is folded; no sync."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 3, 4, 4)
    calls: list[str] = []
    with Probe(model) as probe:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            with forbid_host_sync() as seen:
                for _ in range(2):
                    loss = model(x).square().mean() * 2.0
                    probe.watch(loss)
                    loss.backward()
                probe.step()
            calls += seen
    assert calls == []
    report = probe.report()
    assert "hook_errors" not in report.metadata.extra
    assert len(report.trace.ceiling) == 3 and all(c > 0 for c in report.trace.ceiling)


def test_forward_headroom_capture_and_the_forward_audit_never_sync() -> None:
    """The Probe's per-module forward maxima (on by default) and the profile's ForwardAudit stay on the device."""
    from fp16probe.capture.forward import ForwardAudit

    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(2, 3, 4, 4)
    with Probe(model, forward=True) as probe:
        calls = _probed_steps(model, x, probe, 3, guard=True)
    assert calls == []
    forward = probe.report().forward
    assert forward.module_max and len(forward.step_max) == 3 and all(v > 0 for v in forward.step_max)
    audit = ForwardAudit(model)
    for step in range(2):
        with forbid_host_sync() as seen, audit.step(step):
            loss = model(x).square().mean()
            audit.note_loss(loss)
        loss.backward()
        assert seen == []
    assert audit.result()["tensors"]


def test_a_syncing_forward_capture_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard sees a sync in the forward capture, so the test above covers it."""
    from fp16probe.capture import recorder

    real = recorder.Recorder.note_max

    def syncing(self, channel, value):
        value.item()
        return real(self, channel, value)

    monkeypatch.setattr(recorder.Recorder, "note_max", syncing)
    torch.manual_seed(0)
    model = _Net()
    with Probe(model, forward=True, activation_grads=False, weight_grads=False) as probe, \
            pytest.warns(RuntimeWarning, match="hook failed"):
        calls = _probed_steps(model, torch.randn(2, 3, 4, 4), probe, 1, guard=True)
    assert "item" in calls


def test_a_syncing_ceiling_hook_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard sees a sync in the ceiling's node hooks, so the test above covers them."""
    real = torch.aminmax

    def syncing(x, *args, **kwargs):
        x.abs().amax().item()
        return real(x, *args, **kwargs)

    monkeypatch.setattr("fp16probe.capture.ceiling.torch.aminmax", syncing)
    torch.manual_seed(0)
    model = _Net()
    with Probe(model) as probe, pytest.warns(RuntimeWarning, match="hook failed"):
        calls = _probed_steps(model, torch.randn(2, 3, 4, 4), probe, 1, guard=True)
    assert "item" in calls


def test_a_syncing_hook_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard must see a sync in the engine, or the test above proves nothing."""
    real = histogram_module.count_into

    def syncing(x: torch.Tensor, *args, **kwargs):
        x.abs().amax().item()
        return real(x, *args, **kwargs)

    monkeypatch.setattr(histogram_module, "count_into", syncing)
    torch.manual_seed(0)
    model = _Net()
    with Probe(model) as probe, pytest.warns(RuntimeWarning, match="hook failed"):
        calls = _probed_steps(model, torch.randn(2, 3, 4, 4), probe, 1, guard=True)
    assert "item" in calls


def test_guard_lets_user_code_sync() -> None:
    with forbid_host_sync() as calls:
        assert torch.ones(()).item() == 1.0
        assert bool(torch.ones(()))
    assert calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_probed_steps_under_sync_debug_error() -> None:
    torch.manual_seed(0)
    model = _Net().cuda()
    x = torch.randn(2, 3, 4, 4, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    with Probe(model, scaler=scaler) as probe:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                probe.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            scaler.step(opt)  # GradScaler's own inf check syncs, by design: outside the guard
            scaler.update()
    report = probe.report()
    assert "hook_errors" not in report.metadata.extra
    assert report.histogram("activation_grad").total > 0


def _step_max(trace, kind: str) -> tuple[float, ...]:
    """The largest finite magnitude of ``kind`` per step."""
    return tuple(h.max_abs for h in trace.histograms.get(kind, ()))
