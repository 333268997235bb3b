"""Code to paste is built from checked tokens only (issue 40, item 1).

Each printed code line (the GradScaler line, the ``keep_in_fp32`` fix, TransformerEngine's and
torchao's snippets) in every medium: a report's stored strings never become code, a value that
does not fit is refused as the report loads (exit 2, one line) or gives no code and a note, and
every line that is printed parses to exactly the intended call. The fuzz at the end draws the
values that reach the code and parses what comes out.
"""

from __future__ import annotations

import ast
import copy
import html
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fp16probe.analysis.effect import judge_report
from fp16probe.cli import app
from fp16probe.emulation import Emulation
from fp16probe.presentation.answer import fix_code, grad_scaler_code, scaler_device
from fp16probe.presentation.html import recommendation_html
from fp16probe.recommendation import Recommendation, Verdict
from fp16probe.report import Report
from fp16probe.validation import AUTOCAST_TARGETS, GRAD_SCALER_ARGS, SCALER_DEVICES
from tests.fixtures.reports import hand_report

EVIL = '"); __import__("os").system("touch PWNED"); print("'


@pytest.fixture(scope="module")
def gradient_error_dict() -> dict:
    """A hand-built report whose emulated step puts ``mid.weight`` 10% off and ``mid`` in fp32 fixes it."""
    report = hand_report()
    k = judge_report(report, "fp16").log2_scale

    def setting(keep: list[str], rows: list[list[float]]) -> dict:
        return {"log2_scale": k, "keep_fp32": keep, "loss_low": False, "batches": 1, "params": rows, "outputs": []}

    fine = [[1e-6, 1.0, 0, 10, 0]] * 3
    off = [[1e-6, 1.0, 0, 10, 0], [0.01, 1.0, 0, 10, 0], [1e-6, 1.0, 0, 10, 0]]
    data = {"format": "fp16", "target": "cpu", "regime": "autocast", "batches": 1,
            "parameters": ["head.weight", "mid.weight", "deep.weight"],
            "settings": [setting([], off), setting(["mid"], fine)]}
    report = report.with_sections({"emulation": Emulation.from_dict(data)})
    report = Report(**{**report.__dict__, "recommendation": judge_report(report, "fp16")})
    d = json.loads(report.to_json())
    assert d["recommendation"]["verdict"] == "gradient_error"
    return d


def _write(tmp_path: Path, d: dict, name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def _run(*args: Any):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "80"})


def _pre_blocks(page: str) -> list[str]:
    return [html.unescape(b) for b in re.findall(r"<pre>(.*?)</pre>", page, re.S)]


def _rich(obj: Any, width: int = 80) -> str:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(obj)
    return out.getvalue()


# -- the injections ----------------------------------------------------------------------
def test_an_emulation_target_that_is_code_is_refused_in_one_line(gradient_error_dict, tmp_path):
    """Before: ``show`` exit 0, printing ``device_type="cuda"); __import__("os").system(...)`` under ``fix:``."""
    d = copy.deepcopy(gradient_error_dict)
    d["sections"]["emulation"]["target"] = "cuda" + EVIL
    for command in ("show", "recommend", "schedule"):
        result = _run(command, _write(tmp_path, d))
        assert result.exit_code == 2, result.output
        assert "sections.emulation.target: expected cuda or cpu" in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_a_stored_fix_code_is_never_shown(gradient_error_dict, tmp_path):
    """Before: the notebook view and ``rich.print(report)`` showed ``evidence.fix_code`` word for word."""
    d = copy.deepcopy(gradient_error_dict)
    d["recommendation"]["evidence"]["fix_code"] = '__import__("os").system("touch PWNED")'
    report = Report.load(_write(tmp_path, d))
    shown = [*_pre_blocks(report._repr_html_()), *_pre_blocks(report.recommendation._repr_html_()),
             _rich(report), _rich(report.recommendation), _run("show", _write(tmp_path, d)).output]
    for text in shown:
        assert "os" not in re.findall(r"\w+", text.replace("fp16probe", "")) and "system" not in text
    expected = "import fp16probe\nfp16probe.keep_in_fp32(model, ['mid'], device_type=\"cpu\")"
    assert _pre_blocks(report._repr_html_())[0] == expected
    assert expected in _rich(report, 100) and expected in _run("show", _write(tmp_path, d)).output


def test_the_notebook_code_block_is_lines_that_parse(gradient_error_dict, tmp_path):
    """Before: ``GradScaler(\\n    "cuda", ...`` with a literal backslash-n, a SyntaxError when copied."""
    report = Report.load(_write(tmp_path, gradient_error_dict))
    rec = Recommendation(**{**report.recommendation.__dict__, "verdict": Verdict.CONSTANT,
                            "grad_scaler_kwargs": {"init_scale": 2.0**16, "growth_factor": 2.0,
                                                   "backoff_factor": 0.5, "growth_interval": 2000}})
    blocks = _pre_blocks(recommendation_html(rec, report))
    scaler = [b for b in blocks if "GradScaler" in b]
    assert scaler and "\\n" not in scaler[0] and len(scaler[0].splitlines()) > 1
    call = ast.parse(scaler[0]).body[0].value
    assert [ast.literal_eval(a) for a in call.args] == ["cuda"] and len(call.keywords) == 4


@pytest.mark.parametrize("field,value,said", [
    (("recommendation", "grad_scaler_kwargs"), {"init_scale=1.0); import os; (x": 1.0}, "not an argument"),
    (("recommendation", "grad_scaler_kwargs"), {"init_scale": "2.0**16"}, "init_scale"),
    (("recommendation", "grad_scaler_kwargs"), {"growth_factor": 0.5}, "growth_factor"),
    (("recommendation", "evidence", "fix_device"), "cuda" + EVIL, "fix_device"),
    (("recommendation", "evidence", "fix_modules"), [["x"]], "fix_modules[0]"),
    (("recommendation", "evidence", "emulated", "target"), "cuda" + EVIL, "emulated.target"),
])
def test_values_that_would_become_code_are_refused_as_the_report_loads(gradient_error_dict, tmp_path, field, value,
                                                                        said):
    d = copy.deepcopy(gradient_error_dict)
    target = d
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    result = _run("show", _write(tmp_path, d))
    assert result.exit_code == 2, result.output
    assert said in result.output and len(result.output.strip().splitlines()) == 1


def test_recommend_takes_only_a_device_type_for_its_gradscaler_line(gradient_error_dict, tmp_path):
    result = _run("recommend", _write(tmp_path, gradient_error_dict), "--device", "cuda" + EVIL)
    assert result.exit_code == 2 and "--device" in result.output and "expected a device type" in result.output
    assert _run("recommend", _write(tmp_path, gradient_error_dict), "--device", "xpu").exit_code == 0


def test_block_advice_code_comes_from_its_checked_fields(tmp_path):
    from fp16probe.blockadvice import BlockAdvice

    advice = {"format": "mxfp8_e4m3", "recipe": "rceil", "advised_recipe": "floor", "threshold": 0.001, "layers": [],
              "keep_high": ["fc1\nimport os; os.system('x')"], "te_code": "import os", "torchao_code": "import os",
              "notes": []}
    loaded = BlockAdvice.from_dict(advice)
    assert all(line != "import os" for code in (loaded.te_code, loaded.torchao_code) for line in code.splitlines())
    assert "ScaleCalculationMode.FLOOR" in loaded.torchao_code
    for code in (loaded.te_code, loaded.torchao_code):
        assert not [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and n.id == "os"]
    with pytest.raises(Exception, match=r"block_advice.advised_recipe: expected one of rceil"):
        BlockAdvice.from_dict({**advice, "advised_recipe": "rceil)\nimport os\n("})
    with pytest.raises(Exception, match=r"block_advice.format: expected one of"):
        BlockAdvice.from_dict({**advice, "format": "fp8_x"})


# -- long fixes wrap as Python is written ----------------------------------------------------------
def test_a_fix_of_many_long_names_wraps_within_80_columns_and_is_listed_once(gradient_error_dict, tmp_path):
    """The MobileViT case: before, one line of 1,700 columns, and the names again in the next paragraph."""
    names = [f"mobilevit.encoder.layer.{i}.transformer.layer.{j}.attention.attention.query"
             for i in range(3) for j in range(9)] + ["x" * 120 + ".y"]
    d = copy.deepcopy(gradient_error_dict)
    rec = Recommendation.from_dict(d["recommendation"])
    rec = Recommendation(**{**rec.__dict__, "verdict": Verdict.FORWARD_UNDERFLOW, "stored_text": "",
                            "evidence": {**rec.evidence, "fix_modules": names, "fix_device": "cuda",
                                         "target": "cuda", "regime": "autocast", "backward_verdict": "constant",
                                         "forward_flushing": [{"name": "t", "role": "output",
                                                               "flushed_fraction": 0.5}]}})
    code = fix_code(rec, width=80)
    assert code is not None and max(len(line) for line in code.splitlines()) <= 80
    call = ast.parse(code).body[1].value
    assert ast.literal_eval(call.args[1]) == names
    from fp16probe.presentation.verdict import verdict_text

    text = verdict_text(rec)
    assert names[0] not in text and "the 28 modules the fix names" in text


def test_the_loss_in_fp32_line_takes_only_an_autocast_device():
    from fp16probe.presentation.paste import loss_in_fp32_call

    for device in AUTOCAST_TARGETS:
        code = loss_in_fp32_call(device)
        assert code is not None
        with_ = ast.parse(code).body[0]
        assert isinstance(with_, ast.With) and ast.literal_eval(with_.items[0].context_expr.args[0]) == device
    assert loss_in_fp32_call("cuda" + EVIL) is None and loss_in_fp32_call("xpu") is None


# -- the fuzz: every printed code line parses to exactly the intended call --------------------------
_NUMBER = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**6), st.booleans(),
                    st.text(max_size=8), st.none())
_KWARGS = st.dictionaries(st.one_of(st.sampled_from(GRAD_SCALER_ARGS), st.text(max_size=12)), _NUMBER, max_size=5)
_GOOD_KWARGS = st.fixed_dictionaries({}, optional={
    "init_scale": st.floats(1e-30, 1e30) | st.integers(1, 2**40).map(lambda e: 2.0 ** (e % 100)),
    "growth_factor": st.floats(1.0001, 1e6), "backoff_factor": st.floats(1e-6, 0.9999),
    "growth_interval": st.integers(1, 2**31 - 1), "enabled": st.booleans()})
_NAME = st.text(max_size=60) | st.sampled_from(["a.b", "", "x" * 200, "a'b\"c\\", "m\u200bx", "l\n::x"])


def _value(node: ast.expr) -> Any:
    """A keyword's value: a literal, or ``2.0**k`` as the code writes a power of two."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return ast.literal_eval(node.left) ** ast.literal_eval(node.right)
    return ast.literal_eval(node)


def _check_scaler(code: str, kwargs: dict[str, Any], device: str) -> None:
    body = ast.parse(code).body
    assert len(body) == 1 and isinstance(body[0], ast.Assign), code
    assert [ast.unparse(t) for t in body[0].targets] == ["scaler"]
    call = body[0].value
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "torch.amp.GradScaler", code
    assert [ast.literal_eval(a) for a in call.args] == [device]
    got = {k.arg: _value(k.value) for k in call.keywords}
    assert list(got) == list(kwargs)
    for k, v in kwargs.items():
        assert type(got[k]) is type(v) and got[k] == v, (k, got[k], v)


def _check_fix(code: str, names: list[str], device: str) -> None:
    body = ast.parse(code).body
    assert len(body) == 2 and ast.unparse(body[0]) == "import fp16probe", code
    assert isinstance(body[1], ast.Expr) and isinstance(body[1].value, ast.Call)
    call = body[1].value
    assert ast.unparse(call.func) == "fp16probe.keep_in_fp32" and ast.unparse(call.args[0]) == "model"
    assert len(call.args) == 2 and ast.literal_eval(call.args[1]) == names
    assert [(k.arg, ast.literal_eval(k.value)) for k in call.keywords] == [("device_type", device)]


def _valid_scaler(kwargs: dict[str, Any]) -> bool:
    from fp16probe.validation import check_grad_scaler_kwargs

    try:
        check_grad_scaler_kwargs(kwargs)
    except Exception:
        return False
    return True


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(verdict=st.sampled_from([Verdict.FORWARD_OVERFLOW, Verdict.FORWARD_UNDERFLOW, Verdict.GRADIENT_ERROR,
                                Verdict.CONSTANT, Verdict.DYNAMIC, Verdict.NONE_NEEDED]),
       kwargs=st.one_of(_KWARGS, _GOOD_KWARGS), names=st.lists(_NAME, max_size=30),
       fix_device=st.one_of(st.sampled_from(AUTOCAST_TARGETS), _NAME),
       asked=st.one_of(st.none(), st.sampled_from(SCALER_DEVICES), _NAME),
       width=st.one_of(st.none(), st.integers(40, 200)))
def test_fuzz_every_printed_code_line_parses_to_the_intended_call(verdict, kwargs, names, fix_device, asked, width):
    rec = Recommendation(
        verdict=verdict, format="fp16", log2_scale=10, scale=1024.0, grad_scaler_kwargs=kwargs,
        flushed_fraction_at_1=0.0, flushed_fraction_at_scale=0.0, overflow_steps_at_scale=0, headroom_bits=3,
        worst_modules=[], evidence={"fix_modules": names, "fix_device": fix_device}, thresholds={},
        citations=())
    device = asked if asked in SCALER_DEVICES else "cuda"
    assert scaler_device(None, asked)[0] == device
    scaler, fix = grad_scaler_code(rec, scaler_device(None, asked)[0], width), fix_code(rec, width)
    scaler_kwargs = kwargs or ({"enabled": False} if verdict is Verdict.NONE_NEEDED else {})
    if scaler_kwargs and _valid_scaler(scaler_kwargs):
        _check_scaler(scaler, scaler_kwargs, device)
    else:
        assert scaler == ""
    fix_offered = verdict in (Verdict.FORWARD_OVERFLOW, Verdict.FORWARD_UNDERFLOW, Verdict.GRADIENT_ERROR) and names
    if fix_offered and fix_device in AUTOCAST_TARGETS:
        _check_fix(fix, names, fix_device)
    else:
        assert fix == ("" if not fix_offered else None)  # None: short_answer says "no fix code" instead
    for code in (scaler, fix or ""):
        assert not code or max(len(line) for line in code.splitlines()) <= (width or 10**9)


_KEEP = st.lists(_NAME, max_size=12)


def _skeleton(code: str) -> str:
    """The code's statements with every string constant the same: what the code does, whatever the names."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = "_"
        if isinstance(node, (ast.Set, ast.List)):
            node.elts = node.elts[:1]
    return ast.dump(tree)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(data=st.data(), keep=_KEEP)
def test_fuzz_block_advice_code_parses_to_its_recipe_and_kept_names(data, keep):
    from fp16probe.blockadvice import BlockAdvice
    from fp16probe.blockscale import DelayedRecipe
    from fp16probe.formats import SCALED_FORMATS

    fmt = data.draw(st.sampled_from(sorted(SCALED_FORMATS)))
    recipe = data.draw(st.sampled_from(SCALED_FORMATS[fmt].family.recipes))
    delayed = DelayedRecipe(data.draw(st.integers(1, 4096)), data.draw(st.integers(0, 64)),
                            data.draw(st.sampled_from(["max", "most_recent"])))
    advice = BlockAdvice(format=fmt, recipe=recipe, advised_recipe=recipe, threshold=0.001, layers=(),
                         keep_high=tuple(keep), delayed=delayed)
    plain = BlockAdvice(format=fmt, recipe=recipe, advised_recipe=recipe, threshold=0.001, layers=(),
                        keep_high=tuple(f"m{i}" for i in range(len(keep))), delayed=delayed)
    for code, same in ((advice.te_code, plain.te_code), (advice.torchao_code, plain.torchao_code)):
        assert _skeleton(code) == _skeleton(same), code  # the names change no statement
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "KEEP" and keep:
                assert {ast.literal_eval(e) for e in node.value.elts} == set(keep)
    kept = [line[4:] for line in advice.te_code.splitlines() if line.startswith("#   ")]
    if "# keep in bf16" in advice.te_code:  # TE's code for the recipe (not a pointer to torchao's)
        assert [ast.literal_eval(k) for k in kept] == list(keep)


# -- the paper cuts: wrong-typed evidence, histograms that do not add up, names whole and visible --------
@pytest.mark.parametrize("key,value", [("max_abs", []), ("largest_safe_log2_scale", "x"), ("emulated", -1)])
def test_wrong_typed_evidence_is_exit_2_in_one_line(gradient_error_dict, tmp_path, key, value):
    """Before: ``show`` crashed with TypeError/AttributeError (exit 4) on these, where every other field gets exit 2."""
    d = copy.deepcopy(gradient_error_dict)
    d["recommendation"]["evidence"][key] = value
    for command in ("show", "recommend"):
        result = _run(command, _write(tmp_path, d))
        assert result.exit_code == 2, result.output
        assert f"recommendation.evidence.{key}" in result.output and len(result.output.strip().splitlines()) == 1


def test_module_histograms_that_do_not_add_up_to_the_trace_are_refused(gradient_error_dict, tmp_path):
    """Before: show, recommend and schedule exit 0 on 10^9 module values against the trace's few; compare refused."""
    d = copy.deepcopy(gradient_error_dict)
    module = next(m for m in d["modules"] if m["kind"] == "activation_grad")
    bins = module["histogram"]["bins"]
    first = next(iter(bins))
    bins[first] += 10**9
    for command in ("show", "recommend", "schedule"):
        result = _run(command, _write(tmp_path, d))
        assert result.exit_code == 2, (command, result.output)
        assert "do not add up to its per-step trace" in result.output
    assert _run("show", _write(tmp_path, gradient_error_dict)).exit_code == 0


def test_module_names_in_prose_are_whole_not_cut():
    """Before: ``worst gpt_neox.….weight``: the one place a user is told what to change named nothing findable."""
    from fp16probe.presentation.answer import fit_name, recommendation_summary, wrap_text

    name = "gpt_neox.layers.11.attention.query_key_value." + "very_long_part_" * 8 + ".weight"
    rec = Recommendation(
        verdict=Verdict.CONSTANT, format="fp16", log2_scale=10, scale=1024.0, grad_scaler_kwargs={},
        flushed_fraction_at_1=0.1, flushed_fraction_at_scale=0.0, overflow_steps_at_scale=0, headroom_bits=3,
        worst_modules=[(name, 0.5)], evidence={}, thresholds={}, citations=())
    for width in (40, 80):
        text = recommendation_summary(rec, width)
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
        assert name in "".join(line.strip() for line in text.splitlines())
    assert "".join(fit_name(name, 30, whole=True)) == name and max(map(len, fit_name(name, 30, whole=True))) <= 30
    assert name in "".join(line.strip() for line in wrap_text(f"keep {name} in fp32", 30))


def test_zero_width_and_tag_characters_in_names_are_shown_escaped(gradient_error_dict, tmp_path):
    from fp16probe.presentation import escape

    assert escape.text("a\u200bb\u2060c\U000e0041d") == "a\\u200bb\\u2060c\\U000e0041d"
    d = copy.deepcopy(gradient_error_dict)
    d["metadata"]["model_class"] = "Net\u200b\u2060\U000e0041"
    result = _run("show", _write(tmp_path, d))
    assert result.exit_code == 0 and "Net\\u200b\\u2060\\U000e0041" in result.output
    assert not re.search("[\u200b\u2060\U000e0000-\U000e007f]", result.output)
