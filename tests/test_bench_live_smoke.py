"""Keep bench/live.py from rotting: run its code path with tiny sizes (timings mean nothing here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import live as bench_live  # noqa: E402


@pytest.mark.slow
def test_live_benchmark_runs():
    pytest.importorskip("transformers")
    shadow = bench_live.bench_shadow(steps=3, every=1, rounds=1)
    assert shadow["shadow_reruns"] == 3 and shadow["shadow_steps"] == [0, 1, 2]
    assert set(shadow["step_ms"]) == {"plain", "probe", "probe+history", "rerun every step",
                                                                     "probe+history+shadow"}
    live = bench_live.bench_live_logging(total=60, at=(50,), log_every=25)
    assert live["interval_s"][50] > 0 and live["whole_report_s"][50] > 0 and live["history_bytes"] > 0
