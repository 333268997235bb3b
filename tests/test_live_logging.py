"""Live logging: the callbacks and LiveLogger send histograms to the user's tracker during training.

A real Lightning ``Trainer.fit`` with a TensorBoardLogger and a real Hugging Face
``Trainer.train`` with ``report_to=["tensorboard"]``; the event files are read back with
TensorBoard's own EventAccumulator and must hold, step by step, the exact bins of the
report the callback writes at the end.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.histogram import MIN_EXP
from fp16probe.integrations.live import LiveLogger
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.tensorboard import SummaryWriter  # noqa: E402


def _events(log_dir):
    ea = EventAccumulator(str(log_dir), size_guidance={"histograms": 0, "scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _buckets(h):
    occupied = [MIN_EXP + i for i, c in enumerate(h.counts) if c]
    exps = range(min(occupied), max(occupied) + 1)
    return [float(e) for e in exps], [float(h.count(e)) for e in exps]


def _assert_events_match_trace(ea, report, offset):
    for kind in (ACTIVATION_GRAD, WEIGHT_GRAD):
        events = ea.Histograms(f"fp16probe/{kind}")
        assert [e.step for e in events] == [s + offset for s in report.trace.steps]
        for event, h in zip(events, report.trace.histograms[kind]):
            assert (list(event.histogram_value.bucket_limit), list(event.histogram_value.bucket)) == _buckets(h)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def test_live_logger_reports_only_at_the_interval(tmp_path, monkeypatch):
    model = _mlp()
    probe = Probe(model).start()
    calls = []
    original = probe.report
    monkeypatch.setattr(probe, "report", lambda *a, **k: calls.append(1) or original(*a, **k))
    writer = SummaryWriter(str(tmp_path))
    live = LiveLogger(probe, writer, log_every=4, recommend=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    logged = []
    for _ in range(10):
        x = torch.randn(4, 8, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        probe.step()
        logged.append(live.step())
    assert logged == [False, False, False, True, False, False, False, True, False, False]
    assert len(calls) == 2  # the statistics came to the host twice in ten steps
    live.close()  # sends steps 8 and 9
    writer.close()
    assert len(calls) == 3
    probe.stop()
    _assert_events_match_trace(_events(tmp_path), probe.report(), 0)


def test_live_logger_refuses_a_bad_interval():
    from fp16probe.errors import ProbeError

    with pytest.raises(ProbeError, match="log_every"):
        LiveLogger(Probe(_mlp()), None, log_every=0)


# -- Lightning ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_lightning_fit_logs_histograms_to_its_tensorboard_logger(tmp_path):
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.loggers import TensorBoardLogger
    from pytorch_lightning.plugins.precision import MixedPrecision

    from fp16probe.integrations.lightning import Fp16ProbeCallback

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g)), batch_size=4)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    # 16-mixed on the CPU with a real GradScaler: the fp16 path, loss scaled by 2^10
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    callback = Fp16ProbeCallback(log_every=2, log_modules=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=5, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[callback], plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    trainer.fit(Tiny(), data)
    report = callback.report
    ea = _events(logger.log_dir)
    _assert_events_match_trace(ea, report, 1)  # step s of the probe is global step s + 1
    assert [(s.step, s.value) for s in ea.Scalars("fp16probe/loss_scale")] == [
        (s + 1, v) for s, v in zip(report.trace.steps, report.trace.scale)]
    assert {v for _, v in zip(report.trace.steps, report.trace.scale)} == {1024.0}
    # module histograms: the running totals at each interval; the last equals the report's
    net2 = ea.Histograms("fp16probe/activation_grad/net.2")
    assert [e.step for e in net2] == [2, 4, 5]
    assert (list(net2[-1].histogram_value.bucket_limit), list(net2[-1].histogram_value.bucket)) == _buckets(
        report.module("net.2").histogram)


# -- Hugging Face ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_hf_trainer_logs_histograms_to_tensorboard_via_report_to(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from fp16probe.integrations.huggingface import Fp16ProbeCallback

    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=["tensorboard"],
        use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    callback = Fp16ProbeCallback(log_every=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=[callback])
    trainer.train()
    ea = _events(tmp_path / "runs" / "fp16probe")
    _assert_events_match_trace(ea, callback.report, 1)
    assert [e.step for e in ea.Histograms("fp16probe/activation_grad")] == [1, 2, 3, 4]
    assert "fp16probe/activation_grad/flushed_fraction_at_recommended_scale" in ea.Tags()["scalars"]


def test_hf_trackers_needs_a_supported_report_to(tmp_path):
    import types

    from fp16probe.errors import InputError
    from fp16probe.integrations.live import hf_trackers

    with pytest.raises(InputError, match="report_to"):
        hf_trackers(types.SimpleNamespace(report_to=["none"], output_dir=str(tmp_path)))


# -- the trackers a trainer is configured with --------------------------------------------------

def test_lightning_loggers_of_each_kind_are_written_to(tmp_path, monkeypatch):
    pytest.importorskip("pytorch_lightning")
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from pytorch_lightning.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    from fp16probe.errors import InputError
    from fp16probe.integrations.live import lightning_trackers
    from fp16probe.presentation.trackers import TrackerLog, sink_for
    from tests.test_trackers import scaled_report

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = (tmp_path / "mlruns").as_uri()
    loggers = [TensorBoardLogger(str(tmp_path / "tb")), MLFlowLogger(tracking_uri=uri),
               WandbLogger(save_dir=str(tmp_path), offline=True), CSVLogger(str(tmp_path))]
    trainer = type("T", (), {"loggers": loggers})()
    found = lightning_trackers(trainer)
    assert found == loggers[:3]  # the CSV logger has nowhere to put a histogram
    assert [sink_for(t).name for t in found] == ["tensorboard", "mlflow", "wandb"]
    mlflow_log = TrackerLog(loggers[1], recommend=False)
    assert mlflow_log.log(scaled_report()) == 6
    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(loggers[1].run_id, "fp16probe/loss_scale")
    assert sorted((m.step, m.value) for m in history) == [(0, 256.0), (1, 256.0), (2, 256.0), (3, 128.0), (4, 128.0), (5, 100.0)]
    loggers[2].experiment.finish()
    with pytest.raises(InputError, match="CSVLogger"):
        lightning_trackers(type("T", (), {"loggers": loggers[3:]})())


def test_hf_report_to_finds_the_active_mlflow_and_wandb_runs(tmp_path, monkeypatch):
    import types

    mlflow = pytest.importorskip("mlflow")
    wandb = pytest.importorskip("wandb")
    from fp16probe.integrations.live import hf_trackers

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    args = types.SimpleNamespace(report_to=["tensorboard", "wandb", "mlflow", "codecarbon"], output_dir=str(tmp_path))
    with mlflow.start_run() as active:
        run = wandb.init(dir=str(tmp_path), project="t")
        try:
            writer, wandb_run, (client, run_id) = hf_trackers(args)
        finally:
            run.finish()
    assert writer.log_dir == str(tmp_path / "tb") and writer._fp16probe_owned
    writer.close()
    assert wandb_run is run and run_id == active.info.run_id
    assert client.get_run(run_id).info.run_id == run_id


@pytest.mark.slow
def test_ddp_two_ranks_log_the_merged_statistics(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fp16probe import Report

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "live_ddp_worker.py"), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = Report.load(tmp_path / "merged.json")
    assert merged.metadata.world_size == 2
    assert (tmp_path / "reports.txt").read_text() == "2"  # one merge at step 2, one at close()
    _assert_events_match_trace(_events(tmp_path / "tb"), merged, 0)


def test_live_logger_attaches_the_final_report_to_an_mlflow_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    model = _mlp()
    probe = Probe(model).start()
    live = LiveLogger(probe, (client, run_id), log_every=2, recommend=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        model.zero_grad()
        probe.step()
        live.step()
    live.close()
    history = client.get_metric_history(run_id, "fp16probe/activation_grad/flushed_fraction_at_1")
    assert sorted(m.step for m in history) == [0, 1, 2]
    names = {a.path for a in client.list_artifacts(run_id, "fp16probe")}
    assert {"fp16probe/fp16probe-report.json", "fp16probe/fp16probe-figures.png", "fp16probe/fp16probe-report.html"} <= names
    assert client.get_run(run_id).info.status == "RUNNING"  # the caller's run stays open
