"""Read a report file with bounds: a regular file only, and no more than a cap of bytes.

A report is input that may come from an untrusted CI artifact: ``/dev/zero``, a FIFO or a
gigabyte of JSON must end in one line and exit 2, not in a hang or a MemoryError. The cap
(:data:`DEFAULT_MAX_REPORT_MB`, raised with the ``FP16PROBE_MAX_REPORT_MB`` environment
variable) also bounds a report's step history: a 12-layer GPT-2 sampled on every step writes
about 7,800 bytes a step as lists and 1,800 packed (:mod:`fp16probe.columns`), so the default
holds about 34,000 and 150,000 of its steps (measured: ``bench/long_history.py``, docs/faults.md).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from fp16probe.errors import ReportError

__all__ = ["DEFAULT_MAX_REPORT_MB", "MAX_REPORT_MB_VARIABLE", "max_report_bytes", "read_report_text"]

DEFAULT_MAX_REPORT_MB = 256
"""The largest report file read, in MiB, unless ``FP16PROBE_MAX_REPORT_MB`` says otherwise."""

MAX_REPORT_MB_VARIABLE = "FP16PROBE_MAX_REPORT_MB"


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


def _read_at_most(f: BinaryIO, limit: int, expected: int) -> bytes:
    """Up to ``limit`` bytes of ``f``, read in pieces: ``f.read(limit)`` would allocate ``limit`` bytes at once
    (a cap raised to 100 GiB is a MemoryError before a byte is read)."""
    parts: list[bytes] = []
    got = 0
    while got < limit:
        part = f.read(min(limit - got, max(expected - got, 0) + 1, 2**30))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_report_text(path: Path) -> str:
    """The text of a report file: refused when it is not a regular file or is larger than :func:`max_report_bytes`."""
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
    try:
        with open(path, "rb") as f:
            data = _read_at_most(f, cap + 1, st.st_size)  # the file may have grown since it was measured
    except OSError as e:
        raise ReportError(f"{path}: cannot read report: {e.strerror or e}") from e
    if len(data) > cap:
        raise _too_big(path, cap)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReportError(f"{path}: cannot read report: not UTF-8 text ({e.reason} at byte {e.start:,})") from e
