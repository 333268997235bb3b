"""The live verdict under gradient accumulation with clipping, in accelerate, the Hugging Face Trainer and Lightning.

Each framework trains a tiny GPT-2 for a few real fp16 steps on the CPU as it runs on a GPU
(CPU fp16 autocast, a real ``torch.amp.GradScaler("cpu")``), accumulating N micro-batches per
optimizer step and clipping the gradient norm. Each micro-batch backpropagates its loss divided
as the framework divides it (accelerate and Lightning: loss / N; the Trainer: the model's loss
normalised by ``num_items_in_batch``, the same here). The verdict must be within one power of two
of the fp32 reference of that loss, computed here by plain torch (the same micro-batches
accumulated in fp32, each loss / N, clipped), and the run with the Probe must end with the very
weights of the run without it.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.verdict import verdict_text

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

STEPS = 3  # optimizer steps, all rerun (the early schedule: 0, 1, 2)
CLIP = 1.0
COUNTS = [1, 2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
ALL_SLOW = [pytest.param(n, marks=pytest.mark.slow) for n in (1, 2, 4, 8)]


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return transformers.GPT2LMHeadModel(config).train()


def _micro_batches(n: int) -> list[dict[str, torch.Tensor]]:
    """STEPS * n micro-batches of 4 sequences, in the order every loop here takes them."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * n):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


@functools.cache
def _fp32_reference(n: int, divisor: int) -> int:
    """log2 S of an fp32 run of the same micro-batches, each backpropagating loss / ``divisor``, accumulated
    n to a step and clipped: plain torch, the statistics from an fp32 Probe with no reruns."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = Probe(model, precision="fp32", shadow_every=0).start()
    batches = _micro_batches(n)
    for s in range(STEPS):
        for batch in batches[s * n:(s + 1) * n]:
            (model(**batch).loss / divisor).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        probe.step()
    rec = analyze(probe.report())
    assert rec.verdict in ("constant", "dynamic"), verdict_text(rec)
    return int(rec.log2_scale)


def _check(report, n: int) -> None:
    runs = report.shadow_runs
    assert report.metadata.precision == "fp16-autocast"
    assert runs.steps == (0, 1, 2) and not runs.discarded and runs.accumulation == n, runs
    rec = analyze(report)
    assert rec.verdict in ("constant", "dynamic"), verdict_text(rec)
    check = rec.evidence["scale_check"]  # the accumulated live step against the accumulated reruns
    assert check["carried"] and abs(check["log2_ratio"]) < 0.1, check
    reference = _fp32_reference(n, n)
    assert abs(rec.log2_scale - reference) <= 1, (rec.log2_scale, reference)
    # like with like: the reruns' micro-batches hold as many values as the live step's
    live = report.trace.histograms["activation_grad"]
    ref = report.shadow.trace.histograms["activation_grad"]
    assert [h.total for h in live] == [h.total for h in ref]


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# -- accelerate -------------------------------------------------------------------------------------

def _accelerate_run(n: int, probed: bool):
    """``Accelerator(mixed_precision="fp16", gradient_accumulation_steps=n)`` as it sets up CUDA, with
    ``accumulate()`` and ``clip_grad_norm_``; its ``backward`` divides each loss by n."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=n)
    acc.native_amp, acc.scaler = True, torch.amp.GradScaler("cpu")
    model = _gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    probe = Probe(model, scaler=acc.scaler, accumulation=n).start() if probed else None
    for batch in _micro_batches(n):
        with acc.accumulate(model):
            acc.backward(model(**batch).loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        if probe is not None and acc.sync_gradients:
            probe.step()
    return model, (None if probe is None else probe.report())


@pytest.mark.parametrize("n", COUNTS)
def test_accelerate_accumulation_gives_the_fp32_reference_of_the_divided_loss(n):
    model, report = _accelerate_run(n, probed=True)
    _check(report, n)
    assert report.shadow_runs.loss_divisors == (float(n),)
    assert _same_weights(model, _accelerate_run(n, probed=False)[0])


# -- the Hugging Face Trainer ---------------------------------------------------------------------

class _Rows(torch.utils.data.Dataset):
    """The micro-batches one row at a time, taken in order (``train_sampling_strategy="sequential"``)."""

    def __init__(self, n: int) -> None:
        self.rows = [{k: v[i] for k, v in b.items()} for b in _micro_batches(n) for i in range(4)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _trainer_run(n: int, tmp_path, probed: bool):
    from fp16probe.integrations.huggingface import Fp16ProbeCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, gradient_accumulation_steps=n,
        max_grad_norm=CLIP, fp16=True, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, learning_rate=1e-3, train_sampling_strategy="sequential")
    trainer = transformers.Trainer(model=_gpt2(), args=args, train_dataset=_Rows(n))
    trainer.accelerator.native_amp, trainer.accelerator.scaler = True, torch.amp.GradScaler("cpu")
    callback = Fp16ProbeCallback(every=1)
    if probed:
        trainer.add_callback(callback)
    trainer.train()
    return trainer.model, callback.report


@pytest.mark.parametrize("n", ALL_SLOW)
def test_hf_trainer_accumulation_gives_the_fp32_reference_of_the_loss_it_backpropagates(n, tmp_path):
    model, report = _trainer_run(n, tmp_path / "probed", probed=True)
    assert report.workload.training_arguments["gradient_accumulation_steps"] == n
    _check(report, n)
    # GPT-2 takes num_items_in_batch: its loss is already normalised over the step's micro-batches
    assert report.shadow_runs.loss_divisors == (1.0,)
    assert _same_weights(model, _trainer_run(n, tmp_path / "plain", probed=False)[0])


def test_hf_divisor_follows_the_trainers_rule():
    from fp16probe.integrations.huggingface import trainer_accumulation

    args = transformers.TrainingArguments(output_dir="unused", gradient_accumulation_steps=4, report_to=[])
    got = trainer_accumulation(args)
    assert got["accumulation"] == 4
    assert got["loss_divisor"]({"num_items_in_batch": torch.tensor(240)}) == 1.0
    assert got["loss_divisor"]({"input_ids": None}) == 4.0
    assert got["loss_divisor"]({"num_items_in_batch": None}) == 4.0

    class Scaled:
        loss_is_scaled_for_ga = False

    assert trainer_accumulation(args, Scaled())["loss_divisor"] == 4.0


# -- Lightning ----------------------------------------------------------------------------------------

def _lightning_run(n: int, tmp_path, probed: bool):
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
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         accumulate_grad_batches=n, gradient_clip_val=CLIP, callbacks=[callback] if probed else [],
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    rows = [{k: v[i] for k, v in b.items()} for b in _micro_batches(n) for i in range(4)]
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=4))
    return module, callback.report


@pytest.mark.parametrize("n", ALL_SLOW)
def test_lightning_accumulation_gives_the_fp32_reference_of_the_divided_loss(n, tmp_path):
    module, report = _lightning_run(n, tmp_path, probed=True)
    _check(report, n)
    assert report.shadow_runs.loss_divisors == (float(n),)
    assert _same_weights(module, _lightning_run(n, tmp_path, probed=False)[0])


# -- the rerun step itself --------------------------------------------------------------------------

def test_a_micro_batch_whose_rerun_fails_drops_the_whole_rerun_step():
    """Fail the third micro-batch's rerun of step 0: steps 1 and 2 are references, step 0 is none."""
    model = _gpt2()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = Probe(model, scaler=scaler, accumulation=4).start()
    calls = {"n": 0}

    def loss_of(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted")
        return model(**batch).loss

    batches = _micro_batches(4)
    for s in range(STEPS):
        for batch in batches[s * 4:(s + 1) * 4]:
            try:
                probe.shadow(lambda b=batch: loss_of(b))
            except RuntimeError as e:
                assert str(e) == "planted"
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss / 4
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        probe.step()
    report = probe.report()
    assert report.shadow_runs.steps == (1, 2)
    assert len(report.shadow.trace) == 2
    live = report.trace.histograms["activation_grad"]
    assert [h.total for h in report.shadow.trace.histograms["activation_grad"]] == [h.total for h in live[1:]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_bad_accumulation_is_refused(bad):
    from fp16probe.errors import ProbeError

    with pytest.raises(ProbeError, match="accumulation"):
        Probe(nn.Linear(2, 2), accumulation=bad)
    with pytest.raises(ProbeError, match="loss_divisor"):
        Probe(nn.Linear(2, 2), loss_divisor=0)
