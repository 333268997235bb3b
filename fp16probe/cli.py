"""The ``fp16probe`` command line: profile, show, recommend, compare.

Human output goes to stderr through rich (see :mod:`fp16probe.presentation.terminal`); ``--json`` puts
machine output alone on stdout. Exit codes are stable and documented in the README:
0 fine, 1 a gate failed, 2 bad usage or input, 3 the model could not be loaded, its loading
was refused, or it failed while running (on any rank), 4 an internal error, 129 hung up
(SIGHUP), 130 interrupted (Ctrl-C) and 143 terminated (SIGTERM); after 129, 130, 143 or a
failure part-way, a partial report is written (see docs/faults.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, get_args

import typer
import typer.core

from fp16probe.errors import Fp16ProbeError, InputError, ModelError, ModelLoadError, message_of
from fp16probe.validation import SCALER_DEVICES

if TYPE_CHECKING:
    from fp16probe.blockadvice import BlockAdvice


class _Deferred:
    """A name of a module that imports torch, imported on first use, so --help starts fast.

    ``fp16probe --help`` (and a usage error) then needs only typer; the report and the
    number formats (whose bounds come from ``torch.finfo``) load when a command runs.
    """

    def __init__(self, module: str, name: str) -> None:
        self._where = (module, name)

    def _target(self) -> Any:
        import importlib

        module, name = self._where
        return getattr(importlib.import_module(module), name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._target(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)


Report: Any = _Deferred("fp16probe.report", "Report")
atomic_write_text: Any = _Deferred("fp16probe.report", "atomic_write_text")
append_text: Any = _Deferred("fp16probe.report", "append_text")

__all__ = [
    "EXIT_GATE", "EXIT_HANGUP", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_LOAD", "EXIT_OK", "EXIT_TERMINATED", "EXIT_USAGE",
    "PARAMETER_FLAGS", "app", "main",
]

EXIT_OK = 0
EXIT_GATE = 1
EXIT_USAGE = 2
EXIT_LOAD = 3
EXIT_INTERNAL = 4
EXIT_HANGUP = 129  # 128 + SIGHUP: the terminal or ssh session closed
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended

DEFAULT_OUT = Path("fp16probe-report.json")

class _OneLineErrors(typer.core.TyperGroup):
    """Report usage errors (unknown option, bad value, missing argument) as one ``error:`` line.

    Typer would draw a multi-line box with a usage header; the README promises one line
    on stderr and exit code 2 for every bad input, so scripts can read it.
    """

    def main(self, args: Any = None, prog_name: Any = None, complete_var: Any = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        _COMMAND_STARTED.clear()
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if code == EXIT_INTERRUPTED and not _COMMAND_STARTED:
                # Ctrl-C while typer parsed the command line: it exits 130 without a word.
                from fp16probe.presentation.terminal import make_console, print_error

                print_error(make_console(), "interrupted")
        except _CLICK_EXCEPTION as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()  # bare ``fp16probe``: its help is the answer, not an error line
            else:
                from fp16probe.presentation.terminal import make_console, print_error

                where = e.ctx.command_path if getattr(e, "ctx", None) is not None else "fp16probe"
                message = " ".join(e.format_message().split()).rstrip(".")
                print_error(make_console(), f"{message}; see '{where} --help'")
            code = e.exit_code
        if standalone_mode:
            sys.exit(code or 0)
        return code


# Set when a command's own error handling took over (it then says why it stops).
_COMMAND_STARTED: list[bool] = []
_RUN_AS_PROCESS: list[bool] = []  # main() runs a command as the whole process, which exits after it (not CliRunner)

# typer vendors click from 0.2x on and uses the real one before: take the class it raises.
_CLICK_EXCEPTION = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


app = typer.Typer(
    cls=_OneLineErrors,
    name="fp16probe",
    help="Measure whether FP16 training loses gradients to underflow, where, and what loss scale fixes it.",
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

def _print_version(value: bool) -> None:
    if value:
        from fp16probe._version import __version__

        sys.stdout.write(f"fp16probe {__version__}\n")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Measure whether FP16 training loses gradients to underflow, where, and what loss scale fixes it."""


# The choices of the options that take one, spelled here so that --help needs no torch;
# tests/test_cli_help.py checks the formats and kinds against fp16probe.formats.FORMATS and fp16probe.report.KINDS.
FormatName = Literal["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
# The scaled formats only `profile` and `show` take (their statistics are captured on the run itself);
# tests/test_blockformats.py checks them against fp16probe.formats.SCALED_FORMATS.
ProfileFormatName = Literal[FormatName, "mxfp8_e4m3", "mxfp8_e5m2", "nvfp4"]
Kind = Literal["all", "activation_grad", "weight_grad"]  # all: every gradient the loss scale multiplies
FORMAT_NAMES = get_args(FormatName)
BLOCK_FORMAT_NAMES = get_args(ProfileFormatName)[len(FORMAT_NAMES):]


FormatOpt = Annotated[Optional[FormatName], typer.Option(
    "--format", "-f", help="Target number format (default: the one the report was judged for; profile: fp16, "
                           "or bf16 with --precision bf16).")]
KindOpt = Annotated[Optional[Kind], typer.Option(
    "--kind", help="Which gradients to analyse (default: the report's own choice, else all).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON alone on stdout.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
ExplainOpt = Annotated[bool, typer.Option("--explain", help="After the short answer, the reasoning, evidence, replay and sources.")]
ReportArg = Annotated[Path, typer.Argument(help="A report written by fp16probe profile.", dir_okay=False)]


# The library's errors name the parameter they are about (``e.parameter``, spelled ``input_shape=...``
# in the message); the command line speaks of its flags. Each parameter of fp16probe.profile,
# its helpers and ProfileRequest -> its flag.
PARAMETER_FLAGS = {
    "batches": "--batches", "device": "--device", "format": "--format", "granularity": "--granularity",
    "input_dtype": "--input-dtype", "input_shape": "--input-shape", "kind": "--kind", "loss": "--loss",
    "loss_fn": "--loss", "objective": "--objective", "loss_scale": "--loss-scale", "lr": "--lr", "modules": "--modules",
    "optimizer": "--optimizer", "plot": "--plot", "precision": "--precision", "recipe": "--recipe",
    "scaler": "--loss-scale", "seed": "--seed", "steps": "--steps", "trust_checkpoint": "--trust-checkpoint",
    "trust_remote_code": "--trust-remote-code", "verify": "--verify", "target": "--target", "trial": "--trial",
    "vocab_size": "--vocab-size", "weights": "--weights",
}


@contextlib.contextmanager
def _errors(console: Any, debug: bool, stopped: str = "") -> Iterator[None]:
    """Turn errors into one line on stderr and a stable exit code; ``stopped`` says what a signal cut short."""
    from fp16probe.presentation.terminal import print_error

    from fp16probe.running.signals import Hangup, Terminated

    _COMMAND_STARTED.append(True)
    try:
        yield
    except typer.Exit:
        raise
    except KeyboardInterrupt as e:
        what, code = (("hung up (SIGHUP)", EXIT_HANGUP) if isinstance(e, Hangup)
                      else ("terminated (SIGTERM)", EXIT_TERMINATED) if isinstance(e, Terminated)
                      else ("interrupted", EXIT_INTERRUPTED))
        print_error(console, what + stopped)
        raise typer.Exit(code) from None
    except SystemExit as e:  # user code (a factory, a loss) called sys.exit: never a silent success
        _fail(console, f"user code called sys.exit({e.code!r}) while fp16probe was loading or running it; "
              "a factory or loss must return, not exit", EXIT_LOAD, debug, print_error)
    except (ModelLoadError, ModelError) as e:
        _fail(console, e.spelled(PARAMETER_FLAGS), EXIT_LOAD, debug, _quiet(e, print_error))
    except Fp16ProbeError as e:  # ReportError, InputError, UnknownFormatError, ProbeError
        _fail(console, e.spelled(PARAMETER_FLAGS), EXIT_USAGE, debug, _quiet(e, print_error))
    except Exception as e:
        _fail(
            console,
            f"internal error {type(e).__name__}: {message_of(e)}; rerun with --debug and report it",
            EXIT_INTERNAL, debug, print_error,
        )


def _quiet(e: Fp16ProbeError, print_error: Any) -> Any:
    """``print_error``, or nothing on a rank whose error rank 0 prints for the whole run."""
    return (lambda console, message: None) if e.reported_elsewhere else print_error


def _fail(console: Any, message: str, code: int, debug: bool, print_error: Any) -> None:
    if debug:
        traceback.print_exc(file=sys.stderr)
    print_error(console, message)
    raise typer.Exit(code)


def _load_checked(path: Path) -> Report:
    """Load a report and refuse one whose module histograms do not add up to its trace (as compare does)."""
    from fp16probe.analysis.gate import check_consistency

    report = Report.load(path)
    check_consistency(report, str(path))
    return report


def _judged(report: Report, format: Any, kind: Any) -> tuple[str, str, Any]:
    """Return the format and kind to judge ``report`` for (the flags, else the report's own) and the Recommendation."""
    from fp16probe.analysis.effect import judge_report
    from fp16probe.analysis.recommend import target_of

    fmt, knd = target_of(report, format, kind)
    return fmt, knd, judge_report(report, fmt, kind=knd)  # the emulated step's judgement kept, when it applies


def _stored_format(report: Report) -> str:
    """The format a report was made for: its recommendation's, its scaled-format advice's, else its precision's."""
    from fp16probe.analysis.recommend import target_of

    advice = report.block_advice
    if report.recommendation is None and advice is not None and advice.format in BLOCK_FORMAT_NAMES:
        return advice.format
    return target_of(report)[0]


def _check_output(path: Path, option: str, inputs: Sequence[Path] = (), *, figure: bool = False,
                  writable: bool = False) -> None:
    """Refuse, before any work, an output path that is a folder, lies under a file, is one of ``inputs``
    or inside an input folder, is not a figure file (``figure``) or cannot be written (``writable``)."""
    if path.is_dir():
        raise InputError(f"{option} {path} is a folder; expected a file path, e.g. one inside that folder")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{option} {path}: {parent} is a file, not a folder; choose another output path")
    for p in inputs:
        try:
            same = p.exists() and (path.resolve() == p.resolve()
                                   or (p.is_dir() and path.resolve().is_relative_to(p.resolve())))
        except OSError:
            same = False
        if same:
            raise InputError(f"{option} {path} would overwrite the input {p}; choose another output path")
    if figure:
        from fp16probe.presentation import figures

        figures.check_figure_path(path)
    if writable:
        _check_writable(path, option)


@contextlib.contextmanager
def _writing(path: Path, option: str) -> Iterator[None]:
    """Turn a failed write (read-only place, full disk) into one line that names the option."""
    try:
        yield
    except OSError as e:
        raise InputError(
            f"{option} {path}: cannot write it ({e.strerror or type(e).__name__}); choose a writable path"
        ) from e


@app.command()
def profile(
    model: Annotated[Optional[str], typer.Argument(
        help="package.module:factory, a Hugging Face folder, a .pt2 archive, or a pickled module. "
             "Omit for the built-in demo. Safe without flags (no code from the file runs): state_dicts, "
             ".safetensors, Hugging Face folders, .pt2 archives of tensors and operators; a pickled module or "
             "a .pt2 that needs pickle runs code and needs --trust-checkpoint, folder code --trust-remote-code.")] = None,
    weights: Annotated[Optional[Path], typer.Option(help="state_dict for an import-string MODEL: .pt/.pth, .safetensors or Lightning .ckpt.")] = None,
    trust_checkpoint: Annotated[bool, typer.Option("--trust-checkpoint", help="Allow unpickling (runs code from the file).")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow a Hugging Face folder's own model code.")] = False,
    input_shape: Annotated[Optional[str], typer.Option(help="Shape of synthetic inputs, e.g. 8,64 (token models: batch,seq).")] = None,
    input_dtype: Annotated[Literal["float32", "float16", "bfloat16", "int64", "int32"], typer.Option(help="dtype of synthetic inputs.")] = "float32",
    vocab_size: Annotated[Optional[int], typer.Option(min=1, help="Range of synthetic integer ids (default: the model config's).")] = None,
    batches: Annotated[Optional[str], typer.Option(help="package.module:function returning an iterable of real batches.")] = None,
    loss: Annotated[Optional[str], typer.Option(help="A built-in loss (cross_entropy, nll, bce_with_logits, mse, l1, smooth_l1: against the batch's targets, else random ones) or package.module:function(output, batch) returning a scalar. Default: the model family's own loss (see the README).")] = None,
    objective: Annotated[Optional[Literal["grpo", "ppo"]], typer.Option(help="An RL post-training loss instead of the model's own, for a causal LM: before the run, completions are sampled from the model (the first half of each batch's token ids as prompts, 4 completions each), then each step takes the clipped policy-gradient loss on them (grpo: group-normalised advantages, k3 KL x 0.001; ppo: the batch's mean reward as baseline), with synthetic rewards (docs/rl.md).")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Forward+backward passes to profile.")] = 10,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option(help="Where to run.")] = "auto",
    precision: Annotated[Literal["fp32", "fp16", "bf16"], typer.Option(help="fp32 reference, or autocast fp16/bf16.")] = "fp32",
    loss_scale: Annotated[Optional[float], typer.Option(help="Loss scale S for fp16/bf16 runs (GradScaler init_scale).")] = None,
    optimizer: Annotated[Literal["none", "sgd", "adam", "adamw"], typer.Option(help="Train with this optimizer (default: weights unchanged).")] = "none",
    lr: Annotated[float, typer.Option(help="Learning rate for --optimizer.")] = 1e-3,
    format: Annotated[Optional[ProfileFormatName], typer.Option("--format", "-f", help="Target number format (default: fp16, or bf16 with --precision bf16). fp8_e4m3, fp8_e5m2, mxfp8_e4m3, mxfp8_e5m2 and nvfp4 also capture the scaled-format statistics and print per-layer advice (docs/block-formats.md).")] = None,
    recipe: Annotated[Optional[str], typer.Option(help="For a scaled --format, the recipe to judge: fp8: current (default), delayed[:history_len[:margin[:max|most_recent]]], rowwise, blockwise; mxfp8: rceil (default), floor, ceil, even; nvfp4: torchao (default), cast, 16x16.")] = None,
    kind: KindOpt = None,
    granularity: Annotated[Literal["module", "op"], typer.Option(help="module: each hooked module's output gradient; op: every differentiable op's output inside them (F.gelu, residual adds, softmax).")] = "module",
    modules: Annotated[Optional[list[str]], typer.Option("--modules", "-m", metavar="PATTERN", help="Module name patterns to hook (repeatable), e.g. 'encoder.*'.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Where to write the report (JSON, atomically).")] = DEFAULT_OUT,
    plot: Annotated[Optional[Path], typer.Option(help="Also save figures of the report to this file.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for synthetic inputs and labels, and for torch's own random numbers (a factory's initialisation, dropout), so a run repeats exactly.")] = 0,
    verify: Annotated[bool, typer.Option("--verify", help="Then run the recommended setting for real (fp16 autocast with the recommended scaler, same steps and batches; .half() for a model that came in fp16) and report predicted against measured.")] = False,
    target: Annotated[Optional[Literal["cuda", "cpu"]], typer.Option(help="Whose fp16 autocast rules the prediction applies: cuda (default; cpu with --verify on a CPU) or cpu. --target cuda --verify on a CPU checks the CUDA prediction on an emulated CUDA step.")] = None,
    trial: Annotated[Optional[int], typer.Option(metavar="STEPS", help="Then train copies of the model from the same weights for STEPS optimizer steps in fp32 and in the answer's format with its GradScaler (the target's autocast on its own device, else the emulated target step), over 3 data orders of the profiled batches, and say whether the low-precision loss stays inside fp32's seed band. Costs STEPS x 3 x 2 training steps; the model is not changed.")] = None,
    json_out: JsonOpt = False,
    explain: ExplainOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run N forward+backward steps of MODEL under the probe, analyse, and write the report."""
    if not json_out and sys.stderr.isatty() and os.environ.get("RANK", "0") == "0":
        # Said before torch and the model load (seconds): a terminal is never silent.
        sys.stderr.write(f"loading {model or 'the built-in demo model'}...\n")
        sys.stderr.flush()
    from fp16probe.presentation import terminal as render
    from fp16probe.running.profile import profile_request
    from fp16probe.running.request import ProfileRequest
    from fp16probe.running.signals import stop_signals
    from fp16probe.running.thirdparty import held_back

    console = render.make_console()
    # stop_signals: a second Ctrl-C never aborts the partial report; one before the first step leaves none
    with _errors(console, debug, " before the first step finished; no report written"), stop_signals() as shield:
        if _RUN_AS_PROCESS:  # it exits right after the block: a stop signal then (torchrun's SIGTERM once
            shield.keep()  # another rank exits, a late SIGHUP) is ignored, not left to kill it after its report
        # Refused before the model loads or runs; the files behind module:function inputs are inputs too.
        _check_profile_outputs(model, weights, out, plot, batches=batches, loss=loss)
        request = ProfileRequest(
            model=model, weights=weights, trust_checkpoint=trust_checkpoint, trust_remote_code=trust_remote_code,
            input_shape=input_shape, input_dtype=input_dtype, vocab_size=vocab_size, batches=batches, loss=loss,
            objective=objective, steps=steps, device=device, precision=precision, loss_scale=loss_scale,
            optimizer=None if optimizer == "none" else optimizer, lr=lr, format=format, kind=kind or "all",
            granularity=granularity, modules=tuple(modules or ()), seed=seed, verify=verify, target=target,
            recipe=recipe, plot=plot, trial=trial)
        # What torch, transformers and torchao write while they load and run the model is held back
        # and counted in one line (--debug lets it through): a right answer or a refusal stands alone.
        with held_back(enabled=not debug) as held:
            try:
                report = profile_request(
                    request, on_notes=None if json_out else lambda notes: _print_notes(console, notes),
                    progress=lambda total, main: render.progress(console, total, enabled=not json_out and main))
            except Fp16ProbeError as e:
                if e.report is None:
                    raise
                raise _with_partial_report(e, out) from e
        if report is None:  # a rank other than 0: rank 0 writes and prints
            raise typer.Exit(shield.exit_code or EXIT_OK)
        if held.lines and not json_out:
            _print_notes(console, [f"{held.lines} line(s) of third-party warnings and logs held back "
                                   f"({', '.join(held.sources) or 'printed'}); --debug shows them"])
        _report_out(console, report, request, out, json_out=json_out, explain=explain)
    # A signal that came after the loop (while the report was made and written) still says so.
    raise typer.Exit(_exit_code(report) or shield.exit_code or EXIT_OK)


def _code_files(specs: dict[str, Optional[str]]) -> list[Path]:
    """The source files behind ``module:function`` inputs, found without running them (an output must not replace one)."""
    from fp16probe.running.loading import module_file

    files = []
    for spec in specs.values():
        if spec and ":" in spec and not Path(spec).exists():
            found = module_file(spec.split(":", 1)[0])
            if found is not None:
                files.append(found)
    return files


def _check_profile_outputs(model: str | None, weights: Path | None, out: Path, plot: Path | None, *,
                           batches: str | None, loss: str | None) -> None:
    """Refuse an output that is a folder, an input (the files behind module:function inputs too),
    unwritable, or (figures) of an unknown type."""
    inputs = [Path(model)] if model and Path(model).exists() else []
    if weights is not None:
        inputs.append(weights)
    inputs += _code_files({"MODEL": model, "--batches": batches, "--loss": loss})
    _check_output(out, "--out", inputs, writable=True)
    if plot is not None:
        _check_output(plot, "--plot", [*inputs, out], figure=True, writable=True)
        _check_distinct({"--out": out, "--plot": plot})


def _check_distinct(outputs: Mapping[str, Any]) -> None:
    """Refuse two output options naming one file (before it exists too): the second write would replace the first."""
    seen: dict[Path, str] = {}
    for option, p in outputs.items():
        if not p:
            continue
        key = Path(p).resolve()
        if key in seen:
            raise InputError(f"{option} {p} is also the {seen[key]} file: one would replace the other; "
                             f"give {option} another path")
        seen[key] = option


def _print_notes(console: Any, notes: list[str]) -> None:
    for note in notes:  # what loading and the inputs changed: said now, and kept in the report
        console.print(f"note: {note}", markup=False, highlight=False)


def _with_partial_report(e: Fp16ProbeError, out: Path) -> Fp16ProbeError:
    """A failure part-way keeps the steps before it: write them and say where."""
    with _writing(out, "--out"):
        e.report.save(out)
    return type(e)(f"{e}; the {e.report.metadata.steps_seen} step(s) before it are in the partial report {out}",
                   e.parameter)


def _report_out(console: Any, report: Report, request: Any, out: Path, *, json_out: bool, explain: bool) -> None:
    """Write the report (and its figures), then print it: JSON alone on stdout, else the summary or per-layer answer."""
    from fp16probe.presentation import terminal as render

    with _writing(out, "--out"):
        report.save(out)
    if request.plot is not None:
        with _writing(request.plot, "--plot"):
            _save_figures(report, request.plot, recommendation=report.recommendation, format=request.format,
                          kind=request.kind)
    if json_out:
        sys.stdout.write(report.to_json() + "\n")
    else:
        render.print_answers(console, report, report.recommendation, report.block_advice, kind=request.kind,
                             explain=explain, out=str(out))


def _save_figures(report: Report, path: Path, **options: Any) -> None:
    """Draw the figures into a temporary file beside ``path``, then rename it: a full disk never truncates the old one."""
    from fp16probe.outputs import output_target
    from fp16probe.presentation import figures

    target = output_target(path)
    if target.in_place:  # a FIFO or a device: written where it is, never replaced
        figures.save_figures(report, path, **options)
        return
    path = target.path  # through a symlink, its target is replaced
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # same extension: same file type
    try:
        figures.save_figures(report, tmp, **options)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _exit_code(report: Report) -> int:
    """0 for a whole run; the interruption's code for a partial one; 1 when a verification did not hold or the
    training trial left fp32's band at settings the verdict called fine."""
    stopped = None if report.workload is None else report.workload.stopped
    codes = {"interrupted": EXIT_INTERRUPTED, "terminated": EXIT_TERMINATED, "hangup": EXIT_HANGUP}
    if stopped in codes:
        return codes[stopped]
    if report.verification is not None and not report.verification.held:
        return EXIT_GATE
    from fp16probe.analysis.trial import HURT_UNSEEN, report_agreement

    if report_agreement(report) == HURT_UNSEEN:
        return EXIT_GATE
    return EXIT_OK


def _check_writable(path: Path, option: str) -> None:
    """Refuse, before the run, an output that cannot be written: create and remove a file beside it."""
    from fp16probe.outputs import output_target

    try:
        target = output_target(path)
        if target.in_place:  # a device, a FIFO or our own descriptor: written in place, nothing made beside it
            if target.fd is None and not os.access(target.path, os.W_OK):
                raise PermissionError(13, "Permission denied")
            return
        path = target.path
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        fd, probe = tempfile.mkstemp(prefix=".fp16probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write there ({e.strerror or type(e).__name__}); "
                         "choose a writable path") from e


@app.command()
def show(
    report: ReportArg,
    format: Annotated[Optional[ProfileFormatName], typer.Option("--format", "-f", help="Target number format (default: the one the report was made for); the scaled ones (mxfp8_e4m3, mxfp8_e5m2, nvfp4, and fp8_* with their statistics) need a report profiled with that --format.")] = None,
    recipe: Annotated[Optional[str], typer.Option(help="For a scaled --format, the recipe to judge (see profile --help).")] = None,
    kind: KindOpt = None,
    top: Annotated[int, typer.Option(min=1, help="How many worst modules to list.")] = 10,
    json_out: JsonOpt = False,
    explain: ExplainOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a report: the distribution against the format's bounds, worst modules, verdict and evidence."""
    from fp16probe.presentation import terminal as render

    console = render.make_console()
    with _errors(console, debug):
        r = _load_checked(report)
        wanted = format or _stored_format(r)
        advice = _block_advice(r, wanted, recipe)
        rec = None
        if wanted not in BLOCK_FORMAT_NAMES:  # MXFP8, NVFP4: no loss scale to analyse, the per-layer answer alone
            fmt, knd, rec = _judged(r, wanted, kind)
        if json_out:
            data = (advice.to_dict() if rec is None and advice is not None
                    else _show_data(r, rec, fmt=fmt, kind=knd, top=top, source=str(report)))
            if rec is not None and advice is not None:
                data["block_advice"] = advice.to_dict()
            sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")
        else:
            render.print_answers(console, r, rec, advice, kind=kind if rec is None else knd, top=top,
                                 distribution=True, explain=explain)


def _block_advice(report: Report, fmt: str, recipe: Optional[str]) -> Optional["BlockAdvice"]:
    """The per-layer scaled-format advice for ``fmt`` from the report's statistics (None for fp16 and bf16)."""
    from fp16probe.analysis.blockformats import advise
    from fp16probe.blockscale import block_stats_of
    from fp16probe.formats import SCALED_FORMATS
    from fp16probe.running.request import check_recipe

    check_recipe(fmt, recipe)
    if fmt not in SCALED_FORMATS:
        return None
    stats = block_stats_of(report)
    if stats is None:
        if fmt in BLOCK_FORMAT_NAMES:
            raise InputError(f"this report has no scaled-format statistics: profile with --format {fmt}")
        return None  # an fp8 report made without them: the histogram analysis alone, as before
    return advise(stats, fmt, recipe)


def _show_data(report: Report, rec: Any, *, fmt: str, kind: str, top: int, source: str) -> dict[str, Any]:
    """What ``show`` prints, as JSON-ready data: metadata, the distribution at S = 1 and at S, worst modules, advice."""
    from fp16probe.analysis.whatif import flushed_fraction, fraction, worst_modules
    from fp16probe.recommendation import jsonable

    h = report.histogram(kind)
    k = rec.log2_scale
    n = h.nonzero_finite
    modules = [report.module(w.name, w.kind) for w in worst_modules(report, fmt, kind=kind, count=top)]
    return jsonable({
        "report": source,
        "format": fmt,
        "kind": kind,
        "metadata": report.metadata.to_dict(),
        **({"sections": report.to_dict()["sections"]} if report.sections else {}),
        "distribution": {
            "values": h.total, "nonzero": n, "zero": h.zero, "inf": h.inf, "nan": h.nan, "max_abs": h.max_abs,
            "flushed_fraction_at_1": flushed_fraction(h, fmt),
            "subnormal_fraction_at_1": fraction(h.subnormal(fmt, 0), n),
            "log2_scale": k,
            "flushed_fraction_at_scale": None if k is None else flushed_fraction(h, fmt, k),
            "bins": {str(e): c for e, c in ((e, h.count(e)) for e in range(h.lowest_exp or 0, (h.highest_exp or -1) + 1)) if c},
        },
        "worst_modules": [
            {"name": m.name, "module_type": m.module_type, "values": m.histogram.total,
             "flushed_fraction_at_1": flushed_fraction(m.histogram, fmt),
             "flushed_fraction_at_scale": None if k is None else flushed_fraction(m.histogram, fmt, k)}
            for m in modules
        ],
        "recommendation": rec.to_dict(),
        "verification": None if report.verification is None else report.verification.to_dict(),
    })


@app.command()
def plot(
    report: ReportArg,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Figure file: .png, .svg or .pdf.", dir_okay=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", hidden=True, dir_okay=False,
                                                   help="The old name of --out, still taken.")] = None,
    format: FormatOpt = None,
    kind: KindOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Draw the report: the Figure 3 view, per-module heatmap, what-if curve and scale timeline."""
    from fp16probe.presentation import terminal as render

    console = render.make_console()
    with _errors(console, debug):
        if out is not None and output is not None and out != output:
            raise InputError(f"--out {out} and --output {output} name two files; --output is the old name of "
                             "--out: give one")
        output = out or output
        if output is None:
            raise InputError("plot needs --out FILE, the figure file (.png, .svg or .pdf), e.g. --out report.png")
        _check_output(output, "--out", [report], figure=True)
        r = _load_checked(report)
        fmt, knd, rec = _judged(r, format, kind)
        with _writing(output, "--out"):
            _save_figures(r, output, recommendation=rec, format=fmt, kind=knd)
        console.print(f"figures written to {output}", markup=False)


@app.command()
def recommend(
    report: ReportArg,
    format: FormatOpt = None,
    kind: KindOpt = None,
    device: Annotated[Optional[str], typer.Option(help="Device for the GradScaler line (default: where the profile ran if not the CPU, else cuda).")] = None,
    json_out: JsonOpt = False,
    explain: Annotated[bool, typer.Option("--explain", help="Also the caveats, reasoning, evidence and sources, and the loss-scale rules replayed over the run's recorded steps (as fp16probe schedule), where the report has them.")] = False,
    debug: DebugOpt = False,
) -> None:
    """Print the recommendation alone, with GradScaler arguments ready to paste (--explain: the evidence)."""
    from fp16probe.presentation import terminal as render

    console = render.make_console()
    with _errors(console, debug):
        if device is not None and device not in SCALER_DEVICES:  # it goes into the code to paste
            raise InputError(f"--device {device!r}: expected a device type GradScaler takes: "
                             f"{', '.join(SCALER_DEVICES)}")
        r = _load_checked(report)
        fmt, knd, rec = _judged(r, format, kind)
        if json_out:
            from fp16probe.presentation.answer import grad_scaler_code, scaler_device

            d = rec.to_dict()
            dev, how = scaler_device(r, device)
            d["grad_scaler_code"] = grad_scaler_code(rec, dev)
            d["grad_scaler_device"] = how
            if explain and r.history is not None:
                from fp16probe.analysis.schedule import judge_schedules
                from fp16probe.presentation.schedule import schedule_dict
                from fp16probe.recommendation import jsonable

                d["schedule"] = jsonable(schedule_dict(judge_schedules(r, fmt, kind=knd)))
            sys.stdout.write(json.dumps(d, indent=2) + "\n")
        else:
            render.print_recommendation(console, rec, r, device, explain=explain)
            if explain and r.history is not None:
                from fp16probe.analysis.schedule import judge_schedules

                render.print_schedule(console, judge_schedules(r, fmt, kind=knd))


@app.command()
def schedule(
    report: ReportArg,
    format: FormatOpt = None,
    kind: KindOpt = None,
    max_flushed: Annotated[float, typer.Option("--max-flushed", help="Flushed share above which a step flushes too much (0.001 = 0.1%).")] = 1e-3,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Replay loss-scale rules over the run's own recorded steps; table and plain-words answer."""
    from fp16probe.analysis.recommend import target_of
    from fp16probe.analysis.schedule import judge_schedules
    from fp16probe.presentation import terminal as render
    from fp16probe.presentation.schedule import schedule_dict
    from fp16probe.recommendation import jsonable

    console = render.make_console()
    with _errors(console, debug):
        r = _load_checked(report)
        fmt, knd = target_of(r, format, kind)
        table = judge_schedules(r, fmt, max_flushed_fraction=max_flushed, kind=knd)
        if r.shadow is not None:  # a live run judged by fp32 reruns: name the verdict's GradScaler too
            from fp16probe.analysis.one_answer import with_verdict_note
            from fp16probe.analysis.recommend import analyze

            table = with_verdict_note(table, analyze(r, fmt, kind=knd))
        if json_out:
            sys.stdout.write(json.dumps(jsonable(schedule_dict(table)), indent=2) + "\n")
        else:
            render.print_schedule(console, table)


@app.command()
def compare(
    baseline: Annotated[Path, typer.Argument(help="The baseline report.", dir_okay=False)],
    current: Annotated[Path, typer.Argument(help="The current report.", dir_okay=False)],
    max_flushed_increase_at_scale: Annotated[float, typer.Option(min=0.0, help="Allowed rise of the share flushed at the deployed scale (the baseline's recommendation, and each run's own); 0.001 = 0.1 point.")] = 0.001,
    max_flushed_increase: Annotated[float, typer.Option(min=0.0, help="Allowed rise of the flushed share at S=1 (0.01 = 1 point).")] = 0.01,
    max_module_increase: Annotated[float, typer.Option(min=0.0, help="Allowed rise of one module's own flushed share at the baseline's scale (0.01 = 1 point).")] = 0.01,
    max_scale_shift: Annotated[int, typer.Option(min=0, help="Allowed move of the recommended scale, in powers of two.")] = 2,
    worst: Annotated[int, typer.Option(min=1, help="How many regressed modules to name.")] = 3,
    allow_new_overflow: Annotated[bool, typer.Option("--allow-new-overflow", help="Do not fail on new overflow.")] = False,
    allow_worse_verdict: Annotated[bool, typer.Option("--allow-worse-verdict", help="Do not fail when the verdict got worse.")] = False,
    require_same_workload: Annotated[bool, typer.Option("--require-same-workload", help="Refuse (exit 2) reports that profiled different models, precisions, inputs or losses, instead of warning.")] = False,
    format: FormatOpt = None,
    kind: KindOpt = None,
    summary: Annotated[Optional[Path], typer.Option(help="Append the Markdown summary to this file (also to $GITHUB_STEP_SUMMARY when set).")] = None,
    junit: Annotated[Optional[Path], typer.Option(help="Write JUnit XML here.")] = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """The CI gate: exit 1 when CURRENT regressed against BASELINE at the scale users deploy."""
    import time

    from fp16probe.analysis import gate
    from fp16probe.presentation import ci
    from fp16probe.presentation.gate import result_dict, warning_text
    from fp16probe.presentation import terminal as render

    console = render.make_console()
    started = time.perf_counter()
    with _errors(console, debug):
        outputs = {"--summary": summary, "--junit": junit, "$GITHUB_STEP_SUMMARY": os.environ.get("GITHUB_STEP_SUMMARY")}
        for option, p in outputs.items():
            if p:
                _check_output(Path(p), option, [baseline, current])
        # the summary is appended to $GITHUB_STEP_SUMMARY and --summary alike: only --junit must stand apart
        _check_distinct({"--summary": summary, "--junit": junit})
        _check_distinct({"$GITHUB_STEP_SUMMARY": outputs["$GITHUB_STEP_SUMMARY"], "--junit": junit})
        thresholds = gate.GateThresholds(
            max_flushed_increase=max_flushed_increase, max_flushed_increase_at_scale=max_flushed_increase_at_scale,
            max_module_increase=max_module_increase, max_scale_shift_bits=max_scale_shift, worst_n=worst,
            fail_on_new_overflow=not allow_new_overflow, fail_on_worse_verdict=not allow_worse_verdict)
        try:
            result = gate.compare_reports(baseline, current, thresholds=thresholds, format=format, kind=kind)
            if require_same_workload and result.warnings:
                raise InputError(f"--require-same-workload: {warning_text(result.warnings[0])}")
        except Fp16ProbeError as e:
            # A report that cannot be judged is an error in CI too: the summary, the JUnit file and
            # the annotations say so, so that no stale or missing file reads as a pass.
            _write_gate_outputs(outputs, ci.error_markdown(str(e)), ci.error_junit(str(e), seconds=time.perf_counter() - started),
                                [ci.github_error_annotation(str(e))], json_out)
            raise
        _write_gate_outputs(outputs, ci.to_markdown(result), ci.to_junit(result, seconds=time.perf_counter() - started),
                            ci.github_annotations(result), json_out)
        if json_out:
            sys.stdout.write(json.dumps(result_dict(result), indent=2) + "\n")
        else:
            render.print_compare(console, result)
    raise typer.Exit(EXIT_OK if result.passed else EXIT_GATE)


def _write_gate_outputs(outputs: dict[str, Any], markdown: str, junit_xml: str, annotations: list[str],
                        json_out: bool) -> None:
    """Append the Markdown summary, write the JUnit XML (both atomically), print GitHub annotations."""
    targets = {Path(p): option for option, p in outputs.items() if p and option != "--junit"}
    for target, option in targets.items():
        with _writing(target, option):  # appended, as GitHub expects, but never half-written
            append_text(target, markdown)
    junit = outputs.get("--junit")
    if junit is not None:
        with _writing(junit, "--junit"):
            atomic_write_text(junit, junit_xml)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        # Workflow commands go to stdout, where GitHub reads them, unless --json owns stdout.
        stream = sys.stderr if json_out else sys.stdout
        for line in annotations:
            stream.write(line + "\n")


@app.command()
def export(
    report: ReportArg,
    dest: Annotated[Optional[str], typer.Argument(
        help="TensorBoard: the log folder. wandb: the folder for its files (WANDB_MODE=offline keeps "
             "them local). MLflow: a tracking URI or a folder (default: MLflow's own setting).")] = None,
    to: Annotated[Literal["tensorboard", "wandb", "mlflow"], typer.Option("--to", help="The tracker to write to.")] = "tensorboard",
    modules: Annotated[bool, typer.Option("--modules", help="Also log each module's histogram.")] = False,
    name: Annotated[Optional[str], typer.Option("--name", help="Run name (wandb, MLflow).")] = None,
    project: Annotated[str, typer.Option("--project", help="wandb project / MLflow experiment.")] = "fp16probe",
    format: FormatOpt = None,
    kind: KindOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Log a report's histograms and scalars to TensorBoard, wandb or MLflow."""
    from fp16probe.presentation import terminal as render
    from fp16probe.presentation.trackers import export as export_report

    console = render.make_console()
    with _errors(console, debug):
        if to == "tensorboard" and dest is None:
            raise InputError("export --to tensorboard needs DEST, the log folder, e.g. runs/fp16probe")
        r = Report.load(report)
        from fp16probe.analysis.recommend import target_of

        fmt, _ = target_of(r, format, "all")
        where = export_report(r, to=to, dest=dest, format=fmt, kind=kind or "activation_grad", modules=modules,
                              run_name=name, project=project)
        console.print(f"exported {r.metadata.steps_seen} step(s) to {to}: {where}", markup=False)


def main() -> None:
    """Entry point of the ``fp16probe`` console script."""
    _RUN_AS_PROCESS.append(True)
    try:
        app(prog_name="fp16probe")
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C before a command took over its signals (typer builds the
        sys.stderr.write("error: interrupted\n")  # command line from the annotations first)
        sys.exit(EXIT_INTERRUPTED)
