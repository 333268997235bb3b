"""The Hugging Face callback: real Trainer steps on a tiny GPT-2, and GradScaler handling.

Trainer fp16 is not runnable on the CPU (accelerate makes no GradScaler there), so the
scaler path is checked at unit level: the callback's hooks driven by hand around a real
torch.amp.GradScaler("cpu"), against an unscaled run of the same steps.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("fp16probe.analysis.recommend", reason="the analyzer writes the recommendation")

from fp16probe import Fp16ProbeError, Report  # noqa: E402
from fp16probe.integrations import RECOMMENDATION_NAME, REPORT_NAME  # noqa: E402
from fp16probe.integrations.huggingface import Fp16ProbeCallback, trainer_scaler  # noqa: E402


def _tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config)


class _Data(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _trainer(tmp_path, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=kw.pop("max_steps", 3), per_device_train_batch_size=2,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, **kw,
    )
    return transformers.Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Data())


@pytest.mark.slow
def test_real_trainer_run_writes_report_and_recommendation(tmp_path):
    trainer = _trainer(tmp_path, max_steps=4)
    callback = Fp16ProbeCallback(every=2).attach(trainer)
    callback.attach(trainer)  # attaching twice adds it once
    assert sum(cb is callback for cb in trainer.callback_handler.callbacks) == 1
    trainer.train()
    report = Report.load(tmp_path / REPORT_NAME)
    assert report.recommendation is not None and report.recommendation == callback.report.recommendation
    assert (tmp_path / RECOMMENDATION_NAME).read_text().strip()
    assert report.metadata.steps_total == 4 and report.metadata.steps_seen == 2
    assert report.workload.trainer == "transformers" and report.workload.global_step == 4
    assert "transformer.h.0.attn.c_attn" in {m.name for m in report.modules_of("activation_grad")}
    assert report.histogram("activation_grad").nonzero_finite > 0
    weights = report.module("transformer.h.1.mlp.c_fc.weight", "weight_grad").histogram
    assert weights.total == 2 * 32 * 128  # two sampled steps of a 32x128 weight
    assert trainer_scaler(trainer) is None  # fp32 on the CPU: accelerate made no scaler
    assert hasattr(trainer.accelerator, "scaler")  # ...but this is where it keeps one


@pytest.mark.parametrize("via", ["optimizer", "trainer"])
def test_callback_unscales_with_a_real_grad_scaler(tmp_path, via):
    """Drive the callback's hooks as the Trainer does, loss scaled by a real GradScaler.

    ``via="optimizer"`` is ``Trainer(callbacks=[Fp16ProbeCallback()])``: no attach(), the scaler
    found on the optimizer every event receives, as accelerate's AcceleratedOptimizer carries it.
    """
    data = _Data()

    def run(scaler):
        model = _tiny_gpt2()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        args = types.SimpleNamespace(fp16=scaler is not None, output_dir=str(tmp_path), gradient_accumulation_steps=1)
        state = types.SimpleNamespace(global_step=0, is_world_process_zero=True)
        if via == "trainer":
            cb = Fp16ProbeCallback(trainer=types.SimpleNamespace(accelerator=types.SimpleNamespace(scaler=scaler)))
            cb.on_train_begin(args, state, None, model=model, optimizer=opt)
        else:
            cb = Fp16ProbeCallback()
            wrapped = types.SimpleNamespace(optimizer=opt, scaler=scaler)  # what accelerate hands the events
            cb.on_train_begin(args, state, None, model=model, optimizer=wrapped)
        for step in range(2):
            batch = {k: v[None] for k, v in data[step].items()}
            loss = model(**batch).loss
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            state.global_step += 1
            cb.on_step_end(args, state, None)
        probe = cb.probe
        cb.on_train_end(args, state, None)
        assert cb.probe is None and not probe.active
        return cb.report

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaled, plain = run(scaler), run(None)
    assert scaled.metadata.grad_scaler and scaled.trace.scale == (2.0**12, 2.0**12)
    assert scaled.workload.loss_scaled is True and not plain.workload.loss_scaled
    assert scaled.workload.grad_scaler_found_at == f"{via}.scaler" if via == "optimizer" else (
        scaled.workload.grad_scaler_found_at == "trainer.accelerator.scaler")
    assert scaled.workload.training_arguments == {"fp16": True, "gradient_accumulation_steps": 1}
    for kind in ("activation_grad", "weight_grad"):
        # a power-of-two scale and its reciprocal are exact: unscaled equals never scaled
        assert scaled.histogram(kind) == plain.histogram(kind)


def test_fp16_without_the_trainer_is_refused_and_missing_framework_is_explained(monkeypatch):
    cb = Fp16ProbeCallback()
    args = types.SimpleNamespace(fp16=True, output_dir=".")
    with pytest.raises(Fp16ProbeError, match=r"found no GradScaler.*SGD.*Fp16ProbeCallback\(scaler=...\)"):
        cb.on_train_begin(args, None, None, model=_tiny_gpt2(),
                          optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    from fp16probe.integrations import require

    with pytest.raises(Fp16ProbeError, match=r"pip install 'fp16probe\[hf\]'"):
        require("transformers_not_installed_here", "hf", "fp16probe.integrations.huggingface")


@pytest.mark.slow
def test_fp16_trainer_on_a_cpu_runs_with_the_callback_in_callbacks(tmp_path):
    """Trainer(fp16=True, callbacks=[Fp16ProbeCallback()]) on a CPU: accelerate scales no loss there, so it works.

    Before, it was refused with an error asking for attach(trainer).
    """
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True, fp16=True,
    )
    callback = Fp16ProbeCallback()
    trainer = transformers.Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Data(), callbacks=[callback])
    trainer.train()
    report = Report.load(tmp_path / REPORT_NAME)
    assert REPORT_NAME == "fp16probe-report.json"  # the command line's default name too
    assert report.metadata.steps_seen == 2 and report.workload.loss_scaled is False
    assert not report.metadata.grad_scaler
    recorded = report.workload.training_arguments
    assert recorded["fp16"] is True and recorded["bf16"] is False and recorded["gradient_accumulation_steps"] == 2
    assert report.histogram("activation_grad").nonzero_finite > 0
    # the run was fp32 whatever the arguments said, and the report says so beside its advice
    assert report.metadata.precision == "fp32"
    assert any("TrainingArguments(fp16=True) had no effect" in n for n in report.workload.notes)
