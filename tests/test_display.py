"""What a person reads: the short answer first, at 80 columns and in pipes, in the terminal,
in rich.print, in Jupyter's HTML; module names and URLs as data, never broken or parsed."""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp16probe.analysis.recommend import analyze
from fp16probe.cli import app
from fp16probe.presentation import answer, html, terminal
from fp16probe.recommendation import Caveat
from fp16probe.report import ACTIVATION_GRAD, Report
from fp16probe.sources import GRADSCALER
from tests.fixtures.reports import hand_report

ROOT = Path(__file__).resolve().parents[1]
DEMO_REPORT = ROOT / "tests" / "data" / "report-v1-demo.json"
URL = re.compile(r"https?://\S+")
NVIDIA_GUIDE = "https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html"


@pytest.fixture(scope="module")
def hand():
    report = hand_report()
    return report.with_recommendation(analyze(report, "fp16"))


@pytest.fixture(scope="module")
def long_names(tmp_path_factory):
    """A report of the LongNames model, written by ``fp16probe profile``, and its summary."""
    out = tmp_path_factory.mktemp("long") / "report.json"
    result = CliRunner().invoke(app, ["profile", "tests.fixtures.cli_models:make_long_names",
                                      "--input-shape", "4,8", "--steps", "3", "--out", str(out)],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return Report.load(out), result.output


def _rich(renderable, width: int = 80) -> str:
    from rich.console import Console

    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _whole_pieces(lines: list[str], names: list[str]) -> None:
    """Every dotted piece of a module name on a line starts and ends where the name's parts do."""
    for line in lines:
        for token in re.findall(r"[^\s│┃|,;()]+", line):
            for piece in token.split("…"):
                if "." not in piece.strip(".") or len(piece) < 4:
                    continue
                owners = [n for n in names if piece in n]
                if not owners:
                    continue
                assert any(_at_boundaries(n, piece) for n in owners), f"{piece!r} breaks a name: {line!r}"


def _at_boundaries(name: str, piece: str) -> bool:
    start = name.find(piece)
    while start != -1:
        end = start + len(piece)
        if (start == 0 or name[start - 1] == "." or piece.startswith(".")) and (
                end == len(name) or name[end] == "." or piece.endswith(".")):
            return True
        start = name.find(piece, start + 1)
    return False


def _check_80_columns(text: str, names: list[str]) -> list[str]:
    lines = text.splitlines()
    for line in lines:
        # A URL longer than a line stands alone on its line, whole.
        assert len(line) <= 80 or URL.fullmatch(line.strip().strip("(),.;")), f"line over 80 columns: {line!r}"
        assert "…" not in re.sub(r"[\w.\[\]/$\\{}]*…[\w.\[\]/$\\{}]*", "", line), f"cut: {line!r}"
    _whole_pieces(lines, names)
    return lines


# -- the profile summary at 80 columns --------------------------------------------------------
def test_profile_summary_leads_with_the_answer_at_80_columns(long_names):
    report, output = long_names
    names = [m.name for m in report.modules_of(ACTIVATION_GRAD)]
    lines = _check_80_columns(output, names)
    rec = report.recommendation
    verdict = next(i for i, ln in enumerate(lines) if ln.startswith(f"verdict for {rec.format}:"))
    code = next(i for i, ln in enumerate(lines) if ln.startswith("scaler = torch.amp.GradScaler("))
    assert verdict < 10 and code < 10, lines[:12]
    assert str(rec.verdict) in lines[verdict] or answer.VERDICT_WORDS[rec.verdict] in lines[verdict]
    # the code is the recommendation's, for CUDA, and the device choice is explained
    pasted = "".join(ln.strip() for ln in lines[code:code + 4] if not ln.startswith("note"))
    for key, value in rec.grad_scaler_kwargs.items():
        assert f"{key}=" in pasted
    assert '"cuda"' in pasted
    assert any("this profile ran on cpu" in ln for ln in lines[:code])
    # the invented inputs say so in one visible line
    assert sum(ln.startswith("note: invented random inputs") for ln in lines) == 1
    # the worst-modules table wraps the 114-character name after its dots; a part longer than
    # the column is shortened in its middle, its start and end kept
    longest = max(names, key=len)
    assert len(longest) > 80
    last = longest.split(".")[-1]
    assert last in output or re.search(re.escape(last[:8]) + r"\w*…\w*" + re.escape(last[-8:]), output)


def test_show_explain_keeps_urls_and_names_whole(long_names, tmp_path):
    report, _ = long_names
    path = tmp_path / "r.json"
    report.save(path)
    result = CliRunner().invoke(app, ["show", str(path), "--explain"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = _check_80_columns(result.output, [m.name for m in report.modules])
    assert "[/bold]" in result.output and "$\\frac{$" in result.output  # names as data, not markup
    for url in URL.findall(result.output):
        assert url.rstrip(".,;:)") in {NVIDIA_GUIDE, GRADSCALER.url} or url.startswith("https://arxiv.org/")
    if "docs.nvidia.com" in result.output:
        assert any(NVIDIA_GUIDE in ln for ln in lines)
    assert "LIT-" not in result.output, "sources are cited by authors, title and identifier"
    assert "sources:" in result.output and "Micikevicius et al." in result.output


def test_show_explain_of_the_demo_gives_the_replay_and_whole_urls():
    result = CliRunner().invoke(app, ["show", str(DEMO_REPORT), "--explain"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = _check_80_columns(result.output, [])
    assert "growth_interval replay over 20,000 simulated steps" in result.output
    # GradScaler's default row is marked in the table and said what it is once below it
    assert any(ln.strip("│ ").startswith("2,000 (default) ") for ln in lines), result.output
    assert sum(ln.startswith("(default): GradScaler's default growth_interval") for ln in lines) == 1
    assert any(ln.strip() == NVIDIA_GUIDE for ln in lines)  # the guide's URL alone on a line, whole
    assert "LIT-" not in result.output


def test_show_without_explain_is_short(long_names, tmp_path):
    report, _ = long_names
    path = tmp_path / "r.json"
    report.save(path)
    result = CliRunner().invoke(app, ["show", str(path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "sources:" not in result.output and "--explain" in result.output


def test_rich_print_of_a_report_fits_80_columns_and_cuts_no_number():
    report = Report.load(DEMO_REPORT)
    text = _rich(report, width=80)
    _check_80_columns(text, [m.name for m in report.modules])
    h = report.histogram(ACTIVATION_GRAD)
    assert f"{h.total:,}" in text  # 4,917,760 whole
    assert "verdict for fp16:" in text


# -- the answer's words ---------------------------------------------------------------------
def test_code_line_wraps_as_valid_python_and_names_the_device(hand):
    rec = hand.recommendation
    code = answer.grad_scaler_code(rec, "cuda", width=40)
    assert all(len(ln) <= 40 for ln in code.splitlines())
    tree = compile(code, "<pasted>", "exec")  # still Python
    assert tree is not None
    assert answer.grad_scaler_code(rec, "cuda").count("\n") == 0
    assert answer.scaler_device(hand, None) == ("cuda", "for CUDA, where fp16 training runs; this profile ran on cpu")
    gpu = replace(hand, metadata=replace(hand.metadata, device="cuda:0"))
    assert answer.scaler_device(gpu, None) == ("cuda", "for cuda, where this profile ran")
    assert answer.scaler_device(hand, "cpu") == ("cpu", "for cpu, as asked")


def test_names_are_shortened_and_wrapped_only_at_dots():
    name = "bert.encoder.layer.2.attention.output.dense"
    assert answer.shorten_name(name, 80) == name
    short = answer.shorten_name(name, 24)
    assert len(short) <= 24 and short.startswith("bert.") and short.endswith(".dense") and "…" in short
    assert all(p in name.split(".") for p in short.split(".") if p != "…")
    assert answer.fit_name(name, 20) == ["bert.encoder.layer.", "2.attention.output.", "dense"]
    assert "".join(answer.fit_name(name, 20)) == name
    assert answer.wrap_text(f"see {NVIDIA_GUIDE} for more", 40)[1] == NVIDIA_GUIDE


def test_caveats_reach_every_medium(hand):
    rec = replace(hand.recommendation, caveats=(Caveat("text", {"text": "this run computed in fp16 <at S = 1>"}),))
    report = hand.with_recommendation(rec)
    assert "caveat: this run computed in fp16 <at S = 1>" in _rich(report, 100)
    assert "caveat: this run computed in fp16 &lt;at S = 1&gt;" in html.report_html(report, figure=False)
    fig = report.plot("distribution")
    assert any("caveat: this run computed in fp16" in t.get_text() for t in fig.findobj()
               if hasattr(t, "get_text") and t.get_gid() == "caveats")


# Representative data for each caveat code, as the analysis writes it.
CAVEAT_SAMPLES = {
    "text": {"text": "An old report's caveat, stored as its sentence."},
    "low_precision_run": {"precision": "fp16-autocast", "scales": [1024.0], "zero_values": 12, "values": 1000},
    "hooked_ceiling": {},
    "scale_not_carried": {"log2_ratio": -14.0, "claimed_scales": [2.0**24], "steps": [0, 1, 2]},
    "schedule_differs": {"schedule_choice": "growth_interval=2000", "defaults_fine": True, "history_steps": 300},
    "reruns_discarded": {"count": 3, "first": {"module": "fc1", "dtype": "float16", "step": 0}},
    "scale_induced_overflow": {"count": 2, "scales": [2.0**15, 2.0**16], "steps": [3, 7]},
    "intrinsic_nonfinite": {"count": 1},
    "narrowed_kind": {"kind": "activation_grad", "others": ["weight_grad"]},
    "silent_modules": {"count": 7, "modules": ["a", "b", "c", "d", "e"]},
    "autocast_fp32_ops": {"count": 2, "ops": ["norm/rsqrt", "(model)/mse_loss"]},
    "partial_run": {"stopped": "hangup", "steps_seen": 3, "steps_requested": 10},
    "rerun_steps": {"count": 2, "next_step": None},
    "projected_schedule": {"horizon": 20000, "history_steps": 30},
    "pure_fp16": {},
    "forward_modules_only": {},
    "forward_low_headroom": {"regime": "autocast", "target": "cuda", "tensors": [["fc1", 2.5]]},
    "forward_flushing": {"regime": "pure_fp16", "target": "cpu", "count": 6,
                         "tensors": [["t1", 0.05], ["t2", 0.04], ["t3", 0.03], ["t4", 0.02]]},
    "custom_functions": {"functions": ["_ScaledBackward"]},
    "loss_fp16": {"regime": "autocast", "target": "cuda"},
    "forward_no_effect": {"finding": "forward_underflow", "tensor": "(model)/mul", "flushed_fraction": 0.25,
                          "max_abs": None, "error": 0.0005, "log2_scale": 18, "target": "cpu", "regime": "autocast",
                          "tolerance": 0.05},
    "flush_no_effect": {"flushed_fraction": 0.00124, "threshold": 0.001, "modules": ["layers.1.q_proj"],
                        "error": 0.0006, "zeroed": 0, "nonzero": 96576, "log2_scale": 19, "tolerance": 0.05,
                        "target": "cpu", "regime": "autocast"},
    "emulated_overflow": {"log2_scale": 17, "nonfinite": 12, "error_below": 0.001, "target": "cuda",
                          "regime": "autocast"},
    "error_within_noise": {"parameter": "layer1.bn1.bias", "error": 0.101, "noise": 1.15, "model_error": 0.06,
                           "model_noise": 1.1, "noise_batches": 4, "noise_share": 0.5, "tolerance": 0.05,
                           "log2_scale": 10, "target": "cpu", "format": "fp16"},
    "bf16_worse_than_fp16": {"error": 0.0025, "fp16_error": 0.0003, "fp16_log2_scale": 17, "target": "cuda"},
}


def _emitted_caveat_codes() -> set[str]:
    """Every code the analysis writes: the first argument of each ``Caveat(...)`` under fp16probe/analysis."""
    codes = set()
    for path in sorted((ROOT / "fp16probe" / "analysis").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Caveat":
                assert isinstance(node.args[0], ast.Constant), f"{path.name}:{node.lineno}: a code is a literal"
                codes.add(node.args[0].value)
    return codes


def test_every_caveat_code_the_analysis_writes_has_its_words():
    assert _emitted_caveat_codes() | {"text"} == set(answer.CAVEAT_WORDS) == set(CAVEAT_SAMPLES)
    for code, data in CAVEAT_SAMPLES.items():
        caveat = Caveat(code, data)
        text = answer.caveat_text(caveat)
        assert text.endswith(".") and "{" not in text and "None" not in text, (code, text)
        assert str(Caveat.from_dict(json.loads(json.dumps(caveat.to_dict())))) == text
    assert answer.caveat_text(Caveat("text", {"text": "As stored."})) == "As stored."
    # A code from a newer writer, or data an edited file broke, still shows (code and data), never an error.
    assert answer.caveat_text(Caveat("newer", {"n": 1})) == "newer: {'n': 1}"
    assert answer.caveat_text(Caveat("silent_modules", {"count": 2})) == "silent_modules: {'count': 2}"


def test_within_the_noise_the_words_follow_the_evidence():
    """Under a tenth of the noise every evidence model trained like fp32: "training will not feel it". From there up
    to the alarm's half both outcomes were measured (docs/evidence.md's sweep): the words say so and point at
    --trial."""
    data = dict(CAVEAT_SAMPLES["error_within_noise"])
    low = answer.caveat_text(Caveat("error_within_noise", {**data, "error": 0.09, "noise": 1.0}))
    mid = answer.caveat_text(Caveat("error_within_noise", {**data, "error": 0.3, "noise": 1.0}))
    assert "training will not feel it" in low and "--trial" not in low
    assert "training will not feel it" not in mid and "30% of it, under the alarm's line" in mid
    assert "fp16probe profile --trial STEPS" in mid and "docs/evidence.md" in mid


# -- HTML -----------------------------------------------------------------------------------
def test_report_html_has_the_summary_numbers(hand):
    page = html.report_html(hand, figure=False)
    h = hand.histogram(ACTIVATION_GRAD)
    flushed = f"{100 * h.flushed('fp16') / h.nonzero_finite:.3g}%"
    assert "HandBuilt" in page
    row = re.search(r"<tr><td>activation_grad</td>(.*?)</tr>", page).group(1)
    assert f"<td>{h.total:,}</td>" in row and f"<td>{flushed}</td>" in row
    assert "<td>weight_grad</td>" in page


def test_report_html_leads_with_the_answer_and_expands_the_reasoning(hand):
    page = hand._repr_html_()
    rec = hand.recommendation
    assert page.index(f">{rec.verdict}</span>") < page.index("<details>")
    assert "<pre>scaler = torch.amp.GradScaler(" in page and "&quot;cuda&quot;, init_scale=" in page
    details = page[page.index("<details>"):]
    assert "evidence" in details and "sources:" in details
    png = re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page).group(1)
    assert base64.b64decode(png).startswith(b"\x89PNG\r\n\x1a\n")


def test_html_names_are_escaped_and_wrap_only_at_dots(hand):
    evil = replace(hand.modules[2], name="enc.<script>alert(1)</script>.deep")
    report = replace(hand, modules=(*hand.modules[:2], evil, *hand.modules[3:]))
    page = html.report_html(report, figure=False)
    assert "<script>" not in page
    assert "enc.<wbr>&lt;script&gt;alert(1)&lt;/script&gt;.<wbr>deep" in page
    assert "td.name{white-space:normal" in page and "white-space:nowrap" in page


def test_recommendation_html_alone(hand):
    page = hand.recommendation._repr_html_()
    assert "fp16probe recommendation" in page
    assert f"{100 * hand.recommendation.flushed_fraction_at_1:.3g}%" in page
    for url in re.findall(r"href='([^']+)'", page):
        assert f">{url}</a>" in page  # a link shows its whole URL


def test_a_report_without_a_recommendation_says_so_and_runs_no_analysis(hand):
    bare = hand.with_recommendation(None)
    assert "no recommendation stored" in bare._repr_html_()
    assert "no recommendation stored" in _rich(bare, 80)


def test_recommendation_rich_view(hand):
    text = _rich(hand.recommendation, 80)
    assert text.startswith("verdict for fp16:")
    assert "scaler = torch.amp.GradScaler(" in text


def test_markup_in_module_names_is_printed_as_data(hand):
    odd = replace(hand.modules[2], name="[/bold]")
    report = replace(hand, modules=(*hand.modules[:2], odd, *hand.modules[3:]))
    text = _rich(terminal.summary_view(report, hand.recommendation, explain=True), 100)
    assert "[/bold]" in text


@pytest.mark.slow
def test_importing_fp16probe_loads_neither_matplotlib_nor_rich():
    code = ("import sys, fp16probe, fp16probe.presentation.html, fp16probe.presentation.answer; "
            "print('matplotlib' in sys.modules, 'rich' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]
