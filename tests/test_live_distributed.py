"""The live verdict under DDP and FSDP2, two gloo ranks on the CPU (issue 39, item 3).

DDP: each rank reruns its own micro-batch in fp32 through the wrapped module, running no collective, and
each rank's report and the merged one give S within one power of two of an fp32 profile of the same
model and batches; training is bit-identical with and without the Probe, ``no_sync`` accumulation too.
FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.float16)``): each rank reruns on an
unsharded fp32 copy of the model (its weights gathered at each rerun), with accumulation.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp16probe
from fp16probe.analysis.recommend import analyze
from fp16probe.report import Report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import live_rerun_ddp_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow  # a torchrun of two processes per test


def _torchrun(how: str, micro: int, out: Path) -> dict[str, Report]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", LIVE_MICRO=str(micro))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "live_rerun_ddp_worker.py"), str(out), how]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in (0, 1):  # training with the Probe is bit-identical to training without it, on each rank
        assert (out / f"identical{r}.txt").read_text() == "True", r
    return {name: Report.load(out / f"{name}.json") for name in ("rank0", "rank1", "merged")}


@pytest.fixture(scope="module")
def fp32_scale() -> int:
    """log2 S from an fp32 fp16probe.profile of the model on rank 0's batches, one process."""
    batches = [dict(zip("xy", worker.batch(step, 0, 0))) for step in range(worker.STEPS)]
    report = fp16probe.profile(worker.make_model(), batches, lambda out, batch: out, steps=worker.STEPS,
                               precision="fp32", optimizer="sgd", lr=0.1)
    return report.recommendation.log2_scale


def test_ddp_reruns_on_each_rank_give_the_fp32_verdict(tmp_path, fp32_scale):
    reports = _torchrun("ddp", 1, tmp_path)
    for name, report in reports.items():
        runs = report.shadow_runs
        assert runs.steps == (0, 1, 2) and runs.off is None and not runs.discarded, (name, runs)
        # the live weight gradients are the all-reduced ones: the rank-local reruns record none
        assert report.shadow.histogram("weight_grad").total == 0
        rec = analyze(report)
        assert rec.verdict in ("constant", "dynamic"), (name, rec)
        assert abs(rec.log2_scale - fp32_scale) <= 1, (name, rec.log2_scale, fp32_scale)
        assert rec.evidence["scale_check"]["carried"], (name, rec.evidence["scale_check"])
    # the merged report's reference is both ranks' reruns, as its live counts are both ranks'
    assert reports["merged"].shadow.histogram("activation_grad").total == \
        2 * reports["rank0"].shadow.histogram("activation_grad").total


def _fp32_reference(micro: int, rank: int) -> int:
    """log2 S of an fp32 run of one rank's micro-batches, each loss / micro, accumulated to a step: plain torch,
    the statistics from an fp32 Probe with no reruns (one process: the DDP average moves the weights by ~1e-5)."""
    model = worker.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = fp16probe.Probe(model, shadow_every=0).start()
    for step in range(worker.STEPS):
        for m in range(micro):
            (model(*worker.batch(step, m, rank)) / micro).backward()
        opt.step()
        opt.zero_grad()
        probe.step()
    probe.stop()
    rec = analyze(probe.report())
    assert rec.verdict in ("constant", "dynamic"), rec
    return rec.log2_scale


def test_ddp_no_sync_accumulation_gives_the_fp32_verdict_of_the_divided_loss_and_leaves_training_as_it_was(tmp_path):
    reports = _torchrun("ddp", 2, tmp_path)
    for name, report in reports.items():
        runs = report.shadow_runs
        assert runs.steps == (0, 1, 2) and runs.off is None and not runs.discarded, (name, runs)
        assert runs.accumulation == 2 and runs.loss_divisors == (2.0,), (name, runs)
    for rank in (0, 1):
        rec, reference = analyze(reports[f"rank{rank}"]), _fp32_reference(2, rank)
        assert rec.verdict in ("constant", "dynamic"), (rank, rec)
        assert abs(rec.log2_scale - reference) <= 1, (rank, rec.log2_scale, reference)
        assert rec.evidence["scale_check"]["carried"], (rank, rec.evidence["scale_check"])


def _has_fsdp2() -> None:
    pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 (fully_shard)")


def test_fsdp2_reruns_on_an_unsharded_copy_give_the_fp32_verdict_and_leave_training_as_it_was(tmp_path):
    """FSDP2 computing in its policy's fp16, 2 micro-batches a step: each rank reruns them on an unsharded fp32 copy,
    and its verdict is within one power of two of a plain fp32 run of those micro-batches (each loss / 2). The
    copy's path without sharding (one micro-batch, probe.shadow refused) is tests/test_unsharded_copy.py's."""
    _has_fsdp2()
    micro = 2
    reports = _torchrun("fsdp2", micro, tmp_path)
    for name, report in reports.items():
        runs = report.shadow_runs
        assert runs.steps == (0, 1, 2) and runs.off is None and not runs.discarded, (name, runs)
        assert runs.accumulation == micro and runs.loss_divisors == (float(micro),), (name, runs)
        assert report.capture.weight_grads_sharded
        # the live weight gradients are reduce-scattered shards: the rank-local reruns record none
        assert report.shadow.histogram("weight_grad").total == 0
        assert report.shadow.histogram("activation_grad").total > 0
        assert analyze(report).evidence["scale_check"]["carried"], name
    for rank in (0, 1):
        rec, reference = analyze(reports[f"rank{rank}"]), _fp32_reference(micro, rank)
        assert rec.verdict in ("constant", "dynamic") and rec.evidence["reference"] == "fp32_shadow_reruns", rec
        assert abs(rec.log2_scale - reference) <= 1, (rank, rec.log2_scale, reference)
    assert reports["merged"].shadow.histogram("activation_grad").total == \
        2 * reports["rank0"].shadow.histogram("activation_grad").total
