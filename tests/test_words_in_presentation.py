"""Decisions in analysis, sentences in presentation: no English is built in ``fp16probe/analysis``.

Analysis returns verdicts, numbers and codes; every sentence a reader sees is rendered in
``fp16probe/presentation`` (``verdict.py`` for the verdict's reasoning, ``answer.py`` for the
caveats and the short answer). This test reads each analysis module's syntax tree and fails on
a string of three or more words outside a docstring, unless it is an error raised to the user
(a ``raise`` statement or an ``...Error(...)`` call: errors stay where they are raised) or a
comment. ``PENDING`` lists the modules whose words have not moved yet, each with its reason; a
module leaves the list when its words move, and the test fails if a listed module is clean.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ANALYSIS = Path(__file__).resolve().parent.parent / "fp16probe" / "analysis"
WORDS = re.compile(r"[A-Za-z']+[ ,:;]+[A-Za-z']+[ ,:;]+[A-Za-z']+")

# Modules still writing English, with the words they write. Shrink this; never grow it.
PENDING: dict[str, str] = {}


def _error_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside a raise statement or an ``...Error(...)``/``...Warning(...)`` call."""
    out: set[int] = set()
    for node in ast.walk(tree):
        inside = isinstance(node, ast.Raise) or (
            isinstance(node, ast.Call) and re.search(r"(Error|Warning|Exception)$", ast.unparse(node.func)))
        if inside:
            out.update(id(n) for n in ast.walk(node))
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def sentences(path: Path) -> list[str]:
    """The strings of three or more words built in ``path`` (f-strings by their literal parts)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _error_nodes(tree) | _docstrings(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
            text = " ".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if WORDS.search(text):
            found.append(f"{path.name}:{node.lineno}: {text[:70]!r}")
    return found


MODULES = sorted(p for p in ANALYSIS.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_analysis_builds_no_sentences(path: Path) -> None:
    found = sentences(path)
    if path.name in PENDING:
        assert found, f"{path.name} writes no English any more: take it off PENDING"
        return
    assert not found, "English built in analysis (word it in fp16probe/presentation):\n" + "\n".join(found)


def test_the_detector_finds_a_sentence(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('def f(x):\n    """Doc string is fine here."""\n    if x:\n        raise ValueError(f"no good value {x} here")\n'
                   '    return f"the value is {x} today"\n')
    assert [s.split(": ", 1)[0] for s in sentences(bad)] == ["bad.py:5"]
