"""The HF Trainer and Lightning callbacks under torchrun: a failing rank stops every rank in time, and rank 0
writes the report of the steps every rank finished. Real 2-rank gloo jobs (tests/callback_rank_worker.py).

A rank that raises in its forward or loss is caught by the ranks' agreement before backward: every
rank ends at once (well under ``FP16PROBE_DIST_TIMEOUT``). One that raises before its DDP forward
(Lightning's fp32 rerun) leaves the others waiting in DDP's own collective: that ends when the
framework's process-group timeout (set to the same bound) runs out, and the report is still written.
Under the Trainer a rank that raises outside the forward (compute_loss, backward, gradient clipping, the
optimizer's or the LR scheduler's step) joins the agreement from the callback's wrappers of
``training_step``, ``_clip_grad_norm``, ``optimizer.step`` and ``lr_scheduler.step``: the others wait out
DDP's all-reduce (loss, backward) or stop at their next forward (clipping and the steps), and rank 0
writes the steps every rank finished, or its own (marked) when rank 1 had not closed the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fp16probe.report import Report
from tests.fixtures.torchrun_jobs import run_jobs

pytest.importorskip("transformers")
pytest.importorskip("pytorch_lightning")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "callback_rank_worker.py"
TIMEOUT_S = 10  # FP16PROBE_DIST_TIMEOUT, and the frameworks' process-group timeout, for these jobs
SLACK_S = 20  # process exit and torchrun's monitoring on a loaded 2-core machine
AT_ONCE = 3


@dataclass(frozen=True)
class Job:
    framework: str
    fail_at: int  # the training forward that raises on rank 1 (0: none)
    shadow_every: str  # "" for the callback's default (Lightning reruns early steps in fp32 first)
    steps_kept: int  # steps in rank 0's report
    fast: bool  # stopped by the agreement, with no timeout waited
    fail_in: str = "forward"  # the Trainer's: forward, loss (compute_loss), backward or step (the optimizer's)
    finished: tuple[int, int] | None = None  # the steps each rank finished, when not steps_kept on both


JOBS = {
    "hf_ok": Job("hf", 0, "", 5, True),
    "hf_forward": Job("hf", 3, "", 2, True),
    # outside the forward: rank 0 waits in DDP's all-reduce until the process-group timeout
    "hf_loss": Job("hf", 3, "", 2, False, "loss"),
    "hf_backward": Job("hf", 3, "", 2, False, "backward"),
    # after the all-reduce: rank 0 finished step 3, rank 1 did not; rank 0 writes its own 3 steps
    "hf_step": Job("hf", 3, "", 3, True, "step", (3, 2)),
    # after the all-reduce too: gradient clipping (max_grad_norm) and the LR scheduler's step
    "hf_clip": Job("hf", 3, "", 3, True, "clip", (3, 2)),
    "hf_scheduler": Job("hf", 3, "", 3, True, "scheduler", (3, 2)),
    "lightning_ok": Job("lightning", 0, "0", 5, True),
    "lightning_forward": Job("lightning", 3, "0", 2, True),
    # forwards 1, 2: step 1's rerun and real one; forward 3 is step 2's rerun, outside DDP
    "lightning_rerun": Job("lightning", 3, "", 1, False),
}


def _launch(name: str, job: Job, base: Path) -> tuple[subprocess.Popen, Path]:
    where = base / name
    where.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_COLOR="1",
               FP16PROBE_DIST_TIMEOUT=str(TIMEOUT_S), SHADOW_EVERY=job.shadow_every, FAIL_IN=job.fail_in)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), job.framework, str(where), str(job.fail_at)]
    proc = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, where


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[str, Path]]:
    """Run every job (AT_ONCE at a time); each one's output and folder."""
    base = tmp_path_factory.mktemp("callback_rank_faults")
    done = run_jobs(JOBS, _launch, base, at_once=AT_ONCE, timeout_s=4 * TIMEOUT_S + 120)
    return {n: (out, where) for n, (out, where, _) in done.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_every_rank_ends_in_time_and_rank_0_reports_the_finished_steps(name, jobs):
    job = JOBS[name]
    out, where = jobs[name]
    ended = {}
    for rank in (0, 1):
        f = where / f"exit.{rank}"
        assert f.exists(), f"rank {rank} left no exit code:\n{out[-3000:]}"
        code, when = f.read_text().split()
        ended[rank] = (int(code), float(when))
    if job.fail_at == 0:
        assert ended[0][0] == ended[1][0] == 0, out[-3000:]
    else:
        fault = float((where / "fault_time").read_text())
        for rank, (code, when) in ended.items():
            assert code == 1, (rank, out[-3000:])
            bound = TIMEOUT_S if job.fast else 2 * TIMEOUT_S + SLACK_S
            assert when - fault < bound, (rank, when - fault)
        # every rank raises the failing rank's error, naming it and the report
        said = (where / "error.0").read_text()
        if not job.fast:  # rank 0 raises DDP's own timeout; the note names the failing rank
            assert "timeout" in said.lower() or "timed out" in said.lower(), said
            note = (where / "trace.0").read_text().splitlines()[-1]
            assert note.startswith("fp16probe: rank 1: "), note
            said = "ModelError: " + note.removeprefix("fp16probe: ")
        assert said.startswith("ModelError: rank 1: RuntimeError: the model broke on purpose; every rank stopped"), said
        assert f"the {job.steps_kept} step(s) before it are in the partial report" in said, said
        assert (where / "error.1").read_text() == "RuntimeError: the model broke on purpose"
    report = Report.load(where / "fp16probe-report.json")
    assert report.metadata.steps_seen == job.steps_kept
    assert report.metadata.world_size == (1 if job.finished else 2)  # rank 0's own steps: its own world
    assert report.metadata.partial == (job.fail_at != 0)
    if job.fail_at:
        assert report.workload.rank_fault["rank"] == 1
        assert report.workload.rank_fault["steps_finished_per_rank"] == list(job.finished or [job.steps_kept] * 2)
        assert report.workload.ranks_in_report == ([0] if job.finished else None)
    assert (where / "fp16probe-recommendation.txt").read_text().strip()
