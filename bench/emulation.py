"""The emulated target step (fp16probe.capture.emulate): its agreement with real autocast, and its cost.

Run from the repository root::

    python bench/emulation.py --out emulation.json            # CPU: agreement with CPU autocast, cost
    python bench/emulation.py --quick                          # tiny sizes (the test suite runs this)

Agreement: per bench model, the emulated fp16 step for the running device's autocast against a
real fp16 autocast step there (GradScaler's arithmetic: loss * S, backward, grad / S), both
against fp32: the whole model's ||g_emulated - g_real|| / ||g_fp32|| (within 0.1%, or 0.6 of
the real run's own error where that is larger: at full size the conv net's batch norms reduce
over 16K values, whose rounding order differs, and its values differ by 2.1% where the real run
is 4.1% off fp32), and each parameter's error size ||g - g_fp32|| / ||g_fp32||, emulated against
real, within 0.2% or 30% of the real one (what a verdict reads; tests/test_emulate.py holds the
smaller models to the tighter value rule). Where the real kernels round partial sums to fp16
(``partial_sum_rounding``: an AVX2 CPU's convolution backward), only the error sizes are compared.
``bench/gpu_check.py`` runs the same comparison on CUDA. Cost: wall time of one emulated step
against one plain fp32 step (forward, loss, backward), median of interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.run import GPT, MLP, ConvNet  # noqa: E402
from fp16probe.capture.emulate import emulated_step, reference_step  # noqa: E402
from fp16probe.running.demo import DemoNet, demo_batches, demo_loss  # noqa: E402

MODEL_TOL = 1e-3
PARAM_TOL = 2e-3
PARTIAL_SUMS_PARAM_TOL = 5e-3  # a parameter's error size where the real kernels round partial sums (agreement())
SCALE = 2.0**10


def workloads(device: str, quick: bool = False) -> list[tuple[str, nn.Module, Callable[[], torch.Tensor]]]:
    """(name, model, run) per bench model and the demo; ``run()`` makes the loss of one fixed batch."""
    torch.manual_seed(0)
    out: list[tuple[str, nn.Module, Callable[[], torch.Tensor]]] = []
    b, img, w = (2, 8, 4) if quick else (16, 32, 32)
    conv = ConvNet(w).to(device)
    x, y = torch.randn(b, 3, img, img, device=device), torch.randint(0, 10, (b,), device=device)
    out.append(("conv", conv, lambda: F.cross_entropy(conv(x), y)))
    b, seq, d, layers, vocab = (2, 8, 16, 1, 32) if quick else (8, 64, 192, 2, 1024)
    gpt = GPT(vocab, d, layers, seq).to(device)
    tok = torch.randint(0, vocab, (b, seq + 1), device=device)
    out.append(("transformer", gpt, lambda: F.cross_entropy(gpt(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())))
    b, w, layers = (2, 8, 10) if quick else (32, 32, 100)
    mlp = MLP(w, layers).to(device)
    xm, ym = torch.randn(b, w, device=device), torch.randint(0, 10, (b,), device=device)
    out.append(("mlp-200", mlp, lambda: F.cross_entropy(mlp(xm), ym)))
    demo = DemoNet().to(device)
    batch = tuple(t.to(device) for t in next(demo_batches()))
    out.append(("demo", demo, lambda: demo_loss(demo(batch[0]), batch)))
    return out


PARTIAL_SUMS_LINE = 0.01  # a share of a conv's input-gradient elements above which a kernel rounds partial sums


def partial_sum_rounding(device: str) -> float:
    """The share of a convolution's input gradient that ``device``'s fp16 autocast backward rounds otherwise than
    once, from an fp32 sum of the fp16 operands (what the emulated step assumes, as GPUs' tensor cores do).

    Measured here on an AMD EPYC with AVX2 (torch 2.13 CPU): 55% of the elements differ by an ulp, the kernel
    rounding its partial sums to fp16; a linear layer's differ in 0.1-0.2% (summation order only). Where this is
    above PARTIAL_SUMS_LINE the real run is no reference for the emulated step's values, only for its error sizes.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 16, 16, generator=g).to(device)
    w = (torch.randn(32, 16, 3, 3, generator=g) * 0.1).to(device)
    up = torch.randn(4, 32, 14, 14, generator=g).half().to(device)
    real = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.float16):
        out = F.conv2d(real, w)
    out.backward(up)
    once = x.half().float().requires_grad_()
    F.conv2d(once, w.half().float()).backward(up.float())
    assert real.grad is not None and once.grad is not None
    return float((real.grad.half() != once.grad.half()).float().mean())


def _real(model: nn.Module, run: Callable[[], torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = run()
    (loss * torch.full((1,), SCALE, device=loss.device)).backward()
    grads = {n: p.grad / SCALE for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def agreement(model: nn.Module, run: Callable[[], torch.Tensor], device: str,
              partial_sums: float | None = None) -> dict[str, Any]:
    """The emulated step for ``device``'s autocast against a real one there (see the module docstring).

    Where ``device``'s kernels round partial sums (:func:`partial_sum_rounding` above PARTIAL_SUMS_LINE;
    ``partial_sums``, measured when not given), a model with a convolution has its error sizes compared, not its
    values.
    """
    if partial_sums is None:
        partial_sums = partial_sum_rounding(device)
    state = torch.get_rng_state()
    ref = reference_step(model, run).grads
    emu = emulated_step(model, run, target=device, scale=SCALE).grads
    real = _real(model, run, device)
    torch.set_rng_state(state)
    total = sum(_norm(g) ** 2 for g in ref.values() if g is not None) ** 0.5
    names = [n for n in real if ref.get(n) is not None and _norm(ref[n]) > 1e-7 * total]
    if not names:
        return {"status": "failed", "why": "no gradient to compare"}
    whole = sum(_norm(emu[n] - real[n]) ** 2 for n in names) ** 0.5 / sum(_norm(ref[n]) ** 2 for n in names) ** 0.5
    real_off = sum(_norm(real[n] - ref[n]) ** 2 for n in names) ** 0.5 / sum(_norm(ref[n]) ** 2 for n in names) ** 0.5
    emu_off = sum(_norm(emu[n] - ref[n]) ** 2 for n in names) ** 0.5 / sum(_norm(ref[n]) ** 2 for n in names) ** 0.5
    convolves = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    values_compared = partial_sums <= PARTIAL_SUMS_LINE or not convolves
    # A kernel that rounds partial sums adds its own error, which no one-rounding model has: measured up to 0.36
    # points on the test's conv net's conv and batch-norm gradients (0.45% real, 0.09% emulated), so 0.5% there.
    tol = PARAM_TOL if values_compared else PARTIAL_SUMS_PARAM_TOL
    worst = max(_norm(emu[n] - real[n]) / _norm(ref[n]) / max(tol, 0.3 * _norm(real[n] - ref[n]) / _norm(ref[n]))
                for n in names)
    # the size of each parameter's error against fp32, emulated against real (what a verdict reads)
    size = max(abs(_norm(emu[n] - ref[n]) - _norm(real[n] - ref[n])) / _norm(ref[n])
               / max(tol, 0.3 * _norm(real[n] - ref[n]) / _norm(ref[n])) for n in names)
    # Values: within MODEL_TOL, or 0.6 of the real run's own error where a large reduction (batch
    # norm over 16K values) rounds in another order; sizes: each within 0.2% or 30% of the real one.
    ok = (not values_compared or whole <= max(MODEL_TOL, 0.6 * real_off)) and size <= 1
    return {"status": "ok" if ok else "failed", "emulated_vs_real": whole, "worst_parameter_over_allowance": worst,
            "real_vs_fp32": real_off, "emulated_vs_fp32": emu_off, "worst_error_size_over_allowance": size,
            "real_rounds_partial_sums": partial_sums, "values_compared": values_compared}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cost(model: nn.Module, run: Callable[[], torch.Tensor], device: str, rounds: int = 7) -> dict[str, float]:
    """Median wall time of one plain fp32 step and of one emulated step (interleaved rounds), and their ratio."""
    def plain() -> None:
        model.zero_grad(set_to_none=True)
        run().backward()

    def emulated() -> None:
        emulated_step(model, run, target=device, scale=SCALE)

    times: dict[str, list[float]] = {"plain": [], "emulated": []}
    for fn in (plain, emulated):  # warm-up: the fake-tensor dtype answers are cached after the first
        fn()
    for _ in range(rounds):
        for name, fn in (("plain", plain), ("emulated", emulated)):
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    p, e = statistics.median(times["plain"]), statistics.median(times["emulated"])
    return {"plain_ms": round(p * 1e3, 3), "emulated_ms": round(e * 1e3, 3), "ratio": round(e / p, 2)}


def check(device: str, quick: bool = False, with_cost: bool = True) -> dict[str, Any]:
    """Agreement (and cost) on every workload; status ok when every model agrees within the tolerances."""
    models: dict[str, Any] = {}
    partial_sums = partial_sum_rounding(device)
    for name, model, run in workloads(device, quick):
        models[name] = agreement(model, run, device, partial_sums)
        if with_cost:
            models[name]["cost"] = cost(model, run, device, rounds=2 if quick else 7)
    bad = [n for n, m in models.items() if m["status"] != "ok"]
    return {"status": "failed" if bad else "ok", "device": device, "torch": torch.__version__,
            "tolerance": {"model": MODEL_TOL, "parameter": PARAM_TOL}, "scale": SCALE, "models": models,
            "disagree": bad}


def main(argv: list[str] | None = None) -> int:
    """Run the check on this machine's device (CUDA when there is one), print or write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="where the figures go (JSON); default stdout")
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    got = check(args.device, quick=args.quick)
    text = json.dumps(got, indent=1)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n")
    return 0 if got["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
