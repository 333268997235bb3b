"""The command line in-process (CliRunner): each MODEL kind, each command, each exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fp16probe.cli import EXIT_GATE, EXIT_INTERRUPTED, EXIT_LOAD, EXIT_OK, EXIT_USAGE, app
from fp16probe.presentation.answer import caveat_text
from fp16probe.recommendation import Caveat
from fp16probe.report import Report
from tests.fixtures.cli import one_error_line, prepare_cli_env, run

TINY = ["--input-shape", "5,8", "--steps", "2"]


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)



def ok(*args: str):
    result = run(*args)
    assert result.exit_code == EXIT_OK, result.output
    return result


# -- profile: each MODEL kind --------------------------------------------------------


@pytest.mark.slow
def test_demo_profile_shows_underflow_recovered(tmp_path):
    """The demo's claim, computed: a sizeable share flushes at S = 1, the recommended S recovers most."""
    ok("profile", "--steps", "3", "--out", "demo.json")
    report = Report.load("demo.json")
    assert report.metadata.model_class == "DemoNet"
    h = report.histogram("activation_grad")
    at_1 = h.flushed("fp16", 0) / h.nonzero_finite
    k = report.recommendation.log2_scale
    at_s = h.flushed("fp16", k) / h.nonzero_finite
    assert at_1 > 0.2
    assert at_s < 0.1 * at_1
    assert not h.overflows("fp16", k)
    assert report.metadata.extra["inputs_synthetic"] is False


def test_default_out_and_summary(tmp_path):
    result = ok("profile", "cli_models:TinyMLP", *TINY)
    assert (tmp_path / "fp16probe-report.json").is_file()
    assert "report written to fp16probe-report.json" in result.stderr
    assert result.stdout == ""


def test_json_alone_on_stdout(tmp_path):
    result = ok("profile", "cli_models:make_tiny", *TINY, "--json", "--out", "r.json")
    data = json.loads(result.stdout)
    assert data["metadata"]["steps_seen"] == 2
    assert data["recommendation"]["format"] == "fp16"
    assert data["metadata"]["extra"]["inputs_synthetic"] is True
    assert data["metadata"]["extra"]["loss_synthetic"] is True
    assert Report.load("r.json").to_dict() == data


def test_weights_change_the_measurement(tmp_path):
    from cli_models import TinyMLP

    m = TinyMLP()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1000.0)
    torch.save(m.state_dict(), "big.pt")
    ok("profile", "cli_models:TinyMLP", *TINY, "--out", "plain.json")
    ok("profile", "cli_models:TinyMLP", "--weights", "big.pt", *TINY, "--out", "big.json")
    plain = Report.load("plain.json").histogram("weight_grad").max_abs
    big = Report.load("big.json").histogram("weight_grad").max_abs
    assert big > 100 * plain
    assert Report.load("big.json").metadata.extra["weights"] == "big.pt"


def test_weights_safetensors_and_ckpt(tmp_path):
    from cli_models import TinyMLP
    from safetensors.torch import save_file

    state = TinyMLP().state_dict()
    save_file(state, "w.safetensors")
    torch.save({"state_dict": {f"model.{k}": v for k, v in state.items()}, "epoch": 0}, "w.ckpt")
    ok("profile", "cli_models:TinyMLP", "--weights", "w.safetensors", *TINY, "--out", "a.json")
    ok("profile", "cli_models:TinyMLP", "--weights", "w.ckpt", *TINY, "--out", "b.json")


@pytest.mark.slow
def test_export_archive(tmp_path):
    from cli_models import TinyMLP

    ep = torch.export.export(TinyMLP(), (torch.randn(3, 8),))
    torch.export.save(ep, "m.pt2")
    ok("profile", "m.pt2", "--steps", "2", "--out", "r.json")
    report = Report.load("r.json")
    assert report.metadata.extra["model_kind"] == "torch.export"
    assert report.histogram("weight_grad").nonzero_finite > 0
    assert "example inputs" in report.metadata.extra["inputs"]


def test_pickled_module_needs_trust(tmp_path):
    from cli_models import TinyMLP

    torch.save(TinyMLP(), "whole.pt")
    result = run("profile", "whole.pt", *TINY, "--out", "r.json")
    assert result.exit_code == EXIT_LOAD
    line = one_error_line(result)
    assert "arbitrary code" in line and "--trust-checkpoint" in line
    assert not Path("r.json").exists()
    ok("profile", "whole.pt", "--trust-checkpoint", *TINY, "--out", "r.json")


def test_huggingface_folder_token_ids(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
                        vocab_size=50, max_position_embeddings=32)
    BertForMaskedLM(config).save_pretrained(tmp_path / "bert")
    ok("profile", str(tmp_path / "bert"), "--input-shape", "2,8", "--input-dtype", "int64", "--steps", "1",
       "--out", "r.json")
    extra = Report.load("r.json").metadata.extra
    assert "2 sequences of 8 uniform random token ids in [0, 50)" in extra["inputs"]
    assert extra["loss"].startswith("the model's own loss: cross-entropy at the 15% masked positions")
    assert extra["loss_synthetic"] is True  # fp16probe drew the masked labels


# -- profile: options ------------------------------------------------------------------


def test_batches_loss_and_modules(tmp_path):
    ok("profile", "cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--loss", "cli_models:mse_loss",
       "--steps", "3", "--modules", "fc*", "--out", "r.json")
    report = Report.load("r.json")
    assert report.metadata.hooked_modules == ("fc1", "fc2")
    assert report.metadata.extra["inputs_synthetic"] is False
    assert report.metadata.extra["loss_synthetic"] is False


def test_fp16_autocast_with_loss_scale_recovers(tmp_path):
    """Under autocast fp16, a tiny loss flushes gradients; a loss scale brings them back (measured)."""
    args = ["cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--loss", "cli_models:small_loss",
            "--steps", "2", "--precision", "fp16", "--device", "cpu"]
    ok("profile", *args, "--out", "s1.json")
    ok("profile", *args, "--loss-scale", str(2.0**20), "--out", "s20.json")
    zero_1 = Report.load("s1.json").module("fc1").histogram.zero
    zero_20 = Report.load("s20.json").module("fc1").histogram.zero
    assert Report.load("s20.json").metadata.grad_scaler
    assert zero_1 > zero_20


def test_reduced_precision_run_says_its_flushed_values_are_invisible(tmp_path):
    """Under fp16 autocast the flushed gradients are already zeros: profile, show and recommend say so."""
    args = ["cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--loss", "cli_models:small_loss",
            "--steps", "2"]
    result = ok("profile", *args, "--precision", "fp16", "--device", "cpu", "--out", "h.json")
    judged = Report.load("h.json").histogram("all")  # --kind all, the default: both gradient kinds
    assert judged.zero > 0
    recommended = json.loads(ok("recommend", "h.json", "--json").stdout)
    caveat = Caveat.from_dict(recommended["caveats"][0])
    assert caveat == Caveat("low_precision_run", {"precision": "fp16-autocast", "scales": [],
                                                  "zero_values": judged.zero, "values": judged.total})
    for out in (result.stderr, ok("show", "h.json").stderr, ok("recommend", "h.json", "--explain").stderr):
        assert f"caveat: {caveat_text(caveat)}" in " ".join(out.split())
    # Every gradient flushed under fp16 autocast: not read as "no scaling needed".
    assert recommended["verdict"] == "insufficient_evidence"
    ok("profile", *args, "--out", "f.json")
    assert "caveat" not in ok("show", "f.json").stderr
    fp32_caveats = json.loads(ok("recommend", "f.json", "--json").stdout)["caveats"]
    assert "low_precision_run" not in [c["code"] for c in fp32_caveats]


def test_optimizer_trains(tmp_path):
    ok("profile", "cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--loss", "cli_models:mse_loss",
       "--steps", "3", "--optimizer", "sgd", "--lr", "0.1", "--out", "r.json")
    assert Report.load("r.json").metadata.extra["optimizer"] == {"name": "sgd", "lr": 0.1}


def test_training_reports_lost_weight_updates(tmp_path):
    common = ["profile", "cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--loss",
              "cli_models:mse_loss", "--steps", "2"]
    fractions = {}
    for lr in ("1e-7", "0.1"):
        result = ok(*common, "--optimizer", "sgd", "--lr", lr, "--out", f"r{lr}.json")
        wul = Report.load(f"r{lr}.json").metadata.extra["weight_update_loss"]
        assert wul["format"] == "fp16" and 0 <= wul["lost"] <= wul["nonzero_updates"] <= wul["elements"]
        assert "weight updates" in result.stderr
        fractions[lr] = wul["lost_fraction"]
    # Updates 10^6 times smaller vanish against fp16 weights far more often.
    assert fractions["1e-7"] > 0.9 and fractions["0.1"] < fractions["1e-7"]
    ok(*common, "--out", "none.json")
    assert "weight_update_loss" not in Report.load("none.json").metadata.extra


def test_ctrl_c_writes_partial_report(tmp_path):
    result = run("profile", "cli_models:TinyMLP", "--batches", "cli_models:interrupting_batches",
                 "--loss", "cli_models:mse_loss", "--steps", "10", "--out", "r.json")
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    report = Report.load("r.json")
    assert report.metadata.partial
    assert report.metadata.steps_seen == 3


def test_nan_loss_is_a_finding(tmp_path):
    ok("profile", "cli_models:TinyMLP", *TINY, "--loss", "cli_models:nan_loss", "--out", "r.json")
    report = Report.load("r.json")
    assert report.metadata.extra["nonfinite_loss_steps"] == [0, 1]
    assert all(report.trace.found_inf)


def test_short_batches_note(tmp_path):
    ok("profile", "cli_models:TinyMLP", "--batches", "cli_models:two_batches", "--steps", "5", "--out", "r.json")
    report = Report.load("r.json")
    assert report.metadata.steps_seen == 2
    assert any("ran out" in n for n in report.metadata.extra["notes"])


def test_never_overwrites_an_input(tmp_path):
    from cli_models import TinyMLP

    torch.save(TinyMLP().state_dict(), "w.pt")
    before = Path("w.pt").read_bytes()
    result = run("profile", "cli_models:TinyMLP", "--weights", "w.pt", *TINY, "--out", "w.pt")
    assert result.exit_code == EXIT_USAGE
    assert "would overwrite the input" in one_error_line(result)
    assert Path("w.pt").read_bytes() == before


@pytest.mark.parametrize("args,option", [
    (["profile", "cli_models:TinyMLP", *TINY, "--out", "folder"], "--out"),
    (["profile", "cli_models:TinyMLP", *TINY, "--out", "a_file/r.json"], "--out"),
    (["profile", "cli_models:TinyMLP", *TINY, "--out", "r.json", "--plot", "folder"], "--plot"),
    (["compare", "base.json", "base.json", "--junit", "folder"], "--junit"),
    (["compare", "base.json", "base.json", "--summary", "a_file/s.md"], "--summary"),
])
def test_unwritable_output_is_usage_error_before_the_run(args, option, monkeypatch):
    """An output path that is a folder, or under a file, is refused up front (exit 2), not after the run."""
    import fp16probe.running.profile as running_profile

    Path("folder").mkdir()
    Path("a_file").write_text("keep")
    ok("profile", "cli_models:TinyMLP", *TINY, "--out", "base.json")
    monkeypatch.setattr(running_profile, "run_profile", lambda *a, **k: pytest.fail("ran before checking the output"))
    result = run(*args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith(f"error: {option} ")
    assert Path("a_file").read_text() == "keep" and not any(Path("folder").iterdir())


def test_github_step_summary_folder_is_usage_error(monkeypatch):
    ok("profile", "cli_models:TinyMLP", *TINY, "--out", "base.json")
    Path("folder").mkdir()
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", "folder")
    result = run("compare", "base.json", "base.json")
    assert result.exit_code == EXIT_USAGE
    assert "$GITHUB_STEP_SUMMARY" in one_error_line(result)


# -- profile: bad inputs (one line each, exit 2 or 3) --------------------------------------


@pytest.mark.parametrize("args,code,expect", [
    (["nope/model.pt"], EXIT_USAGE, "no such file or folder"),
    (["cli_models:Nope", *TINY], EXIT_LOAD, "has no attribute"),
    (["no_such_pkg_q:Model", *TINY], EXIT_LOAD, "cannot import"),
    (["cli_models:broken_factory", *TINY], EXIT_LOAD, "factory failed on purpose"),
    (["cli_models:TinyMLP", "--input-shape", "5,7", "--steps", "1"], EXIT_USAGE,
     "TinyMLP.forward(x) is what it takes: pass --input-shape with a shape it accepts (and a dtype it takes), "
     "or batches from package.module:function"),
    (["cli_models:TinyMLP", "--input-shape", "5,x"], EXIT_USAGE, "--input-shape"),
    (["family_models:TwoInputs"], EXIT_USAGE, "TwoInputs.forward(x, mask) wants x, mask: pass --batches"),
    (["cli_models:make_frozen", *TINY], EXIT_USAGE, "no trainable parameters"),
    (["cli_models:TinyMLP", *TINY, "--modules", "nomatch*"], EXIT_USAGE, "no module name matches"),
    (["cli_models:TinyMLP", *TINY, "--loss-scale", "8"], EXIT_USAGE, "--loss-scale applies"),
    (["cli_models:TinyMLP", *TINY, "--weights", "missing.pt"], EXIT_USAGE, "no such file"),
])
def test_bad_inputs(args, code, expect):
    result = run("profile", *args, "--out", "r.json")
    assert result.exit_code == code, result.output
    assert expect in one_error_line(result)
    assert not Path("r.json").exists()


def test_state_dict_mismatch_and_corrupt(tmp_path):
    from cli_models import TinyMLP

    torch.save(TinyMLP().state_dict(), "w.pt")
    result = run("profile", "cli_models:OtherMLP", "--weights", "w.pt", *TINY)
    assert result.exit_code == EXIT_LOAD
    assert "does not match the model" in one_error_line(result)
    Path("bad.pt").write_bytes(b"\x80\x02garbage")
    result = run("profile", "cli_models:TinyMLP", "--weights", "bad.pt", *TINY)
    assert result.exit_code == EXIT_LOAD
    assert "corrupt or truncated" in one_error_line(result)


def test_debug_shows_traceback():
    result = run("profile", "cli_models:broken_factory", *TINY, "--debug")
    assert result.exit_code == EXIT_LOAD
    assert "Traceback" in result.stderr


def test_unknown_format_is_usage_error():
    result = run("profile", "cli_models:TinyMLP", *TINY, "--format", "fp17")
    assert result.exit_code == EXIT_USAGE
    assert "fp17" in result.output


@pytest.mark.parametrize("args,expect", [
    (["profile", "--format", "fp17"], "'fp17' is not one of"),
    (["profile", "--no-such-option"], "No such option: --no-such-option"),
    (["profile", "--steps", "0"], "--steps"),
    (["show", "."], "is a directory"),
    (["compare", "only-one.json"], "Missing argument"),
    (["no-such-command"], "No such command"),
])
def test_usage_errors_are_one_line(args, expect):
    """Errors typer catches itself (bad option, value or argument) follow the same one-line rule."""
    result = run(*args)
    assert result.exit_code == EXIT_USAGE, result.output
    line = one_error_line(result)
    assert expect in line and "--help" in line
    assert "Usage:" not in result.output and result.stdout == ""


def test_help_still_exits_0():
    result = run("profile", "--help")
    assert result.exit_code == EXIT_OK
    assert "--loss-scale" in result.stdout


# -- show, recommend, compare ----------------------------------------------------------


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.json"
    result = CliRunner().invoke(app, ["profile", "--steps", "2", "--out", str(path)])
    assert result.exit_code == EXIT_OK, result.output
    return path


def test_show(demo_report):
    before = demo_report.read_bytes()
    result = ok("show", demo_report)
    assert "flushed to 0" in result.stderr
    assert "modules that flush the most" in result.stderr
    assert "GradScaler(" in result.stderr
    assert result.stdout == ""
    assert demo_report.read_bytes() == before


def test_recommend_text_and_json(demo_report):
    result = ok("recommend", demo_report)
    assert "scaler = torch.amp.GradScaler(" in result.stderr
    data = json.loads(ok("recommend", demo_report, "--json").stdout)
    assert data["verdict"] in {"none_needed", "constant", "dynamic", "no_single_scale"}
    assert data["grad_scaler_code"].startswith("scaler = torch.amp.GradScaler(")
    bf16 = json.loads(ok("recommend", demo_report, "--json", "--format", "bf16").stdout)
    assert bf16["format"] == "bf16"


@pytest.mark.slow  # over 10 s on a loaded 2-core machine: the full suite only
def test_plot_command_writes_each_format(demo_report):
    before = demo_report.read_bytes()
    for name in ("fig.png", "fig.svg", "fig.pdf"):
        result = ok("plot", demo_report, "-o", name)
        assert f"figures written to {name}" in result.stderr
    assert Path("fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path("fig.svg").read_text().lstrip().startswith("<?xml")
    assert Path("fig.pdf").read_bytes()[:5] == b"%PDF-"
    assert demo_report.read_bytes() == before


def test_profile_plot_with_a_bad_extension_fails_before_the_run():
    result = run("profile", "cli_models:TinyMLP", *TINY, "--plot", "fig.txt", "--out", "r.json")
    assert result.exit_code == EXIT_USAGE
    assert ".png, .svg, .pdf" in one_error_line(result)
    assert not Path("r.json").exists()  # refused before profiling, not after


def test_plot_command_bad_output(demo_report):
    result = run("plot", demo_report, "-o", "fig.txt")
    assert result.exit_code == EXIT_USAGE
    assert ".png, .svg, .pdf" in one_error_line(result)
    before = demo_report.read_bytes()
    result = run("plot", demo_report, "-o", demo_report)
    assert result.exit_code == EXIT_USAGE
    assert "would overwrite the input" in one_error_line(result)
    assert demo_report.read_bytes() == before


@pytest.mark.parametrize("command", ["show", "recommend", "plot"])
def test_report_errors(command, tmp_path):
    extra = ["-o", "x.png"] if command == "plot" else []
    Path("other.json").write_text(json.dumps({"schema_version": 99, "metadata": {}}))
    result = run(command, "other.json", *extra)
    assert result.exit_code == EXIT_USAGE
    assert "schema_version 99" in one_error_line(result)
    Path("trunc.json").write_text('{"schema_version": 1, "meta')
    result = run(command, "trunc.json", *extra)
    assert result.exit_code == EXIT_USAGE
    assert "not valid JSON" in one_error_line(result)
    result = run(command, "missing.json", *extra)
    assert result.exit_code == EXIT_USAGE


def test_compare_same_report_passes(demo_report, tmp_path, monkeypatch):
    summary = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = ok("compare", demo_report, demo_report, "--junit", "junit.xml")
    assert "no regression" in result.stderr
    assert "passed" in summary.read_text()
    assert 'failures="0"' in Path("junit.xml").read_text()


def test_compare_regression_exits_1(tmp_path):
    base = ["cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--steps", "2"]
    ok("profile", *base, "--loss", "cli_models:mse_loss", "--out", "base.json")
    ok("profile", *base, "--loss", "cli_models:small_loss", "--out", "cur.json")
    result = run("compare", "base.json", "cur.json", "--summary", "sum.md", "--junit", "j.xml", "--json")
    assert result.exit_code == EXIT_GATE, result.output
    data = json.loads(result.stdout)
    failed = {c["name"] for c in data["checks"] if not c["passed"]}
    assert "flushed_fraction" in failed
    assert "FAIL" in Path("sum.md").read_text()
    assert "<failure" in Path("j.xml").read_text()


def test_compare_bad_report_exits_2(demo_report):
    Path("bad.json").write_text("[]")
    result = run("compare", demo_report, "bad.json")
    assert result.exit_code == EXIT_USAGE
    assert "expected a JSON object" in one_error_line(result)


def test_no_args_prints_help():
    result = run()
    assert "profile" in result.output


def test_show_bins_never_straddle_the_format_bounds():
    from rich.console import Console

    from fp16probe import Histogram, get_format
    from fp16probe.presentation.terminal import _bins_table

    # 60 occupied bins squeezed into 24 rows: groups of 3, which would straddle -25 and -14.
    h = Histogram.from_values({e: 1 for e in range(-50, 10)})
    console = Console(width=120, record=True, no_color=True)
    console.print(_bins_table(h, get_format("fp16")))
    normal = flushed = subnormal = 0
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.split("│")] if "│" in line else []
        if len(cells) < 5 or not cells[1].startswith("2^"):
            continue
        lo_hi = [int(x) for x in cells[1].replace("2^", "").split("..")]
        region, count = cells[4], int(cells[2].replace(",", ""))
        bins = range(lo_hi[0], lo_hi[-1] + 1)
        expect = {"flushed": all(b <= -25 for b in bins), "subnormal": all(-25 < b <= -14 for b in bins),
                  "normal": all(-14 < b <= 16 for b in bins)}
        assert expect[region], (cells[1], region)
        normal += count * (region == "normal")
        flushed += count * (region == "flushed")
        subnormal += count * (region == "subnormal")
    assert (flushed, subnormal, normal) == (h.flushed("fp16"), h.subnormal("fp16"), 60 - 26 - 11)
