"""MODEL loading: every kind, and every refusal or failure as one clear ModelLoadError/InputError."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from fp16probe.errors import InputError, ModelLoadError
from fp16probe.running.loading import is_import_string, load_model, load_state_dict_file

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    torch.manual_seed(0)


def _tiny():
    from cli_models import TinyMLP

    return TinyMLP()


def _perturbed_state():
    m = _tiny()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    return m.state_dict()


def test_demo_when_no_model():
    loaded = load_model(None)
    assert loaded.kind == "demo"
    assert sum(p.numel() for p in loaded.model.parameters()) > 0


def test_import_string_class_and_factory():
    assert is_import_string("cli_models:TinyMLP")
    assert not is_import_string("some/file.pt")
    assert type(load_model("cli_models:TinyMLP").model).__name__ == "TinyMLP"
    assert type(load_model("cli_models:make_tiny").model).__name__ == "TinyMLP"


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_weights_pt(tmp_path, suffix):
    state = _perturbed_state()
    path = tmp_path / f"w{suffix}"
    torch.save(state, path)
    model = load_model("cli_models:TinyMLP", weights=path).model
    assert torch.equal(model.fc1.weight, state["fc1.weight"])


def test_weights_safetensors(tmp_path):
    from safetensors.torch import save_file

    state = _perturbed_state()
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    model = load_model("cli_models:TinyMLP", weights=path).model
    assert torch.equal(model.fc2.bias, state["fc2.bias"])


def test_weights_lightning_ckpt_strips_prefix(tmp_path):
    # The layout Lightning's Trainer.save_checkpoint writes: a dict whose "state_dict"
    # holds the LightningModule's keys (here the inner model sits under "model.").
    state = {f"model.{k}": v for k, v in _perturbed_state().items()}
    path = tmp_path / "epoch=0-step=1.ckpt"
    torch.save({"epoch": 0, "global_step": 1, "pytorch-lightning_version": "2.6.6", "state_dict": state,
                "hyper_parameters": {"lr": 0.1}}, path)
    loaded = load_model("cli_models:TinyMLP", weights=path)
    assert torch.equal(loaded.model.fc1.bias, state["model.fc1.bias"])
    assert any("model." in n for n in loaded.notes)


def test_state_dict_mismatch(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(_perturbed_state(), path)
    with pytest.raises(ModelLoadError, match="does not match the model: missing keys layer.bias"):
        load_model("cli_models:OtherMLP", weights=path)


def test_corrupt_weights(tmp_path):
    path = tmp_path / "w.pt"
    path.write_bytes(b"this is not a checkpoint")
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model("cli_models:TinyMLP", weights=path)
    st = tmp_path / "w.safetensors"
    st.write_bytes(b"\x00\x01garbage")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model("cli_models:TinyMLP", weights=st)


def test_missing_weights_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_model("cli_models:TinyMLP", weights=tmp_path / "nope.pt")


@pytest.mark.parametrize("spec,match", [
    ("no_such_module_xyz:Model", "cannot import 'no_such_module_xyz'"),
    ("cli_models:Missing", "has no attribute 'Missing'"),
    ("cli_models:broken_factory", "raised ValueError: factory failed on purpose"),
    ("cli_models:not_a_module", "returned a int, expected a torch.nn.Module"),
])
def test_import_string_failures(spec, match):
    with pytest.raises(ModelLoadError, match=match):
        load_model(spec)


def test_missing_model_path():
    with pytest.raises(InputError, match="no such file or folder"):
        load_model("does/not/exist.pt")


def test_pickled_module_refused_without_trust(tmp_path):
    path = tmp_path / "whole.pt"
    torch.save(_tiny(), path)
    with pytest.raises(ModelLoadError, match="arbitrary code.*--trust-checkpoint"):
        load_model(str(path))
    loaded = load_model(str(path), trust_checkpoint=True)
    assert loaded.kind == "pickled-module"
    assert isinstance(loaded.model, nn.Module)


def test_state_dict_given_as_model(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(_perturbed_state(), path)
    with pytest.raises(ModelLoadError, match="is a state_dict.*--weights"):
        load_model(str(path))


def test_export_archive(tmp_path):
    model = _tiny()
    ep = torch.export.export(model, (torch.randn(3, 8),))
    path = tmp_path / "m.pt2"
    torch.export.save(ep, str(path))
    loaded = load_model(str(path))
    assert loaded.kind == "torch.export"
    (args, kwargs) = loaded.example_inputs
    assert tuple(args[0].shape) == (3, 8)
    out = loaded.model(torch.randn(3, 8))
    out.sum().backward()
    assert any(p.grad is not None for p in loaded.model.parameters())


def test_corrupt_export_archive(tmp_path):
    path = tmp_path / "m.pt2"
    path.write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match="torch.export archive"):
        load_model(str(path))


def save_tiny_gpt2(folder: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(folder)


def test_huggingface_folder(tmp_path):
    save_tiny_gpt2(tmp_path / "gpt2")
    loaded = load_model(str(tmp_path / "gpt2"))
    assert loaded.kind == "huggingface"
    assert loaded.vocab_size == 97
    assert loaded.has_loss


def test_huggingface_remote_code_refused(tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text('{"auto_map": {"AutoModel": "modeling_x.XModel"}, "model_type": "x"}')
    with pytest.raises(ModelLoadError, match="--trust-remote-code"):
        load_model(str(folder))


def test_folder_without_config(tmp_path):
    with pytest.raises(InputError, match="without config.json"):
        load_model(str(tmp_path))


def test_weights_need_import_string(tmp_path):
    with pytest.raises(InputError, match="--weights"):
        load_model(None, weights=tmp_path / "w.pt")


def test_load_state_dict_file_rejects_non_mapping(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(ModelLoadError, match="expected a state_dict"):
        load_state_dict_file(path)


MALFORMED_CONFIGS = {
    "a list": ("[]", "expected an object"),
    "a string": ('"gpt2"', "expected an object"),
    "truncated JSON": ('{"model_type": "gpt2", ', "not readable JSON"),
    "nested past the recursion limit": ("[" * 100_000 + "]" * 100_000, "not readable JSON"),
    "architectures a string": ('{"architectures": "GPT2LMHeadModel"}', "architectures is"),
    "architectures of numbers": ('{"architectures": [1]}', "architectures is"),
    "architectures naming no model class": ('{"architectures": ["pipeline"], "model_type": "gpt2"}', "not a model class"),
    "vocab_size a string": ('{"model_type": "gpt2", "vocab_size": "big"}', "vocab_size is"),
    "vocab_size negative": ('{"model_type": "gpt2", "vocab_size": -5}', "vocab_size is"),
    "image_size a float": ('{"model_type": "vit", "image_size": 3.5}', "image_size is"),
    "auto_map a list": ('{"auto_map": ["x"], "model_type": "x"}', "auto_map is"),
    "no model_type": ("{}", "transformers could not load it"),
    "unknown model_type": ('{"model_type": "no-such-model"}', "transformers could not load it"),
}


@pytest.mark.parametrize("case", list(MALFORMED_CONFIGS))
def test_malformed_hf_config_is_one_line_load_error(tmp_path, case):
    """Each malformed config.json is a ModelLoadError (exit 3) naming the file, never another exception."""
    text, match = MALFORMED_CONFIGS[case]
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(folder))
    assert "\n" not in str(info.value)


def test_a_torchscript_file_given_as_the_model_is_named_as_one(tmp_path):
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(path))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    text = str(e.value)
    assert "TorchScript archive" in text and "corrupt" not in text and "weights_only" not in text
    assert "\n" not in text


def test_a_fp16probe_report_given_as_the_model_is_named_as_one(tmp_path):
    path = tmp_path / "report.pt"
    path.write_bytes((Path(__file__).parent / "data" / "report-v1-demo.json").read_bytes())
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path))
    text = str(e.value)
    assert "fp16probe report" in text and "fp16probe show" in text and "weights_only" not in text
    assert "\n" not in text
