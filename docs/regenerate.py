"""Regenerate the command outputs shown in docs/*.md from real runs, or check that they are current.

    python docs/regenerate.py          # rewrite every generated block in place
    python docs/regenerate.py --check  # exit 1 naming each block that differs from a fresh run

A generated block is a fenced ``text`` block right after a line ``<!-- output: NAME -->``;
NAME is a key of BLOCKS below: the commands that set up the run (in a fresh temporary
folder) and the command whose output (stderr and stdout, as a terminal of ``columns``
shows it, trailing spaces dropped) the block holds. ``tests/test_docs_outputs.py`` runs
the check, so a change to what a command prints, or to the run behind it, fails the suite
until the page is regenerated; the check lets each figure differ by CPU_SHARE, which the CPU's
own fp16 kernels account for.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- output: ([\w-]+) -->$")


@dataclass(frozen=True)
class Block:
    """One generated output: where it is shown, how its run is set up, and the command shown."""

    page: str
    setup: tuple[str, ...]
    command: str
    columns: int = 120


BLOCKS = {
    "live-training-schedule": Block(
        page="live-training.md",
        setup=("python docs/live_training_demo.py live-demo.json",),
        command="fp16probe schedule live-demo.json",
    ),
}


def _run(command: str, cwd: Path, columns: int) -> str:
    words = shlex.split(command)
    if words[0] == "fp16probe":
        words = [sys.executable, "-m", "fp16probe", *words[1:]]
    elif words[0] == "python":
        words = [sys.executable, *(str(ROOT / w) if w.endswith(".py") else w for w in words[1:])]
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(words, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        raise SystemExit(f"error: `{command}` exited {done.returncode}: {done.stderr.strip()}")
    return "\n".join(line.rstrip() for line in (done.stderr + done.stdout).rstrip("\n").splitlines())


def output(name: str) -> str:
    """Run block ``name``'s setup and command in a fresh folder; return what the command printed."""
    block = BLOCKS[name]
    with tempfile.TemporaryDirectory(prefix="fp16probe-docs-") as tmp:
        for command in block.setup:
            _run(command, Path(tmp), block.columns)
        return _run(block.command, Path(tmp), block.columns)


def shown(page: Path) -> dict[str, tuple[int, int]]:
    """The generated blocks on ``page``: name -> (first, end) line indexes of the text between the fences."""
    lines = page.read_text().splitlines()
    found = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m:
            if i + 1 >= len(lines) or lines[i + 1] != "```text":
                raise SystemExit(f"error: {page.name}:{i + 1}: <!-- output: {m.group(1)} --> must be followed "
                                 "by a ```text block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j] == "```")
            found[m.group(1)] = (i + 2, end)
    return found


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")
# A figure of a block may differ by this share from one CPU to another: the runs behind a block train in CPU
# fp16 autocast, whose kernels round otherwise on AVX2 than on AVX-512 (bench/emulation.py partial_sum_rounding);
# live-training's mean flushed shares differ by up to 23% between the two (0.0529% against 0.0433%).
CPU_SHARE = 0.3


def same(shown_text: str, fresh: str, *, exact: bool) -> bool:
    """Whether a block shows what a fresh run printed: exactly (``exact``: regenerating), or with the same words
    and layout and each number within CPU_SHARE of the fresh one (``--check``, on whatever CPU runs it)."""
    if shown_text == fresh or exact:
        return shown_text == fresh
    a, b = _NUMBER.split(shown_text), _NUMBER.split(fresh)
    na, nb = _NUMBER.findall(shown_text), _NUMBER.findall(fresh)
    if [t.strip(" ") for t in a] != [t.strip(" ") for t in b] or len(na) != len(nb):
        return False  # column padding may follow a number's width
    return all(abs(float(x) - float(y)) <= CPU_SHARE * max(abs(float(x)), abs(float(y))) for x, y in zip(na, nb))


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name, block in BLOCKS.items():
        page = DOCS / block.page
        where = shown(page)
        if name not in where:
            raise SystemExit(f"error: {block.page} has no <!-- output: {name} --> block")
        first, end = where[name]
        lines = page.read_text().splitlines()
        fresh = output(name)
        if not same(("\n".join(lines[first:end])), fresh, exact=not check):
            stale.append(f"{block.page}: {name}")
            if not check:
                page.write_text("\n".join(lines[:first] + fresh.splitlines() + lines[end:]) + "\n")
    for item in stale:
        print(("out of date: " if check else "regenerated: ") + item, file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
