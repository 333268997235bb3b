"""Signals at random moments to a real process: nothing collected is lost, and the exit code says which signal.

Each trial forks the warm test process (tests/fixtures/signal_runs.py) to run ``fp16probe
profile`` on a tiny model for many steps, and sends it real signals at a random moment:
two SIGINTs 10-300 ms apart (a user pressing Ctrl-C twice), SIGHUP (a closed terminal),
or SIGTERM then SIGINT. 20 trials each. Whatever the moment, the process ends with the
first signal's code (or 0 when the run was over before it), one line on stderr when it
stopped before any report, and otherwise a report that ``fp16probe show`` reads; when a
step had finished, a report is always written. A SIGTERM or SIGHUP in the few milliseconds
before the command takes over its signals (typer still parsing) has its default effect.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from fp16probe.cli import EXIT_HANGUP, EXIT_INTERRUPTED, EXIT_TERMINATED
from fp16probe.report import Report
from tests.fixtures.cli import FIXTURES, prepare_cli_env, run
from tests.fixtures.signal_runs import fork_cli

TRIALS = 20
ARGS = ["profile", "cli_models:TinyMLP", "--batches", "signal_runs:steps_batches", "--loss", "cli_models:mse_loss",
        "--steps", "150", "--out", "r.json"]
FIRST_SIGNAL_WITHIN_S = 0.8  # a warm run of ARGS takes about 0.5-1 s here: before, during and after the loop
CONCURRENT = 4


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)


def _warm(tmp_path: Path) -> None:
    """Run ARGS once in this process, so a forked child starts with everything imported and compiled."""
    result = run(*ARGS[:-1], tmp_path / "warm.json")
    assert result.exit_code == 0, result.output


def _trials(tmp_path: Path, signals: tuple[int, ...], gap_ms: tuple[int, int]) -> list[tuple[Path, int]]:
    """Run TRIALS forked CLIs, CONCURRENT at a time; send each ``signals`` (the first at a random moment,
    each next one ``gap_ms`` later); return each trial's folder and exit status."""
    rng = random.Random(22)
    outcomes: list[tuple[Path, int]] = []
    for start in range(0, TRIALS, CONCURRENT):
        batch = []
        for i in range(start, min(start + CONCURRENT, TRIALS)):
            where = tmp_path / f"trial{i}"
            where.mkdir()
            plan = [rng.uniform(0.0, FIRST_SIGNAL_WITHIN_S)]
            for _ in signals[1:]:
                plan.append(plan[-1] + rng.uniform(*gap_ms) / 1000)
            batch.append((where, fork_cli(ARGS, where), time.monotonic(), plan))
        pending = [(where, pid, t0, when, sig) for where, pid, t0, plan in batch for when, sig in zip(plan, signals)]
        for where, pid, t0, when, sig in sorted(pending, key=lambda p: p[2] + p[3]):
            delay = t0 + when - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # the run was over before this signal
        for where, pid, _, _ in batch:
            _, status = os.waitpid(pid, 0)
            outcomes.append((where, os.waitstatus_to_exitcode(status)))
    return outcomes


def _check(outcomes: list[tuple[Path, int]], codes: tuple[int, ...], first: int) -> dict[str, int]:
    """Every trial ended cleanly with one of ``codes``; count how (before the first step, partial, whole)."""
    seen = {"before the first step": 0, "partial": 0, "whole": 0}
    for where, status in outcomes:
        output = (where / "output.txt").read_text()
        assert "Traceback" not in output, output
        report_file = where / "r.json"
        if status == -first:  # before the command took over its signals: their default action, nothing lost
            assert not report_file.exists() and not (where / "step1_done").exists(), where.name
            seen["before the first step"] += 1
            continue
        assert status in (*codes, 0), (where.name, status, output[-2000:])
        if not report_file.exists():
            assert status in codes, output
            assert not (where / "step1_done").exists(), f"{where.name}: a step had finished, yet no report:\n{output}"
            errors = [ln for ln in output.splitlines() if ln.strip()]
            assert len(errors) == 1 and errors[0].startswith("error: "), output  # before the loop: "interrupted"
            seen["before the first step"] += 1
            continue
        report = Report.load(report_file)
        shown = run("show", report_file)
        assert shown.exit_code == 0, shown.output
        if report.metadata.partial:
            assert status in codes
            seen["partial"] += 1
        else:
            seen["whole"] += 1
    return seen


@pytest.mark.slow
# SIGTERM then SIGINT: when both arrive while Python is inside one C call (a loaded machine),
# CPython runs their handlers in signal-number order, SIGINT first: either code is the first seen.
@pytest.mark.parametrize("signals,gap_ms,codes", [
    ((signal.SIGINT, signal.SIGINT), (10, 300), (EXIT_INTERRUPTED,)),
    ((signal.SIGHUP,), (0, 0), (EXIT_HANGUP,)),
    ((signal.SIGTERM, signal.SIGINT), (10, 300), (EXIT_TERMINATED, EXIT_INTERRUPTED)),
], ids=["two-sigints", "sighup", "sigterm-then-sigint"])
def test_signals_at_random_moments_lose_nothing(signals, gap_ms, codes, tmp_path):
    _warm(tmp_path)
    seen = _check(_trials(tmp_path, signals, gap_ms), codes, signals[0])
    assert seen["partial"] >= 1, seen  # the random moments did land inside the loop
    print(seen)


def test_a_second_sigint_while_the_partial_report_is_made_does_not_abort_it(tmp_path, monkeypatch):
    """Deterministic: the second SIGINT arrives while the report is being analysed."""
    import fp16probe.running.profile as running_profile

    real = running_profile.conclude

    def conclude_under_fire(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, in the middle of the write path
        return real(*args, **kwargs)

    monkeypatch.setattr(running_profile, "conclude", conclude_under_fire)
    monkeypatch.syspath_prepend(str(FIXTURES))
    result = run("profile", "cli_models:TinyMLP", "--batches", "cli_models:interrupting_batches",
                 "--loss", "cli_models:mse_loss", "--steps", "5", "--out", "r.json")
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    report = Report.load("r.json")
    assert report.metadata.partial and report.metadata.steps_seen == 3
    assert report.workload.stopped == "interrupted"


def test_a_signal_after_the_loop_still_writes_the_whole_report_then_exits_with_its_code(monkeypatch):
    import fp16probe.running.profile as running_profile

    real = running_profile.conclude

    def conclude_under_fire(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(running_profile, "conclude", conclude_under_fire)
    result = run("profile", "cli_models:TinyMLP", "--batches", "cli_models:tiny_batches",
                 "--loss", "cli_models:mse_loss", "--steps", "3", "--out", "r.json")
    assert result.exit_code == EXIT_TERMINATED, result.output
    report = Report.load("r.json")
    assert not report.metadata.partial and report.metadata.steps_seen == 3


def test_ctrl_c_during_verify_stops_it_and_keeps_the_report(monkeypatch):
    """--verify can run as long as the profile: a Ctrl-C there stops it, and the profile's report is kept."""
    import fp16probe.running.verify as running_verify

    def verify_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # the shield is armed again: this raises here
        time.sleep(5)
        pytest.fail("the Ctrl-C did not stop the verification")

    monkeypatch.setattr(running_verify, "verify", verify_interrupted)
    result = run("profile", "cli_models:TinyMLP", "--batches", "cli_models:tiny_batches",
                 "--loss", "cli_models:mse_loss", "--steps", "3", "--verify", "--out", "r.json")
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    report = Report.load("r.json")
    assert not report.metadata.partial and report.verification is None
    assert report.workload.verification_stopped == "interrupted"


# -- a stop after the last step: the analysis, the emulated step ------------------------------------------------


def _tiny_profile_args(steps: int = 3):
    from torch import nn

    import cli_models  # tests/fixtures, on the path by the autouse fixture

    return cli_models.TinyMLP(), list(cli_models.tiny_batches())[:steps], lambda out, b: nn.functional.mse_loss(
        out, b[1])


def _profiled(model, batches, loss):
    """fp16probe.profile() for 3 steps; a KeyboardInterrupt out of it fails the test (it does not end the session)."""
    import fp16probe

    try:
        return fp16probe.profile(model, batches, loss, steps=3)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C after the last step escaped profile(): the finished steps' report was lost")


@pytest.mark.parametrize("forwards_before_signal", [None, 0, 1, 3],
                         ids=["during-analysis", "emulation-start", "emulated-forward-1", "emulated-forward-3"])
def test_ctrl_c_after_the_last_step_of_profile_returns_the_finished_steps(forwards_before_signal, monkeypatch):
    """A real SIGINT to this process after the loop: profile() returns the 3 steps' report, no emulated forward
    begins after it, and the report says the emulation pass was stopped. Before, the shield ended with the loop
    and the KeyboardInterrupt lost the report."""
    import fp16probe.capture.emulate as emulate
    import fp16probe.running.profile as running_profile

    model, batches, loss = _tiny_profile_args()
    forwards = {"after_loop": 0, "after_signal": 0}
    sent: list[bool] = []

    def send() -> None:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)

    real_conclude, real_measure = running_profile.conclude, emulate.measure_effect

    def conclude(*args, **kwargs):
        if forwards_before_signal is None:
            send()
        return real_conclude(*args, **kwargs)

    def measure(*args, **kwargs):
        forwards["in_emulation"] = True
        return real_measure(*args, **kwargs)

    def count_forward(module, args):
        if not forwards.get("in_emulation"):
            return
        if sent:
            forwards["after_signal"] += 1
        if forwards_before_signal is not None and forwards["after_loop"] == forwards_before_signal and not sent:
            send()
            # the handler runs here, at the next bytecode: nothing of this forward runs after it
        forwards["after_loop"] += 1

    monkeypatch.setattr(running_profile, "conclude", conclude)
    monkeypatch.setattr(emulate, "measure_effect", measure)
    model.register_forward_pre_hook(count_forward)
    report = _profiled(model, batches, loss)
    assert sent, "the signal was never sent"
    assert report is not None and report.metadata.steps_seen == 3 and not report.metadata.partial
    assert report.section("emulation").error == "stopped: interrupted"
    assert forwards["after_signal"] == 0, forwards
    assert report.recommendation is not None  # the histogram verdict, not judged by an emulation that did not run
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_inside_the_emulated_step_puts_the_training_state_back(monkeypatch):
    """The emulated step is stopped by the signal in its middle; the model's .grad and buffers are as they were."""
    import torch
    from torch import nn

    import fp16probe.capture.emulate as emulate

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    batches = [(torch.randn(5, 8), torch.randn(5, 4)) for _ in range(3)]
    real_measure = emulate.measure_effect
    seen: dict[str, object] = {}

    def measure(model_, runs, **kwargs):
        seen["grads"] = [p.grad for p in model_.parameters()]
        seen["buffers"] = [b.clone() for b in model_.buffers()]

        def interrupted_run():
            loss = runs[0]()
            os.kill(os.getpid(), signal.SIGINT)  # mid-step: after the forward, before the backward
            return loss

        return real_measure(model_, [interrupted_run, *runs[1:]], **kwargs)

    monkeypatch.setattr(emulate, "measure_effect", measure)
    report = _profiled(model, batches, lambda out, b: nn.functional.mse_loss(out, b[1]))
    assert report.section("emulation").error == "stopped: interrupted"
    assert all(a is b for a, b in zip(seen["grads"], [p.grad for p in model.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(seen["buffers"], model.buffers()))


SLOW_ARGS = ["profile", "signal_runs:SlowMLP", "--batches", "cli_models:tiny_batches", "--loss", "cli_models:mse_loss",
             "--steps", "2", "--out", "r.json"]
LOOP_FORWARDS = 2  # one a step; the emulation pass's come after


@pytest.mark.slow
def test_sigterm_after_the_last_step_stops_the_emulation_at_once_and_writes_the_report(tmp_path):
    """A forked CLI on a model of 0.3 s forwards gets SIGTERM at 6 moments after its loop's last forward began
    (0.4-1.4 s: the end of the last step, the analysis, the emulated steps). Each exits 143 with its report written
    and its emulation marked stopped, and no forward begins after the signal. Before, the emulation ran to its
    end (4 more forwards), then the process exited."""
    run(*SLOW_ARGS)  # warm: the forked children start with everything imported
    whole = [float(t) for t in Path("forwards.txt").read_text().split()]
    assert len(whole) > LOOP_FORWARDS + 2, "the emulation pass ran no forwards: nothing to stop"
    delays = [0.4, 0.6, 0.8, 1.0, 1.2, 1.4]
    whole_steps = 0
    for i, delay in enumerate(delays):
        where = tmp_path / f"trial{i}"
        where.mkdir()
        pid = fork_cli(SLOW_ARGS, where)
        starts = where / "forwards.txt"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not starts.exists() or
                                               len(starts.read_text().split()) < LOOP_FORWARDS):
            time.sleep(0.01)
        time.sleep(delay)
        signalled = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        took = time.monotonic() - signalled
        output = (where / "output.txt").read_text()
        began = [float(t) for t in starts.read_text().split()]
        late = [t - signalled for t in began if t > signalled + 0.05]  # a forward already under way may log late
        assert os.waitstatus_to_exitcode(status) == EXIT_TERMINATED, (delay, output[-2000:])
        assert not late, (delay, late)
        report = Report.load(where / "r.json")
        # a loaded machine can still be in the last step at the signal: a partial report of the first, as before
        assert report.metadata.steps_seen in (LOOP_FORWARDS - 1, LOOP_FORWARDS), (delay, output[-2000:])
        whole_steps += report.metadata.steps_seen == LOOP_FORWARDS
        emulation = report.section("emulation")
        assert emulation is not None and emulation.error == "stopped: terminated", (delay, emulation)
        print(f"delay {delay} s: exit {took:.2f} s after SIGTERM, {len(began)} forwards")
    assert whole_steps >= 3, whole_steps  # most signals did land after the loop
