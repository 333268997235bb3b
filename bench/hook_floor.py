"""The floor under any per-module capture: Python hooks at the Probe's points, doing nothing.

The Probe reads every hooked module's output gradient and every parameter's gradient. In
PyTorch that takes a forward hook per module (to reach its output), a hook on the node that
made the output (its gradient exists only while backward runs) and an accumulate hook per
parameter. This measures those hooks empty, on the same models and steps as
``bench/run.py``, so that a cost target can be checked against what no capture at these
points can go below:

* ``forward_hooks``: an empty forward hook on every leaf module;
* ``node_prehooks``: the forward hook registers an empty pre-hook on its output's node
  (the Probe's activation-gradient point, ``grad_fn.register_prehook``);
* ``capture_points``: that, plus an empty ``register_post_accumulate_grad_hook`` on every
  parameter (every point the Probe uses, with nothing in them);
* ``retain_grad``: the forward hook calls ``output.retain_grad()`` instead (a gradient kept by
  autograd's own C++ hook, no Python call in backward), the outputs released after the step,
  plus the empty parameter hooks: the one way to an output's gradient without a Python call
  per output in backward;
* ``probe``: the Probe as it comes.

CPU time (``time.process_time``) at one torch thread, the variants interleaved round by round,
each round at least 60 ms of steps, the median of per-round ratios to the plain step.

    python bench/hook_floor.py [--quick] [--models mlp-200] [--json out.json]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import Sizes, Workload, make_workloads, table_main  # noqa: E402
from fp16probe import Probe  # noqa: E402

VARIANTS = ("plain", "forward_hooks", "node_prehooks", "capture_points", "retain_grad", "probe")
TARGET = 1.15  # issue 39's line: every step at most 1.15x a plain step
_ROUND_S = 0.06  # each round runs at least this much plain-step time


def _leaves(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if next(m.children(), None) is None]


def _variants(w: Workload) -> dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]:
    held: list[torch.Tensor] = []

    def nothing(*args: Any) -> None:
        return None

    def register_prehook(module: Any, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.register_prehook(nothing)

    def retain(module: Any, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.retain_grad()
            held.append(out)

    def hooks(forward: Callable[..., None] | None, params: bool, keep: bool = False):
        def make():
            handles = [m.register_forward_hook(forward) for m in _leaves(w.model)] if forward else []
            if params:
                handles += [p.register_post_accumulate_grad_hook(nothing) for p in w.model.parameters()
                            if p.requires_grad]

            def run() -> None:
                w.step()
                if keep:
                    held.clear()  # the step's outputs and their kept gradients go

            return run, lambda: [h.remove() for h in handles]

        return make

    def plain():
        return w.step, lambda: None

    def probe():
        p = Probe(w.model).start()

        def run() -> None:
            w.step()
            p.step()

        return run, p.stop

    return {
        "plain": plain,
        "forward_hooks": hooks(nothing, False),
        "node_prehooks": hooks(register_prehook, False),
        "capture_points": hooks(register_prehook, True),
        "retain_grad": hooks(retain, True, keep=True),
        "probe": probe,
    }


def bench_model(w: Workload, s: Sizes) -> dict:
    """Per-step CPU time of each variant, interleaved round by round; ratios as medians of per-round ratios."""
    makers = _variants(w)
    w.step()
    t0 = time.process_time()
    w.step()
    steps = max(s.steps_per_round, int(_ROUND_S / max(time.process_time() - t0, 1e-6)))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(s.step_rounds):
        for name in VARIANTS:
            run, stop = makers[name]()
            run()  # the first step after attaching is not timed
            t0 = time.process_time()
            for _ in range(steps):
                run()
            times[name].append((time.process_time() - t0) / steps)
            stop()
    plain = times["plain"]
    return {
        "model": w.name, "what": w.what, "steps_per_round": steps,
        "plain_ms": 1e3 * statistics.median(plain),
        "over_plain": {v: statistics.median(a / b for a, b in zip(times[v], plain) if b > 0)
                       for v in VARIANTS if v != "plain"},
    }


def run(sizes: Sizes) -> dict:
    """The models of ``sizes``; the machine's load beside the figures."""
    torch.set_num_threads(1)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    return {"torch": torch.__version__, "threads": 1, "load_average": load, "target": TARGET,
            "models": [bench_model(w, sizes) for w in make_workloads(sizes)]}


def format_table(r: dict) -> str:
    """The figures as a Markdown table, each variant over the plain step."""
    names = [v for v in VARIANTS if v != "plain"]
    rows = ["| model | plain ms | " + " | ".join(n.replace("_", " ") for n in names) + f" | points empty <= {TARGET}x? |",
            "|---|---|" + "---|" * len(names) + "---|"]
    for m in r["models"]:
        o = m["over_plain"]
        floor = min(o["capture_points"], o["retain_grad"])
        rows.append(f"| {m['model']} | {m['plain_ms']:.1f} | " + " | ".join(f"{o[n]:.3f}x" for n in names)
                    + f" | {'yes' if floor <= TARGET else 'no'} ({floor:.3f}x) |")
    return "\n".join(rows) + f"\n\nCPU time, one torch thread, load average {' '.join(r['load_average'])}."


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the table (and write JSON with ``--json``)."""
    return table_main(__doc__, run, format_table, argv)


if __name__ == "__main__":
    raise SystemExit(main())
