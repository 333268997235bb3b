"""Outputs that are not regular files are written in place, never replaced; symlinks are followed.

A ``mknod`` copy of /dev/null, a FIFO with a reader, /dev/stdout, /dev/full, a symlink, a
folder: for ``profile --out`` and ``--plot``, ``compare --junit`` and ``--summary``, and
:func:`fp16probe.report.atomic_write_text` itself.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from fp16probe.cli import EXIT_OK, EXIT_USAGE
from fp16probe.report import Report, atomic_write_text
from tests.fixtures.cli import one_error_line, prepare_cli_env, run

TINY = ["cli_models:TinyMLP", "--input-shape", "5,8", "--steps", "2"]


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)


def _null_device(path: Path) -> Path:
    """A character device like /dev/null (major 1, minor 3) at ``path``; skip where mknod is not permitted."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"mknod of a character device is not permitted here ({e.strerror})")
    return path


def _fifo(path: Path) -> Path:
    try:
        os.mkfifo(path)
    except (PermissionError, OSError, AttributeError) as e:
        pytest.skip(f"mkfifo is not available here ({e})")
    return path


class _Reader(threading.Thread):
    """Read a FIFO to its end, as a consumer process would."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.data = path, b""

    def run(self) -> None:
        with open(self.path, "rb") as f:
            self.data = f.read()


def _is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


def test_out_onto_a_character_device_writes_into_it_and_keeps_it_a_device():
    dev = _null_device(Path("null-copy"))
    result = run("profile", *TINY, "--out", dev)
    assert result.exit_code == EXIT_OK, result.output
    assert _is_char_device(dev)  # before: replaced by a 5.8 KB JSON file
    assert [p.name for p in Path(".").iterdir()] == ["null-copy"]  # no temporary file left beside it


def test_out_into_a_fifo_reaches_its_reader_and_the_fifo_stays():
    fifo = _fifo(Path("report.fifo"))
    reader = _Reader(fifo)
    reader.start()
    result = run("profile", *TINY, "--out", fifo)
    reader.join(timeout=60)
    assert result.exit_code == EXIT_OK, result.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    report = Report.from_dict(json.loads(reader.data))
    assert report.metadata.steps_seen == 2


def test_out_dev_stdout_writes_to_this_process_stdout(capfd):
    result = run("profile", *TINY, "--out", "/dev/stdout")
    assert result.exit_code == EXIT_OK, result.output
    written = capfd.readouterr().out  # the descriptor itself, not the test runner's sys.stdout
    report = Report.from_dict(json.loads(written))
    assert report.metadata.steps_seen == 2


def test_out_dev_full_is_one_line_and_exit_2():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    result = run("profile", *TINY, "--out", "/dev/full")
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith("error: --out /dev/full: cannot write it (No space left on device)")


def test_a_symlink_is_followed_and_its_target_replaced_atomically():
    Path("runs").mkdir()
    target = Path("runs/latest.json")
    target.write_text("old")
    Path("link.json").symlink_to(target)
    Path("dangling.json").symlink_to("runs/new.json")
    assert run("profile", *TINY, "--out", "link.json").exit_code == EXIT_OK
    assert run("profile", *TINY, "--out", "dangling.json").exit_code == EXIT_OK
    assert Path("link.json").is_symlink() and Path("dangling.json").is_symlink()  # the links stay links
    assert Report.load(target).metadata.steps_seen == 2
    assert Report.load("runs/new.json").metadata.steps_seen == 2
    assert sorted(p.name for p in Path("runs").iterdir()) == ["latest.json", "new.json"]


def test_a_folder_or_a_symlink_to_one_is_refused_in_one_line():
    Path("out").mkdir()
    Path("to-out").symlink_to("out")
    for where in ("out", "to-out"):
        result = run("profile", *TINY, "--out", where)
        assert result.exit_code == EXIT_USAGE, result.output
        assert one_error_line(result).startswith(f"error: --out {where} is a folder")


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
def test_plot_onto_a_device_is_written_in_place():
    dev = _null_device(Path("fig.png"))
    result = run("profile", *TINY, "--out", "r.json", "--plot", dev)
    assert result.exit_code == EXIT_OK, result.output
    assert _is_char_device(dev)


def test_compare_junit_and_summary_onto_devices_and_fifos_are_written_in_place():
    assert run("profile", *TINY, "--out", "a.json").exit_code == EXIT_OK
    dev = _null_device(Path("junit-null"))
    fifo = _fifo(Path("summary.fifo"))
    reader = _Reader(fifo)
    reader.start()
    result = run("compare", "a.json", "a.json", "--junit", dev, "--summary", fifo)
    reader.join(timeout=60)
    assert result.exit_code == EXIT_OK, result.output
    assert _is_char_device(dev) and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert reader.data.decode().lstrip().startswith("#")  # the Markdown summary reached the reader


def test_atomic_write_text_keeps_devices_and_refuses_folders(tmp_path):
    dev = _null_device(tmp_path / "dev")
    atomic_write_text(dev, "{}")
    assert _is_char_device(dev)
    with pytest.raises(IsADirectoryError):
        atomic_write_text(tmp_path, "{}")
