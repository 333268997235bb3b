"""The happy-path cost of the ranks' agreement (fp16probe.running.ranks.RankGuard), under 2 gloo ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/rank_guard.py

Profiles the built-in demo with the guard and without it (the guard replaced by None),
paired and interleaved over ROUNDS, at one torch thread, and prints on rank 0 the wall time
per step (between on_step calls, so setup and the report are left out), the CPU time per
step (the whole call) and the median and p90 of one agreement alone. State the machine's
load (``uptime``) beside the numbers: on a shared machine they move more than the guard does.
"""

from __future__ import annotations

import statistics
import time

import torch

STEPS, ROUNDS, AGREEMENTS = 60, 8, 500


def main() -> None:
    torch.set_num_threads(1)
    from fp16probe.capture import distributed

    distributed.init_from_env(timeout=60)
    import fp16probe.running.profile as running_profile
    from fp16probe.running.demo import DemoNet, demo_batches, demo_loss

    with_guard = running_profile._rank_guard
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(ROUNDS):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            running_profile._rank_guard = with_guard if mode == "on" else (lambda model: None)
            torch.manual_seed(0)
            stamps: list[float] = []
            c0 = time.process_time()
            running_profile.profile(DemoNet(), demo_batches(seed=distributed.rank()), demo_loss, steps=STEPS,
                                    on_step=lambda done, stamps=stamps: stamps.append(time.perf_counter()))
            cpu[mode].append((time.process_time() - c0) / STEPS)
            wall[mode].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    running_profile._rank_guard = with_guard
    guard = with_guard(DemoNet())
    agree = []
    for i in range(AGREEMENTS):
        t0 = time.perf_counter()
        guard.agree(i)
        agree.append(time.perf_counter() - t0)
    if distributed.rank() == 0:
        for mode in ("on", "off"):
            print(f"guard {mode}: wall/step median {statistics.median(wall[mode]) * 1e3:.2f} ms "
                  f"(rounds {', '.join(f'{x * 1e3:.1f}' for x in wall[mode])}), "
                  f"cpu/step median {statistics.median(cpu[mode]) * 1e3:.2f} ms")
        agree.sort()
        print(f"one agreement: median {statistics.median(agree) * 1e6:.0f} us, p90 {agree[int(0.9 * len(agree))] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
