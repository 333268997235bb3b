"""Read a report file with bounds: a regular file only, and no more than a cap of bytes.

A report is input that may come from an untrusted CI artifact: ``/dev/zero``, a FIFO or a
gigabyte of JSON must end in one line and exit 2, not in a hang or a MemoryError. The cap
(:data:`DEFAULT_MAX_REPORT_MB`, raised with the ``FP16PROBE_MAX_REPORT_MB`` environment
variable) also bounds a report's step history: a 12-layer GPT-2 sampled on every step writes
about 7,800 bytes a step as lists and 1,800 packed (:mod:`fp16probe.columns`), so the default
holds about 34,000 and 150,000 of its steps (measured: ``bench/long_history.py``, docs/faults.md).

A long report's bulk is the base64 text of its packed arrays. :func:`read_report` decodes each
long one (:data:`LIFT_FROM` characters and more, in a ``"zlib"`` field) while it reads the file,
through a read-only memory map whose pages it gives back as it goes, inflating it within the
size its object declares, and leaves a token in the text in its place: the JSON parser never
holds that text, and neither the file nor its compressed bytes are ever in memory whole.
"""

from __future__ import annotations

import binascii
import mmap
import os
import re
import stat
import zlib
from pathlib import Path

from fp16probe.columns import Inflated
from fp16probe.errors import ReportError

__all__ = ["DEFAULT_MAX_REPORT_MB", "LIFT_FROM", "MAX_REPORT_MB_VARIABLE", "max_report_bytes", "read_report"]

DEFAULT_MAX_REPORT_MB = 256
"""The largest report file read, in MiB, unless ``FP16PROBE_MAX_REPORT_MB`` says otherwise."""

MAX_REPORT_MB_VARIABLE = "FP16PROBE_MAX_REPORT_MB"

LIFT_FROM = 2**20
"""A packed array's base64 text this long or longer is decoded as the file is read (:func:`read_report`)."""

_ZLIB_KEY = b'"zlib": "'  # how json.dumps writes a packed array's text field (fp16probe.columns.pack)
_PIECE = 2**22  # base64 characters decoded at a time: a multiple of 4 and of the page size
# The start of a packed array as fp16probe.columns.pack writes it: its declared size bounds the inflating.
_PACKED_START = re.compile(rb'\{"dtype": "(\|u1|<u2|<u4|<i8|<f4|<f8)", "count": (\d{1,13}), \Z')


def max_report_bytes() -> int:
    """The cap on a report file's size in bytes: ``FP16PROBE_MAX_REPORT_MB`` MiB, else the default."""
    raw = os.environ.get(MAX_REPORT_MB_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_MAX_REPORT_MB * 2**20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 0 < mb < 2**40:
        raise ReportError(f"{MAX_REPORT_MB_VARIABLE}={raw!r}: expected a positive number of MiB, "
                          f"e.g. {MAX_REPORT_MB_VARIABLE}=1024")
    return int(mb * 2**20)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n:,} bytes"


def _too_big(path: Path, cap: int, size: str = "") -> ReportError:
    return ReportError(f"{path}: the report is {size}larger than the {_mib(cap)} a report may be; if it is one "
                       f"you trust, raise the cap with {MAX_REPORT_MB_VARIABLE}=<MiB>")


def read_report(path: Path) -> tuple[str, dict[str, bytearray]]:
    """The text of a report file, with its long packed arrays lifted out: refused when it is not a regular
    file or is larger than :func:`max_report_bytes`.

    Returns the text, each long ``"zlib"`` field's base64 replaced by a token (``"#0"``, ``"#1"``:
    never base64, so never a packed array's own text), and each token's bytes: inflated
    (:class:`~fp16probe.columns.Inflated`) where the field's object starts as ``pack`` writes it
    (``{"dtype": ..., "count": ...,``: its declared size the bound), else still compressed, read
    once (``columns.unpack`` empties it as it inflates it). A field that is not pure base64, or
    whose data does not inflate to its declared size, is left in the text, for the reader to refuse by name."""
    cap = _checked_cap(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > cap:
                raise _too_big(path, cap)
            if size == 0:
                return "", {}
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                if len(mm) > cap:
                    raise _too_big(path, cap)
                text, lifted = _lift(mm)
    except OSError as e:
        raise ReportError(f"{path}: cannot read report: {e.strerror or e}") from e
    return _utf8(path, text), lifted


def _lift(mm: mmap.mmap) -> tuple[bytes, dict[str, bytearray]]:
    """The mapped file's bytes with each long base64 ``"zlib"`` field replaced by a token, and the tokens' bytes."""
    parts: list[bytes] = []
    lifted: dict[str, bytearray] = {}
    copied = pos = 0
    while (k := mm.find(_ZLIB_KEY, pos)) >= 0:
        start = k + len(_ZLIB_KEY)
        end = mm.find(b'"', start)
        if end < 0:
            break
        pos = end + 1
        backslashes = 0
        while k - 1 - backslashes >= 0 and mm[k - 1 - backslashes] == 0x5C:
            backslashes += 1
        if end - start < LIFT_FROM or backslashes % 2:  # short, or the key's quote is inside a string
            continue
        head = _PACKED_START.search(mm[max(0, k - 64):k])
        size = None if head is None else int(head[2]) * int(head[1][2:])
        data = _base64(mm, start, end, size)
        if data is None:
            continue
        token = f"#{len(lifted)}"
        parts += [mm[copied:start], token.encode("ascii")]
        lifted[token] = data
        copied = end
    parts.append(mm[copied:])
    return b"".join(parts), lifted


def _base64(mm: mmap.mmap, start: int, end: int, size: int | None) -> bytearray | None:
    """The bytes of ``mm[start:end]`` read as base64, piece by piece, each piece's pages given back once read;
    with ``size`` (the array's declared bytes), inflated as they come, never past it: an :class:`Inflated`.
    None when it is not base64, or not zlib data of exactly ``size`` bytes."""
    out = bytearray() if size is None else Inflated()
    inflate = zlib.decompressobj()
    page = mmap.PAGESIZE
    try:
        for a in range(start, end, _PIECE):
            b = min(a + _PIECE, end)
            piece = binascii.a2b_base64(mm[a:b], strict_mode=True)
            if size is None:
                out += piece
            else:
                out += inflate.decompress(piece, size - len(out) + 1)
                if len(out) > size or inflate.unconsumed_tail:
                    return None
            lo, hi = -(-a // page) * page, b // page * page  # whole pages inside the piece
            if hi > lo and hasattr(mm, "madvise"):
                mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    except (binascii.Error, zlib.error):
        return None
    if size is not None and (len(out) != size or not inflate.eof or inflate.unused_data):
        return None
    return out


def _checked_cap(path: Path) -> int:
    """The size cap, once ``path`` is known to be a regular file no larger than it."""
    cap = max_report_bytes()
    try:
        st = os.stat(path)  # follows a symlink: its target is what would be read
    except FileNotFoundError as e:
        raise ReportError(f"{path}: no such report file") from e
    except OSError as e:
        raise ReportError(f"{path}: cannot read report: {e.strerror or e}") from e
    if stat.S_ISDIR(st.st_mode):
        raise ReportError(f"{path}: is a folder, not a report file")
    if not stat.S_ISREG(st.st_mode):
        raise ReportError(f"{path}: not a regular file (a device, FIFO or socket); a report is a JSON file "
                          "written by fp16probe profile: copy it to a file first")
    if st.st_size > cap:
        raise _too_big(path, cap, f"{_mib(st.st_size)}, ")
    return cap


def _utf8(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"{path}: cannot read report: not UTF-8 text ({e.reason} at byte {e.start:,})") from e
