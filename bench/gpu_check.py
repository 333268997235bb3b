"""The prepared GPU check: a few minutes on a CUDA machine, figures written to one JSON file.

Run from the repository root on a machine with a GPU::

    python bench/gpu_check.py --out gpu_check.json

It runs, in order, and records each part's outcome and figures (a failing part is
recorded and the rest still run; the exit status is 1 if any part failed):

1. ``sync``: probed fp16-autocast steps with a real ``GradScaler`` under
   ``torch.cuda.set_sync_debug_mode("error")`` (forward and module hooks, gradient hooks,
   the end-of-backward weight-gradient pass, the overflow ceiling's node hooks, ``step()``);
   any host synchronisation raises. Then one probed step under the profiler: no
   host-to-device copy from pageable memory may appear (the debug mode does not flag those).
2. ``engine``: the GPU engines (Triton when installed, and the eager ``index_add_`` path)
   against the CPU engine on the same data: random bit patterns (subnormals, inf, NaN),
   fp16 and bf16 tensors, and gradients unscaled by a device scalar. Counts must be equal.
3. ``amp``: a probed run under fp16 autocast with a real GradScaler; each step's weight
   gradient histograms equal the CPU engine's count of ``grad * (1 / scale)`` taken at the
   end of backward.
4. ``verify``: ``fp16probe profile --verify`` on the demo model on the GPU (the recommended
   scaler run for real, predicted against measured).
5. ``pytest``: the suite's CUDA-marked tests (``-m cuda``).
6. ``bench``: ``bench/run.py --device cuda`` (fp16 autocast + GradScaler steps).

``--dry-run`` runs every part that can run without a GPU on the CPU with tiny sizes (the
test suite does this, so the script cannot rot); parts that need CUDA are recorded as
skipped. Never fake figures: a skipped part has none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.models import HookMix  # noqa: E402
from fp16probe import Probe  # noqa: E402
from fp16probe.capture import engine  # noqa: E402
from fp16probe.report import WEIGHT_GRAD  # noqa: E402


def _Net() -> nn.Module:
    """Every kind of hook the Probe uses (bench/models.HookMix), sized for the GPU check: [B, 3, 8, 8] in."""
    return HookMix(channels=8, dim=32, heads=4, classes=5)


def _amp_step(model: nn.Module, x: torch.Tensor, opt, scaler, device: str, probe: Probe | None,
              before_step: Callable[[], None] | None = None) -> None:
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    if before_step is not None:
        before_step()
    if probe is not None:
        probe.step()
    scaler.step(opt)
    scaler.update()


def check_sync(device: str) -> dict:
    """Probed fp16-autocast steps with a GradScaler raise on any host sync (CUDA's debug mode)."""
    if device != "cuda":
        return {"status": "skipped", "why": "needs CUDA (set_sync_debug_mode)"}
    torch.manual_seed(0)
    model = _Net().cuda()
    x = torch.randn(4, 3, 8, 8, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    steps = 5
    with Probe(model, scaler=scaler, activations=True) as probe:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                probe.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            scaler.step(opt)  # GradScaler's own inf check syncs, by design: outside the guard
            scaler.update()
    report = probe.report()
    errors = report.metadata.extra.get("hook_errors", 0)
    pageable = _pageable_copies_in_a_probed_step(model, x, opt, scaler)
    return {
        "status": "ok" if not errors and len(report.trace) == steps and not pageable else "failed",
        "steps": len(report.trace),
        "hook_errors": errors,
        "first_hook_error": report.metadata.extra.get("first_hook_error"),
        # set_sync_debug_mode does not flag a copy from pageable host memory: the profiler does.
        "pageable_host_to_device_copies": pageable,
    }


def _pageable_copies_in_a_probed_step(model: nn.Module, x: torch.Tensor, opt, scaler) -> list[str]:
    """Names of host-to-device copies from pageable memory while hooks and step() run."""
    from torch.profiler import ProfilerActivity, profile

    with Probe(model, scaler=scaler) as probe:
        _amp_step(model, x, opt, scaler, "cuda", probe)  # first step: tables allocated
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            probe.step()
            torch.cuda.synchronize()
        scaler.step(opt)
        scaler.update()
    return sorted({e.name for e in prof.events() if "HtoD" in e.name and "Pageable" in e.name})


def _engine_cases(device: str, n: int) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int64, generator=g).to(torch.int32)
    dense = torch.randn(n, generator=g) * 1e-3
    odd = n // 3 + 1  # not a multiple of the kernel's tile
    cases = [
        ("random_bits", bits.view(torch.float32), None),
        ("fp16", (torch.randn(odd, generator=g) * 1e-4).half(), None),
        ("bf16", (torch.randn(odd, generator=g) * 1e-30).to(torch.bfloat16), None),
        ("relu_masked", torch.relu(dense), None),
        ("unscaled_fp16", (torch.randn(odd, generator=g) * 512).half(), torch.tensor(2.0**-16)),
        ("unscaled_subnormals", dense * 1e-35, torch.tensor(2.0**-7)),
    ]
    return [(name, x.to(device), None if inv is None else inv.to(device)) for name, x, inv in cases]


def check_engine(device: str, n: int = 1 << 20) -> dict:
    """Each engine on ``device`` gives the CPU engine's counts on the same data."""
    out: dict = {"cases": {}}
    names = ["device"]
    if device == "cuda" and engine._triton_available():
        names.insert(0, "triton")
    ok = True
    for name, x, inv in _engine_cases(device, n):
        ref_x = x.cpu().float() * inv.cpu() if inv is not None else x.cpu()
        want = engine.histogram(ref_x)
        got = {}
        for which in names:
            saved = engine._TRITON
            engine._TRITON = which == "triton"
            saved_cpu = engine.CPU_ENGINE
            engine.CPU_ENGINE = "device"  # on a CPU dry run: the accelerator path on CPU tensors
            try:
                counts, keys = engine.new_table(1, device)
                engine.count_into(x, counts, keys, 0, inv=inv)
                same = torch.equal(counts[0].cpu(), want[0]) and int(keys[0]) == int(want[1])
            finally:
                engine._TRITON = saved
                engine.CPU_ENGINE = saved_cpu
            got[which] = same
            ok &= same
        out["cases"][name] = got
    out["engines"] = names
    out["status"] = "ok" if ok else "failed"
    return out


def check_amp(device: str) -> dict:
    """Weight-gradient histograms under fp16 autocast + GradScaler equal a re-count of grad/scale."""
    torch.manual_seed(0)
    model = _Net().to(device)
    x = torch.randn(4, 3, 8, 8, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device)
    steps = 3
    expected: list[dict[str, tuple]] = []
    with Probe(model, scaler=scaler) as probe:
        for _ in range(steps):

            def snapshot() -> None:
                inv = scaler._scale.double().reciprocal().float()
                step = {}
                for name, p in model.named_parameters():
                    if p.grad is not None:
                        counts, key = engine.histogram((p.grad.float() * inv).cpu())
                        step[name] = (counts, int(key))
                expected.append(step)

            _amp_step(model, x, opt, scaler, device, probe, before_step=snapshot)
    report = probe.report()
    # Totals over steps: each parameter's histogram is the sum of its per-step counts.
    mismatched = []
    for name in expected[0]:
        total = sum(step[name][0] for step in expected)
        key = max(step[name][1] for step in expected)
        module = report.module(name, WEIGHT_GRAD)
        h = module.histogram
        got = list(h.counts) + [h.zero, h.inf, h.nan]
        if got != total.tolist() or h.max_abs != engine.max_abs_from_key(key):
            mismatched.append(name)
    return {
        "status": "ok" if not mismatched else "failed",
        "steps": steps,
        "parameters": len(expected[0]),
        "mismatched": mismatched,
        "scales": list(report.trace.scale),
        "precision": report.metadata.precision,
    }


def check_verify(device: str, out_dir: Path, dry_run: bool) -> dict:
    """Run ``fp16probe profile --verify`` on the demo model; keep its verification block."""
    out = out_dir / "verify_report.json"
    steps = "2" if dry_run else "20"
    cmd = [sys.executable, "-m", "fp16probe", "profile", "--device", device, "--steps", steps,
           "--verify", "--out", str(out), "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    result: dict = {"command": " ".join(cmd[1:]), "exit_code": proc.returncode,
                    "seconds": round(time.perf_counter() - t0, 1)}
    if out.exists():
        report = json.loads(out.read_text())
        result["verification"] = report.get("verification")
        result["device"] = report.get("metadata", {}).get("device")
    # Exit 1 is the gate's "did not hold": a result, recorded, not a crash.
    result["status"] = "ok" if proc.returncode in (0, 1) and out.exists() else "failed"
    if result["status"] != "ok":
        result["stderr_tail"] = proc.stderr[-2000:]
    return result


def check_pytest(device: str) -> dict:
    """Run the suite's CUDA-marked tests."""
    if device != "cuda":
        return {"status": "skipped", "why": "needs CUDA"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    return {"status": "ok" if proc.returncode == 0 else "failed", "exit_code": proc.returncode,
            "tail": proc.stdout[-1500:]}


def check_bench(device: str, out_dir: Path, dry_run: bool) -> dict:
    """Run the benchmark on ``device`` and keep its JSON and table."""
    from bench import run as bench

    path = out_dir / f"bench_{device}.json"
    argv = ["--device", device, "--json", str(path)] + (["--quick"] if dry_run else [])
    bench.main(argv)
    data = json.loads(path.read_text())
    return {"status": "ok", "table": bench.format_table(data), "json": str(path)}


def main(argv: list[str] | None = None) -> int:
    """Run every part, write the figures, exit 1 if any part failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where the figures go (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: run the CPU-safe parts, tiny sizes")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if not args.dry_run and device != "cuda":
        print("no CUDA device here: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    out_dir = args.out.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    parts: dict[str, Callable[[], dict]] = {
        "sync": lambda: check_sync(device),
        "engine": lambda: check_engine(device, 1 << 12 if args.dry_run else 1 << 20),
        "amp": lambda: check_amp(device),
        "verify": lambda: check_verify(device, out_dir, args.dry_run),
        "pytest": lambda: check_pytest(device),
        "bench": lambda: check_bench(device, out_dir, args.dry_run),
    }
    results: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "parts": {},
    }
    for name, part in parts.items():
        if name in skip:
            results["parts"][name] = {"status": "skipped", "why": "--skip"}
            continue
        t0 = time.perf_counter()
        try:
            results["parts"][name] = part()
        except Exception:
            results["parts"][name] = {"status": "failed", "error": traceback.format_exc()[-3000:]}
        results["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"  {name}: {results['parts'][name]['status']} ({results['parts'][name]['seconds']} s)",
              file=sys.stderr, flush=True)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")  # kept if a later part hangs
    bench_part = results["parts"].get("bench", {})
    if "table" in bench_part:
        print(bench_part["table"])
    failed = [n for n, r in results["parts"].items() if r["status"] == "failed"]
    print(f"\nparts failed: {failed or 'none'}; figures in {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
