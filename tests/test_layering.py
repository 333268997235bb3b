"""Data flows one way: capture -> statistics -> report -> analysis -> presentation.

Each module may import only from earlier stages; rich and matplotlib stay at the edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp16probe"

# Stage of each module; a module may import fp16probe modules of its own stage or earlier.
STAGES = {
    "_version": 0, "errors": 0, "formats": 0,
    "_cpu_kernel": 1, "histogram": 1,
    "report": 2,
    "probe": 3, "ops": 3, "distributed": 3,
    "provenance": 4, "replay": 4, "analysis": 4, "compare": 4, "demo": 4, "loading": 4, "workload": 4,
    "plotting": 5, "display": 5, "render": 5,
    "integrations": 6, "cli": 6, "__main__": 7, "__init__": 7,
}
# Imports made inside functions (lazy) that deliberately point later: thin presentation
# hooks (`Report.plot`, `_repr_html_`, `__rich__`) that load the presentation on demand.
LAZY_OK = {("report", "plotting"), ("report", "display"), ("analysis", "plotting"), ("analysis", "display")}
ONLY_IN = {"rich": {"render", "display"}, "matplotlib": {"plotting"}, "numba": {"_cpu_kernel"}}
# (That importing fp16probe loads neither rich nor matplotlib is checked in test_display.py.)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        yield rel.parts[0], path


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            yield name, id(node) in top_level


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda v: str(v))
def test_imports_follow_the_stages(name, path):
    assert name in STAGES, f"{name}: give the new module a stage in tests/test_layering.py"
    for imported, top_level in _imports(path):
        root = imported.split(".")[0]
        if root in ONLY_IN:
            assert name in ONLY_IN[root], f"{path.name} imports {root}, allowed only in {sorted(ONLY_IN[root])}"
        parts = imported.split(".")
        if parts[0] != "fp16probe" or len(parts) < 2:
            continue
        target = parts[1]
        if target not in STAGES:
            continue  # ``from fp16probe import x``: x names a module only if it is in STAGES
        if STAGES[target] > STAGES[name]:
            assert (name, target) in LAZY_OK and not top_level, (
                f"{path.name} imports fp16probe.{target}, a later stage"
            )
