"""The packed form of a report's per-step fields: one array per field, inside the JSON file.

A list per step costs a long run dearly: a 12-layer GPT-2 sampled on every step (what the
Hugging Face and Lightning callbacks do by default) writes about 8,000 bytes of JSON a step,
and reading it back makes a Python object of every number (a 248 MB report took 4.7 GB to
show). So a trace or history longer than :data:`PACK_FROM` steps is written as columns: each
per-step field one array, its bytes little-endian, zlib-compressed and base64-encoded::

    {"dtype": "<f4", "count": 3, "zlib": "eJz7..."}

``dtype`` is one of :data:`DTYPES` (the narrowest that holds every value exactly: a float32
value is not widened to 8 bytes), ``count`` the number of values. In a float column a value
of -1 stands for null (no value recorded), as every recorded value is at least 0 (inf and NaN
are stored as themselves). Reading one is bounded: the decompressed size must be exactly
``count`` times the item size, and no more is ever inflated.

In memory the arrays stay arrays: :class:`Column` and :class:`HistogramColumn` are read-only
sequences over them (``trace.scale[i]``, ``trace.histograms[kind][i]`` work as on tuples),
and analysis that runs over every step reads their arrays whole (``.array``, ``.dense()``,
``.total()``) instead of a Python object per value. So a long report loads in memory close to
its packed size and in time proportional to it.

A new per-step field is one more array in the section's packed form, one line in its
``to_dict``/``from_dict`` and in the schema (``#/$defs/packed``).

Plain host-side data: numpy only, nothing here touches a model or a device.
"""

from __future__ import annotations

import base64
import binascii
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from fp16probe.errors import ReportFieldError
from fp16probe.histogram import NUM_EXP_BINS, Histogram

__all__ = [
    "DTYPES",
    "LAYOUT",
    "MODULE_STEPS",
    "PACK_FROM",
    "Column",
    "HistogramColumn",
    "Inflated",
    "block_max",
    "is_packed",
    "narrow_counts",
    "narrow_floats",
    "pack",
    "pack_histograms",
    "pack_history",
    "pack_trace",
    "steps_per_block",
    "unpack",
    "unpack_floats",
    "unpack_histograms",
]

LAYOUT = "columns"
"""The ``layout`` a packed trace or history names (a section in rows has no ``layout``)."""

PACK_FROM = 256
"""A trace or history of more steps than this is written packed; a shorter one as lists, readable by eye."""

MODULE_STEPS = 4096
"""The most entries a trace keeps per module: beyond it, each module's largest |g| is kept per block of steps.

Every whole-model per-step field (histograms, scale, found_inf, ceiling; the history) is kept for
every step: the GradScaler replay and the schedule read those. The per-module maxima are
``len(names)`` numbers a step (273 for a 12-layer GPT-2, 1,375 of its 1,768 packed bytes a step),
so a trace of more steps than this keeps, per module, the max over each block of
:func:`steps_per_block` steps: exact for what it is, the largest value over those steps."""

DTYPES = ("|u1", "<u2", "<u4", "<i8", "<f4", "<f8")
"""The item types a packed array may have."""

NULL = -1.0
"""What a float column stores for null (no value recorded)."""

_CHUNK = 4096  # steps handled at once where a whole-trace temporary per value or per bin would be large

_ZLIB_LEVEL = 1  # level 6 packs a GPT-2 trace 3% smaller at four times the CPU time


# -- one array --------------------------------------------------------------------------------

def pack(values: Any, dtype: str | None = None) -> dict[str, Any]:
    """The packed JSON of a 1-D array (as ``dtype``, else its own, which must be one of DTYPES)."""
    a = np.ascontiguousarray(values if dtype is None else np.asarray(values).astype(dtype))
    name = a.dtype.newbyteorder("<").str if a.dtype.byteorder == "=" else a.dtype.str
    if name == "|b1":
        a, name = a.astype("|u1"), "|u1"
    if name not in DTYPES:
        raise ValueError(f"cannot pack an array of {a.dtype}: expected one of {', '.join(DTYPES)}")
    raw = a.astype(name, copy=False).reshape(-1).tobytes()
    return {"dtype": name, "count": int(a.size), "zlib": base64.b64encode(zlib.compress(raw, _ZLIB_LEVEL)).decode("ascii")}


class Inflated(bytearray):
    """A packed array's bytes, already inflated within its declared size while its file was read
    (:func:`fp16probe.reading.read_report`); stands in for its ``zlib`` text."""


def is_packed(v: Any) -> bool:
    """Whether ``v`` is a packed section or array (has a ``layout`` or a ``zlib`` field), not lists."""
    return isinstance(v, Mapping) and ("layout" in v or "zlib" in v)


def unpack(d: Any, path: str, count: int | None = None) -> np.ndarray:
    """The read-only array a packed JSON object holds; anything malformed raises ReportFieldError naming ``path``.

    ``count``: the number of values it must hold. Decompression stops at the declared size:
    a small file never inflates to more than it says it holds."""
    if not isinstance(d, Mapping):
        raise ReportFieldError(path, f"{path}: expected a packed array ({{dtype, count, zlib}}), got {_kind(d)}")
    for key in ("dtype", "count", "zlib"):
        if key not in d:
            raise ReportFieldError(f"{path}.{key}", f"{path}: missing field {key!r}")
    dtype, n, text = d["dtype"], d["count"], d["zlib"]
    if dtype not in DTYPES:
        raise ReportFieldError(f"{path}.dtype", f"{path}.dtype: expected one of {', '.join(DTYPES)}, got {_short(dtype)}")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**40:
        raise ReportFieldError(f"{path}.count", f"{path}.count: expected a non-negative integer, got {_short(n)}")
    if count is not None and n != count:
        raise ReportFieldError(f"{path}.count", f"{path} has {n} entries for {count} steps")
    if not isinstance(text, (str, bytearray)):  # a bytearray: the base64 decoded as the file was read (fp16probe.reading)
        raise ReportFieldError(f"{path}.zlib", f"{path}.zlib: expected base64 text, got {_kind(text)}")
    size = n * np.dtype(dtype).itemsize
    if isinstance(text, Inflated):
        if len(text) != size:
            raise ReportFieldError(f"{path}.zlib", f"{path}.zlib: holds other than {n} values of {dtype}")
        a = np.frombuffer(text, dtype=dtype)
        a.flags.writeable = False
        return a
    try:
        packed = text if isinstance(text, bytearray) else base64.b64decode(text, validate=True)
        inflate = zlib.decompressobj()
        raw = inflate.decompress(packed, size)
        whole = inflate.eof and not inflate.unconsumed_tail and not inflate.unused_data
        if isinstance(text, bytearray):
            text.clear()  # read once (fp16probe.reading made it for this): its memory goes as the array arrives
    except (binascii.Error, ValueError, zlib.error) as e:
        raise ReportFieldError(f"{path}.zlib", f"{path}.zlib: not base64 of zlib data ({e})") from e
    if len(raw) != size or not whole:
        raise ReportFieldError(f"{path}.zlib", f"{path}.zlib: holds other than {n} values of {dtype}")
    a = np.frombuffer(raw, dtype=dtype)
    a.flags.writeable = False
    return a


def _kind(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), type(v).__name__)


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def narrow_floats(values: Any) -> np.ndarray:
    """``values`` as float32 when every one is a float32 exactly (what a device recorded), else float64."""
    a = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = a.astype(np.float32)
    same = (f.astype(np.float64) == a) | (np.isnan(a) & np.isnan(f))
    return f if bool(same.all()) else a


def narrow_counts(values: Any) -> np.ndarray:
    """Non-negative integers in the narrowest unsigned type that holds them (int64 past 2^32)."""
    a = np.asarray(values, dtype=np.int64)
    top = int(a.max()) if a.size else 0
    for t in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(t).max:
            return a.astype(t)
    return a


def _nullable(values: Sequence[float | None]) -> np.ndarray:
    if isinstance(values, Column):
        return values.array
    return np.fromiter((NULL if v is None else v for v in values), dtype=np.float64, count=len(values))


def steps_per_block(steps: int) -> int:
    """How many steps each per-module entry covers in a trace of ``steps`` steps (1: one per step)."""
    return max(1, -(-steps // MODULE_STEPS))


def block_max(matrix: Any, block: int) -> np.ndarray:
    """Each row's max over consecutive blocks of ``block`` columns (the last block may be shorter)."""
    a = np.asarray(matrix)
    if block <= 1 or a.shape[-1] == 0:
        return a
    return np.maximum.reduceat(a, np.arange(0, a.shape[-1], block), axis=-1)


# -- columns in memory -------------------------------------------------------------------------

class Column(Sequence[Any]):
    """A read-only sequence over a 1-D array: Python ints, floats or bools, and None for a null float.

    ``array`` is the array itself, for analysis over every step. Equal to any sequence with
    the same values (a NaN equals a NaN), so a packed report compares equal to the same report in rows.
    """

    __slots__ = ("array", "nullable")

    def __init__(self, array: np.ndarray, nullable: bool = False) -> None:
        self.array = array
        self.nullable = nullable and array.dtype.kind == "f"

    def __len__(self) -> int:
        return int(self.array.shape[0])

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> "Column": ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return Column(self.array[i], self.nullable)
        v = self.array[i].item()
        return None if self.nullable and v < 0 else v

    def __iter__(self) -> Iterator[Any]:
        for lo in range(0, len(self), 65536):
            for v in self.array[lo:lo + 65536].tolist():
                yield None if self.nullable and v < 0 else v

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Column):
            return self.nullable == other.nullable and bool(np.array_equal(self.array, other.array, equal_nan=True))
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != len(self):
            return False
        return all(a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
                   for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Column({len(self)} values of {self.array.dtype})"

    def tolist(self) -> list[Any]:
        """The values as a list (None for null)."""
        return list(self)


class HistogramColumn(Sequence[Histogram]):
    """One histogram per step, kept as arrays: a step's counts are ``counts[offset[i]:offset[i+1]]`` for
    bins ``lo[i]`` on (bin indices, 0 for 2^MIN_EXP); ``zero``, ``inf``, ``nan``, ``max_abs`` one per step.

    ``hist[i]`` builds that step's :class:`~fp16probe.histogram.Histogram`; ``dense``, ``total``,
    ``max_abs`` and ``nonfinite`` read every step at once.
    """

    __slots__ = ("lo", "offset", "counts", "zero", "inf", "nan", "max_abs")

    def __init__(self, lo: np.ndarray, width: np.ndarray, counts: np.ndarray, zero: np.ndarray, inf: np.ndarray,
                 nan: np.ndarray, max_abs: np.ndarray) -> None:
        self.lo = lo.astype(np.int64)
        self.offset = np.concatenate([[0], np.cumsum(width, dtype=np.int64)])
        self.counts, self.zero, self.inf, self.nan, self.max_abs = counts, zero, inf, nan, max_abs

    def __len__(self) -> int:
        return int(self.lo.shape[0])

    @property
    def width(self) -> np.ndarray:
        """How many bins each step stores."""
        return np.diff(self.offset)

    @overload
    def __getitem__(self, i: int) -> Histogram: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Histogram]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("histogram index out of range")
        lo = int(self.lo[i])
        counts = [0] * NUM_EXP_BINS
        counts[lo:lo + int(self.offset[i + 1] - self.offset[i])] = self.counts[self.offset[i]:self.offset[i + 1]].tolist()
        return Histogram(tuple(counts), int(self.zero[i]), int(self.inf[i]), int(self.nan[i]), float(self.max_abs[i]))

    def __iter__(self) -> Iterator[Histogram]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        if isinstance(other, HistogramColumn):
            return all(bool(np.array_equal(a, b)) for a, b in (
                (self.zero, other.zero), (self.inf, other.inf), (self.nan, other.nan), (self.max_abs, other.max_abs))) \
                and all(x == y for x, y in zip(self, other))
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"HistogramColumn({len(self)} steps)"

    def dense(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Steps ``start`` to ``stop`` as an int64 matrix, one row of NUM_EXP_BINS counts per step."""
        stop = len(self) if stop is None else stop
        out = np.zeros((max(stop - start, 0), NUM_EXP_BINS), dtype=np.int64)
        a, b = int(self.offset[start]), int(self.offset[stop])
        if b > a:
            step = np.repeat(np.arange(stop - start), np.diff(self.offset[start:stop + 1]))
            col = self.lo[start:stop][step] + (np.arange(a, b) - self.offset[start:stop][step])
            out[step, col] = self.counts[a:b]
        return out

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The steps ``rows`` as an int64 matrix, one row of NUM_EXP_BINS counts per step (like ``dense``)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.zeros((len(rows), NUM_EXP_BINS), dtype=np.int64)
        width = self.offset[rows + 1] - self.offset[rows]
        step = np.repeat(np.arange(len(rows)), width)
        within = np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)
        out[step, self.lo[rows][step] + within] = self.counts[self.offset[rows][step] + within]
        return out

    def total(self) -> Histogram:
        """Every step's histogram summed, exactly (Python integers where int64 could overflow)."""
        n = len(self)
        if n == 0:
            return Histogram()
        if self._sum_fits():
            counts = np.zeros(NUM_EXP_BINS, dtype=np.int64)
            for lo in range(0, n, _CHUNK):
                counts += self.dense(lo, min(lo + _CHUNK, n)).sum(axis=0)
            return Histogram(tuple(int(c) for c in counts), int(self.zero.sum()), int(self.inf.sum()),
                             int(self.nan.sum()), float(self.max_abs.max()))
        return Histogram.sum(self)

    def _sum_fits(self) -> bool:
        top = max((int(a.max()) for a in (self.counts, self.zero, self.inf, self.nan) if a.size), default=0)
        return top * len(self) < 2**62

    @property
    def nonfinite(self) -> np.ndarray:
        """Whether each step's histogram holds an inf or NaN."""
        return (self.inf > 0) | (self.nan > 0)


# -- histograms, a trace and a history, packed and read back -----------------------------------

def pack_histograms(hists: Sequence[Histogram] | Mapping[str, Any]) -> dict[str, Any]:
    """One histogram per step, packed: each step's bins from its lowest to its highest nonzero one.

    ``hists``: the histograms, or arrays by name (``lo``: first bin index per step, ``counts``: a
    step-by-bin matrix from there, ``zero``, ``max_abs``; ``inf``, ``nan`` zero where absent)."""
    if isinstance(hists, HistogramColumn):
        lo, width, counts = hists.lo, hists.width, hists.counts
        zero, inf, nan, max_abs = hists.zero, hists.inf, hists.nan, hists.max_abs
    elif isinstance(hists, Mapping):
        matrix = np.asarray(hists["counts"], dtype=np.int64)
        n = matrix.shape[0]
        nz = matrix > 0
        has = nz.any(axis=1)
        first = np.where(has, nz.argmax(axis=1), 0)
        last = np.where(has, matrix.shape[1] - 1 - nz[:, ::-1].argmax(axis=1), -1)
        width = last - first + 1
        keep = (np.arange(matrix.shape[1]) >= first[:, None]) & (np.arange(matrix.shape[1]) <= last[:, None])
        lo, counts = np.asarray(hists["lo"], dtype=np.int64) + first, matrix[keep]
        zero = np.asarray(hists["zero"], dtype=np.int64)
        inf = np.asarray(hists.get("inf", np.zeros(n)), dtype=np.int64)
        nan = np.asarray(hists.get("nan", np.zeros(n)), dtype=np.int64)
        max_abs = np.asarray(hists["max_abs"], dtype=np.float64)
    else:
        n = len(hists)
        lo, width = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        parts = []
        for i, h in enumerate(hists):
            row = np.asarray(h.counts, dtype=np.int64)
            nz = np.flatnonzero(row)
            if nz.size:
                lo[i], width[i] = nz[0], nz[-1] - nz[0] + 1
                parts.append(row[nz[0]:nz[-1] + 1])
        counts = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        zero = np.fromiter((h.zero for h in hists), dtype=np.int64, count=n)
        inf = np.fromiter((h.inf for h in hists), dtype=np.int64, count=n)
        nan = np.fromiter((h.nan for h in hists), dtype=np.int64, count=n)
        max_abs = np.fromiter((h.max_abs for h in hists), dtype=np.float64, count=n)
    return {"lo": pack(narrow_counts(lo)), "width": pack(narrow_counts(width)), "counts": pack(narrow_counts(counts)),
            "zero": pack(narrow_counts(zero)), "inf": pack(narrow_counts(inf)), "nan": pack(narrow_counts(nan)),
            "max_abs": pack(narrow_floats(max_abs))}


def unpack_histograms(d: Any, path: str, count: int) -> HistogramColumn:
    """Read packed histograms, checking what ``Histogram.from_dict`` checks of each (bins in range, counts
    below 2^63, ``max_abs`` finite and in the highest occupied bin) over all steps at once."""
    if not isinstance(d, Mapping):
        raise ReportFieldError(path, f"{path}: expected packed histograms (an object of arrays), got {_kind(d)}")
    a = {key: unpack(d.get(key), f"{path}.{key}", count) for key in ("lo", "width", "zero", "inf", "nan", "max_abs")}
    for key in ("lo", "width", "zero", "inf", "nan"):
        _need(a[key].dtype.kind in "ui", f"{path}.{key}", "integers")
    lo, width = a["lo"].astype(np.int64), a["width"].astype(np.int64)
    _need(bool(((lo >= 0) & (width >= 0) & (lo + width <= NUM_EXP_BINS)).all()), f"{path}.lo",
          f"bin ranges within the {NUM_EXP_BINS} bins")
    total = int(width.sum())
    counts = unpack(d.get("counts"), f"{path}.counts", total)
    _need(counts.dtype.kind in "ui", f"{path}.counts", "integers")
    for key, arr in (("counts", counts), ("zero", a["zero"]), ("inf", a["inf"]), ("nan", a["nan"])):
        _need(not arr.size or int(arr.min()) >= 0, f"{path}.{key}", "non-negative counts below 2^63")
    max_abs = a["max_abs"].astype(np.float64)
    _need(a["max_abs"].dtype.kind == "f" and bool((np.isfinite(max_abs) & (max_abs >= 0)).all())
          and (not max_abs.size or float(max_abs.max()) <= 2.0**128 * (1 - 2.0**-24)), f"{path}.max_abs",
          "finite numbers in [0, 3.403e+38]")
    hist = HistogramColumn(lo, width, counts, a["zero"], a["inf"], a["nan"], a["max_abs"])
    # max_abs lies in the highest occupied bin, (2^(top-1), 2^top], as check_histogram requires of each.
    top = np.full(count, -1, dtype=np.int64)
    for first in range(0, count if total else 0, _CHUNK):  # in blocks of steps: temporaries bounded, not per value
        last = min(first + _CHUNK, count)
        a, b = int(hist.offset[first]), int(hist.offset[last])
        step = np.repeat(np.arange(first, last), width[first:last])
        col = lo[step] + (np.arange(a, b) - hist.offset[step])
        occupied_value = counts[a:b] > 0
        np.maximum.at(top, step[occupied_value], col[occupied_value])
    from fp16probe.histogram import MIN_EXP

    occupied = top >= 0
    exp = top + MIN_EXP
    with np.errstate(over="ignore"):
        inside = (max_abs > np.ldexp(1.0, exp - 1)) & (max_abs <= np.ldexp(1.0, exp))
    _need(bool(np.where(occupied, inside, max_abs == 0.0).all()), f"{path}.max_abs",
          "each step's max_abs in its highest occupied bin (0 with none)")
    return hist


def _need(ok: bool, path: str, expected: str) -> None:
    if not ok:
        raise ReportFieldError(path, f"{path}: expected {expected}")


def pack_trace(*, steps: Any, histograms: Mapping[str, Any], names: Mapping[str, Sequence[str]],
               module_max: Mapping[str, Any], scale: Any, found_inf: Any, ceiling: Any | None,
               module_block: int = 1) -> dict[str, Any]:
    """A trace's packed JSON (see ``StepTrace``): ``module_max[kind]`` a module-by-step matrix in ``names[kind]``'s order,
    or by block of ``module_block`` steps; a per-step matrix of more than MODULE_STEPS steps is reduced to block maxima."""
    n = len(steps)
    if module_block == 1 and n > MODULE_STEPS:
        module_block = steps_per_block(n)
        module_max = {k: block_max(np.asarray(m).reshape(len(names[k]), n), module_block) for k, m in module_max.items()}
    out: dict[str, Any] = {
        "layout": LAYOUT,
        "steps": pack(narrow_counts(steps) if len(steps) and int(np.min(steps)) >= 0 else np.asarray(steps, np.int64)),
        "histograms": {k: pack_histograms(hs) for k, hs in histograms.items()},
        "module_max": {k: {"names": list(names[k]), "values": pack(narrow_floats(np.asarray(module_max[k]).reshape(-1)))}
                       for k in module_max},
        "scale": pack(narrow_floats(_nullable(scale))),
        "found_inf": pack(np.asarray(found_inf, dtype=bool)),
    }
    if ceiling is not None:
        out["ceiling"] = pack(narrow_floats(np.asarray(ceiling, dtype=np.float64)))
    if module_block > 1:
        out["module_block"] = int(module_block)
    return out


def pack_history(first_step: int, scale: Sequence[float | None], grad_max: Sequence[float | None],
                 ceiling: Sequence[float | None], forward_max: Sequence[float | None] | None) -> dict[str, Any]:
    """A history's packed JSON (see ``StepHistory``); null is -1 in every column."""
    return {"layout": LAYOUT, "first_step": int(first_step),
            "scale": pack(narrow_floats(_nullable(scale))), "grad_max": pack(narrow_floats(_nullable(grad_max))),
            "ceiling": pack(narrow_floats(_nullable(ceiling))),
            "forward_max": None if forward_max is None else pack(narrow_floats(_nullable(forward_max)))}


def unpack_floats(d: Any, path: str, count: int | None, *, nullable: bool, nonfinite: str = "") -> Column:
    """A float column, checked: each value finite in [0, float max] (or inf/NaN as ``nonfinite`` allows:
    ``"inf"``, ``"inf nan"``), or -1 for null where ``nullable``."""
    a = unpack(d, path, count)
    _need(a.dtype.kind == "f", f"{path}.dtype", "a float type (<f4 or <f8)")
    v = a.astype(np.float64, copy=False)
    ok = np.isfinite(v) & (v >= 0)
    if nullable:
        ok |= v == NULL
    if "inf" in nonfinite:
        ok |= v == np.inf
    if "nan" in nonfinite:
        ok |= np.isnan(v)
    if not bool(ok.all()):
        i = int(np.flatnonzero(~ok)[0])
        allowed = ", ".join(["finite numbers >= 0", *nonfinite.split(), *(["-1 for null"] if nullable else [])])
        raise ReportFieldError(f"{path}[{i}]", f"{path}[{i}]: expected {allowed}, got {v[i]!r}")
    return Column(a, nullable)
