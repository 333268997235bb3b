"""What the scaled-format statistics cost, and that fp16 users pay nothing for them.

Run from the repository root::

    python bench/blockformats.py                      # this tree only: the cost when on
    python bench/blockformats.py --base /path/to/tree # also: Probe() here against Probe() in another tree

1. fp16 path (with ``--base``): a training step of the small GPT-2-style model of
   ``bench/run.py`` under ``Probe()`` (no block format), timed in fresh processes that
   alternate between this tree and ``--base`` (a checkout without the block formats),
   in process CPU time at one torch thread; the median over rounds of the ratio.
2. Cost when on: the same step plain, under ``Probe()`` and under ``Probe(block_formats=...)``
   for ``fp8_e4m3``, ``mxfp8_e4m3`` and ``nvfp4``, interleaved in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _workload():
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE))
    from run import GPT  # the small GPT-2-style model of bench/run.py

    torch.manual_seed(0)
    b, seq, d, layers, vocab = 8, 64, 192, 2, 1024
    model = GPT(vocab, d, layers, seq)
    tok = torch.randint(0, vocab, (b, seq + 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten()).backward()
        opt.step()

    return model, step


def _cpu_per_step(step, probe, steps: int) -> float:
    c0 = time.process_time()
    for _ in range(steps):
        step()
        if probe is not None:
            probe.step()
    return (time.process_time() - c0) / steps


def worker(steps: int) -> None:
    """Print the CPU seconds per step under Probe() (no block format) in this process's tree."""
    import torch

    torch.set_num_threads(1)
    from fp16probe import Probe

    model, step = _workload()
    with Probe(model) as probe:
        _cpu_per_step(step, probe, 2)  # warm-up
        print(json.dumps({"cpu_per_step": _cpu_per_step(step, probe, steps)}))


def fp16_path(base: Path, rounds: int, steps: int) -> dict:
    """Probe() in this tree against Probe() in ``base``: fresh processes, alternating."""
    times: dict[str, list[float]] = {"here": [], "base": []}
    trees = {"here": HERE.parent, "base": base}
    for _ in range(rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, str(HERE / "blockformats.py"), "--worker", "--steps", str(steps)],
                                 env=env, capture_output=True, text=True, check=True, cwd=str(tree))
            times[name].append(json.loads(out.stdout.strip().splitlines()[-1])["cpu_per_step"])
    ratios = [h / b for h, b in zip(times["here"], times["base"])]
    return {"here_s": statistics.median(times["here"]), "base_s": statistics.median(times["base"]),
            "ratio_median": statistics.median(ratios), "ratios": ratios}


def cost_when_on(rounds: int, steps: int) -> dict:
    """Plain, Probe() and Probe(block_formats=...) steps, interleaved in one process."""
    import torch

    torch.set_num_threads(1)
    from fp16probe import Probe

    model, step = _workload()
    variants = {"plain": None, "probe": (), "fp8_e4m3": "fp8_e4m3", "mxfp8_e4m3": "mxfp8_e4m3", "nvfp4": "nvfp4"}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fmt in variants.items():
            if fmt is None:
                _cpu_per_step(step, None, 1)
                times[name].append(_cpu_per_step(step, None, steps))
                continue
            with Probe(model, block_formats=fmt or None) as probe:
                _cpu_per_step(step, probe, 1)
                times[name].append(_cpu_per_step(step, probe, steps))
    plain = times["plain"]
    return {name: {"cpu_per_step_s": statistics.median(t),
                   "vs_plain": statistics.median(a / b for a, b in zip(t, plain))} for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="a tree without the block formats, for the fp16-path comparison")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.steps)
        return 0
    result = {"load": os.getloadavg()}
    if args.base is not None:
        result["fp16_path"] = fp16_path(args.base, args.rounds, args.steps)
    result["cost_when_on"] = cost_when_on(args.rounds, args.steps)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
