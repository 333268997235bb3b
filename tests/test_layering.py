"""The folders are the pipeline's stages, and imports follow them one way.

``fp16probe/*.py`` is shared data (formats, histograms, the report, the recommendation,
errors); ``capture/`` and ``analysis/`` build on the data only; ``presentation/`` shows data
and analysis; ``running/`` drives capture and analysis; the CLI, the integrations and the
package's ``__init__`` sit on top. The layers are derived from the folders, so a new module
needs no entry here, and any import cycle between modules fails, within a layer too.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp16probe"

# What each layer may import (besides itself).
ALLOWED = {
    "data": {"data"},
    "capture": {"data"},
    "analysis": {"data"},
    "presentation": {"data", "analysis"},
    "running": {"data", "capture", "analysis"},
    "integrations": {"data", "capture", "analysis", "presentation", "running"},
    "entry": {"data", "capture", "analysis", "presentation", "running", "integrations"},
    "package": {"data", "capture", "analysis", "presentation", "running"},
}
# Declared display shims: methods of data classes that hand their object to a presentation
# module on demand. Only these may import presentation (inside the method), and those
# imports are left out of the cycle check.
SHIMS = {
    ("fp16probe.recommendation", "Caveat.__str__"),
    ("fp16probe.recommendation", "Recommendation.__repr__"),
    ("fp16probe.recommendation", "Recommendation.__rich__"),
    ("fp16probe.recommendation", "Recommendation._repr_html_"),
    ("fp16probe.recommendation", "Recommendation.explanation"),
    ("fp16probe.recommendation", "Recommendation.text"),
    ("fp16probe.blockadvice", "BlockAdvice.te_code"),
    ("fp16probe.blockadvice", "BlockAdvice.torchao_code"),
    ("fp16probe.blockadvice", "BlockAdvice.notes"),
    ("fp16probe.report", "Report.__repr__"),
    ("fp16probe.report", "Report.__rich__"),
    ("fp16probe.report", "Report._repr_html_"),
    ("fp16probe.report", "Report.plot"),
}
# Third-party packages that live in one module each (ruff's banned-api says the same).
ONLY_IN = {
    "rich": {"fp16probe.presentation.terminal"},
    "matplotlib": {"fp16probe.presentation.figures"},
    "numba": {"fp16probe.capture._cpu_kernel", "fp16probe.capture._cpu_blockkernel"},
    "typer": {"fp16probe.cli"},
    "tensorboard": {"fp16probe.presentation.trackers"},
    "wandb": {"fp16probe.presentation.trackers"},
    "mlflow": {"fp16probe.presentation.trackers"},
}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under fp16probe."""
    parts = module.split(".")[1:]
    if not parts or parts == ["__init__"]:
        return "package"
    if (PACKAGE / parts[0]).is_dir():
        return parts[0]
    return "entry" if parts[0] in {"cli", "__main__"} else "data"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, known: Iterable[str]) -> list[tuple[str, str | None]]:
    """(imported module, where) for each import of ``path``, resolved to known modules.

    ``where`` is None at module level (``if TYPE_CHECKING:`` included), else the qualified
    name of the function or class the import sits in, e.g. ``Report.plot``.
    """
    known = set(known)
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, where: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, child.name if where is None else f"{where}.{child.name}")
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, where) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.extend((f"{child.module}.{a.name}", where) for a in child.names)
                found.append((child.module, where))
            visit(child, where)

    visit(ast.parse(path.read_text(encoding="utf-8")), None)
    resolved = []
    for name, where in found:
        if name.split(".")[0] != "fp16probe":
            resolved.append((name, where))
            continue
        # `from fp16probe.x import y` names module fp16probe.x.y if it exists, else fp16probe.x
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known:
            resolved.append((name, where))
    return list(dict.fromkeys(resolved))  # `from m import a, b` names m once


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for imported, where in _imports(path, mods):
            if imported in mods and imported != m and not _is_shim(m, imported, where):
                graph[m].add(imported)
    return graph


def _is_shim(importer: str, imported: str, where: str | None) -> bool:
    return (importer, where) in SHIMS and layer_of(imported) == "presentation"


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def layer_violations(module: str, imports: Iterable[tuple[str, str | None]]) -> list[str]:
    """Imports of ``module`` that point to a layer it may not use, or a package outside its one home."""
    problems = []
    mine = layer_of(module)
    for imported, where in imports:
        root = imported.split(".")[0]
        if root in ONLY_IN and module not in ONLY_IN[root]:
            problems.append(f"{module} imports {root}, allowed only in {sorted(ONLY_IN[root])}")
        if root != "fp16probe":
            continue
        theirs = layer_of(imported)
        if theirs == mine or theirs in ALLOWED[mine]:
            continue
        if _is_shim(module, imported, where):
            continue
        inside = "" if where is None else f" in {where}"
        problems.append(f"{module} ({mine}) imports {imported} ({theirs}){inside}")
    return problems


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_follow_the_layers(module):
    mods = _modules()
    assert layer_violations(module, _imports(mods[module], mods)) == []


def test_no_import_cycles():
    assert find_cycles(_graph()) == []


def test_a_planted_import_fails_on_a_copy_of_the_package(tmp_path, monkeypatch):
    """On a copy of the real package, one added import is caught as a cycle and as a backwards import."""
    import shutil

    copy = tmp_path / "fp16probe"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    histogram = copy / "histogram.py"
    histogram.write_text(histogram.read_text(encoding="utf-8") + "\nimport fp16probe.capture.probe\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    assert find_cycles(_graph())  # capture.probe -> ... -> histogram -> capture.probe
    mods = _modules()
    assert layer_violations("fp16probe.histogram", _imports(mods["fp16probe.histogram"], mods)) == [
        "fp16probe.histogram (data) imports fp16probe.capture.probe (capture)"
    ]


def test_the_checks_can_fail():
    """The checkers flag a planted backwards import, a planted dependency and a planted cycle."""
    assert layer_violations("fp16probe.report", [("fp16probe.capture.probe", None)])
    assert layer_violations("fp16probe.capture.probe", [("fp16probe.analysis.recommend", "Probe.report")])
    assert layer_violations("fp16probe.report", [("fp16probe.presentation.figures", None)])  # shim at top
    assert not layer_violations("fp16probe.report", [("fp16probe.presentation.figures", "Report.plot")])
    assert layer_violations("fp16probe.recommendation", [("fp16probe.presentation.figures", "Report.plot")])
    assert layer_violations("fp16probe.analysis.recommend", [("rich.table", "analyze")])
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_an_undeclared_display_method_fails(tmp_path):
    """Read from source: a data method that imports presentation passes only when declared a shim."""
    source = tmp_path / "report.py"
    source.write_text(
        "class Report:\n"
        "    def plot(self):\n"
        "        from fp16probe.presentation.figures import figure\n"
        "    def summary(self):\n"
        "        from fp16probe.presentation.answer import report_summary\n"
        "        def inner():\n"
        "            from fp16probe.presentation.html import report_html\n",
        encoding="utf-8",
    )
    assert layer_violations("fp16probe.report", _imports(source, _modules())) == [
        "fp16probe.report (data) imports fp16probe.presentation.answer (presentation) in Report.summary",
        "fp16probe.report (data) imports fp16probe.presentation.html (presentation) in Report.summary.inner",
    ]


def test_every_declared_shim_imports_presentation():
    """No stale entry in SHIMS: each names a method that does import a presentation module."""
    mods = _modules()
    used = {(m, where) for m in {m for m, _ in SHIMS}
            for imported, where in _imports(mods[m], mods) if layer_of(imported) == "presentation"}
    assert SHIMS <= used


def test_layers_come_from_folders():
    assert layer_of("fp16probe.histogram") == "data"
    assert layer_of("fp16probe.capture.engine") == "capture"
    assert layer_of("fp16probe.cli") == "entry"
    assert layer_of("fp16probe") == "package"
    assert {layer_of(m) for m in _modules()} <= set(ALLOWED)
