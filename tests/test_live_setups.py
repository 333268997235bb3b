"""The live verdict in the set-ups that carry fp16 training, each against an fp32 profile (issue 31).

Each set-up trains a tiny GPT-2 for a few real fp16 steps on the CPU, set up the way it runs
on a GPU: CPU fp16 autocast and a real ``torch.amp.GradScaler("cpu")``. accelerate and the
Hugging Face Trainer are given ``native_amp=True`` and a GradScaler before ``prepare()`` (on
a CUDA device they set up exactly that; on a CPU they would run fp32). Each must give a
verdict from its fp32 reruns at the first rerun step, S within one power of two of an fp32
``fp16probe.profile`` of the same model and batches, and every rerun must have run in fp32.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fp16probe
from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.capture import shadow as shadow_mod
from fp16probe.presentation.verdict import verdict_text

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

STEPS = 3  # rerun steps 0, 1 and 2 (the early schedule)
AUTOCAST = {"device_type": "cpu", "dtype": torch.float16}


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).train()


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


@pytest.fixture(scope="module")
def fp32_scale() -> int:
    """log2 S from an fp32 fp16probe.profile of the same model and batches."""
    report = fp16probe.profile(_gpt2(), _batches(), steps=STEPS, precision="fp32", optimizer="adamw")
    rec = report.recommendation
    assert rec.verdict in ("constant", "dynamic"), verdict_text(rec)
    return rec.log2_scale


def _loop(model, forward, scaler, probe, *, outer_autocast: bool) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in _batches():
        with torch.autocast(**AUTOCAST, enabled=outer_autocast):
            loss = forward(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        probe.step()


class _EntersAutocast(nn.Module):
    """A model whose forward enters fp16 autocast itself (trained inside an autocast loop too)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        with torch.autocast(**AUTOCAST):
            return self.inner(**kw)


def _plain():
    model, scaler = _gpt2(), torch.amp.GradScaler("cpu")
    probe = Probe(model, scaler=scaler).start()
    _loop(model, model, scaler, probe, outer_autocast=True)
    return probe.report()


def _decorated_forward():
    """``model.forward = torch.autocast(...)(model.forward)``: autocast on only inside the call."""
    model, scaler = _gpt2(), torch.amp.GradScaler("cpu")
    model.forward = torch.autocast(**AUTOCAST)(model.forward)
    probe = Probe(model, scaler=scaler).start()
    _loop(model, model, scaler, probe, outer_autocast=False)
    return probe.report()


def _nested():
    model, scaler = _EntersAutocast(_gpt2()), torch.amp.GradScaler("cpu")
    probe = Probe(model, scaler=scaler).start()
    _loop(model, model, scaler, probe, outer_autocast=True)
    return probe.report()


def _fp16_accelerator():
    """A new ``Accelerator(mixed_precision="fp16")``: accelerate keeps one state per process, so an earlier
    test's Accelerator (or Trainer) with another precision is forgotten first."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return accelerate.Accelerator(mixed_precision="fp16", cpu=True)


def _accelerator():
    """``Accelerator(mixed_precision="fp16")`` as it sets up CUDA: autocast wrapped around forward, a GradScaler."""
    acc = _fp16_accelerator()
    acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    probe = Probe(model, scaler=acc.scaler).start()
    for batch in _batches():
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
        probe.step()
    return probe.report()


SETUPS = {"plain GradScaler loop": _plain, "autocast(...)(forward)": _decorated_forward,
          "model enters autocast inside an autocast loop": _nested, "Accelerator fp16": _accelerator}


def _check(report, fp32_scale: int) -> None:
    meta = report.shadow_runs
    assert report.metadata.precision == "fp16-autocast"
    assert meta.steps == (0, 1, 2) and not meta.discarded, meta
    assert report.shadow is not None and report.shadow.metadata.precision == "fp32"
    rec = analyze(report)
    assert rec.verdict in ("constant", "dynamic"), verdict_text(rec)
    assert abs(rec.log2_scale - fp32_scale) <= 1, (rec.log2_scale, fp32_scale)
    check = rec.evidence["scale_check"]  # the gradients carry the scale the scaler reports
    assert check["carried"] and abs(check["log2_ratio"]) < 0.1 and check["steps"] == [0, 1, 2], check
    # a verdict already from the first rerun step alone
    first = shadow_mod_first_step(report)
    assert analyze(first).verdict in ("constant", "dynamic")
    assert abs(analyze(first).log2_scale - fp32_scale) <= 1


def shadow_mod_first_step(report):
    """The report as it stood after step 0: its first rerun and its first live step only."""
    import dataclasses

    from fp16probe.report import Report

    def cut(r):
        t = r.trace
        trace = dataclasses.replace(
            t, steps=t.steps[:1], histograms={k: v[:1] for k, v in t.histograms.items()},
            module_max={k: {n: v[:1] for n, v in m.items()} for k, m in t.module_max.items()},
            scale=t.scale[:1], found_inf=t.found_inf[:1], ceiling=t.ceiling[:1] if t.ceiling else t.ceiling)
        return Report(r.metadata, r.modules, trace)

    first = cut(report)
    return dataclasses.replace(first, shadow=cut(report.shadow))


@pytest.mark.parametrize("setup", list(SETUPS))
def test_each_setup_gives_the_fp32_profiles_scale_from_fp32_reruns(setup, fp32_scale):
    _check(SETUPS[setup](), fp32_scale)


def test_an_accelerate_wrapped_forward_is_found():
    acc = _fp16_accelerator()
    acc.native_amp = True
    model = acc.prepare(nn.Linear(2, 2))
    found = shadow_mod.forward_autocast(model.forward)
    assert found is not None and found.fast_dtype == torch.float16
    assert shadow_mod.forward_autocast(nn.Linear(2, 2).forward) is None
    assert shadow_mod.forward_autocast(torch.autocast("cpu", enabled=False)(nn.Linear(2, 2).forward)) is None


def test_a_rerun_that_is_not_fp32_is_discarded_and_never_judged(monkeypatch):
    """Plant a rerun that runs in fp16 (the model's own autocast left on): it is discarded, named, not judged."""
    monkeypatch.setattr(shadow_mod, "autocast_off", _no_change)
    report = _nested()
    meta = report.shadow_runs
    assert meta.steps == () and report.shadow is None
    assert [d["step"] for d in meta.discarded] == [0, 1, 2]
    assert meta.discarded[0]["dtype"] == "float16"
    rec = analyze(report)
    assert rec.verdict == "insufficient_evidence"
    assert "discarded" in verdict_text(rec) and "float16" in verdict_text(rec)


class _no_change:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Data(torch.utils.data.Dataset):
    """The same batches as _batches(), one row at a time (batch size 4, no shuffling)."""

    def __init__(self) -> None:
        self.rows = [{k: v[i] for k, v in b.items()} for b in _batches() for i in range(4)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


@pytest.mark.slow
def test_hf_trainer_in_its_gpu_set_up_gives_the_fp32_profiles_scale(tmp_path, fp32_scale):
    """Trainer(fp16=True) as it runs on a GPU: accelerate's autocast-wrapped forward and its GradScaler."""
    from fp16probe.integrations.huggingface import Fp16ProbeCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, fp16=True, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=1e-3)
    trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=_Data())
    trainer.accelerator.native_amp, trainer.accelerator.scaler = True, torch.amp.GradScaler("cpu")
    callback = Fp16ProbeCallback(every=1)
    trainer.add_callback(callback)
    trainer.train()
    assert callback.report.workload.grad_scaler_found_at == "optimizer.scaler"
    _check(callback.report, fp32_scale)


@pytest.mark.slow
def test_lightning_fp16_plugin_gives_the_fp32_profiles_scale(tmp_path, fp32_scale):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.plugins.precision import MixedPrecision

    from fp16probe.integrations.lightning import Fp16ProbeCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt2 = _gpt2()

        def training_step(self, batch, batch_idx):
            return self.gpt2(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    callback = Fp16ProbeCallback(every=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[callback], plugins=[MixedPrecision("16-mixed", "cpu",
                                                                       scaler=torch.amp.GradScaler("cpu"))])
    trainer.fit(Module(), torch.utils.data.DataLoader(_Data(), batch_size=4))
    _check(callback.report, fp32_scale)


@pytest.mark.parametrize("applied, reported", [(2.0**10, 2.0**24), (2.0**10, 2.0**10)])
def test_a_scale_the_gradients_do_not_carry_gives_no_verdict_and_the_measured_ratio(applied, reported, fp32_scale):
    """The loss is scaled by ``applied`` and the scaler reports ``reported`` (an engine that did not apply its scale)."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = Probe(model, scaler=reported).start()
    for batch in _batches():
        with torch.autocast(**AUTOCAST):
            loss = model(**batch).loss
        (loss * applied).backward()
        for p in model.parameters():
            p.grad.div_(applied)
        opt.step()
        opt.zero_grad()
        probe.step()
    rec = analyze(probe.report())
    check = rec.evidence["scale_check"]
    measured = math.log2(applied / reported)
    assert abs(check["log2_ratio"] - measured) < 0.1, check
    if applied == reported:
        assert check["carried"] and abs(rec.log2_scale - fp32_scale) <= 1
        return
    assert not check["carried"]
    assert rec.verdict == "insufficient_evidence" and rec.log2_scale is None and rec.grad_scaler_kwargs == {}
    assert rec.evidence["insufficient_reason"] == "scale_not_carried"
    assert abs(rec.evidence["fp32_reference_log2_scale"] - fp32_scale) <= 1
    assert [c.code for c in rec.caveats if c.code == "scale_not_carried"] == ["scale_not_carried"]
    assert "2^-14.0" in verdict_text(rec)


def test_the_verdict_and_the_schedule_name_one_gradscaler(tmp_path, monkeypatch):
    """After a live run, fp16probe analyze and fp16probe schedule paste the same GradScaler, and say why they differ."""
    import json

    from fp16probe.analysis.one_answer import schedule_choice, with_verdict_note
    from fp16probe.analysis.schedule import judge_schedules
    from fp16probe.presentation.schedule import schedule_dict
    from tests.fixtures.cli import prepare_cli_env, run

    report = _plain()
    rec = analyze(report)
    table = judge_schedules(report, "fp16")
    name, rule = schedule_choice(table)
    moves = {k: rule[k] for k in ("growth_factor", "backoff_factor", "growth_interval")}
    verdict_moves = {k: rec.grad_scaler_kwargs[k] for k in moves}
    assert moves != verdict_moves  # 3 steps: the verdict holds S (longest interval), the defaults are fine
    one = rec.evidence["one_answer"]
    assert one["schedule_choice"] == name and one["paste"] == dict(rec.grad_scaler_kwargs)
    assert "schedule_differs" in [c.code for c in rec.caveats]
    prepare_cli_env(monkeypatch, tmp_path)
    out = run("schedule", report.save(tmp_path / "live.json"), "--json")
    assert out.exit_code == 0, out.output
    notes = json.loads(out.stdout)["notes"]
    paste = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.grad_scaler_kwargs.items())
    assert [n for n in notes if f"pastes GradScaler({paste})" in n and "Paste the verdict's" in n], notes
    assert json.loads(out.stdout)["rows"] == json.loads(json.dumps(schedule_dict(table)))["rows"]
    note = with_verdict_note(table, rec).notes[-1]
    assert (note.code, note.data["differs"], note.data["grad_scaler_kwargs"]) == ("verdict", True, dict(rec.grad_scaler_kwargs))
