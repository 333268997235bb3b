"""Files fp16probe writes get the user's umask (as open() would), not the temporary file's 0600."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from fp16probe.report import atomic_write_text

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX permission bits")


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_new_file_follows_umask(tmp_path, umask, mask):
    umask(mask)
    path = tmp_path / "report.json"
    atomic_write_text(path, "{}")
    plain = tmp_path / "plain.json"
    with open(plain, "w") as f:
        f.write("{}")
    assert _mode(path) == _mode(plain) == 0o666 & ~mask


def test_replaced_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "report.json"
    path.write_text("old")
    os.chmod(path, 0o640)
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert _mode(path) == 0o640


def test_report_and_junit_are_readable_by_group(tmp_path, umask, monkeypatch):
    """The two files the issue named: a saved report and compare's --junit output."""
    from typer.testing import CliRunner

    from fp16probe.cli import app
    from tests.fixtures.reports import hand_report

    umask(0o022)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    report = hand_report()
    report.save(tmp_path / "a.json")
    assert _mode(tmp_path / "a.json") == 0o644
    result = CliRunner().invoke(app, ["compare", "a.json", "a.json", "--junit", "j.xml"])
    assert result.exit_code == 0, result.output
    assert _mode(tmp_path / "j.xml") == 0o644
