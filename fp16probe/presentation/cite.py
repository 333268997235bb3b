"""A citation in words: ``authors, "title", arXiv:id (note), url``.

The records come from :mod:`fp16probe.sources` or from a report file; a file's fields are
untrusted, so every field is escaped (``presentation.escape``) before it joins the line. An
older report's stored sentence is shown as it was, escaped too.
"""

from __future__ import annotations

from fp16probe.presentation import escape
from fp16probe.recommendation import Cited
from fp16probe.sources import MIXED_PRECISION_TRAINING

__all__ = ["PAPER", "cite"]


def cite(c: Cited, *, short: bool = False) -> str:
    """``c`` as one line; ``short`` leaves out the note and the URL (for a citation inside a sentence)."""
    if isinstance(c, str):
        return escape.text(c)
    line = f'{escape.text(c.authors)}, "{escape.text(c.title)}"'
    if c.arxiv:
        line += f", arXiv:{escape.text(c.arxiv)}"
    if short:
        return line
    if c.note:
        line += f" ({escape.text(c.note)})"
    if c.url:
        line += f", {escape.text(c.url)}"
    return line


PAPER = cite(MIXED_PRECISION_TRAINING, short=True)  # the paper, inside a sentence
