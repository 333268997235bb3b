"""A tampered .pt2 archive never runs its payload without --trust-checkpoint.

Each tampered archive carries a payload that would create a marker file. Every test first
shows that ``torch.export.load`` really runs that payload (so the tampering is live and the
test can fail), then that fp16probe refuses the archive, with one line and exit 3, and that
the marker was never created.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from fp16probe.cli import EXIT_LOAD, app
from fp16probe.errors import ModelLoadError
from fp16probe.running.loading import load_model


class _Payload:
    """Unpickling this creates ``marker``: what an attacker's code would do, made visible."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _export(path: Path, dynamic: bool = False) -> Path:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    shapes = ({0: torch.export.Dim("batch", min=2, max=64)},) if dynamic else None
    torch.export.save(torch.export.export(model, (torch.randn(3, 4),), dynamic_shapes=shapes), str(path))
    return path


def _rewrite(src: Path, dst: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    with zipfile.ZipFile(src) as z:
        files = {name: z.read(name) for name in z.namelist()}
    edit(files)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return dst


def _pickled(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    return buf.getvalue()


def _named(files: dict[str, bytes], suffix: str) -> str:
    return next(n for n in files if n.endswith(suffix))


def _swap_weight(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """The first weight's payload becomes a pickle, and the archive's own config says so."""

    def edit(files: dict[str, bytes]) -> None:
        name = _named(files, "data/weights/model_weights_config.json")
        config = json.loads(files[name])
        first = next(iter(config["config"].values()))
        first["use_pickle"] = True
        files[name] = json.dumps(config).encode()
        files[name.rsplit("/", 1)[0] + "/" + first["path_name"]] = _pickled(marker)

    return edit


def _swap_sample_inputs(marker: Path) -> Callable[[dict[str, bytes]], None]:
    def edit(files: dict[str, bytes]) -> None:
        files[_named(files, "data/sample_inputs/model.pt")] = _pickled(marker)

    return edit


def _poison_shape_expressions(marker: Path) -> Callable[[dict[str, bytes]], None]:
    """torch hands each ``expr_str`` to sympy.sympify, which evaluates it as Python."""

    def poison(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr_str":
                    node[key] = f"__import__('builtins').open({str(marker)!r}, 'w').close() or {value}"
                else:
                    poison(value)
        elif isinstance(node, list):
            for value in node:
                poison(value)

    def edit(files: dict[str, bytes]) -> None:
        name = _named(files, "models/model.json")
        program = json.loads(files[name])
        poison(program)
        files[name] = json.dumps(program).encode()

    return edit


def _torch_runs_it(archive: Path, marker: Path) -> None:
    """The tampering is live: torch's own loader runs the payload (then the marker is removed)."""
    try:
        torch.export.load(str(archive))
    except Exception:
        pass  # the payload ran before torch noticed the object was no tensor
    assert marker.exists(), "the tampered archive no longer reaches the payload; the test proves nothing"
    marker.unlink()


CASES = {
    "weight payload swapped for a pickle (use_pickle set)": (_swap_weight, False, "stored as a pickle"),
    "sample inputs swapped for a pickle": (_swap_sample_inputs, False, "sample inputs hold Python objects"),
    "shape expression that sympify would evaluate": (_poison_shape_expressions, True, "not plain arithmetic"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tampered_archive_is_refused_and_payload_never_runs(tmp_path, case):
    tamper, dynamic, reason = CASES[case]
    marker = tmp_path / "payload-ran"
    archive = _rewrite(_export(tmp_path / "clean.pt2", dynamic), tmp_path / "tampered.pt2", tamper(marker))
    _torch_runs_it(archive, marker)

    with pytest.raises(ModelLoadError, match=reason) as info:
        load_model(str(archive))
    assert "--trust-checkpoint" in str(info.value)
    assert not marker.exists()

    result = CliRunner().invoke(app, ["profile", str(archive), "--steps", "1", "--out", str(tmp_path / "r.json")])
    assert result.exit_code == EXIT_LOAD, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and reason in lines[0], result.stderr
    assert not marker.exists()
    assert not (tmp_path / "r.json").exists()


def test_clean_archives_load_without_trust(tmp_path):
    for dynamic in (False, True):
        loaded = load_model(str(_export(tmp_path / f"m{dynamic}.pt2", dynamic)))
        assert loaded.kind == "torch.export"
        assert loaded.example_inputs is not None
        batch = 5 if dynamic else 3  # a static export checks the batch size it was traced with
        assert loaded.model(torch.randn(batch, 4)).shape == (batch, 2)


def test_guards_code_is_not_run(tmp_path):
    """An archive's guards are Python source that ExportedProgram.module() would exec; never run them."""
    marker = tmp_path / "payload-ran"

    def edit(files: dict[str, bytes]) -> None:
        name = _named(files, "models/model.json")
        program = json.loads(files[name])
        program["guards_code"] = [f"__import__('builtins').open({str(marker)!r}, 'w').close() is None"]
        files[name] = json.dumps(program).encode()

    archive = _rewrite(_export(tmp_path / "clean.pt2"), tmp_path / "guarded.pt2", edit)
    loaded = load_model(str(archive))
    loaded.model(torch.randn(3, 4))
    assert not marker.exists()
    assert any("guard" in note and "not run" in note for note in loaded.notes)


def test_trust_checkpoint_is_the_consent(tmp_path):
    """With --trust-checkpoint the archive goes to torch.export.load, which runs what it holds."""
    marker = tmp_path / "payload-ran"
    archive = _rewrite(_export(tmp_path / "clean.pt2"), tmp_path / "t.pt2", _swap_sample_inputs(marker))
    with pytest.raises(ModelLoadError):  # the payload returns None where (args, kwargs) belong
        load_model(str(archive), trust_checkpoint=True)
    assert marker.exists()
