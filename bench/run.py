"""Benchmark fp16probe against the least any statistic costs and against the usual ways.

Run from the repository root::

    python bench/run.py                 # full run (about two minutes on two cores)
    python bench/run.py --quick         # tiny sizes: checks the code path, numbers mean little
    python bench/run.py --json out.json # where the JSON goes (default bench/results.json)

Every figure is a ratio measured in interleaved rounds (A, B, A, B, ...), reported as the
median over rounds, so a machine that other work slows down moves both sides together.

1. Engine: ``raw_histogram`` on a 16M-element fp32 tensor against one ``x.abs().amax()``.
2. Probe overhead: a full training step (forward, backward, optimizer) of a conv net and a
   transformer with the Probe on every leaf module, every step and with ``every=10``.
3. The usual ways on the same hooks and tensors: host copy + ``numpy.histogram``
   (TensorBoard's ``add_histogram``) and ``torch.histc`` with ``.item()`` per tensor
   (wandb's ``log_tensor_stats``).
4. Memory the Probe holds after 10, 100 and 1000 steps.
5. End to end: ``fp16probe.profile()`` (the path the CLI, callbacks and notebooks take) on
   the demo, against the same forward+backward loop without it; analysis included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/run.py` from anywhere uses this checkout
    sys.path.insert(0, str(ROOT))

from fp16probe import Probe  # noqa: E402
from fp16probe.capture.engine import histogram as raw_histogram  # noqa: E402


# -- sizes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    engine_numel: int
    engine_rounds: int
    conv_batch: int
    conv_image: int
    conv_width: int
    tf_batch: int
    tf_seq: int
    tf_dim: int
    tf_layers: int
    tf_vocab: int
    step_rounds: int
    steps_per_round: int
    memory_steps: tuple[int, ...]
    profile_steps: int = 10


FULL = Sizes(
    engine_numel=1 << 24,
    engine_rounds=9,
    conv_batch=16,
    conv_image=32,
    conv_width=32,
    tf_batch=8,
    tf_seq=64,
    tf_dim=192,
    tf_layers=2,
    tf_vocab=1024,
    step_rounds=5,
    steps_per_round=1,
    memory_steps=(10, 100, 1000),
)
QUICK = Sizes(
    engine_numel=1 << 12,
    engine_rounds=2,
    conv_batch=2,
    conv_image=8,
    conv_width=4,
    tf_batch=2,
    tf_seq=8,
    tf_dim=16,
    tf_layers=1,
    tf_vocab=32,
    step_rounds=2,
    steps_per_round=1,
    memory_steps=(2, 4, 8),
    profile_steps=2,
)


# -- models ----------------------------------------------------------------------------
class ConvNet(nn.Module):
    """A small ResNet-style net for 32x32 images: conv-BN-ReLU stages with residual blocks."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.stage1 = _Block(w, w, 1)
        self.stage2 = _Block(w, 2 * w, 2)
        self.stage3 = _Block(2 * w, 4 * w, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage3(self.stage2(self.stage1(self.stem(x))))
        return self.head(self.pool(x).flatten(1))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU()
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        return self.relu2(self.bn2(self.conv2(y)) + self.skip(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: pre-LayerNorm blocks of causal attention and a GELU MLP."""

    def __init__(self, vocab: int, dim: int, layers: int, seq: int, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_GPTBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class _GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


@dataclass
class Workload:
    name: str
    model: nn.Module
    step: Callable[[], None]


def make_workloads(s: Sizes) -> list[Workload]:
    """Build the two models with fixed data and an SGD step each."""
    torch.manual_seed(0)
    conv = ConvNet(s.conv_width)
    conv_x = torch.randn(s.conv_batch, 3, s.conv_image, s.conv_image)
    conv_y = torch.randint(0, 10, (s.conv_batch,))
    gpt = GPT(s.tf_vocab, s.tf_dim, s.tf_layers, s.tf_seq)
    tok = torch.randint(0, s.tf_vocab, (s.tf_batch, s.tf_seq + 1))
    return [
        Workload("convnet", conv, _train_step(conv, lambda m: F.cross_entropy(m(conv_x), conv_y))),
        Workload(
            "transformer",
            gpt,
            _train_step(gpt, lambda m: F.cross_entropy(m(tok[:, :-1]).flatten(0, 1), tok[:, 1:].flatten())),
        ),
    ]


def _train_step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model).backward()
        opt.step()

    return step


# -- the usual ways, on the same hooks as the Probe ------------------------------------
class TensorHooks:
    """Call ``fn`` on every leaf module's output gradient and every parameter's gradient.

    The same hook points the Probe uses: a forward hook that registers a tensor hook on
    the output, and ``register_post_accumulate_grad_hook`` on each parameter.
    """

    def __init__(self, model: nn.Module, fn: Callable[[torch.Tensor], object]) -> None:
        self.fn = fn
        self.handles = []
        for m in model.modules():
            if next(m.children(), None) is None:
                self.handles.append(m.register_forward_hook(self._forward))
        for p in model.parameters():
            self.handles.append(p.register_post_accumulate_grad_hook(lambda p: self.fn(p.grad)))

    def _forward(self, module: nn.Module, args: object, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self.fn)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def tensorboard_way(t: torch.Tensor) -> None:
    """Copy to the host and histogram with numpy, as SummaryWriter.add_histogram does."""
    a = t.detach().cpu().numpy().reshape(-1)
    np.histogram(a, bins=64)


def wandb_way(t: torch.Tensor) -> None:
    """Histogram on the device with histc, bounds fetched by .item(), as wandb's torch hook does."""
    flat = t.detach().reshape(-1).float()
    lo, hi = flat.min().item(), flat.max().item()
    torch.histc(flat, bins=64, min=lo, max=hi).cpu()


# -- timing ----------------------------------------------------------------------------
def _time(fn: Callable[[], object], reps: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def bench_engine(s: Sizes) -> dict:
    """Time the engine against one abs().amax() pass, interleaved."""
    torch.manual_seed(0)
    x = torch.randn(s.engine_numel) * 1e-3
    amax = lambda: x.abs().amax()  # noqa: E731
    engine = lambda: raw_histogram(x)  # noqa: E731
    amax(), engine()  # warm up
    a_ms, e_ms, ratios = [], [], []
    for _ in range(s.engine_rounds):
        a = _time(amax)
        e = _time(engine)
        a_ms.append(a * 1e3)
        e_ms.append(e * 1e3)
        ratios.append(e / a)
    small = torch.randn(4096)
    small_us = min(_time(lambda: raw_histogram(small), 200) for _ in range(3)) * 1e6
    return {
        "numel": s.engine_numel,
        "amax_ms": statistics.median(a_ms),
        "engine_ms": statistics.median(e_ms),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "small_tensor_numel": small.numel(),
        "small_tensor_us": small_us,
    }


def bench_steps(w: Workload, s: Sizes) -> dict:
    """Time a train step plain, with the Probe (every=1, every=10, op-level) and with the usual ways."""

    def with_probe(every: int, granularity: str = "module") -> Callable[[], Callable[[], None]]:
        def attach() -> Callable[[], None]:
            p = Probe(w.model, every=every, granularity=granularity).start()

            def run() -> None:
                w.step()
                p.step()

            run.detach = p.stop  # type: ignore[attr-defined]
            return run

        return attach

    def with_hooks(fn: Callable[[torch.Tensor], object]) -> Callable[[], Callable[[], None]]:
        def attach() -> Callable[[], None]:
            h = TensorHooks(w.model, fn)
            run = lambda: w.step()  # noqa: E731
            run.detach = h.remove  # type: ignore[attr-defined]
            return run

        return attach

    def plain() -> Callable[[], None]:
        run = lambda: w.step()  # noqa: E731
        run.detach = lambda: None  # type: ignore[attr-defined]
        return run

    variants = {
        "plain": plain,
        "probe_every1": with_probe(1),
        "probe_every10": with_probe(10),
        "probe_op_level": with_probe(1, "op"),
        "tensorboard_numpy": with_hooks(tensorboard_way),
        "wandb_histc_item": with_hooks(wandb_way),
    }
    # every=10 samples one step in ten: a round runs ten steps so that each round holds one.
    per_round = {k: (10 * s.steps_per_round if k == "probe_every10" else s.steps_per_round) for k in variants}
    for attach in variants.values():  # warm up every path once
        run = attach()
        run()
        run.detach()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(s.step_rounds):
        for k, attach in variants.items():
            run = attach()
            times[k].append(_time(run, per_round[k]))
            run.detach()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratio = {
        k: statistics.median(t / p for t, p in zip(times[k], times["plain"])) for k in variants if k != "plain"
    }
    probe_cost = ms["probe_every1"] - ms["plain"]
    return {
        "model": w.name,
        "params": sum(p.numel() for p in w.model.parameters()),
        "leaf_modules": sum(1 for m in w.model.modules() if next(m.children(), None) is None),
        "step_ms": ms,
        "ratio_to_plain": ratio,
        # How many times more the usual way adds to a step than the Probe does.
        "numpy_cost_over_probe_cost": (ms["tensorboard_numpy"] - ms["plain"]) / probe_cost
        if probe_cost > 0
        else float("inf"),
    }


def probe_bytes(p: Probe) -> dict:
    """Bytes of tensor storage the Probe holds: fixed tables and the per-step trace."""
    return p.recorder.memory()


def bench_memory(s: Sizes) -> dict:
    """Run a small MLP for 10/100/1000 steps and read what the Probe holds.

    What the Probe holds depends on the number of hooked tensors and steps, not on their
    sizes, so a model small enough to run a thousand steps in seconds shows it.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(8, 32)
    y = torch.randint(0, 10, (8,))
    step = _train_step(model, lambda m: F.cross_entropy(m(x), y))
    out = {}
    with Probe(model) as p:
        done = 0
        for n in s.memory_steps:
            while done < n:
                step()
                p.step()
                done += 1
            out[str(n)] = probe_bytes(p)
    a, b = s.memory_steps[0], s.memory_steps[-1]
    per_step = (out[str(b)]["trace_bytes"] - out[str(a)]["trace_bytes"]) / (b - a)
    return {
        "model": "mlp(32-64-64-10)",
        "hooked_tensors": sum(len(r.names) for r in p.recorder.rows.values()),
        "by_steps": out,
        "fixed_bytes_constant": len({v["fixed_bytes"] for v in out.values()}) == 1,
        "trace_bytes_per_step": per_step,
    }


# -- report ----------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.is_available(),
        "cpu_engine": _cpu_engine(),
    }


def _cpu_engine() -> str:
    """The CPU engine the Probe uses here (set FP16PROBE_CPU_ENGINE=torch|numba to choose)."""
    from fp16probe.capture import engine

    return engine.cpu_engine()


def format_table(r: dict) -> str:
    e = r["engine"]
    lines = [
        f"machine: {r['machine']['cpu']}, nproc={r['machine']['nproc']}, torch {r['machine']['torch']},"
        f" CPU engine: {r['machine']['cpu_engine']}",
        "",
        f"engine on {e['numel']:,} fp32: {e['engine_ms']:.1f} ms vs abs().amax() {e['amax_ms']:.1f} ms"
        f" -> {e['ratio']:.2f}x (rounds: {e['ratio_min']:.2f}-{e['ratio_max']:.2f}x)",
        f"engine on a {e['small_tensor_numel']}-element tensor: {e['small_tensor_us']:.0f} us per call",
        "",
        f"{'model':<12} {'plain ms':>9} {'probe/1':>8} {'probe/10':>9} {'op-level':>9} {'tb+numpy':>9} {'histc+item':>11}"
        f" {'numpy cost / probe cost':>24}",
    ]
    for m in r["steps"]:
        q = m["ratio_to_plain"]
        lines.append(
            f"{m['model']:<12} {m['step_ms']['plain']:>9.1f} {q['probe_every1']:>7.3f}x {q['probe_every10']:>8.3f}x"
            f" {q['probe_op_level']:>8.3f}x {q['tensorboard_numpy']:>8.3f}x {q['wandb_histc_item']:>10.3f}x"
            f" {m['numpy_cost_over_probe_cost']:>23.1f}x"
        )
    mem = r["memory"]
    lines.append("")
    lines.append(f"memory held by the Probe ({mem['model']}, {mem['hooked_tensors']} hooked tensors):")
    for n, v in mem["by_steps"].items():
        lines.append(
            f"  after {n:>5} steps: fixed {v['fixed_bytes'] / 1024:8.1f} KiB + trace {v['trace_bytes'] / 1024:8.1f} KiB"
        )
    lines.append(f"  trace grows {mem['trace_bytes_per_step']:.0f} bytes per step; fixed part constant: "
                 f"{mem['fixed_bytes_constant']}")
    prof = r.get("profile")
    if prof is not None:
        lines.append("")
        lines.append(f"fp16probe.profile() on the {prof['model']}, {prof['steps']} steps, analysis included: "
                     f"{prof['profile_s']:.2f} s vs {prof['plain_s']:.2f} s for the bare loop -> {prof['ratio']:.2f}x "
                     f"(verdict {prof['verdict']})")
    return "\n".join(lines)


def bench_profile(s: Sizes) -> dict:
    """Time ``fp16probe.profile()`` on the demo against the same forward+backward steps without it."""
    import fp16probe
    from fp16probe.running.demo import DemoNet, demo_batches, demo_loss

    batches = [b for _, b in zip(range(s.profile_steps), demo_batches())]
    model = DemoNet()
    fp16probe.profile(model, batches[:1], demo_loss, steps=1)  # warm-up: first-call costs are not the path's
    t0 = time.perf_counter()
    report = fp16probe.profile(model, batches, demo_loss, steps=s.profile_steps)
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for batch in batches:
        demo_loss(model(batch[0]), batch).backward()
        model.zero_grad(set_to_none=True)
    plain_s = time.perf_counter() - t0
    return {"model": "demo", "steps": s.profile_steps, "profile_s": profile_s, "plain_s": plain_s,
            "ratio": profile_s / plain_s, "verdict": str(report.recommendation.verdict)}


def run(sizes: Sizes) -> dict:
    """Run every section and return the results as plain data."""
    result = {"machine": machine(), "sizes": sizes.__dict__ | {"memory_steps": list(sizes.memory_steps)}}
    result["engine"] = _progress("engine", bench_engine, sizes)
    result["steps"] = [_progress(w.name, bench_steps, w, sizes) for w in make_workloads(sizes)]
    result["memory"] = _progress("memory", bench_memory, sizes)
    result["profile"] = _progress("profile()", bench_profile, sizes)
    return result


def _progress(what: str, fn: Callable, *args: object):
    t0 = time.perf_counter()
    out = fn(*args)
    print(f"  {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: exercise the code path only")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results.json", help="where to write JSON")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = run(QUICK if args.quick else FULL)
    result["wall_s"] = time.perf_counter() - t0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"\n({result['wall_s']:.0f} s; JSON in {args.json})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
