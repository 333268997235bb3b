"""Each model family runs with no flags, on the inputs and loss its task trains with, recorded truthfully.

Issue 12's "Done when": one tiny model per Hugging Face family, built from a config, and a
torchvision-style classifier, each profiled by ``fp16probe profile MODEL`` with no extra
flags, with the loss recorded correctly (``loss_synthetic`` true exactly when fp16probe
invented the loss or its labels) and one line saying what was invented.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp16probe.cli import EXIT_OK, EXIT_USAGE, app
from fp16probe.report import Report
from tests.fixtures.cli import FIXTURES, prepare_cli_env


# family -> (words the recorded loss must contain, words the recorded labels must contain)
EXPECTED = {
    "causal_lm": ("cross-entropy of each next token", "labels = input_ids"),
    "masked_lm": ("cross-entropy at the 15% masked positions", "original ids at the masked positions"),
    "seq2seq_lm": ("cross-entropy of the decoder's tokens", "random target ids in [0, 97)"),
    "sequence_classification": ("cross-entropy over 3 classes", "random class in [0, 3) per sequence"),
    "sequence_classification_gpt2": ("cross-entropy over 4 classes", "random class in [0, 4) per sequence"),
    "token_classification": ("cross-entropy of each token's label over 5 labels", "label in [0, 5) per token"),
    "question_answering": ("start and end positions", "answer spans"),
    "image_classification": ("cross-entropy over 10 classes", "random class in [0, 10) per image"),
}


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path, columns=100)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    import sys

    sys.path.insert(0, str(FIXTURES))
    try:
        from family_models import save_hf_models
    finally:
        sys.path.remove(str(FIXTURES))
    return save_hf_models(tmp_path_factory.mktemp("hf"))


def profile(*args: str) -> Report:
    result = CliRunner().invoke(app, ["profile", *map(str, args), "--steps", "2", "--out", "r.json"])
    assert result.exit_code == EXIT_OK, result.output
    return Report.load("r.json")


@pytest.mark.parametrize("family", list(EXPECTED))
def test_hf_family_runs_with_no_flags_on_its_own_loss(hf_folders, family):
    extra = profile(hf_folders[family]).workload.to_dict()
    loss_words, label_words = EXPECTED[family]
    assert extra["family"] == family.removesuffix("_gpt2")
    assert extra["loss"].startswith("the model's own loss: ")
    assert loss_words in extra["loss"]
    assert label_words in extra["labels"]
    # fp16probe drew the labels, so the loss is recorded as invented, and the summary says so.
    assert extra["loss_synthetic"] is True and extra["inputs_synthetic"] is True
    assert extra["stand_in"].startswith("invented random inputs and labels (for the model's own loss); S shifts by k")


def test_seq2seq_t5_gets_decoder_inputs(hf_folders):
    """A T5 used to fail with advice to change --input-shape; now it trains on teacher-forced targets."""
    extra = profile(hf_folders["seq2seq_lm"]).workload.to_dict()
    assert "target sequences" in extra["inputs"]


def test_gpt2_classifier_gets_a_pad_id(hf_folders):
    extra = profile(hf_folders["sequence_classification_gpt2"]).workload.to_dict()
    assert any("pad_token_id" in n for n in extra["notes"])
    assert "[0, 96)" in extra["inputs"]  # the pad id 96 is never drawn


def test_image_inputs_come_from_the_config(hf_folders):
    assert "3x32x32 (pixel_values)" in profile(hf_folders["image_classification"]).workload.inputs
    base = profile(hf_folders["hf_base_image"]).workload.to_dict()
    assert "1x32x32 (pixel_values)" in base["inputs"]  # num_channels=1 in this config


@pytest.mark.parametrize("family", ["hf_base_text", "hf_base_image"])
def test_base_model_keeps_the_documented_default(hf_folders, family):
    extra = profile(hf_folders[family]).workload.to_dict()
    assert extra["family"] == family
    assert extra["loss"] == "default: mean of squares of the model's floating-point outputs"
    assert extra["loss_synthetic"] is True
    assert extra["stand_in"].startswith("invented random inputs and loss (mean of squares of the outputs)")


def test_labels_from_the_batches_are_not_synthetic(hf_folders):
    """The model's own .loss on labels the user's batches carry is the user's loss (it was recorded as synthetic)."""
    extra = profile(hf_folders["causal_lm"], "--batches", "family_models:gpt2_batches").workload.to_dict()
    assert extra["loss"] == "the model's own output .loss, on the labels the batches carry"
    assert extra["loss_synthetic"] is False and extra["inputs_synthetic"] is False
    assert not extra.get("stand_in")


def test_torchvision_style_classifier_trains_on_cross_entropy():
    extra = profile("family_models:TinyResNet").workload.to_dict()
    assert "[4, 3, 224, 224]" in extra["inputs"] and "Conv2d(3, ...)" in extra["inputs"]
    assert extra["loss"].startswith("default for class logits [batch, 10]: cross-entropy")
    assert extra["loss_synthetic"] is True
    assert extra["stand_in"].startswith("invented random inputs and loss (cross-entropy against random labels)")


def test_non_logits_output_keeps_mean_of_squares():
    extra = profile("family_models:Regressor").workload.to_dict()
    assert "[8, 8]" in extra["inputs"] and "Linear(8, ...)" in extra["inputs"]
    assert extra["loss"] == "default: mean of squares of the model's floating-point outputs"


def test_named_loss_with_and_without_targets():
    invented = profile("family_models:MLPClassifier", "--loss", "cross_entropy").workload.to_dict()
    assert invented["loss"] == "--loss cross_entropy: cross-entropy of the logits against uniformly random class labels"
    assert invented["loss_synthetic"] is True
    given = profile("family_models:MLPClassifier", "--loss", "cross_entropy",
                    "--batches", "family_models:classifier_batches").workload.to_dict()
    assert given["loss"] == "--loss cross_entropy: cross-entropy of the logits against the batch's targets"
    assert given["loss_synthetic"] is False
    mse = profile("family_models:Regressor", "--loss", "mse").workload.to_dict()
    assert "zeros (the mean of squares)" in mse["loss"]


def test_unknown_loss_name_lists_the_built_ins():
    result = CliRunner().invoke(app, ["profile", "family_models:Regressor", "--loss", "crossentropy", "--steps", "1"])
    assert result.exit_code == EXIT_USAGE
    assert "cross_entropy" in result.stderr and "package.module:function" in result.stderr


def test_model_that_needs_more_than_one_input_names_its_forward():
    result = CliRunner().invoke(app, ["profile", "family_models:TwoInputs", "--steps", "1"])
    assert result.exit_code == EXIT_USAGE, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1
    assert "TwoInputs.forward(x, mask)" in lines[0] and "--batches" in lines[0]


def test_hf_inputs_are_checked_before_the_model_loads(tmp_path):
    """A class fp16probe cannot feed is refused from config.json alone: its weights are never read."""
    from transformers import WhisperConfig

    folder = tmp_path / "whisper"
    folder.mkdir()
    config = WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1).to_dict()
    config["architectures"] = ["WhisperForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not weights")  # loading would fail with exit 3
    result = CliRunner().invoke(app, ["profile", str(folder), "--steps", "1"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "WhisperForConditionalGeneration.forward(input_features" in result.stderr
    assert "--batches" in result.stderr


def test_the_answer_moves_with_the_loss_as_the_line_says():
    """The stand-in line's claim, measured: a loss 2^3 times steeper moves every gradient up 3 bins exactly."""
    one = profile("family_models:Regressor", "--loss", "family_models:squares")
    eight = profile("family_models:Regressor", "--loss", "family_models:squares_times_8")
    a, b = one.histogram("activation_grad"), eight.histogram("activation_grad")
    assert a.nonzero_finite == b.nonzero_finite > 0
    assert a.counts[:-3] == b.counts[3:] and not any(a.counts[-3:]) and not any(b.counts[:3])
    assert b.max_abs == 8 * a.max_abs


def test_loading_notes_are_printed_not_only_saved():
    from cli_models import TinyMLP

    state = {f"model.{k}": v for k, v in TinyMLP().state_dict().items()}
    torch.save({"state_dict": state, "epoch": 0}, "w.ckpt")
    result = CliRunner().invoke(app, ["profile", "cli_models:TinyMLP", "--weights", "w.ckpt", "--steps", "1",
                                      "--out", "r.json"])
    assert result.exit_code == EXIT_OK, result.output
    assert "note: stripped the key prefix 'model.' from w.ckpt" in result.stderr
    assert "stripped the key prefix 'model.' from w.ckpt" in Report.load("r.json").workload.notes


def test_no_flag_runs_repeat_exactly(hf_folders):
    """--seed also seeds torch's own random numbers: dropout (and a factory's initialisation) repeat."""
    torch.manual_seed(1)
    first = profile(hf_folders["causal_lm"]).histogram("activation_grad")
    torch.manual_seed(2)  # whatever state the caller left, the run is the same
    second = profile(hf_folders["causal_lm"]).histogram("activation_grad")
    assert first.counts == second.counts and first.max_abs == second.max_abs


def test_hf_runs_print_no_transformers_warnings(hf_folders, tmp_path):
    """A tiny config's token ids and transformers' loss_type fallback would otherwise print above the summary."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "fp16probe", "profile", str(hf_folders["causal_lm"]), "--steps", "1",
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == EXIT_OK, run.stderr
    assert "[transformers]" not in run.stderr and "loss_type" not in run.stderr, run.stderr
