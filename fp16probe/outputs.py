"""Where a file fp16probe writes really lands: replaced atomically, or written in place.

A report, a figure or a JUnit file normally goes through a temporary file and a rename,
so a crash or a full disk never leaves half a file. That is right for a regular file and
wrong for anything else: renaming over ``/dev/null`` (or a ``mknod`` copy of it) replaces
the device with a JSON file, and renaming over a FIFO leaves its reader with nothing.

- A regular file, or a path that does not exist yet: atomic (temporary file + rename).
- A symlink: followed to its target (through every link), and the target is written
  atomically; the link stays a link.
- A character or block device, a FIFO or a socket: written in place with a plain
  ``open(path, "wb")`` (no temporary file, no rename, no fsync); a FIFO's ``open`` waits
  for its reader, as ``echo > fifo`` does.
- ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N`` and ``/proc/self/fd/N``: written to the
  process's own descriptor N, as a shell redirect expects (no temporary file, no
  truncation of what is already there).
- A directory: refused (``IsADirectoryError``).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
from pathlib import Path

__all__ = ["OutputTarget", "output_target", "write_in_place"]

_OWN_FD = re.compile(r"^/(?:dev/fd|proc/self/fd|proc/thread-self/fd|proc/(\d+)/fd)/(\d+)$")
_STD = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_MAX_LINKS = 40  # as the kernel's own limit (ELOOP)


class OutputTarget:
    """``path``: where the bytes go; ``in_place``: write there directly; ``fd``: or to this descriptor of ours."""

    __slots__ = ("fd", "in_place", "path")

    def __init__(self, path: Path, in_place: bool, fd: int | None = None) -> None:
        self.path = path
        self.in_place = in_place
        self.fd = fd

    def __repr__(self) -> str:
        return f"OutputTarget({str(self.path)!r}, in_place={self.in_place}, fd={self.fd})"


def _own_fd(path: Path) -> int | None:
    text = str(path)
    if text in _STD:
        return _STD[text]
    m = _OWN_FD.match(text)
    if m is None or (m.group(1) is not None and int(m.group(1)) != os.getpid()):
        return None
    return int(m.group(2))


def output_target(path: str | os.PathLike[str]) -> OutputTarget:
    """Resolve ``path`` as a write would see it (see the module docstring); a directory raises IsADirectoryError."""
    given = Path(path)
    p = Path(os.path.abspath(given))
    for _ in range(_MAX_LINKS):
        fd = _own_fd(p)
        if fd is not None:
            return OutputTarget(p, True, fd)
        if not p.is_symlink():
            break
        link = Path(os.readlink(p))
        p = Path(os.path.abspath(link if link.is_absolute() else p.parent / link))
    else:
        raise OSError(errno.ELOOP, "Too many levels of symbolic links", str(given))
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return OutputTarget(p, False)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(given))
    return OutputTarget(p, not stat.S_ISREG(mode))


def write_in_place(target: OutputTarget, data: bytes, *, append: bool = False) -> None:
    """Write ``data`` to a target that must not be replaced: a device, a FIFO, one of our descriptors."""
    if target.fd is not None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None and stream.fileno() == target.fd:
                    stream.flush()  # what was printed before comes first
            except (OSError, ValueError, AttributeError):
                pass
        view = memoryview(data)
        while view:
            view = view[os.write(target.fd, view):]
        return
    with open(target.path, "ab" if append else "wb") as f:
        f.write(data)
