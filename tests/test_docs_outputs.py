"""The outputs shown in docs/*.md are what the commands print today: docs/regenerate.py reruns them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _regenerate():
    spec = importlib.util.spec_from_file_location("regenerate", ROOT / "docs" / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regenerate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_generated_block_is_registered_and_shown():
    regenerate = _regenerate()
    marked = {name: page.name for page in (ROOT / "docs").glob("*.md") for name in regenerate.shown(page)}
    assert marked == {name: block.page for name, block in regenerate.BLOCKS.items()}


@pytest.mark.slow
def test_the_generated_blocks_match_a_fresh_run(capsys):
    assert _regenerate().main(["--check"]) == 0, capsys.readouterr().err  # rerun: python docs/regenerate.py
