"""The noise judgement's cost on the profile: fp16probe.profile with and without its batch-to-batch noise measurement.

Run from the repository root: python bench/noise_cost.py [--rounds 5]

On the demo model (fp16probe.running.demo) and bench/run.py's small GPT-2-style transformer (2 layers, d=192,
seq 64, batch 8), 4 batches each: ``profile(model, batches, loss, steps=4, target="cpu")`` as it is, and with
``fp16probe.capture.noise.measure_noise`` replaced by one that measures nothing (one batch: the judgement then
says the noise was not measured), in paired rounds whose order alternates. CPU seconds
(``time.process_time``), one torch thread; the time spent inside measure_noise is timed too. Prints the
median of each and of the paired difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp16probe  # noqa: E402
import fp16probe.capture.noise as noise_module  # noqa: E402
from bench.run import GPT  # noqa: E402
from fp16probe.running.demo import DemoNet, demo_batches, demo_loss  # noqa: E402

BATCHES = 4


def workloads() -> list[tuple[str, Callable[[], torch.nn.Module], list[Any], Callable[..., torch.Tensor]]]:
    """(name, model builder, batches, loss) for the demo and the small transformer."""
    gen = demo_batches()
    demo = [next(gen) for _ in range(BATCHES)]
    b, seq, d, layers, vocab = 8, 64, 192, 2, 1024  # bench/run.py's small_tf
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (b, seq + 1), generator=g) for _ in range(BATCHES)]
    text = [(t[:, :-1], t[:, 1:]) for t in tokens]

    def gpt() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(vocab, d, layers, seq)

    def lm_loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), batch[1].flatten())

    return [("demo", DemoNet, demo, demo_loss), ("transformer", gpt, text, lm_loss)]


def timed_profile(build: Callable[[], torch.nn.Module], batches: list[Any], loss: Callable[..., torch.Tensor],
                  with_noise: bool) -> tuple[float, float, Any]:
    """CPU seconds of one profile, the seconds inside measure_noise, and the answer's noise as it judged it."""
    real = noise_module.measure_noise
    inside = [0.0]

    def timed(*args: Any, **kwargs: Any) -> dict[str, Any]:
        t0 = time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            inside[0] += time.process_time() - t0

    def nothing(model: Any, runs: Any, names: Any) -> dict[str, Any]:
        return {"batches": 1, "params": [[0.0, 0.0] for _ in names], "source": "bench/noise_cost.py: not measured"}

    noise_module.measure_noise = timed if with_noise else nothing  # type: ignore[assignment]
    try:
        model = build()
        t0 = time.process_time()
        report = fp16probe.profile(model, batches, loss, steps=len(batches), target="cpu")
        spent = time.process_time() - t0
    finally:
        noise_module.measure_noise = real  # type: ignore[assignment]
    return spent, inside[0], str(report.recommendation.verdict)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for name, build, batches, loss in workloads():
        timed_profile(build, batches, loss, True)  # warm-up: imports, numba compilation
        on: list[float] = []
        off: list[float] = []
        inside: list[float] = []
        verdicts = set()
        for r in range(a.rounds):
            for with_noise in ((True, False) if r % 2 == 0 else (False, True)):
                spent, noise_s, v = timed_profile(build, batches, loss, with_noise)
                verdicts.add((with_noise, v))
                (on if with_noise else off).append(spent)
                if with_noise:
                    inside.append(noise_s)
        diff = [x - y for x, y in zip(on, off)]
        print(f"{name}: profile with the noise {statistics.median(on):.3f} s, without {statistics.median(off):.3f} s, "
              f"paired difference {statistics.median(diff):+.3f} s (range {min(diff):+.3f} to {max(diff):+.3f}), "
              f"inside measure_noise {statistics.median(inside):.3f} s; verdicts {sorted(verdicts)} "
              f"(median of {a.rounds} rounds, CPU seconds, one thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
