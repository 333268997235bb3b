"""Format bounds come from torch.finfo; here they are checked against torch's own casts."""

import math

import pytest
import torch

from fp16probe.errors import Fp16ProbeError, UnknownFormatError
from fp16probe.formats import FORMATS, get_format

ALL = list(FORMATS.values())


def next32(x: float, toward: float) -> float:
    """The neighbouring fp32 value of x in the direction of toward."""
    t = torch.tensor(x, dtype=torch.float32)
    return torch.nextafter(t, torch.tensor(toward, dtype=torch.float32)).item()


def cast(values, fmt):
    return torch.tensor(values, dtype=torch.float32).to(fmt.dtype).to(torch.float32)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_max_and_min_are_representable_and_tight(fmt):
    got = cast([fmt.max, fmt.min_normal, fmt.min_subnormal], fmt).tolist()
    assert got == [fmt.max, fmt.min_normal, fmt.min_subnormal]
    # Half the min subnormal is the tie: it rounds to the even neighbour, zero.
    # The next fp32 above it rounds up to the min subnormal.
    tie = fmt.flush_threshold
    above, below = next32(tie, math.inf), next32(tie, 0.0)
    assert cast([tie, below, above], fmt).tolist() == [0.0, 0.0, fmt.min_subnormal]


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_subnormals_sit_below_min_normal(fmt):
    # The largest subnormal is min_normal - min_subnormal, and it is exactly representable.
    largest_sub = fmt.min_normal - fmt.min_subnormal
    assert cast([largest_sub], fmt).item() == largest_sub
    assert fmt.log2_min_normal == round(math.log2(fmt.min_normal))
    assert fmt.log2_flush_threshold == fmt.log2_min_subnormal - 1


def _beyond_max(y: float, fmt) -> bool:
    """The cast's own verdict; for e4m3 (no inf, this build saturates) use scale invariance
    of rounding: round y's significand in range, then compare with max."""
    if fmt.has_inf:
        return math.isinf(cast([y], fmt).item())
    m = math.floor(math.log2(y)) - 7  # puts y/2^m in [128, 256), inside e4m3's range
    rounded = cast([math.ldexp(y, -m)], fmt).item()
    return math.ldexp(rounded, m) > fmt.max


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_overflow_threshold_matches_the_cast(fmt):
    t = fmt.overflow_threshold
    for y in [fmt.max, next32(t, 0.0), t, next32(t, math.inf), 2 * t]:
        y32 = torch.tensor(y, dtype=torch.float32).item()
        if math.isinf(y32):
            continue
        assert fmt.overflows(y32) == _beyond_max(y32, fmt), (fmt.name, y32)


def test_reference_values():
    # REFERENCE.md section 3, checked with casts there; here as a guard against drift.
    fp16 = FORMATS["fp16"]
    assert (fp16.max, fp16.min_normal, fp16.min_subnormal) == (65504.0, 2**-14, 2**-24)
    assert fp16.overflow_threshold == 65520.0 and fp16.overflow_inclusive
    assert FORMATS["bf16"].log2_flush_threshold == -134
    assert FORMATS["fp8_e4m3"].max == 448.0 and not FORMATS["fp8_e4m3"].overflow_inclusive
    assert FORMATS["fp8_e5m2"].overflow_threshold == 61440.0


def test_unknown_format_is_a_clear_error():
    with pytest.raises(UnknownFormatError, match=r"unknown format 'fp12'.*fp16, bf16"):
        get_format("fp12")
    assert issubclass(UnknownFormatError, Fp16ProbeError)
    assert get_format("float16") is FORMATS["fp16"] and get_format("E4M3") is FORMATS["fp8_e4m3"]



def test_a_format_name_is_looked_up_once_at_each_entry_point(monkeypatch):
    """Below the entry points the format travels as a Format: no leaf looks its name up again.

    Counted: lookups of a name (``get_format("fp16")``); ``get_format`` of a Format returns it.
    """
    import io
    import sys

    import fp16probe
    import fp16probe.formats
    from fp16probe.presentation import figures, html, terminal
    from fp16probe.running.demo import DemoNet, demo_batches, demo_loss

    # Modules that look fp16 up when imported (its bounds) load before counting starts.
    import fp16probe.analysis.forward  # noqa: F401
    import fp16probe.capture.forward  # noqa: F401
    import fp16probe.running.profile  # noqa: F401

    names = []

    def counting(fmt):
        if isinstance(fmt, str):
            names.append(fmt)
        return get_format(fmt)

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("fp16probe") and getattr(module, "get_format", None) is get_format:
            monkeypatch.setattr(module, "get_format", counting)

    def lookups(run) -> int:
        names.clear()
        run()
        return len(names)

    torch.manual_seed(0)
    report = fp16probe.profile(DemoNet(), demo_batches(), demo_loss, steps=3)
    assert len(names) <= 2, names  # the run's settings check and the analysis, each an entry point
    console = terminal.make_console()
    console.file = io.StringIO()
    assert lookups(lambda: terminal.print_summary(console, report, report.recommendation, explain=True,
                                                  distribution=True)) == 1
    assert lookups(lambda: html.report_html(report, figure=False)) == 1
    assert lookups(lambda: figures.figure(report)) == 1
