"""A failing rank never hangs a torchrun job: real 2-rank gloo jobs on localhost, one per fault.

Each job runs ``torchrun --nproc-per-node 2 -m fp16probe profile`` (through
tests/fixtures/rank_exit.py, which notes each rank's own exit code: torchrun itself exits 1)
with a model or batches from tests/fixtures/rank_faults.py that fail on rank 1. Every rank
must end within the bound (twice ``FP16PROBE_DIST_TIMEOUT`` after the fault, plus slack for a
loaded machine), with the documented exit code, exactly one ``error:`` line, and a partial
report that ``fp16probe show`` reads. The jobs run concurrently, four at a time, to keep
the wall time near that of the slowest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fp16probe.cli import EXIT_LOAD, EXIT_OK, EXIT_USAGE
from fp16probe.report import Report
from tests.fixtures.cli import FIXTURES, prepare_cli_env, run
from tests.fixtures.torchrun_jobs import run_jobs

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 10  # FP16PROBE_DIST_TIMEOUT for these jobs: small, so the suite stays fast
SLACK_S = 20  # process exit and torchrun's monitoring on a loaded 2-core machine
STEPS = 5
AT_ONCE = 4  # jobs run together (each is three processes: torchrun's agent and two ranks)


@dataclass(frozen=True)
class Job:
    model: str
    batches: str
    codes: dict[int, int | None]  # rank -> exit code (None: killed by a signal)
    error: str | None  # how the one error line starts
    steps_kept: int | None  # steps in the partial report (None: no report)
    world_size: int = 2  # of the report: 2 merged, 1 when rank 0 wrote its own steps


JOBS = {
    "happy": Job("rank_faults:same_model", "rank_faults:many_batches", {0: EXIT_OK, 1: EXIT_OK}, None, STEPS),
    "forward": Job("rank_faults:forward_fails_on_rank_1", "rank_faults:many_batches", {0: EXIT_LOAD, 1: EXIT_LOAD},
                   "error: rank 1: step 3: the forward raised RuntimeError: the model broke on purpose; every rank "
                   "stopped; the 2 step(s) before it are in the partial report r.json", 2),
    "backward": Job("rank_faults:backward_fails_on_rank_1", "rank_faults:many_batches", {0: EXIT_LOAD, 1: EXIT_LOAD},
                    "error: rank 1: step 3: the backward raised ValueError: backward broke on purpose; every rank "
                    "stopped; the 2 step(s) before it are in the partial report r.json", 2),
    "batches_run_out": Job("rank_faults:same_model", "rank_faults:batches_run_out_on_rank_1",
                           {0: EXIT_USAGE, 1: EXIT_USAGE},
                           "error: rank 1: the batches ran out after 2 step(s) while other ranks had more", 2),
    "batches_raise": Job("rank_faults:same_model", "rank_faults:batches_raise_on_rank_1",
                         {0: EXIT_USAGE, 1: EXIT_USAGE},
                         "error: rank 1: step 3: the batches raised OSError: the data file vanished; every rank "
                         "stopped; the 2 step(s) before it are in the partial report r.json", 2),
    "different_model": Job("rank_faults:different_model_on_rank_1", "rank_faults:many_batches",
                           {0: EXIT_LOAD, 1: EXIT_LOAD},
                           "error: rank 1 built a different model from rank 0: 2 parameter tensors against 4", None),
    "killed": Job("rank_faults:same_model", "rank_faults:rank_1_killed_at_step_3", {0: EXIT_LOAD, 1: None},
                  "error: rank 0 lost contact with rank 1: after 2 step(s), the ranks' agreement failed (", 2,
                  world_size=1),
}


def _launch(name: str, job: Job, base: Path) -> tuple[subprocess.Popen, Path]:
    where = base / name
    where.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(FIXTURES)]), OMP_NUM_THREADS="1",
               NO_COLOR="1", FP16PROBE_DIST_TIMEOUT=str(TIMEOUT_S), FAULT_TIME_FILE=str(where / "fault_time"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "rank_exit", str(where), "profile", job.model, "--batches", job.batches,
           "--loss", "rank_faults:mse_loss", "--steps", str(STEPS), "--out", "r.json"]
    proc = subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, where


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[str, Path, float]]:
    """Run every job (AT_ONCE at a time); each one's output, folder and finishing time."""
    base = tmp_path_factory.mktemp("rank_faults")
    return run_jobs(JOBS, _launch, base, at_once=AT_ONCE, timeout_s=4 * TIMEOUT_S + 120)


def _rank_exit(where: Path, rank: int) -> tuple[int, float] | None:
    f = where / f"exit.{rank}"
    if not f.exists():
        return None
    code, when = f.read_text().split()
    return int(code), float(when)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_every_rank_ends_in_time_with_its_code_one_line_and_the_steps_kept(name, jobs, monkeypatch, tmp_path):
    job = JOBS[name]
    out, where, _ = jobs[name]
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    if job.error is None:
        assert errors == [], out[-3000:]
    else:
        assert len(errors) == 1, out[-3000:]
        assert errors[0].startswith(job.error), errors[0]
    for rank, code in job.codes.items():
        ended = _rank_exit(where, rank)
        if code is None:
            assert ended is None, f"rank {rank} was meant to be killed: {ended}"
            continue
        assert ended is not None, f"rank {rank} left no exit code:\n{out[-3000:]}"
        assert ended[0] == code, (rank, ended, out[-3000:])
        if job.error is not None:  # the bound, measured from the fault the fixture noted
            fault = float((where / "fault_time").read_text())
            assert ended[1] - fault < 2 * TIMEOUT_S + SLACK_S, (rank, ended[1] - fault)
    report_file = where / "r.json"
    if job.steps_kept is None:
        assert not report_file.exists()
        return
    report = Report.load(report_file)
    assert report.metadata.steps_seen == job.steps_kept
    assert report.metadata.world_size == job.world_size
    assert report.metadata.partial == (job.error is not None)
    if job.world_size == 1:  # rank 0's own steps, marked as such
        assert report.workload.ranks_in_report == [0]
    prepare_cli_env(monkeypatch, tmp_path)
    shown = run("show", report_file)
    assert shown.exit_code == 0, shown.output
