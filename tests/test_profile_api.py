"""fp16probe.profile() called from Python: the one path, its partial reports and its errors."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe import InputError, ModelError, Probe, profile
from fp16probe.running.demo import DemoNet, demo_batches, demo_loss
from fp16probe.running.inputs import make_batches
from fp16probe.running.loading import LoadedModel
from fp16probe.running.profile import Terminated

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import faulty_models  # noqa: E402


def tiny_batches(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def mse(output, batch):
    return nn.functional.mse_loss(output, batch[1])


def test_profile_is_exported_and_returns_an_analysed_report():
    report = fp16probe.profile(nn.Linear(8, 4), tiny_batches(), mse, steps=3)
    assert report.metadata.steps_seen == 3 and not report.metadata.partial
    assert report.recommendation is not None and report.recommendation.log2_scale is not None
    assert report.workload.loss == "mse" and report.workload.loss_synthetic is False
    assert report.workload.steps_requested == 3


def test_profile_counts_what_a_hand_written_probe_loop_counts():
    """The one path adds nothing to, and loses nothing of, what the Probe records."""
    got = profile(DemoNet(), demo_batches(), demo_loss, steps=2)
    # The same batches and model, by hand:
    model, batches = DemoNet(), demo_batches()
    with Probe(model) as probe:
        for _ in range(2):
            batch = next(batches)
            demo_loss(model(batch[0]), batch).backward()
            model.zero_grad(set_to_none=True)
            probe.step()
    want = probe.report()
    for kind in ("activation_grad", "weight_grad"):
        assert got.histogram(kind).counts == want.histogram(kind).counts


def test_default_loss_is_marked_synthetic():
    report = profile(nn.Linear(8, 4), [torch.randn(5, 8) for _ in range(2)], steps=2)
    assert report.workload.loss_synthetic is True


def test_fewer_batches_than_steps_end_the_run_with_a_note():
    report = profile(nn.Linear(8, 4), tiny_batches(2), mse, steps=5)
    assert report.metadata.steps_seen == 2
    assert any("ran out after 2" in n for n in report.workload.notes)


def test_no_batch_at_all_is_an_input_error():
    with pytest.raises(InputError, match="yielded no batch"):
        profile(nn.Linear(8, 4), [], mse, steps=2)


# -- Ctrl-C and SIGTERM: a partial report of the steps finished ------------------------


def interrupting(n_good: int, exc: type[BaseException] = KeyboardInterrupt):
    yield from tiny_batches(n_good)
    raise exc()


def test_ctrl_c_returns_a_partial_report():
    report = profile(nn.Linear(8, 4), interrupting(2), mse, steps=5)
    assert report.metadata.partial and report.metadata.steps_seen == 2
    assert report.workload.stopped == "interrupted"
    assert report.recommendation is not None


def test_ctrl_c_before_the_first_step_propagates():
    with pytest.raises(KeyboardInterrupt):
        profile(nn.Linear(8, 4), interrupting(0), mse, steps=5)


def test_sigterm_is_handled_like_ctrl_c_and_the_handler_is_restored():
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    report = profile(faulty_models.FailsAtStep(at=99), faulty_models.sigterm_batches(), mse, steps=5)
    assert report.metadata.partial and report.metadata.steps_seen == 2
    assert report.workload.stopped == "terminated"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sigterm_before_the_first_step_raises_terminated():
    with pytest.raises(Terminated):
        profile(nn.Linear(8, 4), interrupting(0, Terminated), mse, steps=5)


# -- failures of user code: the real cause, the step, the steps before it kept ----------


def test_model_error_at_step_3_keeps_the_two_good_steps():
    with pytest.raises(ModelError, match=r"step 3: the forward raised RuntimeError: the model broke on purpose") as e:
        profile(faulty_models.FailsAtStep(3), tiny_batches(), mse, steps=5)
    assert e.value.report is not None
    assert e.value.report.metadata.partial and e.value.report.metadata.steps_seen == 2
    assert e.value.report.workload.stopped == "error"
    assert "step 3" in e.value.report.workload.error


def test_key_error_in_forward_is_the_models_not_the_inputs():
    with pytest.raises(ModelError, match=r"step 1: the forward raised KeyError: 'gain'"):
        profile(faulty_models.KeyErrorModel(), tiny_batches(), mse, steps=2)


def test_exception_in_backward_is_the_models():
    with pytest.raises(ModelError, match=r"step 1: the backward raised ValueError: backward broke on purpose"):
        profile(faulty_models.BackwardFails(), tiny_batches(), mse, steps=2)


def test_a_shape_error_after_good_steps_is_not_blamed_on_the_input():
    error = RuntimeError("mat1 and mat2 shapes cannot be multiplied (5x8 and 7x4)")
    with pytest.raises(ModelError, match="step 2: the forward raised RuntimeError: mat1"):
        profile(faulty_models.FailsAtStep(2, error), tiny_batches(), mse, steps=3)


def test_a_first_batch_that_does_not_fit_is_the_inputs():
    with pytest.raises(InputError, match="rejected the input"):
        profile(nn.Linear(7, 4), tiny_batches(), mse, steps=2)


def test_failing_batches_mid_run_keep_the_steps_before():
    with pytest.raises(InputError, match=r"step 3: the batches raised OSError: the data file vanished") as e:
        profile(nn.Linear(8, 4), faulty_models.failing_batches(), mse, steps=5)
    assert e.value.report.metadata.steps_seen == 2


def test_system_exit_in_forward_is_a_model_error_not_an_exit():
    with pytest.raises(ModelError, match=r"step 2: the forward called sys.exit\(0\)") as e:
        profile(faulty_models.exiting_model(), tiny_batches(), mse, steps=3)
    assert e.value.report.metadata.steps_seen == 1


def test_a_model_on_the_meta_device_is_refused_before_the_run():
    with pytest.raises(ModelError, match="meta device"):
        profile(faulty_models.meta_model(), tiny_batches(), mse, steps=2)


# -- settings refused before the run, naming the parameter -----------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"precision": "fp16", "scaler": math.inf}, r"scaler=inf"),
    ({"precision": "fp16", "scaler": -2.0}, r"scaler=-2"),
    ({"scaler": 1024.0}, r"scaler= applies to fp16 and bf16 runs"),
    ({"lr": math.nan, "optimizer": "sgd"}, r"lr=nan"),
    ({"lr": -1.0, "optimizer": "sgd"}, r"lr=-1"),
    ({"steps": 0}, r"steps=0"),
    ({"precision": "fp8"}, r"precision='fp8'"),
    ({"optimizer": "lion"}, r"optimizer='lion'"),
    ({"modules": ["nomatch*"]}, r"modules=\['nomatch\*'\]: no module name matches"),
])
def test_bad_settings_are_refused_before_the_run(kwargs, match):
    model = faulty_models.FailsAtStep(at=1)  # would raise if it ever ran
    with pytest.raises(InputError, match=match):
        profile(model, tiny_batches(), mse, **kwargs)
    assert model.calls == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"input_shape": "100000,100000"}, r"input_shape=100000,100000: one batch of 1e\+10 float32 values needs 37.3 GiB"),
    ({"input_shape": f"{10**30},8"}, r"input_shape=1000000000000000000000000000000,8: one batch of 8e\+30"),
])
def test_synthetic_inputs_that_cannot_be_made_are_refused(kwargs, match):
    loaded = LoadedModel(nn.Linear(8, 4), "import", "test")
    with pytest.raises(InputError, match=match):
        make_batches(loaded, torch.device("cpu"), **kwargs)


def test_the_callers_optimizer_is_used_and_recorded():
    model = nn.Linear(8, 4)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    report = profile(model, tiny_batches(2), mse, steps=2, optimizer=opt)
    assert report.workload.optimizer == {"name": "sgd", "lr": 0.5}
    assert not torch.equal(model.weight, before)
    assert "weight_update_loss" in report.workload.to_dict()


# -- .grad the caller left set ---------------------------------------------------------------------


def _left_with_grads(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """A training loop's end, ``zero_grad(); backward(); step()``: .grad stays set (here large, as a scaled one is)."""
    model.zero_grad()
    mse(model(batch[0]), batch).backward()
    for p in model.parameters():
        p.grad.fill_(1000.0)
    return {n: p.grad for n, p in model.named_parameters()}


def test_grads_the_caller_left_are_set_aside_for_the_profile_and_put_back():
    """The first step's recorded weight gradients are the true ones (plain torch, same weights and batch), not
    the caller's .grad plus them (1000.27 for a true 0.273 before); the caller's .grad tensors come back as they were."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batch = tiny_batches(1)[0]
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    mse(reference(batch[0]), batch).backward()
    true = {n: p.grad.abs().max().item() for n, p in reference.named_parameters()}
    left = _left_with_grads(model, batch)

    report = profile(model, [batch], mse, steps=1)

    recorded = {f"{m.name}": m.histogram.max_abs for m in report.modules if m.kind == "weight_grad"}
    assert recorded.keys() == true.keys()
    assert all(recorded[n] == pytest.approx(true[n], rel=1e-6) for n in true), (recorded, true)
    assert all(p.grad is left[n] for n, p in model.named_parameters())
    assert all(torch.all(p.grad == 1000.0) for p in model.parameters())


def test_grads_the_caller_left_come_back_after_a_model_error_too():
    model = faulty_models.FailsAtStep(at=3)
    left = _left_with_grads(model, tiny_batches(1)[0])  # forward call 1
    with pytest.raises(ModelError) as e:
        profile(model, tiny_batches(), mse, steps=4)  # forward calls 2, 3 (raises)
    assert e.value.report is not None and e.value.report.metadata.steps_seen == 1
    assert all(p.grad is left[n] for n, p in model.named_parameters())


_FIRST_PROFILE = """
import json, os, warnings
import torch
from torch import nn
import fp16probe
env, filters = dict(os.environ), list(warnings.filters)
fp16probe.profile(nn.Linear(8, 4), [(torch.randn(5, 8), torch.randn(5, 4))] * 2,
                  lambda out, b: nn.functional.mse_loss(out, b[1]), steps=2)
print(json.dumps({"env": {k: v for k, v in os.environ.items() if env.get(k) != v},
                  "filters": [repr(f) for f in warnings.filters if f not in filters]}))
"""


@pytest.mark.slow
def test_the_first_profile_of_a_process_leaves_the_environment_and_the_warnings_filters_as_found():
    """A fresh interpreter (the first profile imports torch._dynamo and sympy): before, TORCHINDUCTOR_CACHE_DIR
    was left in os.environ and SymPy's 'once' filter in warnings.filters."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _FIRST_PROFILE], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"env": {}, "filters": []}
