"""Peak extra memory of the Probe on a ResNet-18-like model, from the process's peak RSS.

Each variant runs in a fresh process (``--variant plain`` or ``--variant probe``) that imports
the same modules (torch, fp16probe and its CPU kernel, warmed up), builds the same model and
runs the same SGD steps; the Probe variant also takes its report. The extra memory is the
difference of the two processes' peak resident set sizes (``ru_maxrss``), the median over
``--repeats`` pairs. CPU only; torch on one thread.

    python bench/peak_memory.py                      # this checkout
    PYTHONPATH=/path/to/other/checkout python bench/peak_memory.py   # another version, same model

It uses only ``Probe(model)``, ``start()``, ``step()`` and ``report()``, which every version has.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("PYTHONPATH") and ROOT not in sys.path:  # this checkout unless PYTHONPATH names one
    sys.path.insert(0, ROOT)


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18's layout (He et al. 2015, arXiv:1512.03385): stem, four stages of two basic blocks."""
    from models import BasicBlock  # bench/models.py (this script's folder is on sys.path)

    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


def run_variant(variant: str, steps: int, batch: int, image: int) -> dict:
    """Run one variant in this process; return its peak RSS in KiB."""
    torch.set_num_threads(1)
    from fp16probe import Probe  # imported by both variants: the same modules are loaded

    torch.manual_seed(0)
    warm = nn.Linear(4, 4)
    with Probe(warm) as p:  # load and compile the CPU kernel in both variants
        warm(torch.randn(2, 4)).sum().backward()
        p.step()
    p.report()
    model = resnet18()
    x, y = torch.randn(batch, 3, image, image), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    probe = Probe(model).start() if variant == "probe" else None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if probe is not None:
            probe.step()
    if probe is not None:
        probe.stop()
        probe.report()
    return {"variant": variant, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("plain", "probe"), help="run one variant here (internal)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of processes; the median is reported")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    sizes = ["--steps", str(args.steps), "--batch", str(args.batch), "--image", str(args.image)]
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.steps, args.batch, args.image)))
        return 0
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed, and then
    # keeps freed tensors' memory in the heap, so peak RSS would depend on the history.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    peaks: dict[str, list[int]] = {"plain": [], "probe": []}
    for _ in range(args.repeats):
        for variant in ("plain", "probe"):
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--variant", variant, *sizes],
                check=True, capture_output=True, text=True, env=env,
            ).stdout
            peaks[variant].append(json.loads(out.strip().splitlines()[-1])["peak_rss_kib"])
    extra = [b - a for a, b in zip(peaks["plain"], peaks["probe"])]
    import fp16probe

    result = {
        "model": f"ResNet-18 layout, batch {args.batch} of {args.image}x{args.image}, {args.steps} SGD steps",
        "fp16probe": os.path.dirname(fp16probe.__file__),
        "peak_rss_kib": peaks,
        "extra_kib": extra,
        "extra_mib_median": round(statistics.median(extra) / 1024, 1),
    }
    print(f"{result['model']}; fp16probe from {result['fp16probe']}")
    print(f"peak RSS plain  {[round(k / 1024) for k in peaks['plain']]} MiB")
    print(f"peak RSS probe  {[round(k / 1024) for k in peaks['probe']]} MiB")
    print(f"extra (median of {args.repeats}): {result['extra_mib_median']} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
