"""``kept_training_state``: a step run inside it leaves buffers, random state and ``.grad`` as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp16probe.capture.state import kept_training_state


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    model(torch.randn(16, 4)).sum().backward()  # a step of the user's own: .grad on every parameter...
    model[4].bias.grad = None  # ...but one
    return model


def _step(model: nn.Module) -> None:
    """A training step of the package's own: BatchNorm's statistics move, dropout draws, backward writes .grad."""
    model(torch.randn(16, 4)).square().mean().backward()


class _Stop(Exception):
    pass


def _run(model: nn.Module, raised: type[BaseException] | None) -> dict[str, torch.Tensor | None]:
    """Step inside the manager (raising ``raised`` at the end when given); return the step's gradients."""
    seen: dict[str, torch.Tensor | None] = {}

    def step() -> None:
        with kept_training_state(model):
            assert all(p.grad is None for p in model.parameters())  # the step starts from no gradients
            _step(model)
            seen.update((n, p.grad) for n, p in model.named_parameters())
            if raised is not None:
                raise raised()

    if raised is None:
        step()
    else:
        with pytest.raises(raised):
            step()
    return seen


@pytest.mark.parametrize("raised", [None, _Stop, KeyboardInterrupt], ids=["normal", "exception", "interrupt"])
def test_buffers_rng_and_grads_are_as_they_were(raised: type[BaseException] | None) -> None:
    model = _model()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    grads = {n: p.grad for n, p in model.named_parameters()}
    rng = torch.get_rng_state()

    seen = _run(model, raised)

    # the step did change each of them, so the checks below are not vacuous
    assert all(seen[n] is not None and seen[n] is not grads[n] for n in grads)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    after = torch.rand(8)
    torch.set_rng_state(rng)
    assert torch.equal(after, torch.rand(8))


def test_the_step_changes_what_the_manager_puts_back() -> None:
    """Without the manager the same step moves the buffers, the random state and ``.grad``: what the test above guards."""
    model = _model()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    _step(model)
    assert not any(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(p.grad is not None and (grads[n] is None or not torch.equal(p.grad, grads[n]))
               for n, p in model.named_parameters())
    assert not torch.equal(torch.get_rng_state(), rng)


def test_same_dropout_masks_after_the_step() -> None:
    """The user's next step draws the dropout masks it would have drawn without the extra step."""
    model = _model()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 4)
    rng = torch.get_rng_state()
    with kept_training_state(model):
        _step(model)
    after = model(x)
    torch.set_rng_state(rng)
    assert torch.equal(after, twin(x))


class _Cache(nn.Module):
    """Rebuilds its buffer in forward (as rotary-embedding caches do when a longer sequence comes)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.table = torch.arange(float(x.shape[-1]))  # a new tensor under the buffer's name
        return x * self.table


def test_a_buffer_the_step_replaced_is_put_back_with_its_values() -> None:
    model = _Cache()
    table = model.table
    with kept_training_state(model):
        model(torch.ones(2, 6))
        assert model.table is not table
    assert model.table is table and torch.equal(table, torch.arange(4.0))
    assert dict(model.named_buffers()) == {"table": table}


def test_a_frozen_parameter_is_left_alone() -> None:
    model = _model()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    kept = frozen.grad
    with kept_training_state(model):
        assert frozen.grad is kept  # not trainable: not cleared, not the step's
        _step(model)
    assert frozen.grad is kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_buffers_and_random_state_are_as_they_were() -> None:
    model = _model().cuda()
    torch.rand(1, device="cuda")  # CUDA initialised
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    rng = torch.cuda.get_rng_state()
    with kept_training_state(model):
        model(torch.randn(16, 4, device="cuda")).square().mean().backward()
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    after = torch.rand(8, device="cuda")
    torch.cuda.set_rng_state(rng)
    assert torch.equal(after, torch.rand(8, device="cuda"))


def _kept(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None], torch.Tensor]:
    return ({n: b.clone() for n, b in model.named_buffers()}, {n: p.grad for n, p in model.named_parameters()},
            torch.get_rng_state())


def _assert_as_before(model: nn.Module, kept: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None],
                                                     torch.Tensor]) -> None:
    buffers, grads, rng = kept
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
    after = torch.rand(8)
    torch.set_rng_state(rng)
    assert torch.equal(after, torch.rand(8))


@pytest.mark.parametrize("step", ["reference", "emulated"])
def test_the_emulated_and_the_reference_step_keep_the_training_state(step: str) -> None:
    from fp16probe.capture.emulate import emulated_step, reference_step

    model = _model()
    x = torch.randn(16, 4)
    kept = _kept(model)
    got = (reference_step(model, lambda: model(x).square().mean()) if step == "reference" else
           emulated_step(model, lambda: model(x).square().mean(), target="cpu", scale=2.0**8))
    assert all(g is not None for g in got.grads.values())  # the step's own gradients, read inside the block
    _assert_as_before(model, kept)


def test_a_failing_emulated_step_keeps_the_training_state() -> None:
    from fp16probe.capture.emulate import emulated_step

    model = _model()
    kept = _kept(model)

    def run() -> torch.Tensor:
        model(torch.randn(16, 4)).sum().backward()
        raise _Stop()

    with pytest.raises(_Stop):
        emulated_step(model, run, target="cpu")
    _assert_as_before(model, kept)


def test_a_shadow_rerun_keeps_the_training_state() -> None:
    from fp16probe import Probe

    model = _model()
    x = torch.randn(16, 4)
    with Probe(model, scaler=torch.amp.GradScaler("cpu"), shadow_every=1) as probe:
        kept = _kept(model)
        assert probe.shadow(lambda: model(x).float().square().mean())
        _assert_as_before(model, kept)


def test_a_stop_signal_while_the_state_is_put_back_puts_all_of_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing in the middle of putting back (here as the random state is set) does not cut it short:
    the buffers after that point are put back too, then the interrupt goes on."""
    model = _model()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    real = torch.set_rng_state
    calls: list[int] = []

    def interrupted_once(state: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(state)

    monkeypatch.setattr(torch, "set_rng_state", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        with kept_training_state(model):
            _step(model)
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert all(p.grad is grads[n] for n, p in model.named_parameters())
