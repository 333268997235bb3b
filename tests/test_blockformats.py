"""The scaled-format statistics captured by the Probe, stored in the report, analysed and printed.

The Probe's counts are checked against the tensors of the same training step, recorded here
with plain torch hooks and quantized with torchao's ``to_mx`` (MXFP8) and real float8 casts.
"""

from __future__ import annotations

import ast

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.formats import SCALED_FORMATS
from fp16probe.analysis.blockformats import RECIPES, advise, delayed_replay, parse_recipe
from fp16probe.blockadvice import BlockAdvice
from fp16probe.blockscale import (
    ELEMENTS,
    BlockStats,
    DelayedRecipe,
    block_stats_of,
    counts_from_relative,
    delayed_scales,
)
from fp16probe.capture.blockstats import nvfp4_counts, relative_histogram, scaled_counts
from fp16probe.errors import AnalysisError, ReportError
from fp16probe.report import Report
from tests.fixtures.cli import one_error_line, prepare_cli_env, run


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 96)
        self.fc2 = nn.Linear(96, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _train(probe_kwargs, steps=3, record=None):
    """Train Net for ``steps`` under a Probe; ``record`` collects fc1's input and output gradient per step."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen: dict[str, list[torch.Tensor]] = {"input": [], "output_grad": []}

    def fwd(m, args, out):
        seen["input"].append(args[0].detach().clone())
        out.register_hook(lambda g: seen["output_grad"].append(g.detach().clone()))

    handle = net.fc1.register_forward_hook(fwd) if record is not None else None
    with Probe(net, **probe_kwargs) as probe:
        for _ in range(steps):
            x = torch.randn(16, 64) * 1e-3
            loss = net(x).pow(2).mean() * 1e-4
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step()
    if handle is not None:
        handle.remove()
        record.update(seen)
    return probe.report()


def _entry(stats: BlockStats, module: str, kind: str):
    return next(t for t in stats.tensors if t.module == module and t.kind == kind)


def test_probe_mx_counts_equal_torchao_on_the_steps_own_tensors():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    seen: dict = {}
    report = _train({"block_formats": "mxfp8_e4m3"}, record=seen)
    stats = block_stats_of(report)
    assert stats is not None and stats.steps == 3 and stats.families == ("mx",)
    for kind in ("input", "output_grad"):
        t = _entry(stats, "fc1", kind)
        for rule in ("floor", "rceil"):
            want = [0, 0]
            for x in seen[kind]:
                scale, lp = to_mx(x.contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode(rule))
                nz = x.ne(0)
                want[0] += int(nz.sum())
                want[1] += int((nz & lp.float().eq(0)).sum())
            got = t.counts("mx32", "e4m3", rule)
            assert (got.nonzero, got.flushed) == tuple(want)
        assert t.amax_trace == tuple(float(x.abs().max()) for x in seen[kind])


def test_probe_fp8_current_and_delayed_counts_equal_real_casts_and_the_replay():
    seen: dict = {}
    report = _train({"block_formats": "fp8_e4m3", "delayed_recipes": [DelayedRecipe(), DelayedRecipe(2, 1)]},
                    steps=4, record=seen)
    stats = block_stats_of(report)
    t = _entry(stats, "fc1", "output_grad")
    # Current scaling: a real e5m2 cast of each step's gradient with TE's scale max / amax.
    flushed = 0
    for g in seen["output_grad"]:
        q = g * torch.full((), ELEMENTS["e5m2"].max).div(g.abs().max())  # TE's scale: a true division
        flushed += int((g.ne(0) & q.to(torch.float8_e5m2).float().eq(0)).sum())
    assert t.current["e5m2"].flushed == flushed
    # Delayed scaling counted live equals the replay of TE's update over the recorded trace.
    for recipe, el, counts in t.delayed:
        scales = delayed_scales(t.amax_trace, el, history_len=recipe.history_len, margin=recipe.margin,
                                algo=recipe.algo)
        want = sum(scaled_counts(g, s, el) for g, s in zip(seen["output_grad"], scales))
        assert [counts.nonzero, counts.flushed, counts.subnormal, counts.saturated] == want.tolist()
    first = dict((el, c) for r, el, c in t.delayed if r == DelayedRecipe())
    assert first["e5m2"].flushed > 0  # step 1 is cast with TE's initial scale 1.0: tiny gradients flush
    scales, hot = delayed_replay(t, "e5m2", DelayedRecipe(1, 0, "most_recent"))
    assert scales[0] == 1.0 and len(scales) == 4


def test_probe_nvfp4_counts_equal_the_pure_function_summed_over_steps():
    seen: dict = {}
    report = _train({"block_formats": "nvfp4"}, record=seen)
    t = _entry(block_stats_of(report), "fc1", "input")
    want = sum(nvfp4_counts(x)[0] for x in seen["input"]).tolist()
    c = t.nvfp4["1x16"]
    assert [c.nonzero, c.flushed, c.subnormal, c.saturated] == want[:4]
    assert c.expected_zero_sr == pytest.approx(sum(float(nvfp4_counts(x)[1]) for x in seen["input"]))


def test_report_round_trip_validation_and_old_reports(tmp_path):
    report = _train({"block_formats": ["mxfp8_e4m3", "nvfp4"]}, steps=2)
    path = report.save(tmp_path / "r.json")
    again = Report.load(path)
    assert block_stats_of(again) == block_stats_of(report)
    plain = _train({}, steps=1)
    assert plain.blocks is None and block_stats_of(plain) is None
    d = json.loads(path.read_text())
    d["blocks"]["tensors"][0]["relative"]["mx32"]["bins"]["999999"] = 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ReportError, match=r"blocks\.tensors\[0\]\.relative\.mx32\.bins"):
        Report.load(bad)


def test_without_a_block_format_nothing_is_registered():
    net = Net()

    def hooks():
        return len(net.fc1._forward_hooks), len(net.fc1.weight._post_accumulate_grad_hooks or {})

    with Probe(net) as probe:
        assert probe.collector("blocks") is None
        plain = hooks()
    with Probe(net, block_formats="fp16"):
        assert hooks() == plain  # fp16 and bf16 ask for nothing more
    with Probe(net, block_formats="mxfp8_e4m3"):
        assert hooks() == (plain[0] + 1, plain[1] + 1)
    assert hooks() == (0, 0)


def test_advice_keeps_the_layers_no_recipe_saves_and_names_them_in_the_code():
    report = _train({"block_formats": "nvfp4"}, steps=2)
    stats = block_stats_of(report)
    lenient = advise(stats, "nvfp4", threshold=1.0)
    assert lenient.keep_high == () and "KEEP = set()" in lenient.torchao_code
    strict = advise(stats, "nvfp4", threshold=0.0)
    assert set(strict.keep_high) == {"fc1", "fc2"}
    assert "NVFP4BlockScaling()" in strict.te_code and "fc1" in strict.te_code
    assert all(0.0 <= layer.loss <= 1.0 for layer in strict.layers)
    with pytest.raises(AnalysisError, match="profile again with --format mxfp8_e4m3"):
        advise(stats, "mxfp8_e4m3")


def test_recipe_names_parse_and_bad_ones_name_the_choices():
    assert parse_recipe("fp8", None) == ("current", None)
    assert parse_recipe("fp8", "delayed:16:2:most_recent") == ("delayed", DelayedRecipe(16, 2, "most_recent"))
    assert parse_recipe("mx", "floor") == ("floor", None)
    for family, text in (("mx", "delayed"), ("fp8", "delayed:x"), ("nvfp4", "torchao:3")):
        with pytest.raises(AnalysisError):
            parse_recipe(family, text)
    assert set(RECIPES) == {f.family.name for f in SCALED_FORMATS.values()}


def test_torchao_code_imports_resolve():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao")
        report = _train({"block_formats": ["mxfp8_e4m3", "nvfp4", "fp8_e4m3"]}, steps=1)
        stats = block_stats_of(report)
        for fmt in ("mxfp8_e4m3", "nvfp4", "fp8_e4m3"):
            code = advise(stats, fmt).torchao_code
            tree = ast.parse(code)  # the whole snippet is valid Python, its lines within 80 columns
            assert max(map(len, code.splitlines())) <= 80, code
            imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
            exec(compile(ast.Module(body=imports, type_ignores=[]), "<advice>", "exec"), {})


# -- command line ---------------------------------------------------------------------------
@pytest.fixture
def cli_env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)


def test_cli_block_format_names_match_the_library():
    from fp16probe import cli
    from fp16probe.formats import FORMATS

    assert set(cli.BLOCK_FORMAT_NAMES) == set(SCALED_FORMATS) - set(FORMATS)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_cli_profile_prints_the_per_layer_table_advice_and_code(cli_env, fmt):
    result = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "2",
                 "--format", fmt, "-o", "r.json")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "lost: " in out and "advice:" in out and "TransformerEngine:" in out and "torchao:" in out
    assert ("MXFP8BlockScaling" if fmt.startswith("mx") else "NVFP4BlockScaling()") in out
    assert "arXiv:2506.08027" in out and "GradScaler(" not in out
    report = Report.load("r.json")
    advice = report.block_advice
    assert advice.format == fmt and advice.layers
    assert "block_advice" not in report.metadata.extra
    assert BlockAdvice.from_dict(advice.to_dict()) == advice  # the section reads back what it writes
    # an older report kept the same JSON in metadata.extra: it loads into the section
    old = report.to_dict()
    old["metadata"]["extra"]["block_advice"] = old.pop("block_advice")
    assert Report.from_dict(old).block_advice == advice


def test_cli_fp8_prints_no_grad_scaler_line(cli_env):
    result = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "2",
                 "--format", "fp8_e5m2", "-o", "r.json")
    assert result.exit_code == 0, result.output
    assert "GradScaler(" not in result.output and "Float8CurrentScaling(fp8_format=Format.HYBRID)" in result.output


def test_cli_bad_recipe_is_one_line_and_a_usage_error(cli_env):
    result = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "1",
                 "--format", "mxfp8_e4m3", "--recipe", "delayed", "-o", "r.json")
    assert result.exit_code == 2
    assert "expected one of rceil, floor, ceil, even" in one_error_line(result)
    result = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "1",
                 "--recipe", "floor", "-o", "r.json")
    assert result.exit_code == 2 and "applies to the scaled formats" in one_error_line(result)


def test_relative_histogram_is_unchanged_by_a_power_of_two_loss_scale():
    x = torch.randn(8, 64)
    a, _ = relative_histogram(x, "mx32")
    b, _ = relative_histogram(x * 2.0 ** 12, "mx32")
    assert np.array_equal(a.numpy(), b.numpy())


def test_gpt2_conv1d_weight_is_read_as_the_linear_it_stands_for():
    """transformers' Conv1D stores its weight [in, out]: the forward GEMM reads W.t()'s rows."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 16))
    with Probe(model, block_formats="mxfp8_e4m3") as probe:
        model(ids, labels=ids).loss.backward()
        probe.step()
    stats = block_stats_of(probe.report())
    t = _entry(stats, "transformer.h.0.mlp.c_fc", "weight")
    assert t.type == "Conv1D" and t.shape == (256, 64)  # [out, in], as a Linear's weight
    want, _ = relative_histogram(model.transformer.h[0].mlp.c_fc.weight.detach().t(), "mx32")
    assert t.counts("mx32", "e4m3", "rceil") == counts_from_relative(want.numpy(), "e4m3", "rceil")
    assert "Conv1D layers" in " ".join(advise(stats, "mxfp8_e4m3").notes)


def test_cli_show_reads_the_block_statistics_of_a_saved_report(cli_env):
    result = run("profile", "cli_models:make_tiny", "--batches", "cli_models:tiny_batches", "--steps", "2",
                 "--format", "mxfp8_e4m3", "-o", "r.json")
    assert result.exit_code == 0, result.output
    shown = run("show", "r.json", "--format", "mxfp8_e4m3", "--recipe", "floor")
    assert shown.exit_code == 0, shown.output
    assert "mxfp8_e4m3 under floor" in shown.output and "lost: rceil" in shown.output
    as_json = run("show", "r.json", "--format", "mxfp8_e4m3", "--json")
    assert json.loads(as_json.stdout)["advised_recipe"] in RECIPES["mx"]
    missing = run("show", "r.json", "--format", "nvfp4")
    assert missing.exit_code != 0 and "profile again with --format nvfp4" in one_error_line(missing)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp8_e4m3", "nvfp4"])
def test_block_capture_hooks_never_bring_values_to_the_host(monkeypatch, fmt):
    from fp16probe.capture import engine
    from tests.test_no_sync import forbid_host_sync

    monkeypatch.setattr(engine, "CPU_ENGINE", "device")  # the accelerator's code path, run on the CPU
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with Probe(net, block_formats=fmt) as probe:
        for _ in range(2):
            with forbid_host_sync() as calls:
                opt.zero_grad()
                net(torch.randn(4, 64)).square().mean().backward()
                probe.step()
            assert calls == []
            opt.step()
    stats = block_stats_of(probe.report())
    assert stats.steps == 2 and stats.hook_errors == 0
