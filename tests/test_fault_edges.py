"""The smaller faults: code files as inputs, partial reports at the gate, forged step counts,
control characters in error lines, meta-device models and merges of unequal runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fp16probe import Probe
from fp16probe.cli import EXIT_GATE, EXIT_OK, EXIT_USAGE
from fp16probe.errors import InputError, ProbeError, ReportError
from fp16probe.report import Report
from tests.fixtures.cli import one_error_line, prepare_cli_env, run

MODULE = '''
import torch
from torch import nn

def small():
    torch.manual_seed(0)
    return nn.Linear(8, 4)

def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        yield torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)

def loss(output, batch):
    return nn.functional.mse_loss(output, batch[1])
'''


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    prepare_cli_env(monkeypatch, tmp_path)


@pytest.mark.parametrize("flag,spec,victim", [
    ("--out", "MODEL", "mymodel.py"),
    ("--out", "--batches", "mydata.py"),
    ("--out", "--loss", "myloss.py"),
    ("--plot", "MODEL", "pkg/net.py"),
])
def test_an_output_onto_the_code_behind_an_import_string_is_refused_before_the_run(flag, spec, victim, monkeypatch):
    import fp16probe.running.profile as running_profile

    Path("pkg").mkdir()
    Path("pkg/__init__.py").write_text("")
    for name in ("mymodel.py", "mydata.py", "myloss.py", "pkg/net.py"):
        Path(name).write_text(MODULE)
    specs = {"MODEL": "mymodel:small", "--batches": "mydata:batches", "--loss": "myloss:loss"}
    if victim == "pkg/net.py":
        specs["MODEL"] = "pkg.net:small"
    monkeypatch.setattr(running_profile, "run_profile", lambda *a, **k: pytest.fail("ran before checking"))
    out = ["--out", victim] if flag == "--out" else ["--out", "r.json", "--plot", victim]
    result = run("profile", specs["MODEL"], "--batches", specs["--batches"], "--loss", specs["--loss"],
                 "--steps", "2", *out)
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith(f"error: {flag} {victim} would overwrite the input ")
    assert Path(victim).read_text() == MODULE


def _reports() -> tuple[Path, Path]:
    whole = ["cli_models:TinyMLP", "--batches", "cli_models:tiny_batches", "--loss", "cli_models:mse_loss"]
    assert run("profile", *whole, "--steps", "4", "--out", "whole.json").exit_code == EXIT_OK
    partial = run("profile", "cli_models:TinyMLP", "--batches", "cli_models:interrupting_batches",
                  "--loss", "cli_models:mse_loss", "--steps", "5", "--out", "partial.json")
    assert partial.exit_code == 130, partial.output
    return Path("whole.json"), Path("partial.json")


def test_compare_warns_on_a_partial_report_and_require_same_workload_refuses_it():
    whole, partial = _reports()
    result = run("compare", whole, partial, "--json")
    assert result.exit_code in (EXIT_OK, EXIT_GATE), result.output
    warnings = json.loads(result.stdout)["warnings"]
    assert any(w.startswith("the current report is partial: the run stopped early (interrupted) after 3 of 5 step(s)")
               for w in warnings), warnings
    refused = run("compare", whole, partial, "--require-same-workload")
    assert refused.exit_code == EXIT_USAGE, refused.output
    assert one_error_line(refused).startswith("error: --require-same-workload: the current report is partial")
    assert run("compare", whole, whole, "--require-same-workload").exit_code == EXIT_OK


def test_a_steps_seen_that_disagrees_with_the_trace_is_refused():
    whole, _ = _reports()
    data = json.loads(whole.read_text())
    data["metadata"]["steps_seen"] = 10**6
    Path("forged.json").write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"metadata.steps_seen is 1000000 but the trace holds 4 step\(s\)"):
        Report.load("forged.json")
    result = run("show", "forged.json")
    assert result.exit_code == EXIT_USAGE
    assert "metadata.steps_seen is 1000000" in one_error_line(result)


def test_control_characters_in_a_path_cannot_split_or_forge_the_error_line():
    result = run("show", "bad\nerror: forged.json")
    assert result.exit_code == EXIT_USAGE
    line = one_error_line(result)  # one line, though the name holds a newline
    assert "bad\\nerror: forged.json" in line
    result = run("show", "tab\tand\x1b[31mred.json")
    assert "tab\\tand\\x1b[31mred.json" in one_error_line(result)


def test_a_probe_on_a_meta_device_model_is_refused_in_one_line():
    with torch.device("meta"):
        model = nn.Linear(8, 4)
    with pytest.raises(ProbeError, match="meta device") as e:
        Probe(model)
    assert "\n" not in str(e.value)


def test_merging_ranks_of_unequal_step_counts_is_the_projects_own_error():
    def report_of(steps: int) -> Report:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        with Probe(model) as probe:
            for _ in range(steps):
                model(torch.randn(5, 8)).pow(2).mean().backward()
                probe.step()
        return probe.report()

    three, two = report_of(3), report_of(2)
    with pytest.raises(InputError, match=r"report 0 holds 3 step\(s\), report 1 2; merge separate runs"):
        three.merge(two, how="ranks")
    assert three.merge(two, how="runs").metadata.steps_seen == 5


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan"])
def test_a_bad_dist_timeout_is_refused_in_one_line(value, monkeypatch):
    monkeypatch.setenv("FP16PROBE_DIST_TIMEOUT", value)
    result = run("profile", "cli_models:TinyMLP", "--input-shape", "5,8", "--steps", "1", "--out", "r.json")
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith(f"error: FP16PROBE_DIST_TIMEOUT={value!r}: expected a number of seconds")


def test_the_settled_error_names_the_failing_rank_and_keeps_its_kind():
    from fp16probe.errors import ModelError
    from fp16probe.running import ranks

    said = ("", "step 3: the forward raised RuntimeError: boom")
    error = ranks.Settled((ranks.OK, ranks.MODEL), (2, 2), said, broken=False).error(0)
    assert isinstance(error, ModelError) and str(error) == f"rank 1: {said[1]}; every rank stopped"
    error = ranks.Settled((ranks.LOST, ranks.INPUT), (2, 2), ("waited", "step 3: the batches raised OSError: x"),
                          broken=False).error(0)
    assert isinstance(error, InputError) and str(error).startswith("rank 1: step 3: the batches raised")
    ran_out = ranks.Settled((ranks.OK, ranks.EXHAUSTED), (2, 2), ("", ""), broken=False).error(0)
    assert isinstance(ran_out, InputError) and str(ran_out).startswith("rank 1: the batches ran out after 2 step(s)")
    assert ranks.Settled((ranks.EXHAUSTED, ranks.EXHAUSTED), (2, 2), ("", ""), broken=False).error(0) is None
    lost = ranks.Settled((ranks.LOST, ranks.LOST), (2, 1), None, broken=True, own="step 3: gloo said so").error(0)
    assert str(lost) == "rank 0 lost contact with rank 1: step 3: gloo said so; rank 0 stopped"


def test_finding_the_code_behind_an_import_string_runs_none_of_it():
    """The check reads the import path; a package's __init__ does not run before the output is refused."""
    Path("pkg2").mkdir()
    Path("pkg2/__init__.py").write_text("open('ran', 'w').close()\n")
    Path("pkg2/net.py").write_text(MODULE)
    result = run("profile", "pkg2.net:small", "--batches", "pkg2.net:batches", "--loss", "pkg2.net:loss",
                 "--steps", "2", "--out", "pkg2/net.py")
    assert result.exit_code == EXIT_USAGE, result.output
    assert one_error_line(result).startswith("error: --out pkg2/net.py would overwrite the input ")
    assert not Path("ran").exists()
    assert Path("pkg2/net.py").read_text() == MODULE


def test_a_discarded_step_leaves_the_closed_steps_as_they_were():
    """What a distributed stop uses: the step another rank never finished is dropped, forward maxima too."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with Probe(model, forward=True) as probe:
        for _ in range(2):
            model(torch.randn(5, 8)).pow(2).mean().backward()
            probe.step()
        kept = probe.report()
        model(torch.randn(5, 8) * 1000).pow(2).mean().backward()  # a step cut short, much larger
        probe.discard_step()
        after = probe.report()
    assert after.metadata.steps_seen == kept.metadata.steps_seen == 2
    assert [m.histogram for m in after.modules] == [m.histogram for m in kept.modules]
    assert after.trace.histograms == kept.trace.histograms
    assert after.to_dict().get("history") == kept.to_dict().get("history")


def test_a_partial_report_says_why_it_stopped_and_how_many_steps_were_asked_for():
    result = run("profile", "faulty_models:fails_at_step_3", "--batches", "cli_models:tiny_batches",
                 "--loss", "cli_models:mse_loss", "--steps", "5", "--out", "r.json")
    assert result.exit_code == 3, result.output
    shown = run("show", "r.json")
    assert shown.exit_code == EXIT_OK, shown.output
    assert "(partial: error)" in shown.output
    assert "The run was stopped by a failure: 2 of 5 requested steps were profiled." in " ".join(shown.output.split())
