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
