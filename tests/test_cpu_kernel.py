"""The CPU kernel's cell rule gives the previous kernel's counts, on every engine.

The kernel bins ``(|bits| + 0x7FFFFF) >> 23`` and runs a second pass only for the two cells
that mix bins (fp32 subnormals with 2^-126, values above 2^127 with inf). The oracle here is
the previous kernel's rule (cells ``2 f + (M == 0)``, subnormals by ``ceil(log2 M)``), written
in numpy, and frexp in float64; the data are every exponent field with its edge mantissas,
both signs, NaN payloads, the formats' rounding boundaries at every scale, and the
gradients of a real conv and transformer step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fp16probe.capture import _cpu_kernel
from fp16probe.capture import engine as engine_module
from fp16probe.capture.engine import NUM_BINS, histogram, new_table
from tests.test_histogram import edge_values

ENGINES = ("torch", "numba", "device")


def previous_kernel(x: torch.Tensor) -> tuple[list[int], int]:
    """The counts and key of the kernel before this one: cells ``2 f + (M == 0)`` folded onto bins."""
    a = x.detach().float().reshape(-1).contiguous().view(torch.int32).numpy().astype(np.int64) & 0x7FFFFFFF
    f, m = a >> 23, a & 0x7FFFFF
    cells = np.bincount(2 * f + (m == 0), minlength=512)
    counts = np.zeros(NUM_BINS, dtype=np.int64)
    for e in range(1, 255):
        counts[e + 22] += cells[2 * e + 1]
        counts[e + 23] += cells[2 * e]
    counts[278], counts[279], counts[280] = cells[1], cells[511], cells[510]
    sub = m[(f == 0) & (m > 0)]
    for v in sub.tolist():
        counts[(v - 1).bit_length()] += 1  # ceil(log2 M)
    finite = a[a < 0x7F800000]
    key = int(finite.max()) + (1 << 23) if finite.size else -1
    return counts.tolist(), key


def frexp_bins(x: torch.Tensor) -> list[int]:
    """Every finite nonzero value's bin ``ceil(log2 |v|) + 149`` from float64 frexp: the independent check."""
    counts = [0] * NUM_BINS
    for v in x.double().tolist():
        if v == 0 or not math.isfinite(v):
            continue
        mant, e = math.frexp(abs(v))
        counts[(e - 1 if mant == 0.5 else e) + 149] += 1
    return counts


def adversarial() -> torch.Tensor:
    """Every exponent field with mantissas 0, 1, 2^22 - 1, 2^22, 2^23 - 1 and a random one, both signs, and the edges."""
    g = torch.Generator().manual_seed(1)
    mant = [0, 1, (1 << 22) - 1, 1 << 22, (1 << 23) - 1]
    bits = []
    for f in range(256):
        for m in mant + [int(torch.randint(1, 1 << 23, (1,), generator=g))]:
            bits += [(f << 23) | m, -(1 << 31) | (f << 23) | m]
    for k in range(23):  # each subnormal power of two and its neighbours
        bits += [1 << k, (1 << k) + 1, max((1 << k) - 1, 1)]
    bits += [0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7F7FFFFF, 0x00800000, 0x007FFFFF]
    as_int = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int64).to(torch.int32)
    return torch.cat([as_int.view(torch.float32), torch.tensor(edge_values(), dtype=torch.float32)])


def real_gradients() -> list[torch.Tensor]:
    """Every activation and weight gradient of one conv step and one transformer step."""
    torch.manual_seed(0)
    grads: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, out: object) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(grads.append)

    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10))
    tf = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    for model, x in ((conv, torch.randn(4, 3, 8, 8)), (tf, torch.randn(2, 16, 32))):
        handles = [m.register_forward_hook(hook) for m in model.modules() if next(m.children(), None) is None]
        model(x).square().mean().backward()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        for h in handles:
            h.remove()
    return [g.detach().reshape(-1).clone() for g in grads]


def counted(x: torch.Tensor, name: str, monkeypatch) -> tuple[list[int], int]:
    if name == "numba" and not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(engine_module, "CPU_ENGINE", name)
    c, k = histogram(x)
    return c.tolist(), int(k)


@pytest.mark.parametrize("name", ENGINES)
def test_adversarial_bit_patterns_count_as_the_previous_kernel(name, monkeypatch):
    x = adversarial()
    want = previous_kernel(x)
    assert want[0][:278] == frexp_bins(x)[:278]  # the oracle itself, against frexp
    assert counted(x, name, monkeypatch) == want
    for v in x.tolist():  # alone, so no miscount hides behind another value's bin
        one = torch.tensor([v], dtype=torch.float32)
        assert counted(one, name, monkeypatch) == previous_kernel(one), v


@pytest.mark.parametrize("name", ENGINES)
def test_each_mixed_cell_alone_and_in_a_crowd(name, monkeypatch):
    """The two cells the second pass splits, at every position of an 8-lane group and in the tail,
    in short tensors (one lane) and long ones (eight), and on both sides of a block edge (the max
    pass and the counting loop go block by block)."""
    mixed = [2.0**-126, 2.0**-130, 2.0**-149, 2.0**127 * 1.5, math.inf, -math.inf, math.nan, 2.0**127]
    long = getattr(_cpu_kernel, "_SMALL", 1024)
    block = getattr(_cpu_kernel, "_BLOCK", 8192)
    for n in (1, 7, 8, 9, 17, 64, long - 1, long, long + 9, block + 1, 2 * block + 9):
        for v in mixed:
            for pos in {0, n // 2, n - 1} | ({block - 1, block} if n > block else set()):
                x = torch.full((n,), 0.5)
                x[pos] = v
                assert counted(x, name, monkeypatch) == previous_kernel(x), (n, v, pos)


@pytest.mark.parametrize("name", ENGINES)
def test_real_gradients_count_as_the_previous_kernel(name, monkeypatch):
    for g in real_gradients():
        assert counted(g, name, monkeypatch) == previous_kernel(g)


def test_split_across_threads_and_chunks_gives_the_same_counts(monkeypatch):
    if not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    x = torch.randn(_cpu_kernel.SPLIT_AT + 13) * 1e-3
    x[::1001] = adversarial()[: len(x[::1001])]
    bits = x.numpy().view(np.int32)
    want = previous_kernel(x)
    for threads in (1, 2, 3):
        c, k = new_table(1)
        _cpu_kernel.count_into(bits, c.numpy(), k.numpy(), 0, False, threads)
        assert (c[0].tolist(), int(k[0])) == want, threads
    # The uint32 cells are folded every _CHUNK values; the uncompiled loop reads the module's _CHUNK.
    monkeypatch.setattr(_cpu_kernel, "_CHUNK", 1000)
    c, k = new_table(1)
    _cpu_kernel._count_into.py_func(bits[:10_007], c.numpy(), k.numpy(), 0, False)
    assert (c[0].tolist(), int(k[0])) == previous_kernel(x[:10_007])


def test_one_torch_thread_never_splits(monkeypatch):
    """At torch.set_num_threads(1) the engine counts on the calling thread alone (no CPU time added)."""
    if not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    seen = []
    real = _cpu_kernel.count_into
    monkeypatch.setattr(_cpu_kernel, "count_into", lambda *a: seen.append(a[-1]) or real(*a))
    monkeypatch.setattr(engine_module, "CPU_ENGINE", "numba")
    before = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            histogram(torch.randn(_cpu_kernel.SPLIT_AT))
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


@pytest.mark.parametrize("name", ["numba", "torch"])
def test_largest_abs_is_the_inf_norm_on_every_pattern(name, monkeypatch):
    """The history's max |g|: torch's own inf-norm on adversarial patterns, NaN over inf over finite."""
    if name == "numba" and not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(engine_module, "CPU_ENGINE", name)
    x = adversarial()
    finite = x[torch.isfinite(x)]
    cases = {
        "finite": [finite[:7], finite[7:]],
        "with inf": [finite, torch.tensor([-math.inf])],
        "with NaN": [torch.tensor([math.inf]), finite, x[torch.isnan(x)][:1]],
        "zeros": [torch.zeros(3), -torch.zeros(5)],
        "one real gradient": real_gradients()[:1],
    }
    for what, xs in cases.items():
        got = engine_module.largest_abs(xs)
        want = torch.stack(torch._foreach_norm(xs, math.inf)).max()
        assert got.dtype == torch.float32 and got.shape == ()
        assert (math.isnan(want.item()) and math.isnan(got.item())) or got.item() == want.item(), what


def test_fold_largest_keeps_the_larger_and_nan():
    """The forward maxima's compiled fold: slot = max(slot, max |x|) on fp32 bits, NaN kept."""
    if not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    fold = engine_module.thin_largest()
    buf = torch.zeros(3)
    slots = buf.data_ptr()
    x = adversarial()
    finite = x[torch.isfinite(x)].contiguous()
    fold(finite.data_ptr(), finite.numel(), slots, 0)
    small = torch.tensor([0.5, -0.25])
    fold(small.data_ptr(), 2, slots, 0)  # smaller: slot unchanged
    assert buf[0].item() == finite.abs().max().item()
    fold(small.data_ptr(), 2, slots, 1)
    nan = torch.tensor([1.0, math.nan, -math.inf])
    fold(nan.data_ptr(), 3, slots, 1)
    fold(small.data_ptr(), 2, slots, 1)  # NaN stays
    assert buf[1].item() == 0.5 or math.isnan(buf[1].item())
    assert math.isnan(buf[1].item()) and buf[2].item() == 0.0


def test_closing_a_step_of_forward_maxima_compiled_equals_torch():
    """The forward maxima's compiled close (run maximum, first step past fp16's max, zeroing) against the
    torch ops it replaces on the CPU: NaN, inf, both sides of 65520, zeros, over several steps."""
    if not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    from fp16probe.capture.recorder import _ForwardMaxima

    def run(compiled: bool) -> list[str]:
        f = _ForwardMaxima()
        f._grow(torch.device("cpu"), 6)
        if not compiled:
            f.fold_at = f.slots = None  # the torch path for the fold and the close
        out = []
        steps = [[0.5, 7e4, math.nan, 1.0, 0.0], [2.0, 1.0, 3.0, math.inf, 0.0], [65519.99, 1e-40, 0.0, 5.0, 65520.0]]
        for k, values in enumerate(steps):
            for i, v in enumerate(values):
                f.fold(f"m{i}", torch.tensor([v, -v / 2]))
            out.append(str(f.close(k).item()))
        out.append(str(f.collect(len(steps))))
        out.append(str(f.step.tolist()))
        return out

    assert run(True) == run(False)
    under = torch.tensor(65519.99).item()  # the float32 just under 65520: never past fp16's max
    assert run(True)[-2] == str(({"m0": under, "m1": 7e4, "m2": math.nan, "m3": math.inf, "m4": 65520.0},
                                 {"m1": 0, "m2": 0, "m3": 1, "m4": 2}))
