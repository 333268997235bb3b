"""`torchrun -m fp16probe profile` on the CPU with gloo: one merged report from two ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp16probe import Report
from fp16probe.report import ACTIVATION_GRAD, WEIGHT_GRAD

ROOT = Path(__file__).resolve().parents[1]


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.slow
def test_torchrun_profile_merges_two_ranks(tmp_path):
    merged_path = tmp_path / "merged.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          "-m", "fp16probe", "profile", "--steps", "2", "--out", str(merged_path)], tmp_path)
    singles = []
    for seed in (0, 1):  # what rank 0 and rank 1 ran: the demo data seeded with --seed + rank
        path = tmp_path / f"seed{seed}.json"
        _run([sys.executable, "-m", "fp16probe", "profile", "--steps", "2", "--seed", str(seed),
              "--out", str(path)], tmp_path)
        singles.append(Report.load(path))
    merged = Report.load(merged_path)
    assert merged.metadata.world_size == 2
    # Activation gradients are local to each rank and add up; with no optimizer step the
    # weights stay put, so each rank's are exactly those of a single run on its batches.
    for m in merged.modules_of(ACTIVATION_GRAD):
        expected = singles[0].module(m.name).histogram + singles[1].module(m.name).histogram
        assert m.histogram == expected, m.name
    # Weight gradients are all-reduced by DDP: counted once, not once per rank.
    for m in merged.modules_of(WEIGHT_GRAD):
        assert m.histogram.total == singles[0].module(m.name, WEIGHT_GRAD).histogram.total, m.name



_JOINED = '''
import sys
import torch
import torch.distributed as dist
from fp16probe.running.ranks import RankGuard, joined_from_env

if sys.argv[1] == "own":  # the group a run joins for itself goes with the run, its control group too
    with joined_from_env() as joined:
        assert joined and dist.is_initialized()
        RankGuard().check_same_model(torch.nn.Linear(2, 2))
    assert not dist.is_initialized()
else:  # a group the caller made stays the caller's
    dist.init_process_group("gloo")
    with joined_from_env() as joined:
        assert joined
        RankGuard().check_same_model(torch.nn.Linear(2, 2))
    assert dist.is_initialized()
    dist.destroy_process_group()
print("joined_from_env ok")
'''


@pytest.mark.slow
@pytest.mark.parametrize("group", ["own", "callers"])
def test_a_run_destroys_the_process_group_it_joined_and_only_that(tmp_path, group):
    """A process leaving with gloo's groups alive now and then aborts at exit (SIGABRT after a good run)."""
    worker = tmp_path / "joined.py"
    worker.write_text(_JOINED)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "--tee", "3", str(worker), group], tmp_path)
    assert proc.stdout.count("joined_from_env ok") == 2, proc.stdout
