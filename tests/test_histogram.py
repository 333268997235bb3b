"""The engine's exactness, with torch's own casts as the oracle.

For every format and every S = 2^k, k in [-40, 40], the number of nonzero finite values
that flush to zero when ``x * S`` is cast must follow from the histogram exactly, and so
must whether anything overflows.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp16probe.formats import FORMATS
from fp16probe.capture.engine import (
    MIN_EXP,
    NUM_BINS,
    SLOT_INF,
    SLOT_NAN,
    SLOT_ZERO,
    count_into,
    count_many,
    histogram,
    max_abs_from_key,
    new_table,
)
from fp16probe.capture.recorder import histogram_from
from fp16probe.report import Histogram

KS = range(-40, 41)


@pytest.fixture(autouse=True, params=["torch", "numba", "device"])
def engine(request, monkeypatch):
    """Run every test on every engine: eager torch ops, the fused numba kernel, and the
    accelerator path (``index_add_`` into the row) run on the CPU as its reference."""
    from fp16probe.capture import _cpu_kernel
    from fp16probe.capture import engine as histogram

    if request.param == "numba" and not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(histogram, "CPU_ENGINE", request.param)
    return request.param
FP32_MIN_NORMAL = 2.0**-126


def histogram_of(x: torch.Tensor) -> Histogram:
    counts, key = histogram(x)
    return histogram_from(counts.tolist(), int(key))


def reference_bin(v: float) -> int:
    """ceil(log2 |v|) computed with frexp in float64: the bin (2^(e-1), 2^e] holding v."""
    m, e = math.frexp(abs(v))
    return e - 1 if m == 0.5 else e


def flushed_by_cast(x: torch.Tensor, fmt) -> list[int]:
    """For each k in KS: nonzero finite values of x that become 0 when x * 2^k is cast to fmt.

    Where x * 2^k falls below fp32's normal range, fp32 itself would round before the
    cast; there the exact product (float64 holds it exactly) is compared with the tie.
    """
    x = x[torch.isfinite(x) & (x != 0)]
    scales = torch.tensor([2.0**k for k in KS], dtype=torch.float64)[:, None]
    exact = x.double()[None, :] * scales
    representable = exact.float().double() == exact
    by_cast = (exact.float().to(fmt.dtype) == 0) & representable
    by_exact = (exact.abs() <= fmt.flush_threshold) & ~representable
    return (by_cast | by_exact).sum(1).tolist()


def overflows_by_cast(x: torch.Tensor, fmt) -> list[bool]:
    """For each k in KS: whether any value of x lands beyond fmt's max when x * 2^k is cast."""
    if not torch.isfinite(x).all():
        return [True] * len(KS)  # an inf or NaN gradient is an overflow at any scale
    if x.numel() == 0 or not x.abs().max() > 0:
        return [False] * len(KS)
    y = x.double().abs().max() * torch.tensor([2.0**k for k in KS], dtype=torch.float64)
    y32 = y.float()  # exact, or inf where fp32 itself overflows
    if fmt.has_inf:
        return (torch.isinf(y32) | torch.isinf(y32.to(fmt.dtype))).tolist()
    # e4m3fn has no inf and this build saturates: round the significand in range instead.
    m = torch.floor(torch.log2(y)) - 7
    rounded = (y / 2.0**m).float().to(fmt.dtype).double() * 2.0**m
    return (torch.isinf(y32) | (rounded > fmt.max)).tolist()


def edge_values() -> list[float]:
    """The tie at min_subnormal/2 for every format and scale, its fp32 neighbours, and friends."""
    vals = [0.0, -0.0, 2.0**-149, -(2.0**-149), 3 * 2.0**-149, 2.0**-126, 2.0**-127,
            float(torch.finfo(torch.float32).max), 1.0, -1.0]
    for fmt in FORMATS.values():
        for k in (-40, -20, -1, 0, 1, 7, 20, 40):
            tie = math.ldexp(fmt.flush_threshold, -k)
            t = torch.tensor(tie, dtype=torch.float32)
            if t.item() != tie or t.item() == 0:
                continue
            up = torch.nextafter(t, torch.tensor(math.inf)).item()
            down = torch.nextafter(t, torch.tensor(0.0)).item()
            vals += [tie, -tie, up, down]
            ovf = math.ldexp(fmt.overflow_threshold, -k)
            o = torch.tensor(ovf, dtype=torch.float32)
            if math.isfinite(o.item()):
                vals += [o.item(), torch.nextafter(o, torch.tensor(0.0)).item()]
    return vals


def check_exact(x: torch.Tensor) -> None:
    h = histogram_of(x)
    for fmt in FORMATS.values():
        expected = flushed_by_cast(x, fmt)
        assert [h.flushed(fmt, k) for k in KS] == expected, fmt.name
        assert [h.overflows(fmt, k) for k in KS] == overflows_by_cast(x, fmt), fmt.name


def test_edge_values_are_exact():
    x = torch.tensor(edge_values(), dtype=torch.float32)
    check_exact(x)


def test_edge_values_one_at_a_time():
    # Each edge value alone, so a miscount cannot hide behind another value's bin.
    for v in edge_values():
        check_exact(torch.tensor([v], dtype=torch.float32))


floats32 = st.floats(width=32, allow_subnormal=True, allow_nan=True, allow_infinity=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(floats32, min_size=0, max_size=40))
def test_flush_and_overflow_are_exact_for_any_values(values):
    check_exact(torch.tensor(values, dtype=torch.float32))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(width=16, allow_subnormal=True, allow_nan=False), min_size=1, max_size=40),
       st.integers(-40, 40))
def test_fp16_values_scaled(values, k):
    # Gradients that are already fp16 values (as under autocast), scaled by 2^k.
    x = torch.tensor(values, dtype=torch.float16).float() * 2.0**k
    check_exact(x)


@settings(max_examples=200, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=30))
def test_every_value_lands_in_its_bin(values):
    x = torch.tensor(values, dtype=torch.float32)
    counts = histogram(x)[0].tolist()
    expected = [0] * NUM_BINS
    for v in x.tolist():
        if math.isnan(v):
            expected[SLOT_NAN] += 1
        elif math.isinf(v):
            expected[SLOT_INF] += 1
        elif v == 0:
            expected[SLOT_ZERO] += 1
        else:
            expected[reference_bin(v) - MIN_EXP] += 1
    assert counts == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(floats32, min_size=0, max_size=30))
def test_max_abs_is_the_largest_finite_magnitude(values):
    x = torch.tensor(values, dtype=torch.float32)
    finite = [abs(v) for v in x.tolist() if math.isfinite(v)]
    _, key = histogram(x)
    assert max_abs_from_key(int(key)) == (max(finite) if finite else 0.0)


def test_every_fp32_subnormal_binade_and_power_of_two():
    # All fp32 powers of two (subnormal and normal), and the values just above each.
    powers = torch.tensor([math.ldexp(1.0, e) for e in range(-149, 128)], dtype=torch.float32)
    above = torch.nextafter(powers, torch.tensor(math.inf))
    h = histogram_of(torch.cat([powers, above]))
    for e in range(-149, 128):
        # 2^e lands in bin e; the next float above it lands in bin e + 1.
        assert h.count(e) == (1 if e == -149 else 2), e
    assert h.count(128) == 1


def test_large_tensor_crosses_cpu_chunks_and_threads():
    x = torch.randn(3 * (1 << 18) + 17) * 1e-4  # past both engines' split points
    x[5] = float("inf")
    x[(1 << 18) + 3] = float("nan")
    x[-1] = 0.0
    x[-2] = 2.0**-140  # an fp32 subnormal in the last part
    h = histogram_of(x)
    assert h.total == x.numel()
    assert (h.inf, h.nan) == (1, 1) and h.count(-140) == 1  # 2^-140 is the top of bin -140
    finite = x[torch.isfinite(x)]
    assert h.max_abs == finite.abs().max().item()
    assert h.zero == int((x == 0).sum())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_are_counted_as_their_fp32_values(dtype):
    x = (torch.randn(1000) * 1e-3).to(dtype)
    assert histogram_of(x) == histogram_of(x.float())


def test_empty_and_noncontiguous_inputs():
    assert histogram_of(torch.empty(0)).total == 0
    m = torch.randn(64, 64)
    assert histogram_of(m.t()) == histogram_of(m.t().contiguous())


def test_engines_agree_on_random_bit_patterns(monkeypatch):
    from fp16probe.capture import _cpu_kernel
    from fp16probe.capture import engine as histogram_module

    if not _cpu_kernel.available():
        pytest.skip("numba is not installed")
    bits = torch.randint(-(2**31), 2**31 - 1, (300_000,), dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.tensor(edge_values(), dtype=torch.float32)])
    # every kind of value: subnormals, inf, NaN payloads, -0.0, and the edges
    results = []
    for name in ("torch", "numba", "device"):
        monkeypatch.setattr(histogram_module, "CPU_ENGINE", name)
        counts, key = histogram(x)
        results.append((counts.tolist(), int(key)))
    assert results[0] == results[1] == results[2]


def test_counts_go_into_a_row_and_replace_overwrites_it():
    counts, keys = new_table(3)
    a, b = torch.randn(100), torch.randn(50) * 1e-6
    count_into(a, counts, keys, 1)
    count_into(b, counts, keys, 1)
    assert counts[0].sum() == 0 and counts[2].sum() == 0 and keys[0] == -1 and keys[2] == -1
    assert histogram_from(counts[1].tolist(), int(keys[1])) == histogram_of(torch.cat([a, b]))
    count_into(b, counts, keys, 1, replace=True)  # the last value of a parameter's gradient wins
    assert histogram_from(counts[1].tolist(), int(keys[1])) == histogram_of(b)


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_counting_many_at_once_gives_each_row_its_own_counts(replace, scaled):
    """count_many (weight gradients at the end of backward) equals count_into one tensor at a time."""
    from fp16probe.capture import _cpu_kernel

    torch.manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (5_000,), dtype=torch.int64).to(torch.int32)
    xs = [
        bits.view(torch.float32),  # subnormals, inf, NaN payloads
        torch.relu(torch.randn(3, 333)),
        torch.randn(40, 30).t(),  # not contiguous: counted on its own
        torch.randn(77).half(),  # not fp32: counted on its own
        torch.empty(0),
        torch.tensor(2.0**-149),
        torch.randn(_cpu_kernel.SPLIT_AT + 5) * 1e-30,  # above the batch's size: split across threads
    ]
    rows = [4, 0, 2, 6, 1, 5, 3]
    inv = torch.tensor(2.0**-12) if scaled else None
    batched, one_by_one = new_table(8), new_table(8)
    earlier = torch.randn(10), torch.randn(10) * 1e-3
    for table in (batched, one_by_one):
        count_into(earlier[0], *table, 0)  # rows already holding counts: added to or replaced
        count_into(earlier[1], *table, 4)
    count_many(xs, *batched, rows, replace=replace, inv=inv)
    for x, row in zip(xs, rows):
        count_into(x, *one_by_one, row, replace=replace, inv=inv)
    assert torch.equal(batched[0], one_by_one[0]) and torch.equal(batched[1], one_by_one[1])
    assert batched[0][7].sum() == 0 and batched[1][7] == -1  # a row nobody named


def test_relu_masked_data_counts_the_zeros_between_values():
    x = torch.relu(torch.randn(10_001))  # runs of exact zeros: the data that made a branchy kernel slow
    h = histogram_of(x)
    assert h.zero == int((x == 0).sum()) and h.total == x.numel()
    assert h.max_abs == x.max().item()


def test_histogram_stays_on_device_and_merges_by_addition():
    a, b = torch.randn(100), torch.randn(50) * 1e-6
    ra, ka = histogram(a)
    rb, kb = histogram(b)
    assert ra.device == a.device and ra.dtype == torch.int64
    merged = histogram_from((ra + rb).tolist(), int(torch.maximum(ka, kb)))
    assert merged == histogram_of(torch.cat([a, b])) == histogram_of(a) + histogram_of(b)


TRITON_CHECK = """
import torch
from fp16probe.capture import _triton_kernel as tk, engine
bits = torch.randint(-(2**31), 2**31 - 1, (5000,), dtype=torch.int64).to(torch.int32)
cases = [(bits.view(torch.float32), None), (torch.randn(3000).half(), None),
         (torch.randn(3000).to(torch.bfloat16), None), (torch.randn(7000) * 1e-3, torch.tensor(2.0**-20))]
for x, inv in cases:
    c, k = engine.new_table(2)
    tk.count_into(x, c, k, 1, False, inv)
    rc, rk = engine.histogram(x.float() * inv if inv is not None else x)
    assert torch.equal(c[1], rc) and int(k[1]) == int(rk) and c[0].sum() == 0
print("ok")
"""


def test_triton_kernel_agrees_in_the_interpreter(engine):
    """The CUDA kernel, run by Triton's CPU interpreter, counts like the CPU engines."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    if engine != "torch":
        pytest.skip("one run is enough")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
