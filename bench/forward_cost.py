"""What the forward-pass captures cost: the Probe's forward maxima and the profile's ForwardAudit.

Two captures came with the whole-fp16-run work:

* ``Probe(forward=True)`` (the default): one ``amax`` per hooked module output per sampled
  step, folded on the device. Measured as Probe with it against Probe without it.
* ``ForwardAudit`` (``fp16probe.profile`` runs it on every fp32 profiled step, never inside
  a user's training loop): a ``TorchFunctionMode`` that works out each op's dtype in the
  target run and reads every fp16 tensor once more. Measured against the plain step.

Same models and steps as ``bench/run.py``; CPU time (``time.process_time``) at one torch
thread, the variants interleaved round by round, the median of per-round ratios reported.
The audit wraps the whole step (forward, loss, backward and the optimizer's own ops), which
is what it costs a profile step.

    python bench/forward_cost.py [--quick] [--models conv,mlp-200] [--json out.json]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import Sizes, Workload, make_workloads, table_main  # noqa: E402
from fp16probe import Probe  # noqa: E402
from fp16probe.capture.forward import ForwardAudit  # noqa: E402

VARIANTS = ("plain", "probe_without_forward", "probe", "audit")


def _variants(w: Workload) -> dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]:
    def plain():
        return w.step, lambda: None

    def probe(forward: bool):
        def make():
            p = Probe(w.model, forward=forward).start()

            def run() -> None:
                w.step()
                p.step()

            return run, p.stop

        return make

    def audit():
        a = ForwardAudit(w.model)
        counter = [0]

        def run() -> None:
            with a.step(counter[0]):
                w.step()
            counter[0] += 1

        return run, lambda: a.result()

    return {"plain": plain, "probe_without_forward": probe(False), "probe": probe(True), "audit": audit}


def bench_model(w: Workload, s: Sizes) -> dict:
    """Per-step CPU time of each variant, interleaved round by round; ratios as medians of per-round ratios."""
    makers = _variants(w)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(s.step_rounds):
        for name in VARIANTS:
            run, stop = makers[name]()
            run()  # warm-up (attach, first tracked forward)
            t0 = time.process_time()
            for _ in range(s.steps_per_round):
                run()
            times[name].append((time.process_time() - t0) / s.steps_per_round)
            stop()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]) if y > 0)

    return {
        "model": w.name, "what": w.what,
        "step_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
        "forward_capture": ratio("probe", "probe_without_forward"),
        "probe_over_plain": ratio("probe", "plain"),
        "audit_over_plain": ratio("audit", "plain"),
    }


def run(sizes: Sizes) -> dict:
    """Every model of the benchmark; the machine's load beside the figures."""
    torch.set_num_threads(1)
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    return {"torch": torch.__version__, "threads": 1, "load_average": load,
            "models": [bench_model(w, sizes) for w in make_workloads(sizes)]}


def format_table(r: dict) -> str:
    """The figures as a Markdown table."""
    rows = ["| model | Probe forward maxima (probe / probe without) | Probe / plain | ForwardAudit / plain |",
            "|---|---|---|---|"]
    for m in r["models"]:
        rows.append(f"| {m['model']} | {m['forward_capture']:.3f}x | {m['probe_over_plain']:.2f}x | "
                    f"{m['audit_over_plain']:.2f}x |")
    return "\n".join(rows) + f"\n\nCPU time, one torch thread, load average {' '.join(r['load_average'])}."


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the table (and write JSON with ``--json``)."""
    return table_main(__doc__, run, format_table, argv)


if __name__ == "__main__":
    raise SystemExit(main())
