"""Exactness of the scaled-format statistics: predicted counts equal a real quantizer's, count for count.

MXFP8: torchao's pure-PyTorch ``to_mx`` in every scale mode it has. Tiles, rows, tensors
and NVFP4: references written here from the specs, on torch's own float8 casts. Delayed
scaling: a plain loop of TransformerEngine's documented update.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from fp16probe.blockscale import ELEMENTS, RELATIVE_BINS, counts_from_relative, delayed_scales, scale_offsets
from fp16probe.capture.blockstats import (
    blocks,
    current_scaling_counts,
    nvfp4_counts,
    relative_histogram,
    scaled_counts,
)


def _torchao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao")
        from torchao.prototype.mx_formats import kernels
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    return to_mx, ScaleCalculationMode, kernels, nvfp4_quantize, per_tensor_amax_to_scale


DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _random(rows: int = 64, cols: int = 256) -> torch.Tensor:
    """Values over 40 binades, some zeros: most blocks hold values that flush, some that saturate."""
    x = torch.randn(rows, cols) * torch.exp2(torch.randint(-30, 10, (rows, cols)).float())
    x[torch.rand(rows, cols) < 0.05] = 0.0
    return x


def _adversarial(element: str) -> torch.Tensor:
    """32-value blocks at every edge: each block amax mantissa class edge (and one ulp either side),
    elements at every flush, subnormal and overflow boundary of both candidate scales (and one ulp
    either side, ties included), fp32 subnormals, zeros and an all-zero block."""
    el = ELEMENTS[element]
    amaxes = []
    for k in range(16):
        base = 1.0 + k / 16
        for nudge in (-1, 0, 1):
            amaxes.append(float(np.nextafter(np.float32(base), np.float32(2 if nudge > 0 else 0))) if nudge else base)
    amaxes = [a for a in amaxes if 1.0 <= a < 2.0] + [float(np.nextafter(np.float32(2.0), np.float32(0)))]
    bounds = [el.flush, el.normal, el.overflow, el.max, math.ldexp(1.0, el.log2_min_normal)]
    cells = []
    for b in bounds:
        for shift in range(-el.emax - 2, -el.emax + 3):
            v = np.float32(math.ldexp(b, shift))
            cells += [v, np.nextafter(v, np.float32(0)), np.nextafter(v, np.float32(np.inf))]
    cells = np.array(cells, dtype=np.float32)
    rows = []
    for i, a in enumerate(amaxes):
        e = (i % 7) * 3 - 9  # block amaxes spread over binades
        top = np.float32(math.ldexp(a, e))
        vals = np.float32(math.ldexp(1.0, e)) * cells  # exact: scaling by a power of two
        vals = vals[vals < top]
        for start in range(0, len(vals), 31):
            chunk = vals[start:start + 31]
            block = np.zeros(32, dtype=np.float32)
            block[0] = top
            block[1:1 + len(chunk)] = chunk * np.where(np.arange(len(chunk)) % 2, -1, 1)
            rows.append(block)
    tiny = np.zeros(32, dtype=np.float32)
    tiny[:4] = [2.0 ** -60, 2.0 ** -70, np.float32(1e-40), -(2.0 ** -61)]  # fp32 subnormal inside
    rows.append(tiny)
    rows.append(np.zeros(32, dtype=np.float32))
    flat = np.concatenate(rows)
    flat = np.concatenate([flat, np.zeros((-len(flat)) % 256, dtype=np.float32)])
    return torch.from_numpy(flat.reshape(-1, 256).copy())


def _cast_counts(x: torch.Tensor, q: torch.Tensor, lp: torch.Tensor, element: str) -> tuple[int, int, int, int]:
    """Counts read off a real cast: ``q`` the fp32 value before it, ``lp`` the cast value."""
    el = ELEMENTS[element]
    nz = x.ne(0)
    flushed = nz & lp.eq(0)
    subnormal = nz & lp.ne(0) & lp.abs().lt(math.ldexp(1.0, el.log2_min_normal))
    saturated = nz & (q.abs().ge(el.overflow) if el.overflow_inclusive else q.abs().gt(el.overflow))
    return int(nz.sum()), int(flushed.sum()), int(subnormal.sum()), int(saturated.sum())


def _predicted(x: torch.Tensor, layout: str, element: str, rule: str) -> tuple[int, int, int, int]:
    h, extra = relative_histogram(x, layout)
    c = counts_from_relative(h.numpy(), element, rule, out_of_range=int(extra[2]))
    assert c.out_of_range == 0
    return c.nonzero, c.flushed, c.subnormal, c.saturated


def _torchao_mx_counts(x: torch.Tensor, element: str, mode) -> tuple[tuple[int, int, int, int], torch.Tensor]:
    to_mx = _torchao()[0]
    scale, lp = to_mx(x, DTYPES[element], 32, mode)
    s = scale.float().repeat_interleave(32, dim=-1)
    if mode.value == "rceil":  # to_mx multiplies by 2^(127 - e), and by 1 when the scale is 2^-127
        q = x * torch.where(s.eq(2.0 ** -127), 1.0, 1.0 / s)
    else:
        q = x / s.clamp(min=2.0 ** -126)
    return _cast_counts(x, q, lp.float(), element), scale.float()


def _exact_rceil_exponent(amax: torch.Tensor, element: str) -> torch.Tensor:
    """cuBLAS's rule, bit-exact: the decoding scale a_B / max rounded up to a power of two."""
    descale = amax / ELEMENTS[element].max
    m, e = torch.frexp(descale)
    return (e - 1 + m.ne(0.5).long()).clamp(-127, 127)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rule", ["floor", "rceil", "ceil", "even"])
def test_mx_counts_equal_torchao_to_mx_on_random_tensors(element, rule):
    _, modes, *_ = _torchao()
    x = _random()
    got = _predicted(x, "mx32", element, rule)
    want, _ = _torchao_mx_counts(x, element, modes(rule))
    assert got == want
    assert got[1] > 100 and got[2] > 10  # the tensor exercises the thresholds


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rule", ["floor", "ceil", "even"])
def test_mx_counts_equal_torchao_to_mx_at_every_edge(element, rule):
    _, modes, *_ = _torchao()
    x = _adversarial(element)
    got = _predicted(x, "mx32", element, rule)
    want, _ = _torchao_mx_counts(x, element, modes(rule))
    assert got == want
    assert min(got[1:3]) > 0
    if rule == "floor" or (rule, element) == ("even", "e4m3"):
        assert got[3] > 0  # OCP's FLOOR clamps values in (464, 512) inside a block


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_mx_rceil_at_every_edge_equals_the_exact_rule_and_torchao_where_its_log2_is_exact(element):
    """torchao's eager RCEIL takes ceil(torch.log2(a_B / max)) in fp32, which rounds to the integer when
    a_B / max is a hair above a power of two (cuBLAS and TE round such a scale up). Our counts follow the
    exact rule; they equal torchao's on every block where the two scales agree."""
    _, modes, *_ = _torchao()
    x = _adversarial(element)
    got = _predicted(x, "mx32", element, "rceil")
    b = blocks(x, "mx32")
    amax = b.abs().amax(dim=1)
    exact = _exact_rceil_exponent(amax, element)
    _, scale = _torchao_mx_counts(x, element, modes.RCEIL)
    ao_exp = torch.frexp(scale.reshape(-1))[1] - 1
    agree = (exact == ao_exp) | amax.eq(0)
    # Reference for all blocks: the exact scale, then torch's own saturating float8 cast.
    s = torch.exp2(exact.float()).unsqueeze(1)
    q = b / s
    lp = q.clamp(-ELEMENTS[element].max, ELEMENTS[element].max).to(DTYPES[element]).float()
    assert got == _cast_counts(b, q, lp, element)
    # And torchao's, on the blocks where its fp32 log2 gives the exact scale.
    keep = agree.repeat_interleave(32).reshape(x.shape)
    xa = torch.where(keep, x, torch.zeros(()))
    assert _predicted(xa, "mx32", element, "rceil") == _torchao_mx_counts(xa, element, modes.RCEIL)[0]
    assert (~agree).any()  # the adversarial set does reach the difference


def test_scale_rules_offsets_follow_the_definitions():
    e4m3 = ELEMENTS["e4m3"]
    assert e4m3.emax == 8 and ELEMENTS["e5m2"].emax == 15 and ELEMENTS["e2m1"].emax == 2
    floor, rceil, ceil = (scale_offsets(r, e4m3) for r in ("floor", "rceil", "ceil"))
    assert (floor == -8).all()
    assert ceil[0] == -8 and (ceil[1:] == -7).all()
    assert (rceil[:25] == -8).all() and (rceil[25:] == -7).all()  # a_B / 2^E_B above 1.75


def test_element_limits_match_torch_casts_and_the_e2m1_grid():
    for name, dtype in DTYPES.items():
        el = ELEMENTS[name]
        for q, want in ((el.flush, 0.0), (el.normal, math.ldexp(1.0, el.log2_min_normal))):
            assert torch.tensor(q).to(dtype).float().item() == want
            below = float(np.nextafter(np.float32(q), np.float32(np.inf)))
            assert torch.tensor(below).to(dtype).float().item() != 0.0
        assert torch.tensor(float(np.nextafter(np.float32(el.normal), np.float32(0)))).to(dtype).float().item() \
            < math.ldexp(1.0, el.log2_min_normal)
    kernels = _torchao()[2]
    grid = torch.tensor([0.0, 0.25, 0.2500001, 0.75, 0.7499999, 5.0, 7.0, 6.9999995, 100.0])
    e2 = ELEMENTS["e2m1"]
    back = kernels.f4_unpacked_to_f32(kernels.f32_to_f4_unpacked(grid.clamp(max=6.0)))
    assert back.tolist() == [0.0, 0.0, 0.5, 1.0, 0.5, 4.0, 6.0, 6.0, 6.0]
    assert [_classify(e2, v) for v in grid.tolist()] == [
        "zero", "flushed", "subnormal", "normal", "subnormal", "normal", "saturated", "normal", "saturated"]


def _pow2_reference(x: torch.Tensor, layout: str, element: str) -> tuple[int, int, int, int]:
    """TE's power-of-two block scaling, from its description: scale = 2^floor(log2(max / a_B)), 1 for a_B = 0."""
    b = blocks(x, layout)
    el = ELEMENTS[element]
    amax = b.abs().amax(dim=1, keepdim=True)
    ratio = torch.where(amax > 0, el.max / amax, torch.ones(()))
    m, e = torch.frexp(ratio)
    scale = torch.exp2((e - 1).float())
    q = b * scale
    lp = q.clamp(-el.max, el.max).to(DTYPES[element]).float()
    return _cast_counts(b, q, lp, element)


@pytest.mark.parametrize("layout", ["tile128", "tile128_t", "tile128x128", "row", "tensor", "mx32_t"])
@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_power_of_two_tiles_rows_and_columns_equal_a_reference_quantizer(layout, element):
    x = torch.cat([_random(128, 256), _adversarial(element)[:128]], dim=0)
    assert _predicted(x, layout, element, "pow2") == _pow2_reference(x, layout, element)


def test_rows_and_columns_quantize_differently():
    x = _random(64, 256)
    x[:, 7] *= 2.0 ** 12  # one hot feature: its rows' blocks lose their small values, columns do not
    rows = _predicted(x, "mx32", "e4m3", "rceil")
    cols = _predicted(x, "mx32_t", "e4m3", "rceil")
    assert rows[0] == cols[0] and rows[1] > cols[1]


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_current_scaling_equals_a_real_cast(element):
    x = _random()
    el = ELEMENTS[element]
    scale = torch.full((), el.max).div(x.abs().amax())  # a true division, as TE computes it
    q = x * scale
    lp = q.to(DTYPES[element]).float()
    assert tuple(current_scaling_counts(x, element).tolist()) == _cast_counts(x, q, lp, element)
    assert tuple(scaled_counts(x, 2.0 * scale, element).tolist()) == _cast_counts(
        x, x * (2.0 * scale), (x * (2.0 * scale)).clamp(-el.max, el.max).to(DTYPES[element]).float(), element)


def _nvfp4_inputs() -> torch.Tensor:
    x = _random(32, 256)
    x[3, :16] = torch.linspace(1, 2, 16) * 2.0 ** -40  # a block whose scale underflows e4m3
    x[4, 16:32] = 0.0  # an all-zero block
    x[5, :16] = torch.tensor([6, 3, 0.75, 0.25, 1.5, 0.5, 4, 2, 1, 0.7499999, 0.2500001, 5, 3.5, 2.5, 1.25, 0.0]) * 2.0 ** -3
    return x


@pytest.mark.parametrize("transposed", [False, True])
def test_nvfp4_counts_equal_torchao_nvfp4_quantize(transposed):
    _, _, kernels, nvfp4_quantize, per_tensor_amax_to_scale = _torchao()
    x0 = _nvfp4_inputs()
    x = x0.t().contiguous() if transposed else x0  # the columns, as torchao quantizes a transpose
    amax = x.abs().amax()
    _, lp = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(amax))
    vals = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(lp)).reshape(x.shape)
    nz = x.ne(0)
    counts, _ = nvfp4_counts(x0, transposed=transposed)
    want = [int(nz.sum()), int((nz & vals.eq(0)).sum()), int((nz & vals.abs().eq(0.5)).sum()), 0, 0, 0]
    assert counts.tolist() == want


def _e2m1_rne(q: torch.Tensor) -> torch.Tensor:
    """Round |q| to the E2M1 grid, ties to the even code (a reference written from the OCP spec)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = q.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist.eq(best)
    even = torch.arange(8).remainder(2).eq(0)  # codes 0, 2, 4, 6: even mantissa
    pick = torch.where(tied.sum(-1, keepdim=True) > 1, tied & even, tied).float().argmax(-1)
    return grid[pick]


@pytest.mark.parametrize("square", [False, True])
def test_nvfp4_cast_block_scale_loses_whole_blocks_as_a_spec_reference_does(square):
    x = _nvfp4_inputs()
    b = blocks(x, "nv16x16" if square else "nv16")
    a_t = x.abs().amax()
    s_t = a_t / (448 * 6)
    block = (b.abs().amax(1, keepdim=True) / 6 / s_t).clamp(max=448).to(torch.float8_e4m3fn).float()
    q = torch.where(block > 0, b * ((1 / s_t) / torch.where(block > 0, block, 1.0)), torch.zeros(()))
    vals = _e2m1_rne(q)
    nz = b.ne(0)
    lost = nz & block.eq(0)
    counts, sr = nvfp4_counts(x, block_scale="cast", square=square)
    assert counts.tolist() == [int(nz.sum()), int((nz & vals.eq(0)).sum()), int((nz & vals.eq(0.5)).sum()), 0,
                               int((block.eq(0) & nz.any(1, keepdim=True)).sum()), int(lost.sum())]
    if not square:  # the 1x16 block at 2^-40 of the tensor's max goes whole
        assert counts[4] == 1 and counts[5] == 16
    expected = torch.where(nz, (1 - 2 * q.abs().double()).clamp(min=0), torch.zeros((), dtype=torch.float64)).sum()
    assert sr.item() == pytest.approx(expected.item(), rel=1e-12)


def test_nvfp4_stochastic_rounding_share_is_the_mean_of_real_stochastic_casts():
    x = torch.rand(4, 64) * torch.exp2(-torch.randint(0, 8, (4, 64)).float())
    counts, sr = nvfp4_counts(x)
    b = blocks(x, "nv16")
    s_t = x.abs().amax() / (448 * 6)
    block = (b.abs().amax(1, keepdim=True) / 6 / s_t).clamp(min=2 ** -6, max=448).to(torch.float8_e4m3fn).float()
    q = b * ((1 / s_t) / block)
    low = q.lt(0.5)
    trials = 4000
    g = torch.Generator().manual_seed(1)
    u = torch.rand((trials,) + q.shape, generator=g)
    zeros = (low & (u >= 2 * q)).sum().item() / trials
    assert sr.item() == pytest.approx(zeros, rel=0.02)
    assert sr.item() > 1


def test_delayed_scaling_replay_equals_a_plain_loop_of_te_update():
    trace = [0.0, 3.0, 2.0, 50.0, 1.0, float("inf"), 0.5, 0.25, 0.125, 7.0]

    def te(trace, history_len, margin, algo, fp8_max):
        history = [0.0] * history_len  # TE's amax_history buffer, newest first after the roll
        scale = np.float32(1.0)
        out = []
        for amax in trace:
            out.append(float(scale))
            history = [amax] + history[:-1]
            ref = max(history) if algo == "max" else history[0]
            sf = np.float32(fp8_max) / np.float32(ref) / np.float32(2.0 ** margin) if ref > 0 else scale
            scale = sf if np.isfinite(ref) and ref > 0 else scale
        return out

    for history_len in (1, 2, 4, 16):
        for margin in (0, 1, 3):
            for algo in ("max", "most_recent"):
                for el in ("e4m3", "e5m2"):
                    with np.errstate(divide="ignore", over="ignore"):
                        want = te(trace, history_len, margin, algo, ELEMENTS[el].max)
                    assert delayed_scales(trace, el, history_len=history_len, margin=margin, algo=algo) == want


def test_relative_histogram_has_no_host_sync_and_counts_every_value():
    x = _random(16, 64)
    x[0, 0] = float("nan")
    h, extra = relative_histogram(x, "mx32")
    assert h.shape == (RELATIVE_BINS,) and h.dtype == torch.int64
    zeros, nonfinite, oor = extra.tolist()
    assert int(h.sum()) + zeros + nonfinite + oor == x.numel()
    assert nonfinite == int((blocks(x, "mx32")[0] != 0).sum())  # the NaN's block has no scale


def test_block_spread_counts_blocks_by_binades_below_the_tensor_amax():
    from fp16probe.blockscale import SPREAD_BINS
    from fp16probe.capture.blockstats import relative_histograms

    x = _random(16, 64)
    x[0, :32] = 0.0  # an all-zero block: left out
    x[1, :32] = 2.0 ** -100  # far below: the last bin
    outs = {"mx32": torch.zeros(RELATIVE_BINS, dtype=torch.int64)}
    spreads = {"mx32": torch.zeros(SPREAD_BINS, dtype=torch.int64)}
    relative_histograms(x, ["mx32"], outs, spreads)
    b = blocks(x, "mx32").abs().amax(dim=1)
    e_t = math.frexp(float(x.abs().max()))[1]
    want = [0] * SPREAD_BINS
    for a in b.tolist():
        if a > 0:
            want[min(e_t - math.frexp(a)[1], SPREAD_BINS - 1)] += 1
    assert spreads["mx32"].tolist() == want and want[-1] == 1


@pytest.mark.parametrize("layout", ["mx32", "mx32_t", "tile128", "tile128_t", "tile128x128", "row", "tensor"])
def test_numba_kernel_counts_equal_the_torch_path(monkeypatch, layout):
    from fp16probe.blockscale import SPREAD_BINS
    from fp16probe.capture import _cpu_blockkernel, engine
    from fp16probe.capture.blockstats import relative_histograms

    if not _cpu_blockkernel.available():
        pytest.skip("numba is not installed")
    x = torch.cat([_random(64, 256), _adversarial("e4m3")[:64], _adversarial("e5m2")[:64]])
    x[3, 5] = float("inf")
    x[70, 9] = float("nan")
    x[80, :40] = 2.0 ** -110  # out of range
    x = x[:, :250]  # partial blocks: padding
    got = {}
    for cpu_engine in ("auto", "device"):
        monkeypatch.setattr(engine, "CPU_ENGINE", cpu_engine)
        outs = {layout: torch.zeros(RELATIVE_BINS, dtype=torch.int64)}
        spreads = {layout: torch.zeros(SPREAD_BINS, dtype=torch.int64)}
        extra = relative_histograms(x, [layout], outs, spreads)[layout]
        got[cpu_engine] = (outs[layout].tolist(), spreads[layout].tolist(), extra.tolist())
    assert got["auto"] == got["device"]
    zeros, nonfinite, out_of_range = got["auto"][2]
    assert zeros > 0 and nonfinite > 0 and (out_of_range > 0) == (layout == "mx32")


def _classify(el, q: float) -> str:
    """What casting the magnitude ``q`` to element format ``el`` does, from its bounds alone."""
    if q == 0:
        return "zero"
    if q <= el.flush:
        return "flushed"
    if q < el.normal:
        return "subnormal"
    if q > el.overflow or (el.overflow_inclusive and q == el.overflow):
        return "saturated"
    return "normal"
