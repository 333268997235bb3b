"""What leaving a Probe on in fp16 training costs: the fp32 shadow reruns, the per-step history, live logging.

Run from the repository root::

    python bench/live.py                 # a few minutes on two shared cores
    python bench/live.py --quick         # tiny sizes: checks the code path, numbers mean little
    python bench/live.py --json out.json # where the JSON goes (default bench/live-results.json)

Torch runs on one thread, and every figure is process CPU time (the work done, whatever
else shares the machine), measured in interleaved rounds (plain, A, B, ..., plain, A, B, ...)
and reported as the median over rounds.

1. Shadow and history: a tiny GPT-2 trained under CPU fp16 autocast with a real GradScaler,
   plain and with ``Probe(every=N)``: without history or shadow, with the history, with the
   history and the default shadow schedule, and rerunning every step (so one warm rerun costs the
   difference to the history-only run); the steady-state share at one rerun in 50 sampled steps.
2. Live logging: ``LiveLogger(log_every=50, recommend=False)`` on a small MLP, the CPU time of
   one interval (one windowed report and the trackers' series) at step 100 and at step 10,000,
   against ``probe.report()`` of the whole run at the same steps; and the analysis of one
   interval's report apart (its cost follows the verdict, not the run's length).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fp16probe import Probe  # noqa: E402
from fp16probe.analysis.recommend import analyze  # noqa: E402
from fp16probe.integrations.live import LiveLogger  # noqa: E402


def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(config).train()


def _train(variant: str, steps: int, every: int) -> tuple[float, dict]:
    """CPU seconds per step of ``steps`` GPT-2 steps under ``variant``; the shadow's own record."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    options = {"plain": None, "probe": {"history": False, "shadow_every": 0},
               "probe+history": {"shadow_every": 0}, "probe+history+shadow": {},
               "rerun every step": {"shadow_every": 1}}[variant]
    probe = None if options is None else Probe(model, scaler=scaler, every=every, **options).start()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(steps)]
    t0 = time.process_time()
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(input_ids=ids, labels=ids)
        scaler.scale(out.loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if probe is not None:
            probe.step()
    per_step = (time.process_time() - t0) / steps
    shadow = {}
    if probe is not None:
        probe.stop()
        runs = probe.report().shadow_runs
        shadow = runs.to_dict() if runs is not None else {}
    return per_step, shadow


def bench_shadow(steps: int, every: int, rounds: int) -> dict:
    variants = ("plain", "probe", "probe+history", "probe+history+shadow", "rerun every step")
    times: dict[str, list[float]] = {v: [] for v in variants}
    shadow = {}
    for _ in range(rounds):
        for v in variants:
            t, sh = _train(v, steps, every)
            times[v].append(t)
            if v == "probe+history+shadow":
                shadow = sh
    med = {v: statistics.median(ts) for v, ts in times.items()}
    plain = med["plain"]
    probe_step = med["probe+history"]
    # one warm rerun: a step that reruns every time, less one that never does
    rerun = med["rerun every step"] - probe_step
    return {
        "steps": steps, "every": every, "rounds": rounds,
        "step_ms": {v: 1e3 * t for v, t in med.items()},
        "overhead_vs_plain": {v: med[v] / plain - 1.0 for v in variants if v != "plain"},
        "history_cost_vs_probe": med["probe+history"] / med["probe"] - 1.0,
        "shadow_reruns": shadow["count"], "shadow_steps": shadow["steps"],
        "one_rerun_ms": 1e3 * rerun, "one_rerun_vs_plain_step": rerun / plain,
        "reruns_seconds_default_schedule": shadow["seconds"],  # host wall time, the first (cold) rerun included
        # the regular schedule: one rerun per 50 sampled steps, each sampled step `every` steps apart
        "steady_state_share_at_1_in_50": rerun / (50 * every * probe_step),
    }


class _NullSink:
    def write(self, series) -> None:
        pass

    def close(self) -> None:
        pass


def bench_live_logging(total: int, at: tuple[int, ...], log_every: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    probe = Probe(model).start()
    # recommend=False: the interval's data path alone; the analysis is timed apart (its cost
    # follows the verdict, a scale verdict runs the 20,000-step replay, not the run's length)
    live = LiveLogger(probe, _NullSink(), log_every=log_every, recommend=False)
    x = torch.randn(8, 16)
    interval: dict[int, float] = {}
    full: dict[int, float] = {}
    analysis: dict[int, float] = {}
    verdicts: dict[int, str] = {}
    for step in range(1, total + 1):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        probe.step()
        if step in at:  # a multiple of log_every: this call is an interval's flush
            t0 = time.process_time()
            live.step()
            interval[step] = time.process_time() - t0
            t0 = time.process_time()
            probe.report()
            full[step] = time.process_time() - t0
            window = probe.report(since_step=step - log_every)
            t0 = time.process_time()
            verdicts[step] = str(analyze(window).verdict)
            analysis[step] = time.process_time() - t0
        else:
            live.step()
    live.close()
    return {"log_every": log_every, "interval_s": interval, "whole_report_s": full,
            "analysis_s": analysis, "verdict": verdicts,
            "trace_bytes": probe.recorder.memory()["trace_bytes"],
            "history_bytes": probe.collector("history").memory_bytes() if probe.collector("history") is not None else 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "live-results.json")
    ap.add_argument("--only", choices=("shadow", "live"), default=None, help="run one part")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        shadow = bench_shadow(steps=12, every=1, rounds=1)
        live = bench_live_logging(total=120, at=(100,), log_every=50)
    else:
        shadow = bench_shadow(steps=100, every=1, rounds=3) if args.only != "live" else {}
        live = bench_live_logging(total=10_000, at=(100, 10_000), log_every=50) if args.only != "shadow" else {}
    out = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": 1,
                       "load": _load()}, "shadow": shadow, "live_logging": live}
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
