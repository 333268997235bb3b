"""The prepared GPU check: one run within a time budget on a CUDA machine, figures in one JSON file.

Run from the repository root on a machine with a GPU::

    python bench/gpu_check.py --budget 300 --out gpu_check.json        # the core parts, about 3-5 min
    python bench/gpu_check.py --budget 900 --slow --out gpu_check.json # also verify, pytest -m cuda, bench

Each part runs in its own process under a hard time limit (its budget, or what is left of
``--budget``, whichever is less); a part that overruns is killed and recorded as
``timed_out``, a failing one as ``failed``, and the rest still run. The exit status is 1 if
any part failed or timed out. The JSON is rewritten after every part, so a run cut short
keeps what it measured. Parts, in order:

1. ``sync``: probed fp16-autocast steps with a real ``GradScaler`` under
   ``torch.cuda.set_sync_debug_mode("error")``, on a model with enough functional ops that
   the overflow ceiling folds its maxima inside backward, over enough steps (70) that its
   dtype tracking runs again (every 64 forwards) and its hook set is replayed in between;
   any host synchronisation raises. Then one probed step under the profiler: no
   host-to-device copy from pageable memory may appear (the debug mode does not flag those).
2. ``engine``: the GPU engines (Triton when installed, and the eager ``index_add_`` path)
   against the CPU engine on the same data, one tensor at a time and many in one launch:
   3 * 2^20 + 7 elements (every Triton program loops), random bit patterns, fp16 (binned
   in the fp16 domain, unscaled by powers of two and by another number), bf16, fp32; and one
   fp16 tensor of 2^31 + 9 elements (64-bit offsets) when the GPU has the memory for it.
3. ``amp``: a probed run under fp16 autocast with a real GradScaler; each step's weight
   gradient histograms equal the CPU engine's count of ``grad * (1 / scale)``.
4. ``overhead``: wall time by CUDA events of a GPT-2-124M-sized model built from its config
   (12 layers, 12 heads, d=768, vocab 50257, context 1024) in fp16 autocast with a
   GradScaler, batch 8 x 1024: plain, the one-read limit (a hook reading every gradient
   once), the Probe every step, and every=10, in interleaved rounds (median ratios).
5. ``forward_headroom``, ``shadow_step``, ``autocast_ops``: named slots for the costs and
   checks other issues add: the Probe with its forward maxima against without, the Probe with
   shadow steps (an fp32 rerun every 10th sampled step, past the doubling start) against
   without and what one shadowed step adds, both by CUDA events on the GPT-2-124M-sized model,
   and the CUDA autocast op-dtype check; each runs when this checkout has the feature, else
   it is recorded as ``not_available`` with the reason.
6. ``emulation``: the emulated fp16 step (fp16probe.capture.emulate) with CUDA's autocast rules
   against a real CUDA fp16 autocast step, per bench model and the demo, within the tolerances
   measured on the CPU (tests/test_emulate.py), and one emulated step's cost against a plain one.
7. Slow, with ``--slow`` only: ``verify`` (``fp16probe profile --verify`` on the demo),
   ``pytest`` (the suite's CUDA-marked tests), ``bench`` (``bench/run.py --device cuda``).

``--dry-run`` runs every part that can run without a GPU on the CPU with tiny sizes, in this
process (the test suite does this, so the script cannot rot); what needs CUDA is recorded
as skipped. Never fake figures: a skipped part has none.
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
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.models import HookMix  # noqa: E402
from fp16probe import Probe  # noqa: E402
from fp16probe.capture import engine  # noqa: E402
from fp16probe.report import WEIGHT_GRAD  # noqa: E402


PART_LIMIT = 600.0  # seconds a part's own subprocess may run (set from the part's budget in its process)


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


class _SyncNet(nn.Module):
    """HookMix, then ``layers`` blocks of Linear with functional ops after it (tanh, a gain): each
    block gives the overflow ceiling two nodes of its own, so it folds inside backward."""

    def __init__(self, layers: int = 70) -> None:
        super().__init__()
        self.mix = _Net()
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(x)
        for lin in self.blocks:
            h = torch.tanh(lin(h)) * 1.5
        return h


def check_sync(device: str, dry_run: bool = False) -> dict:
    """Probed fp16-autocast steps with a GradScaler raise on any host sync (CUDA's debug mode).

    70 steps: past the dtype tracking's re-run (every 64 forwards) with replayed hook sets
    between; the model gives the ceiling more than 128 nodes a step, so its pending maxima
    fold inside backward (every 256). On a dry run the same loop runs on the CPU, without the
    debug mode (it needs CUDA): the part is then ``skipped``, with the loop's figures.
    """
    from fp16probe.capture import ceiling as ceiling_module

    torch.manual_seed(0)
    model = _SyncNet(70 if not dry_run else 6).to(device)
    x = torch.randn(4, 3, 8, 8, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device)
    steps = 2 if dry_run else 70
    folds = [0]
    fold_every = ceiling_module._FOLD_EVERY
    if dry_run:  # a small model on the CPU: fold sooner, so the in-hook fold runs here too
        ceiling_module._FOLD_EVERY = 16
    try:
        return _sync_loop(model, x, opt, scaler, device, steps, folds, fold_every)
    finally:
        ceiling_module._FOLD_EVERY = fold_every


def _sync_loop(model: nn.Module, x: torch.Tensor, opt, scaler, device: str, steps: int, folds: list[int],
               fold_every: int) -> dict:
    from fp16probe.capture import ceiling as ceiling_module

    with Probe(model, scaler=scaler, activations=True) as probe:
        ceiling = probe.collector("ceiling").hooks
        real_fold = ceiling._fold

        def counted_fold() -> None:
            folds[0] += 1
            real_fold()

        ceiling._fold = counted_fold
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast(device, dtype=torch.float16):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                probe.step()
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            scaler.step(opt)  # GradScaler's own inf check syncs, by design: outside the guard
            scaler.update()
    report = probe.report()
    errors = report.metadata.extra.get("hook_errors", 0)
    figures = {
        "steps": len(report.trace),
        "hook_errors": errors,
        "first_hook_error": report.metadata.extra.get("first_hook_error"),
        "ceiling_folds_in_backward": folds[0] - steps,  # close_step folds once a step as well
        "ceiling_nodes_hooked_per_step": ceiling.nodes_hooked / steps,
        "fold_every": ceiling_module._FOLD_EVERY,
        "fold_every_in_the_package": fold_every,
        "dtype_tracking_runs": ceiling.forwards_tracked,
        "recheck_every": ceiling_module._RECHECK_EVERY,
        "replayed_forwards": ceiling.forwards_replayed,
    }
    if device != "cuda":
        return {"status": "skipped", "why": "needs CUDA (set_sync_debug_mode); the loop ran on the CPU without it",
                **figures}
    pageable = _pageable_copies_in_a_probed_step(model, x, opt, scaler)
    reached = figures["ceiling_folds_in_backward"] > 0 and ceiling.forwards_tracked >= 2
    return {
        "status": "ok" if not errors and len(report.trace) == steps and not pageable and reached else "failed",
        **figures,
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
    every_fp16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    fp16 = (torch.randn(n, generator=g) * 2.0**-10).half()
    fp16[:: max(1, n // 65536)] = every_fp16[: len(fp16[:: max(1, n // 65536)])]  # every pattern, spread out
    cases = [
        ("random_bits", bits.view(torch.float32), None),
        ("fp16", fp16, None),
        ("every_fp16_pattern", every_fp16, None),
        ("bf16", (torch.randn(n, generator=g) * 1e-30).to(torch.bfloat16), None),
        ("relu_masked", torch.relu(dense), None),
        ("unscaled_fp16_pow2", fp16, torch.tensor(2.0**-16)),
        ("unscaled_fp16_not_pow2", fp16, torch.tensor(0.3)),
        ("unscaled_subnormals", dense * 1e-35, torch.tensor(2.0**-7)),
    ]
    return [(name, x.to(device), None if inv is None else inv.to(device)) for name, x, inv in cases]


def _cpu_reference(x: torch.Tensor, inv: torch.Tensor | None, chunk: int = 1 << 26) -> tuple[torch.Tensor, int]:
    """The CPU engine's counts of ``x * inv``, in chunks (counts add, keys take the max)."""
    counts, keys = engine.new_table(1)
    flat = x.reshape(-1)
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk].cpu()
        engine.count_into(part.float() * inv.cpu() if inv is not None else part, counts, keys, 0)
    return counts[0], int(keys[0])


def _engines_on(device: str) -> list[str]:
    names = ["device"]
    if device == "cuda" and engine._triton_available():
        names.insert(0, "triton")
    return names


def _count_with(which: str, fn: Callable[[], None]) -> None:
    saved, saved_cpu = engine._TRITON, engine.CPU_ENGINE
    engine._TRITON = which == "triton"
    engine.CPU_ENGINE = "device"  # on a CPU dry run: the accelerator path on CPU tensors
    try:
        fn()
    finally:
        engine._TRITON, engine.CPU_ENGINE = saved, saved_cpu


def check_engine(device: str, n: int = 3 * (1 << 20) + 7, big: bool = False) -> dict:
    """Each engine on ``device`` gives the CPU engine's counts on the same data (one tensor, and many at once)."""
    out: dict = {"numel": n, "cases": {}}
    names = _engines_on(device)
    ok = True
    cases = _engine_cases(device, n)
    for name, x, inv in cases:
        want = _cpu_reference(x, inv)
        got = {}
        for which in names:
            counts, keys = engine.new_table(1, device)
            _count_with(which, lambda x=x, inv=inv, c=counts, k=keys: engine.count_into(x, c, k, 0, inv=inv))
            got[which] = torch.equal(counts[0].cpu(), want[0]) and int(keys[0]) == want[1]
            ok &= got[which]
        out["cases"][name] = got
    # many tensors in one call (the end-of-backward weight-gradient pass), scaled
    inv = torch.tensor(2.0**-12, device=device)
    xs = [x for _, x, _ in cases]
    rows = list(range(len(xs)))[::-1]
    many = {}
    for which in names:
        counts, keys = engine.new_table(len(xs), device)
        _count_with(which, lambda c=counts, k=keys: engine.count_many(xs, c, k, rows, replace=True, inv=inv))
        same = True
        for x, row in zip(xs, rows):
            want = _cpu_reference(x, inv)
            same &= torch.equal(counts[row].cpu(), want[0]) and int(keys[row]) == want[1]
        many[which] = same
        ok &= same
    out["cases"]["many_at_once_scaled"] = many
    out["big"] = _check_big(device, names) if big else {"status": "skipped", "why": "dry run"}
    ok &= out["big"]["status"] != "failed"
    out["engines"] = names
    out["status"] = "ok" if ok else "failed"
    return out


def _check_big(device: str, names: list[str]) -> dict:
    """One fp16 tensor of 2^31 + 9 elements (64-bit offsets), when the device has room for it."""
    n = (1 << 31) + 9
    need = n * 2 + (1 << 30)
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
    if free < need:
        return {"status": "skipped", "why": f"needs {need / 2**30:.1f} GiB free on the device, {free / 2**30:.1f} there"}
    x = torch.empty(n, dtype=torch.float16, device=device)
    x.normal_(0, 2.0**-10)
    x[-1000:] = float("inf")  # the end of the tensor is reached (an int32 offset would wrap before it)
    x[-1] = 2.0**15
    want = _cpu_reference(x, None)
    got = {}
    for which in names:
        counts, keys = engine.new_table(1, device)
        _count_with(which, lambda c=counts, k=keys, x=x: engine.count_into(x, c, k, 0))
        got[which] = torch.equal(counts[0].cpu(), want[0]) and int(keys[0]) == want[1]
    del x
    torch.cuda.empty_cache()
    return {"status": "ok" if all(got.values()) else "failed", "numel": n, "engines": got}


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


def _gpt2_124m(device: str, dry_run: bool) -> tuple[nn.Module, torch.Tensor, str]:
    """GPT-2 124M's shape from its config (12 layers, 12 heads, d=768, vocab 50257, context 1024), batch 8."""
    from bench.run import GPT

    vocab, dim, layers, seq, heads, batch = (64, 32, 2, 16, 4, 2) if dry_run else (50257, 768, 12, 1024, 12, 8)
    torch.manual_seed(0)
    model = GPT(vocab, dim, layers, seq, heads).to(device)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    return model, tokens, f"GPT-2 config: {layers} layers, {heads} heads, d={dim}, vocab {vocab}, batch {batch} x {seq}"


def _gpt2_workload(device: str, dry_run: bool) -> tuple[nn.Module, str, Any, Callable[[], None], Callable[[], Any]]:
    """The GPT-2-124M-sized model, its description, a GradScaler, its fp16-autocast SGD step, and the
    step's loss computed without autocast (what ``Probe.shadow`` reruns in fp32)."""
    import torch.nn.functional as F

    model, tokens, what = _gpt2_124m(device, dry_run)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device)

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16):
            value = loss()
        scaler.scale(value).backward()
        scaler.step(opt)
        scaler.update()

    return model, what, scaler, step, loss


def _timer(device: str) -> Callable[[Callable[[], None], int], float]:
    """Seconds per call of ``fn`` over ``reps`` calls: CUDA events on a GPU (device time), else wall time."""

    def timed(fn: Callable[[], None], reps: int) -> float:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    return timed


def _interleaved(variants: dict[Any, Callable[[], tuple[Callable[[], None], Callable[[], None]]]],
                 reps: dict[Any, int], rounds: int, warm: int, device: str, untimed: bool = True) -> dict[Any, list]:
    """Seconds per step of each variant over interleaved rounds (A, B, ..., A, B, ...). ``attach()`` gives
    (run, detach); each round attaches every variant, runs it once untimed (unless ``untimed`` is False),
    times ``reps`` runs and detaches it; the first ``warm`` rounds (compiles, the allocator) are not kept."""
    timed = _timer(device)
    times: dict[Any, list[float]] = {k: [] for k in variants}
    for r in range(rounds + warm):
        for name, attach in variants.items():
            run, detach = attach()
            if untimed:
                run()
            t = timed(run, reps[name])
            detach()
            if r >= warm:
                times[name].append(t)
    return times


def _ratio(times: dict[Any, list[float]], a: Any, b: Any) -> float:
    """The median over rounds of ``a``'s time over ``b``'s."""
    import statistics

    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def check_overhead(device: str, dry_run: bool = False) -> dict:
    """Wall-time ratios (CUDA events) of the Probe every step, every=10 and the one-read limit to a plain step."""
    import statistics

    from bench.run import TensorHooks, one_read

    model, what, scaler, step, _ = _gpt2_workload(device, dry_run)

    def with_probe(every: int):
        def attach():
            p = Probe(model, every=every, scaler=scaler).start()

            def run() -> None:
                step()
                p.step()

            return run, p.stop

        return attach

    def limit():
        h = TensorHooks(model, one_read)
        return step, h.remove

    variants = {"plain": lambda: (step, lambda: None), "one_read_limit": limit, "probe_every1": with_probe(1),
                "probe_every10": with_probe(10)}
    reps = {"plain": 3, "one_read_limit": 3, "probe_every1": 3, "probe_every10": 10}
    if dry_run:
        reps = dict.fromkeys(reps, 1) | {"probe_every10": 10}
    rounds = 1 if dry_run else 5
    times = _interleaved(variants, reps, rounds, 0 if dry_run else 1, device)
    return {
        "status": "ok",
        "model": what,
        "params": sum(p.numel() for p in model.parameters()),
        "clock": "CUDA events" if device == "cuda" else "wall time (dry run)",
        "rounds": rounds,
        "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "ratio_to_plain": {k: _ratio(times, k, "plain") for k in variants if k != "plain"},
        "probe_over_limit": _ratio(times, "probe_every1", "one_read_limit"),
        "accelerator_engine": ("triton" if engine._triton_available() else "torch index_add_")
        if device == "cuda" else "cpu",
    }


def check_slot(name: str, device: str, dry_run: bool) -> dict:
    """A named slot for another issue's cost or check: run when this checkout has the feature, else ``not_available``."""
    if name == "autocast_ops":
        try:
            from fp16probe.capture.autocast_rules import compare_with_device
        except ImportError:
            return {"status": "not_available", "why": "the CUDA autocast op-dtype check (issue #19, "
                    "fp16probe.capture.autocast_rules.compare_with_device) is not in this checkout"}
        got = compare_with_device(device)
        return {"status": "ok" if not got.get("disagree") else "failed", **got}
    if name == "forward_headroom":
        import inspect

        if "forward" not in inspect.signature(Probe).parameters:
            return {"status": "not_available", "why": "forward-pass headroom capture (issue #19, Probe(forward=...))"
                    " is not in this checkout"}
        return _forward_headroom_cost(device, dry_run)
    if name == "shadow_step":
        import importlib.util

        if importlib.util.find_spec("fp16probe.capture.shadow") is None:
            return {"status": "not_available", "why": "shadow steps (issue #20, fp16probe.capture.shadow) are not in"
                    " this checkout"}
        return _shadow_step_cost(device, dry_run)
    raise ValueError(name)


def check_emulation(device: str, dry_run: bool) -> dict:
    """The emulated fp16 step for this device's autocast against a real autocast step here, and its cost
    (bench/emulation.py: conv, transformer, mlp-200 and the demo; tolerances as tests/test_emulate.py's)."""
    from bench.emulation import check

    return check(device, quick=dry_run)


def _forward_headroom_cost(device: str, dry_run: bool) -> dict:
    """The Probe with its forward maxima against the Probe without, on the GPT-2-124M-sized model (CUDA events)."""
    import statistics

    model, what, scaler, step, _ = _gpt2_workload(device, dry_run)

    def with_forward(forward: bool):
        def attach():
            p = Probe(model, scaler=scaler, forward=forward).start()  # type: ignore[call-arg]

            def run() -> None:
                step()
                p.step()

            return run, p.stop

        return attach

    rounds, warm = (1, 0) if dry_run else (3, 1)
    times = _interleaved({False: with_forward(False), True: with_forward(True)},
                         dict.fromkeys((False, True), 1 if dry_run else 3), rounds, warm, device)
    return {
        "status": "ok",
        "model": what,
        "clock": "CUDA events" if device == "cuda" else "wall time (dry run)",
        "probe_with_forward_over_without": _ratio(times, True, False),
        "step_ms": {"probe_without_forward": statistics.median(times[False]) * 1e3,
                    "probe_with_forward": statistics.median(times[True]) * 1e3},
    }


def _shadow_step_cost(device: str, dry_run: bool) -> dict:
    """The Probe with shadow steps (an fp32 rerun every ``every``-th sampled step, ``Probe.shadow``) against
    the Probe without, on the GPT-2-124M-sized model (CUDA events), in rounds of ``every`` steps that
    each hold one shadowed step; also what one shadowed step adds, against the plain probed step."""
    import statistics

    model, what, scaler, step, loss = _gpt2_workload(device, dry_run)
    every = 2 if dry_run else 10
    probes = {0: Probe(model, scaler=scaler, shadow_every=0), every: Probe(model, scaler=scaler, shadow_every=every)}
    shadowed = 0
    with probes[every]:  # past the doubling start (sampled steps 1, 2, 3, 5, ..., 33) to the steady schedule
        for _ in range(4 if dry_run else 34):
            shadowed += probes[every].shadow(loss)
            step()
            probes[every].step()
    reran = {0: 0, every: 0}  # shadowed steps in the timed rounds: one a round with shadows, none without

    def restart(n: int):
        def attach():
            p = probes[n].start()

            def run() -> None:
                reran[n] += p.shadow(loss)
                step()
                p.step()

            return run, p.stop

        return attach

    rounds = 1 if dry_run else 3
    # No untimed step: each timed round is ``every`` steps, so it holds exactly one shadowed step.
    times = _interleaved({0: restart(0), every: restart(every)}, dict.fromkeys((0, every), every), rounds, 0, device,
                         untimed=False)
    ratio = _ratio(times, every, 0)
    return {
        "status": "ok" if reran == {0: 0, every: rounds} else "failed",
        "model": what,
        "clock": "CUDA events" if device == "cuda" else "wall time (dry run)",
        "shadow_every": every,
        "probe_with_shadow_over_without": ratio,
        "one_shadow_step_over_a_probed_step": (ratio - 1) * every,
        "step_ms": {"probe_without_shadow": statistics.median(times[0]) * 1e3,
                    "probe_with_shadow": statistics.median(times[every]) * 1e3},
        "warmup_shadowed_steps": shadowed,
        "timed_shadowed_steps": reran[every],
        "status_why": None if reran == {0: 0, every: rounds} else f"expected {rounds} shadowed step(s), saw {reran}",
    }


def check_verify(device: str, out_dir: Path, dry_run: bool) -> dict:
    """Run ``fp16probe profile --verify`` on the demo model; keep its verification block."""
    out = out_dir / "verify_report.json"
    steps = "2" if dry_run else "20"
    cmd = [sys.executable, "-m", "fp16probe", "profile", "--device", device, "--steps", steps,
           "--verify", "--out", str(out), "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PART_LIMIT, cwd=ROOT)
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
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PART_LIMIT, cwd=ROOT)
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


# name -> (budget in seconds, slow: runs only with --slow)
PARTS: dict[str, tuple[float, bool]] = {
    "sync": (60, False),
    "engine": (90, False),
    "amp": (30, False),
    "overhead": (120, False),
    "forward_headroom": (30, False),
    "shadow_step": (45, False),  # 34 warm-up steps past the doubling start, then 3 x 2 rounds of 10
    "autocast_ops": (30, False),
    "emulation": (40, False),
    "verify": (150, True),
    "pytest": (300, True),
    "bench": (300, True),
}


def run_part(name: str, device: str, out_dir: Path, dry_run: bool) -> dict:
    """Run one part in this process and return its record."""
    parts: dict[str, Callable[[], dict]] = {
        "sync": lambda: check_sync(device, dry_run),
        "engine": lambda: check_engine(device, 1 << 12 if dry_run else 3 * (1 << 20) + 7, big=not dry_run),
        "amp": lambda: check_amp(device),
        "overhead": lambda: check_overhead(device, dry_run),
        "forward_headroom": lambda: check_slot("forward_headroom", device, dry_run),
        "shadow_step": lambda: check_slot("shadow_step", device, dry_run),
        "autocast_ops": lambda: check_slot("autocast_ops", device, dry_run),
        "emulation": lambda: check_emulation(device, dry_run),
        "verify": lambda: check_verify(device, out_dir, dry_run),
        "pytest": lambda: check_pytest(device),
        "bench": lambda: check_bench(device, out_dir, dry_run),
    }
    try:
        return parts[name]()
    except Exception:
        return {"status": "failed", "error": traceback.format_exc()[-3000:]}


def _run_isolated(name: str, limit: float, dry_run: bool, out_dir: Path) -> dict:
    """Run one part in a child process, killed after ``limit`` seconds."""
    part_out = out_dir / f".gpu_check_{name}.json"
    part_out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--limit", str(limit),
           "--out", str(part_out)]
    if dry_run:
        cmd.append("--dry-run")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        return {"status": "timed_out", "limit_s": round(limit, 1),
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    if not part_out.exists():
        return {"status": "failed", "exit_code": proc.returncode, "stderr_tail": proc.stderr[-3000:]}
    result = json.loads(part_out.read_text())
    part_out.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    """Run every part within the budget, write the figures, exit 1 if any part failed or timed out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where the figures go (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: run the CPU-safe parts, tiny sizes")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (default 300)")
    ap.add_argument("--slow", action="store_true", help="also run the slow parts (verify, pytest, bench)")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out")
    ap.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    ap.add_argument("--part-budget", action="append", default=[], metavar="PART=SECONDS",
                    help="another time limit for one part (repeatable)")
    ap.add_argument("--isolate", action="store_true",
                    help="run each part in its own process under its time limit (the default without --dry-run)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # the child process of --isolate
    ap.add_argument("--limit", type=float, default=600.0, help=argparse.SUPPRESS)  # the child's time limit
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if not args.dry_run and device != "cuda":
        print("no CUDA device here: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    out_dir = args.out.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.part is not None:  # one part, in this process, for the parent
        global PART_LIMIT
        PART_LIMIT = max(args.limit - 5, 1)
        args.out.write_text(json.dumps(run_part(args.part, device, out_dir, args.dry_run), default=str) + "\n")
        return 0
    skip = set(filter(None, args.skip.split(",")))
    only = set(filter(None, args.only.split(",")))
    isolate = args.isolate or not args.dry_run
    budgets = {name: budget for name, (budget, _) in PARTS.items()}
    for item in args.part_budget:
        name, _, seconds = item.partition("=")
        if name not in budgets:
            print(f"--part-budget: no part named {name!r}; the parts are {', '.join(PARTS)}", file=sys.stderr)
            return 2
        budgets[name] = float(seconds)
    results: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "budget_s": args.budget,
        "isolated": isolate,
        "parts": {},
    }
    t_start = time.perf_counter()
    for name, (_, slow) in PARTS.items():
        budget = budgets[name]
        left = args.budget - (time.perf_counter() - t_start)
        why = ("--skip" if name in skip else "not in --only" if only and name not in only
               else "slow: run with --slow" if slow and not args.slow else "no budget left" if left < 1 else None)
        if why is not None:
            results["parts"][name] = {"status": "skipped", "why": why}
            continue
        t0 = time.perf_counter()
        limit = min(budget, left)
        results["parts"][name] = (_run_isolated(name, limit, args.dry_run, out_dir) if isolate
                                  else run_part(name, device, out_dir, args.dry_run))
        results["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        results["parts"][name]["budget_s"] = round(limit, 1)
        print(f"  {name}: {results['parts'][name]['status']} ({results['parts'][name]['seconds']} s"
              f" of {limit:.0f})", file=sys.stderr, flush=True)
        results["seconds"] = round(time.perf_counter() - t_start, 1)
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")  # kept if a later part hangs
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    bench_part = results["parts"].get("bench", {})
    if "table" in bench_part:
        print(bench_part["table"])
    failed = [n for n, r in results["parts"].items() if r["status"] in ("failed", "timed_out")]
    print(f"\nparts failed or timed out: {failed or 'none'}; {results['seconds']} s; figures in {args.out}",
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
