"""The CLI's stderr is its own lines only: what torch, transformers and torchao log while a model
loads and runs (torchao's "Failed to load" lines, pytree deprecations, a Mixture-of-Experts
forward's fake-tensor tracebacks) is held back and counted in one line; --debug shows it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp16probe.running.thirdparty import held_back

ROOT = Path(__file__).resolve().parents[1]
THIRD_PARTY = ("Traceback", "Failed to load", "site-packages", "Warning:", "W1", "E1")


def _fp16probe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fp16probe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Mixtral (whose expert routing logs tracebacks on the CPU) and a Wav2Vec2 (refused), from configs."""
    import transformers as t

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    t.MixtralForCausalLM(t.MixtralConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=32, intermediate_size=64,
        vocab_size=97, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )).save_pretrained(root / "mixtral")
    t.Wav2Vec2ForCTC(t.Wav2Vec2Config(
        num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64, conv_dim=(8, 8),
        conv_kernel=(3, 3), conv_stride=(2, 2), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        vocab_size=20,
    )).save_pretrained(root / "w2v")
    return root


@pytest.mark.slow
def test_a_right_answer_stands_alone_and_debug_shows_what_was_held(folders, tmp_path):
    pytest.importorskip("torchao")  # the import noise the issue saw comes with it
    quiet = _fp16probe("profile", str(folders / "mixtral"), "--steps", "1", "--out", "r.json", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    lines = quiet.stderr.splitlines()
    assert not [line for line in lines if any(mark in line for mark in THIRD_PARTY)], quiet.stderr
    held = [line for line in lines if "held back" in line]
    if not held:
        pytest.skip("nothing third-party was written in this environment")
    count = int(held[0].split("note: ")[1].split()[0])
    loud = _fp16probe("profile", str(folders / "mixtral"), "--steps", "1", "--out", "r.json", "--debug",
                      cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr
    assert "held back" not in loud.stderr
    assert len(loud.stderr.splitlines()) >= len(lines) - 1 + count  # the held lines, shown as they came


@pytest.mark.slow
def test_a_refusal_after_transformers_loads_is_one_line(folders, tmp_path):
    result = _fp16probe("profile", str(folders / "w2v"), "--steps", "1", "--out", "r.json", cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr


def test_held_back_takes_logs_and_prints_and_restores_stderr(capsys):
    before = sys.stderr
    own = logging.getLogger("somelib.own")  # a library's own handler, made on the real stderr before the block
    own.addHandler(logging.StreamHandler(sys.stderr))
    own.propagate = False
    bare = logging.getLogger("otherlib")  # no handler anywhere: logging's last resort writes it to stderr
    bare.propagate = False
    try:
        with held_back() as held:
            print("printed", file=sys.stderr)
            own.warning("logged by its own handler")
            bare.warning("logged through the last resort")

        assert sys.stderr is before
        assert held.lines == 3 and held.sources == ["somelib", "otherlib"], held
        assert capsys.readouterr().err == ""
        own.warning("after the block, through again")
        assert capsys.readouterr().err == "after the block, through again\n"
    finally:
        own.handlers.clear()
    with held_back(enabled=False) as shown:
        print("shown", file=sys.stderr)
    assert shown.lines == 0 and capsys.readouterr().err == "shown\n"


def test_held_back_keeps_a_library_s_warnings_and_shows_fp16probe_s():
    # In a fresh interpreter: pytest records warnings itself, so they never reach showwarning here.
    code = ("import warnings\n"
            "from fp16probe.running.thirdparty import held_back\n"
            "with held_back() as held:\n"
            "    warnings.warn('a library deprecation', DeprecationWarning)\n"
            "    warnings.warn('fp16probe: a hook failed and was skipped', RuntimeWarning)\n"
            "print(held.lines)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "always"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fp16probe: a hook failed" in done.stderr and "a library deprecation" not in done.stderr
    assert int(done.stdout) == 1  # the deprecation, held (no source line under -c)
