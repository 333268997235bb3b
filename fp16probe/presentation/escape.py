"""The one escaping rule for text from a report or a model, in every medium fp16probe writes.

A report file is a CI artifact (it may come from an untrusted branch) and module names come
from code the user may not have written, so every string of theirs is data. :func:`text` is the
rule every medium starts from: C0 and C1 control characters (ESC, and so every terminal escape
sequence, among them), DEL, bidirectional overrides and isolates, zero-width and tag characters,
line and paragraph separators and lone surrogates are shown as visible escapes (``\\x1b``, ``\\n``, ``\\u202e``,
``\\udc80``), so they can neither move the cursor, change a window title, link, reorder the
text nor split a line. Each medium adds its own syntax on top:

- terminal: :func:`text`; and :class:`GuardedStream`, under every console, puts a ``\\`` before a
  printed line that would start with ``::`` (a GitHub Actions workflow command), wherever
  wrapping put the words;
- Markdown (the job summary): :func:`markdown` and :func:`markdown_code`;
- HTML and SVG/XML: :func:`xml` (also what :mod:`html` escapes);
- GitHub workflow commands: :func:`workflow_data` and :func:`workflow_property` (``%25``,
  ``%0D``, ``%0A``, and ``%3A``/``%2C`` in properties);
- matplotlib (SVG and PNG text): :func:`figure`, which also keeps ``$`` from starting mathtext;
- experiment trackers' tags and names: :func:`text`.

What is escaped where is listed in ``docs/faults.md``.
"""

from __future__ import annotations

import re
from typing import IO, Any

__all__ = ["GuardedStream", "figure", "guard_line", "markdown", "markdown_code", "text", "workflow_data",
           "workflow_property", "xml"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0, DEL, C1; line/paragraph separators; bidi marks, embeddings, overrides and isolates; the
# BOM/zero-width no-break space; lone surrogates (a JSON report may hold "\udc80").
# Zero-width and invisible characters (U+200B-U+200D, U+2060-U+2064, U+180E) and the tag characters
# (U+E0000-U+E007F) too: a name that holds them looks like another name.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069"
                     "\ufeff\ud800-\udfff\U000e0000-\U000e007f]")


def _visible(m: re.Match[str]) -> str:
    c = m.group()
    if c in _NAMED:
        return _NAMED[c]
    if ord(c) > 0xFFFF:
        return f"\\U{ord(c):08x}"
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def text(value: object) -> str:
    """``value`` as text with every unsafe character shown as a visible escape (see the module docstring).

    Idempotent: escaping escaped text changes nothing, so two layers that both apply it agree.
    """
    return _UNSAFE.sub(_visible, str(value))


# -- Markdown ---------------------------------------------------------------------------------
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def markdown(value: object) -> str:
    """Text for a Markdown line or table cell: one line, HTML's ``& < >`` as entities, Markdown's marks backslashed.

    So ``<script>`` and ``<img onerror=...>`` show as text, ``[x](url)`` is no link, ``|`` no new
    cell and ``**`` no emphasis; whitespace runs (newlines included, after escaping) become one space.
    """
    s = " ".join(text(value).split())
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", s)


def markdown_code(value: object) -> str:
    """Text for inside a Markdown code span: one line, no backtick (a code span shows everything else literally)."""
    return " ".join(text(value).split()).replace("`", "'")


# -- XML, HTML, SVG ---------------------------------------------------------------------------
def xml(value: object) -> str:
    """Text for an XML or HTML element or a quoted attribute: :func:`text`, then ``& < > " '`` as entities."""
    return (text(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#x27;"))


# -- GitHub Actions workflow commands -----------------------------------------------------------
def workflow_data(value: object) -> str:
    """The message of a workflow command: ``%``, CR and LF as ``%25``, ``%0D``, ``%0A`` (as GitHub reads them), the rest by :func:`text`."""
    s = str(value).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text(s)


def workflow_property(value: object) -> str:
    """A property of a workflow command (``title=``): :func:`workflow_data` plus ``:`` and ``,`` as ``%3A`` and ``%2C``."""
    return workflow_data(value).replace(":", "%3A").replace(",", "%2C")


# -- matplotlib -------------------------------------------------------------------------------
def figure(value: object) -> str:
    """Text for a matplotlib label or title: :func:`text`, with ``$`` escaped so a name never starts mathtext."""
    return text(value).replace("$", r"\$")


# -- printed lines ------------------------------------------------------------------------------
# A printed line may start with blanks and terminal styles (SGR: ESC [ ... m) before its text.
_LINE_HEAD = re.compile(r"(?:[ \t]|\x1b\[[0-9;]*m)*")


def guard_line(line: str) -> str:
    """``line`` with a ``\\`` before its text when that text starts with ``::`` (GitHub reads such a line as a command).

    GitHub's runner trims leading blanks before it looks, so the ``\\`` goes after them.
    """
    head = _LINE_HEAD.match(line)
    end = head.end() if head else 0
    if line.startswith("::", end):
        return f"{line[:end]}\\{line[end:]}"
    return line


class GuardedStream:
    """A text stream that applies :func:`guard_line` to every line written through it.

    Every console fp16probe prints with writes through one, so no printed line starts with
    ``::``, whatever the data and wherever wrapping broke it. The target is looked up at each
    write (``sys.stderr`` by default, so a test's captured stream is honoured).
    """

    def __init__(self, target: Any) -> None:
        self._target = target  # a stream, or a callable that returns the stream now
        self._at_line_start = True

    @property
    def stream(self) -> IO[str]:
        """The stream written to now."""
        return self._target() if callable(self._target) else self._target

    def write(self, s: str) -> int:
        """Write ``s``, guarding each line that starts in it."""
        out = []
        for piece in s.splitlines(keepends=True):
            out.append(guard_line(piece) if self._at_line_start else piece)
            self._at_line_start = piece.endswith(("\n", "\r"))
        return self.stream.write("".join(out))

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, flush, encoding: the stream's own
        return getattr(self.stream, name)
