"""Keep the benchmark from rotting: run its code path with tiny sizes (timings mean nothing here)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import run as bench  # noqa: E402

TINY = dataclasses.replace(
    bench.QUICK, engine_rounds=1, step_rounds=1, memory_steps=(1, 2, 5)
)


@pytest.mark.slow
def test_benchmark_runs_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    monkeypatch.setattr(bench, "QUICK", TINY)
    assert bench.main(["--quick", "--json", str(out)]) == 0
    loaded = json.loads(out.read_text())
    assert "probe/1" in capsys.readouterr().out
    assert loaded["engine"]["numel"] == TINY.engine_numel
    assert {m["model"] for m in loaded["steps"]} == {"conv", "transformer", "gpt-mid", "mlp-200"}
    for m in loaded["steps"]:
        for clock in ("ratio_wall", "ratio_cpu"):
            assert set(m[clock]) == set(bench.VARIANTS) - {"plain"}
            assert all(v > 0 for v in m[clock].values())
        assert all(v > 0 for v in m["step_ms"].values())
        assert m["probe_memory"]["fixed_bytes"] > 0
    assert set(loaded["engine"]["by_data"]) == {"dense", "relu_masked", "sparse_90"}
    table = bench.format_table(loaded)
    assert "probe/1" in table and "memory held by the Probe" in table
    assert loaded["profile"]["steps"] == TINY.profile_steps and loaded["profile"]["ratio"] > 0
    assert "fp16probe.profile() on the demo" in table


def test_probe_memory_grows_only_by_the_trace() -> None:
    mem = bench.bench_memory(TINY)
    by = mem["by_steps"]
    assert mem["fixed_bytes_constant"]
    # The trace grows by the same number of bytes every step: one histogram and one max
    # per module and kind, nothing that depends on tensor sizes or on earlier steps.
    t1, t2, t5 = (by[str(n)]["trace_bytes"] for n in (1, 2, 5))
    assert t2 - t1 == mem["trace_bytes_per_step"]
    assert t5 - t2 == 3 * (t2 - t1)
    assert t1 == t2 - t1


def test_usual_ways_run_on_the_same_hooks() -> None:
    import torch

    seen: list[tuple[int, ...]] = []
    model = bench.ConvNet(2)
    hooks = bench.TensorHooks(model, lambda t: seen.append(tuple(t.shape)))
    try:
        torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 8, 8)), torch.tensor([0, 1])).backward()
    finally:
        hooks.remove()
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    params = list(model.parameters())
    # Every leaf's output gradient (Identity passes its input through) and every weight gradient.
    assert len(seen) >= len(params) + len(leaves) - 1
    bench.tensorboard_way(torch.randn(10))
    bench.one_read(torch.randn(10))
    bench.wandb_way(torch.randn(10))


@pytest.mark.slow
def test_peak_memory_script_runs_both_variants(tmp_path: Path) -> None:
    from bench import peak_memory

    out = tmp_path / "peak.json"
    args = ["--steps", "1", "--batch", "2", "--image", "32", "--repeats", "1", "--json", str(out)]
    assert peak_memory.main(args) == 0
    got = json.loads(out.read_text())
    assert len(got["peak_rss_kib"]["plain"]) == len(got["peak_rss_kib"]["probe"]) == 1
    assert got["peak_rss_kib"]["probe"][0] > 100 * 1024  # a real process with torch loaded
    assert got["fp16probe"].endswith("fp16probe")


def test_forward_cost_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import forward_cost

    out = tmp_path / "forward.json"
    assert forward_cost.main(["--quick", "--json", str(out)]) == 0
    loaded = json.loads(out.read_text())
    assert {m["model"] for m in loaded["models"]} == {"conv", "transformer", "gpt-mid", "mlp-200"}
    assert all(m["forward_capture"] > 0 and m["audit_over_plain"] > 0 for m in loaded["models"])
    assert "ForwardAudit / plain" in capsys.readouterr().out


def test_hook_floor_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import hook_floor

    out = tmp_path / "floor.json"
    assert hook_floor.main(["--quick", "--models", "mlp-200", "--json", str(out)]) == 0
    loaded = json.loads(out.read_text())
    assert [m["model"] for m in loaded["models"]] == ["mlp-200"]
    (m,) = loaded["models"]
    assert set(m["over_plain"]) == set(hook_floor.VARIANTS) - {"plain"}
    assert all(v > 0 for v in m["over_plain"].values())
    assert "capture points" in capsys.readouterr().out
