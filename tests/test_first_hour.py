"""What a new user tripped over in their first hour (issue 23), each checked against a real run.

Every test here failed on the code before the fix: a re-display judged for the wrong format,
invented labels where the batch carried its own, advice that led with a paste line, caveats
about modules that cannot carry a gradient, unexplained numerically-zero gradients, a replay
that could not choose read as a choice, and refusals that named inputs the model does not take.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fp16probe
from fp16probe import Probe
from fp16probe.analysis.recommend import analyze
from fp16probe.presentation.answer import short_answer
from fp16probe.recommendation import Caveat, Verdict
from tests.fixtures.cli import prepare_cli_env, run


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _labelled(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(n)]


# -- the stored format and precision drive every re-display ------------------------------------
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e5m2"])
def test_show_and_recommend_judge_a_report_for_its_own_format(tmp_path, monkeypatch, fmt):
    prepare_cli_env(monkeypatch, tmp_path)
    made = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "3",
               "--format", fmt, "--json")
    assert made.exit_code == 0, made.output
    stored = json.loads(made.stdout)["recommendation"]
    assert stored["format"] == fmt
    shown = run("show", "fp16probe-report.json", "--json")
    assert json.loads(shown.stdout)["recommendation"]["verdict"] == stored["verdict"]
    assert json.loads(shown.stdout)["format"] == fmt
    again = run("recommend", "fp16probe-report.json", "--json")
    assert json.loads(again.stdout)["format"] == fmt
    assert json.loads(again.stdout)["verdict"] == stored["verdict"]
    text = run("show", "fp16probe-report.json")
    assert f"verdict for {fmt}:" in text.stderr
    # asked for explicitly, another format is still judged
    other = run("show", "fp16probe-report.json", "--format", "fp16", "--json")
    assert json.loads(other.stdout)["format"] == "fp16"


def test_a_bf16_profile_is_judged_for_bf16(tmp_path, monkeypatch):
    prepare_cli_env(monkeypatch, tmp_path)
    made = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "2",
               "--precision", "bf16")
    assert made.exit_code == 0, made.output
    assert "verdict for bf16:" in made.stderr and "verdict for fp16" not in made.stderr
    report = fp16probe.Report.load(tmp_path / "fp16probe-report.json")
    assert report.recommendation.format == "bf16"
    # the library's profile() decides the same way
    lib = fp16probe.profile(_mlp(), _labelled(), steps=2, precision="bf16")
    assert lib.recommendation.format == "bf16"


def test_no_flushed_share_beside_not_enough_evidence():
    model = _mlp()
    with Probe(model) as probe:
        for x, y in _labelled():
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y) * 1e-6  # small: many exact zeros in fp16
            loss.backward()
            model.zero_grad()
            probe.step()
    report = probe.report()
    rec = analyze(report, "fp16")
    assert rec.verdict is Verdict.INSUFFICIENT_EVIDENCE
    kinds = [line.kind for line in short_answer(report, rec)]
    assert "flushed" not in kinds


# -- the batch's own labels feed the default loss ----------------------------------------------
def test_the_default_loss_trains_on_the_batch_labels():
    batches = _labelled()
    report = fp16probe.profile(_mlp(), batches, steps=3)
    extra = report.metadata.extra
    assert extra["loss_synthetic"] is False
    assert "labels" not in extra and "stand_in" not in extra
    assert "the batch's own labels" in extra["loss"]
    # the oracle: plain torch cross-entropy against the same y gives the same gradients
    mine = fp16probe.profile(_mlp(), batches, lambda out, b: F.cross_entropy(out, b[1]), steps=3)
    assert [m.histogram for m in report.modules] == [m.histogram for m in mine.modules]


def test_the_default_loss_fits_float_targets_by_mean_squared_error():
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)) for _ in range(2)]
    report = fp16probe.profile(_mlp(), batches, steps=2)
    mine = fp16probe.profile(_mlp(), batches, lambda out, b: F.mse_loss(out, b[1]), steps=2)
    assert report.metadata.extra["loss_synthetic"] is False
    assert [m.histogram for m in report.modules] == [m.histogram for m in mine.modules]


# -- "no single scale" leads with what to do ----------------------------------------------------
def test_no_single_scale_says_what_to_do_before_the_paste_line():
    from tests.fixtures.reports import hand_report

    report = hand_report()
    rec = analyze(report, "fp16", max_flushed_fraction=1e-9)
    assert rec.verdict is Verdict.NO_SINGLE_SCALE
    lines = short_answer(report, rec)
    kinds = [line.kind for line in lines]
    assert kinds.index("todo") < kinds.index("code")
    todo = lines[kinds.index("todo")].text
    assert "bf16" in todo and "fp32" in todo
    assert rec.text.index("bf16") < rec.text.index("GradScaler(")


# -- modules that cannot carry a gradient are no finding ----------------------------------------
class _Rotary(nn.Module):
    """Rotary embeddings: cos/sin from a buffer, no parameters, no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(x.shape[-1] * self.inv_freq)


class _Structural(nn.Module):
    """A rotary embedding, an Identity, a dropout that never runs, a tied embedding, and a
    Linear whose forward its parent bypasses (the one real finding)."""

    def __init__(self) -> None:
        super().__init__()
        self.rotary = _Rotary()
        self.skip = nn.Identity()
        self.drop = nn.Dropout(0.1)  # never called: fused away, as SDPA does
        self.embed = nn.Embedding(10, 4)
        self.shared = nn.Embedding(10, 4)
        self.shared.weight = self.embed.weight  # tied: runs only as embed
        self.bypassed = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.skip(self.embed(ids)) * self.rotary(ids)
        h = F.linear(h, self.bypassed.weight, self.bypassed.bias)
        return self.head(h)


def test_structurally_gradient_free_modules_are_not_reported():
    model = _Structural()
    with Probe(model) as probe:
        for _ in range(2):
            model(torch.randint(0, 10, (3, 4))).pow(2).mean().backward()
            model.zero_grad()
            probe.step()
    report = probe.report()
    assert report.capture.unrecorded_modules == ("bypassed",)
    assert sorted(report.capture.gradient_free_modules) == ["drop", "rotary", "shared"]  # skip records its input's
    assert Caveat("silent_modules", {"count": 1, "modules": ["bypassed"]}) in analyze(report).caveats


# -- numerically-zero gradients are explained where they rank -----------------------------------
def test_a_key_bias_gradient_is_explained_as_numerically_zero():
    torch.manual_seed(0)
    attn = nn.ModuleDict({"query": nn.Linear(16, 16), "key": nn.Linear(16, 16), "value": nn.Linear(16, 16)})

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (self.attn[n](x) for n in ("query", "key", "value"))
            return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v

    model = Attention()
    with Probe(model) as probe:
        x = torch.randn(2, 8, 16)
        model(x).pow(2).mean().backward()
        probe.step()
    report = probe.report()
    # softmax ignores a shift shared by every key: the key bias's gradient is zero up to rounding
    key_bias = report.module("attn.key.bias", "weight_grad").histogram.max_abs
    key_out = report.module("attn.key", "activation_grad").histogram.max_abs
    assert key_bias < key_out * 2.0**-12
    from fp16probe.analysis.whatif import numerically_zero

    cancelled = numerically_zero(report)
    assert set(cancelled) == {"attn.key.bias"}
    assert cancelled["attn.key.bias"] == math.floor(math.log2(key_bias / key_out))
    from fp16probe.presentation.terminal import make_console, summary_view

    console = make_console()
    console.width = 160
    with console.capture() as cap:
        console.print(summary_view(report, analyze(report), kind="all", top=20))
    assert "attn.key.bias *" in cap.get()
    assert "numerically zero" in cap.get()


# -- a replay that cannot choose says so --------------------------------------------------------
def test_a_replay_that_cannot_tell_candidates_apart_says_so():
    model = _mlp()
    with Probe(model) as probe:
        for x, y in _labelled(4):
            (F.cross_entropy(model(x), y) * 1e-6).backward()  # small gradients, the same range every step
            model.zero_grad()
            probe.step()
    rec = analyze(probe.report(), "fp16")
    assert rec.verdict is Verdict.CONSTANT
    rows = rec.growth_interval_table["rows"]
    assert max(r["mean_flushed_fraction"] for r in rows) - min(r["mean_flushed_fraction"] for r in rows) < 1e-4
    assert rec.evidence["simulated_candidates_tied"] is True
    assert "cannot tell the growth_interval candidates" in rec.text
    assert any(line.kind == "schedule" for line in short_answer(None, rec))


# -- refusals name the real forward parameters and nested config fields -------------------------
def _hf_folder(tmp_path, cls_name: str, config) -> str:
    folder = tmp_path / cls_name
    config.architectures = [cls_name]
    config.save_pretrained(folder)
    return str(folder)


def test_refusals_name_the_model_s_own_inputs(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    prepare_cli_env(monkeypatch, tmp_path)
    whisper = _hf_folder(tmp_path, "WhisperForConditionalGeneration", transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        vocab_size=97, num_mel_bins=16, pad_token_id=1, bos_token_id=2, eos_token_id=3,
        decoder_start_token_id=2))
    out = run("profile", whisper, "--steps", "1")
    assert out.exit_code == 2, out.output
    assert "wants input_features, decoder_input_ids:" in out.stderr
    assert "'x'" not in out.stderr and "wants x" not in out.stderr
    clip = _hf_folder(tmp_path, "CLIPModel", transformers.CLIPConfig(
        text_config={"vocab_size": 97, "hidden_size": 32, "num_attention_heads": 2},
        vision_config={"hidden_size": 32, "num_attention_heads": 2}))
    out = run("profile", clip, "--steps", "1")
    assert out.exit_code == 2, out.output
    assert "text_config.vocab_size = 97" in out.stderr
    assert "has no vocab_size" not in out.stderr
    assert "wants input_ids, pixel_values:" in out.stderr


# -- a summary that prints ----------------------------------------------------------------------
def test_print_of_a_report_and_a_recommendation_is_a_short_summary():
    report = fp16probe.profile(_mlp(), _labelled(), steps=3)
    rec = report.recommendation
    for text, head in ((str(report), "Report(Sequential: 3 step(s)"), (repr(rec), f"Recommendation({rec.format}: ")):
        lines = text.splitlines()
        assert lines[0].startswith(head)
        assert len(lines) <= 12 and all(len(line) <= 88 for line in lines), text
    assert repr(report) == str(report)
    assert f"verdict for {rec.format}:" in str(report)
    assert "flushed:" in repr(rec) and "steps: 3 profiled" in repr(rec)
    if rec.grad_scaler_kwargs:  # the pasted line is Python, as printed
        code = repr(rec)[repr(rec).index("scaler = "):]
        compile(code, "<repr>", "exec")
    wrapped = rec.explanation(width=60).splitlines()
    assert len(wrapped) > 1 and max(len(line) for line in wrapped if "://" not in line) <= 60
    assert " ".join(rec.explanation(60).split()) == " ".join(rec.text.split())


def test_version_and_shell_completion(tmp_path, monkeypatch):
    prepare_cli_env(monkeypatch, tmp_path)
    out = run("--version")
    assert out.exit_code == 0 and out.stdout.strip() == f"fp16probe {fp16probe.__version__}"
    assert "--install-completion" in run("--help").stdout


def test_the_terminal_hears_at_once_and_the_bar_tells_time_left(tmp_path):
    import os
    import pty
    import select
    import signal
    import subprocess
    import sys

    leader, follower = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "fp16probe", "profile", "--steps", "1", "-o",
                             str(tmp_path / "r.json")], stdin=follower, stdout=follower, stderr=follower,
                            env=env, cwd=tmp_path)
    os.close(follower)
    try:
        got = b""
        while b"\n" not in got and select.select([leader], [], [], 60)[0]:
            got += os.read(leader, 1024)
        assert got.decode().startswith("loading the built-in demo model..."), got
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.close(leader)
    import io

    from rich.console import Console

    from fp16probe.presentation.terminal import progress

    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=120)
    with progress(console, 4, enabled=True) as update:
        update(2)
    drawn = stream.getvalue()
    assert "2/4" in drawn and "elapsed," in drawn and "left" in drawn, drawn


def test_user_facing_text_cites_works_not_internal_labels():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "notebooks").glob("*.ipynb")]
    for page in pages:
        assert "LIT-" not in page.read_text(encoding="utf-8"), page.name


def test_the_json_schema_refuses_the_bin_names_the_loader_refuses():
    """The schema accepted bins 129, -150, 999 and -999, which the loader refuses (fp32's exponents only)."""
    import copy
    import re
    from importlib import resources

    import jsonschema

    from fp16probe.histogram import MAX_EXP, MIN_EXP
    from fp16probe.report import Report
    from tests.fixtures.reports import tiny_report_json

    schema = json.loads(resources.files("fp16probe").joinpath("schema/report.schema.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    base = tiny_report_json()
    pattern = schema["$defs"]["histogram"]["properties"]["bins"]["propertyNames"]["pattern"]
    assert [e for e in range(-1000, 1000) if re.fullmatch(pattern, str(e))] == list(range(MIN_EXP, MAX_EXP + 1))
    for name in (str(MAX_EXP + 1), str(MIN_EXP - 1), "999", "-999"):
        bad = copy.deepcopy(base)
        bad["modules"][0]["histogram"]["bins"][name] = 1
        with pytest.raises(Exception):
            Report.from_dict(copy.deepcopy(bad))
        assert not validator.is_valid(bad), name
    assert validator.is_valid(base)


def test_the_api_reference_names_every_public_entry_point():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text(encoding="utf-8")
    names = set(fp16probe.__all__) | {"LiveLogger", "hf_trackers", "lightning_trackers", "gather_report",
                                      "merge_rank_reports", "conclude", "trainer_scaler", "lightning_scaler",
                                      "integrations.huggingface.Fp16ProbeCallback",
                                      "integrations.lightning.Fp16ProbeCallback"}
    missing = sorted(n for n in names if n not in page)
    assert not missing, missing
