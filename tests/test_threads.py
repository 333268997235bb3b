"""Patches of torch globals under threads: any interleaving of probes, fp32 reruns and profiles puts them back."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe import Probe
from fp16probe.capture.shadow import autocast_off

AUTOCAST = torch.amp.autocast_mode.autocast
ORIGINAL = (AUTOCAST.__enter__, AUTOCAST.__exit__)


def _autocast_computes_bf16() -> bool:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (a @ b).dtype == torch.bfloat16


def _assert_nothing_left_patched() -> None:
    assert (AUTOCAST.__enter__, AUTOCAST.__exit__) == ORIGINAL
    assert _autocast_computes_bf16()


def _run_all(targets) -> None:
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_two_reruns_that_overlap_without_nesting_put_autocast_back() -> None:
    """A enters, B enters, A leaves, B leaves: a save-and-restore per block left A's patch on for good."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with autocast_off():
            a_in.set()
            assert b_in.wait(10)
        a_out.set()

    def second() -> None:
        assert a_in.wait(10)
        with autocast_off():
            b_in.set()
            assert a_out.wait(10)
            # this thread's rerun still has autocast off, after the other's ended
            seen["off_in_b"] = not _autocast_computes_bf16()

    def bystander() -> None:
        assert b_in.wait(10)
        seen["bystander_bf16"] = _autocast_computes_bf16()  # another thread's training keeps its autocast

    _run_all([first, second, bystander])
    assert seen == {"off_in_b": True, "bystander_bf16": True}
    _assert_nothing_left_patched()


def _shadowed_training(seed: int) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8)
    scaler = torch.amp.GradScaler("cpu")
    with Probe(model, scaler=scaler, shadow_every=1) as probe:
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            probe.shadow(lambda: model(x).float().square().mean())
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            probe.step()
    assert probe.report().metadata.steps_seen == 4


def _profiled(seed: int) -> None:
    torch.manual_seed(seed)
    batches = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)]
    report = fp16probe.profile(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)), batches,
                               lambda out, b: nn.functional.mse_loss(out, b[1]), steps=3)
    assert report is not None and report.metadata.steps_seen == 3


@pytest.mark.parametrize("round_", range(2))
def test_probes_with_reruns_and_profiles_in_threads_leave_autocast_as_it_was(round_: int) -> None:
    _run_all([lambda: _shadowed_training(1), lambda: _shadowed_training(2),
              lambda: _profiled(3), lambda: _profiled(4)])
    _assert_nothing_left_patched()


def test_fake_dtype_answers_are_the_same_from_threads_at_once() -> None:
    """Each thread asks torch's fake kernels through a mode of its own: one shared mode failed under overlap.
    The fake calls are made one at a time: each quiets warnings with catch_warnings, which saves and puts back
    the process's one filter list, and overlapping uses left an 'ignore everything' filter behind."""
    import warnings

    from fp16probe.capture.autocast_rules import _ask_fake

    filters = list(warnings.filters)

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    answers: list[bool | None] = []

    def ask() -> None:
        for _ in range(40):
            answers.append(_ask_fake(torch.matmul, (a, b), {}, lambda t: False, "cpu", "autocast"))

    _run_all([ask] * 4)
    assert answers == [True] * 160  # CPU autocast runs matmul in fp16
    assert warnings.filters == filters
