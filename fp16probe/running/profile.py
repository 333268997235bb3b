"""``fp16probe.profile``: run N forward+backward steps of a model under a Probe and analyse them.

The one path every entry point takes (the command line through :func:`profile_request`, the
callbacks' notebooks and the benchmark), each with its settings in one checked
:class:`~fp16probe.running.request.ProfileRequest`. Library code: it returns a Report and raises
errors whose ``parameter`` names the parameter (``steps=...``); the command line maps it to its flag.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp16probe.errors import Fp16ProbeError, InputError, ModelError, first_line, message_of
from fp16probe.formats import FORMATS, SCALED_FORMATS, Format, get_format
from fp16probe.recommendation import Verdict
from fp16probe.report import ALL_GRADS, Report
from fp16probe.emulation import Emulation
from fp16probe.sections import TrialEnd, Workload
from fp16probe.running.inputs import (Batches, call_model, check_inputs_before_load, describe_batch, make_batches,
                                      move_to, pick_device)
from fp16probe.running.loading import load_model, quiet_transformers
from fp16probe.running.losses import Loss, as_loss, make_loss
from fp16probe.running.optimizers import OPTIMIZERS, make_optimizer
from fp16probe.running.effect import KEPT_BATCHES, with_effect
from fp16probe.running.request import ProfileRequest
from fp16probe.running.signals import Hangup, Terminated, stop_signals

__all__ = [
    "Hangup",
    "OPTIMIZERS",
    "RunResult",
    "RunSettings",
    "Terminated",
    "conclude",
    "make_optimizer",
    "profile",
    "profile_model",
    "profile_request",
    "run_profile",
]

STOPPED_INTERRUPTED = "interrupted"  # Ctrl-C (KeyboardInterrupt)
STOPPED_TERMINATED = "terminated"  # SIGTERM, as timeout, docker and Kubernetes send
STOPPED_HANGUP = "hangup"  # SIGHUP: the terminal or ssh session closed
STOPPED_ERROR = "error"  # the model, the loss or the batches raised (on this rank or another)

@dataclass(frozen=True)
class RunSettings:
    """How the profiling loop runs."""

    steps: int = 10
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | fp16 | bf16 (the latter two through autocast)
    loss_scale: float | None = None
    optimizer: str | None = None  # None: forward + backward only, weights unchanged
    lr: float = 1e-3


@dataclass(frozen=True)
class RunResult:
    """What the loop did: steps finished, why it stopped early, non-finite losses."""

    steps_done: int
    stopped: str | None = None  # None (ran to the end or out of batches) or a STOPPED_* value
    exhausted: bool = False
    error: Fp16ProbeError | None = field(default=None, repr=False)
    nonfinite_loss_steps: tuple[int, ...] = ()
    losses: tuple[float, ...] = field(default=(), repr=False)
    batches: tuple[Any, ...] = field(default=(), repr=False)  # the batches of the finished steps, when kept
    # With an optimizer: the weights before the last step that updated them, and that
    # step's update (new minus old), for the weight-update check of Micikevicius et al.
    # ("Mixed Precision Training", arXiv:1710.03740).
    weights_before: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    updates: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    # Under torch.distributed: every rank's status and finished steps, when an agreement
    # before backward found another rank stopped (see fp16probe.running.ranks).
    agreed: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, repr=False)

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C, SIGTERM or SIGHUP stopped the run early."""
        return self.stopped in (STOPPED_INTERRUPTED, STOPPED_TERMINATED, STOPPED_HANGUP)


def profile(
    model: nn.Module,
    batches: Iterable[Any] | Batches,
    loss_fn: Callable[[Any, Any], torch.Tensor] | Loss | str | None = None,
    *,
    steps: int = 10,
    precision: str = "fp32",
    scaler: Any = None,
    optimizer: str | torch.optim.Optimizer | None = None,
    lr: float = 1e-3,
    format: str | None = None,
    kind: str = ALL_GRADS,
    device: str | torch.device | None = None,
    on_step: Callable[[int], None] | None = None,
    verify: bool = False,
    extra: Mapping[str, Any] | None = None,
    target: str | None = None,
    recipe: str | None = None,
    trial: int | None = None,
    **probe_options: Any,
) -> Report | None:
    """Profile ``steps`` forward+backward passes of ``model`` and return the analysed Report.

    Args:
        model: the ``nn.Module`` to profile. It is put in train mode, its floating
            parameters are cast to float32 (fp32 master weights, noted in the report) and
            it is moved to ``device``, in place, as ``nn.Module.to`` does.
        batches: an iterable of batches: a tensor is the input, a mapping is keyword
            arguments, a tuple ``(inputs, targets...)`` as a DataLoader yields it. Each batch
            is moved to the model's device. Fewer batches than ``steps`` end the run early.
        loss_fn: ``(output, batch) -> scalar tensor``, or a built-in loss's name
            (``"cross_entropy"``, ``"nll"``, ``"bce_with_logits"``, ``"mse"``, ``"l1"``,
            ``"smooth_l1"``: against the batch's targets, else targets drawn as the task
            would). None uses the model's own ``.loss`` when the output has one, else the
            batch's own targets when they fit the output (cross-entropy for class ids, mean
            squared error for values), else cross-entropy against random labels when the output is class logits
            ``[batch, classes]``, else the mean of squares of its floating outputs; the
            report records which, and marks an invented loss or labels as synthetic.
        steps: forward+backward passes to profile.
        precision: ``"fp32"`` (the unscaled reference a recommendation needs), or
            ``"fp16"``/``"bf16"`` under autocast.
        scaler: with fp16/bf16, a loss scale (a number: ``torch.amp.GradScaler(init_scale=...)``)
            or a GradScaler of your own; the Probe records unscaled gradients either way.
        optimizer: None (weights unchanged), ``"sgd"``/``"adam"``/``"adamw"`` at ``lr``, or a
            torch optimizer over the model's parameters.
        format, kind: what the recommendation is for (default: ``"bf16"`` for a bf16 run, else
            ``"fp16"``; ``"all"`` gradients).
        device: where to run (default: where the model's parameters are).
        on_step: called with the number of finished steps after each step (a progress bar).
        verify: after the recommendation, run it for real (see :func:`fp16probe.verify`) and
            store the result as ``Report.verification``.
        trial: after the recommendation, train copies of the model from the weights it started
            from for this many optimizer steps in fp32 and in the answer's format with its
            GradScaler, over three data orders of the profiled batches (see
            :mod:`fp16probe.running.trial`; cost ``trial x 3 x 2`` training steps), and store the
            loss curves as the report's ``trial`` section (``report.section("trial")``).
        extra: the user's own metadata (``metadata.extra``); the run's description is ``report.workload``.
        recipe: for a scaled format (``fp8_e4m3``, ``fp8_e5m2``, ``mxfp8_e4m3``, ``mxfp8_e5m2``,
            ``nvfp4``), the recipe to judge (see :data:`fp16probe.analysis.blockformats.RECIPES`);
            the statistics are captured on the same pass and the per-layer advice is stored
            as ``report.block_advice``.
        target: the device whose fp16 autocast rules the prediction applies: ``"cuda"``
            (where fp16 training runs) or ``"cpu"``. Default: CUDA, except with ``verify``
            on a CPU, where the prediction checked is the CPU's. Every fp32 profiled step
            also audits the forward pass and the loss as the target run computes them
            (:class:`fp16probe.capture.forward.ForwardAudit`); a model whose parameters came
            in fp16 is predicted as a pure-fp16 (``.half()``) run.
        **probe_options: passed to :class:`fp16probe.Probe` (``modules``, ``granularity``, ...).

    Returns:
        The Report with its recommendation. Under ``torch.distributed`` every rank must
        call it (the model runs under DistributedDataParallel); rank 0 gets the merged
        report and the other ranks None.

    Ctrl-C, SIGTERM or SIGHUP stop the run early and return a partial report
    (``report.metadata.partial``, ``report.workload.stopped``) of the steps finished; with
    none finished, the KeyboardInterrupt (or :class:`Terminated`, :class:`Hangup`) propagates.
    Only the first signal stops the run: later ones, while the report is being made, are
    noted and never abort it (see :mod:`fp16probe.running.signals`). Under torch.distributed
    a rank that fails stops every rank within a bound (``$FP16PROBE_DIST_TIMEOUT``, see
    :mod:`fp16probe.running.ranks`), and every rank raises the failing rank's error. A failure of
    the model, the loss or the batches part-way raises :class:`ModelError` or
    :class:`InputError` naming the step and the exception's own message, with the partial
    report of the steps before it as the error's ``report``.
    """
    request = ProfileRequest(steps=steps, precision=precision, loss_scale=scaler, optimizer=optimizer, lr=lr,
                             format=format, kind=kind, verify=verify, target=target, recipe=recipe, trial=trial)
    return profile_model(request, model, batches, loss_fn, device=device, on_step=on_step, extra=extra,
                         **probe_options)


def profile_model(r: ProfileRequest, model: nn.Module, batches: Iterable[Any] | Batches, loss_fn: Any = None, *,
                  device: str | torch.device | None = None, on_step: Callable[[int], None] | None = None,
                  extra: Mapping[str, Any] | None = None, **probe_options: Any) -> Report | None:
    """Profile ``model`` as :func:`profile` does, with the settings of ``r`` (checked when it was made)."""
    format, precision, scaler, optimizer, verify = str(r.format), r.precision, r.loss_scale, r.optimizer, r.verify
    target = _target_of(r, model, device)
    probe_options = _block_options(format, r.recipe, probe_options)
    regime = _regime_of(model)
    model, dev, notes = prepare_model(model, device)
    if regime == "pure_fp16":
        notes.append("the model came in fp16: profiled in fp32 and predicted as it trains, a .half() run "
                     "(every op and the loss in fp16, no autocast)")
    batch_src = batches if isinstance(batches, Batches) else _as_batches(batches, dev)
    loss = as_loss(loss_fn)
    grad_scaler = _make_scaler(scaler, dev)
    probe = _make_probe(model, grad_scaler, {"target": target, "regime": regime, **probe_options})
    settings = RunSettings(steps=r.steps, device=str(dev), precision=precision,
                           loss_scale=_scale_of(scaler), lr=r.lr,
                           optimizer=optimizer if isinstance(optimizer, str) else None)
    # The shield holds until the report is made: a signal after the last step (the analysis, the emulated step,
    # verify) stops what is left and keeps the finished steps' report, instead of losing it to a KeyboardInterrupt.
    with stop_signals(), callers_grads_set_aside(model):
        result, gather, guard, initial = _run_shielded(r, model, batch_src, loss, settings, probe, grad_scaler,
                                                       on_step=on_step, regime=regime)
        if result.steps_done == 0 or gather == "nothing":
            _nothing_to_report(result, gather, guard, batch_src)
            return None  # rank 0 speaks for the run
        extra, gather = _run_extra(extra, optimizer, gather)
        # The analysis and the emulated step's judgement take the Format, resolved here once.
        fmt: str | Format = get_format(format) if format in FORMATS else format
        report = _finish(probe, result, batch_src, loss, settings, format=fmt, kind=r.kind, notes=notes, extra=extra,
                         gather=gather)
        report = _with_measurements(report, r, model, result, loss, target=target, regime=regime, guard=guard,
                                    fmt=fmt)
        if result.error is not None:
            result.error.report = report
            raise result.error
        _check_hooks_kept(report)
        if verify and report is not None and not report.metadata.partial:
            report = _verified(report, initial, result.batches, loss, dev, target)
        if r.trial and report is not None and not report.metadata.partial and report.recommendation is not None:
            report = _trialled(report, r, initial, result.batches, loss, dev, target, regime, guard is not None)
        return report


@contextlib.contextmanager
def callers_grads_set_aside(model: nn.Module) -> Iterator[None]:
    """Every parameter's ``.grad`` starts as None inside the block; the caller's come back after, by any exit.

    A training loop that ends ``zero_grad(); backward(); step()`` leaves ``.grad`` set. The
    profile's first backward would add to it (a first step's weight gradients recorded as
    1000.27 for a true 0.273), and the loop's own ``zero_grad`` would then drop it. The very
    tensors are put back (as :func:`prepare_model` left them: cast and moved with their parameters).
    """
    kept = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for p, _ in kept:
        p.grad = None
    try:
        yield
    finally:
        for p, g in kept:
            p.grad = g


def _target_of(r: ProfileRequest, model: nn.Module, device: str | torch.device | None) -> str:
    """The device whose autocast rules the prediction applies: the request's, else the CPU's for a verify on one."""
    run_device = torch.device(device) if device is not None else next(
        (p.device for p in model.parameters()), torch.device("cpu")) if isinstance(model, nn.Module) else None
    return r.target or ("cpu" if r.verify and run_device is not None and run_device.type == "cpu" else "cuda")


def _regime_of(model: nn.Module) -> str:
    """How the model trains: ``pure_fp16`` when its parameters came in fp16 (a ``.half()`` run), else ``autocast``."""
    return "pure_fp16" if isinstance(model, nn.Module) and any(
        p.dtype == torch.float16 for p in model.parameters()) else "autocast"


def _run_shielded(r: ProfileRequest, model: nn.Module, batch_src: Batches, loss: Loss, settings: RunSettings,
                  probe: Any, grad_scaler: Any, *, on_step: Callable[[int], None] | None,
                  regime: str) -> tuple[RunResult, Any, Any, nn.Module | None]:
    """Run the loop under the signal shield and, under torch.distributed, the rank guard.

    Returns the result (settled with the other ranks), how to gather the report (see
    :func:`_settle`), the guard (None outside torch.distributed) and, for verify, a copy of the
    model as it was before the run. The shield is disarmed when the loop is over: a second
    Ctrl-C or a SIGTERM no longer aborts the report.
    """
    optimizer, verify, precision = r.optimizer, r.verify, r.precision
    with stop_signals() as shield:
        guard = _rank_guard(model)
        runner = _distributed_runner(model)
        initial = copy.deepcopy(model) if verify or r.trial else None  # the weights before the run, for verify()
        audit = None
        if precision == "fp32":
            from fp16probe.capture.forward import ForwardAudit

            audit = ForwardAudit(model, regime=regime)
            probe.add(audit)
        with probe:
            result = run_profile(runner, batch_src, loss, settings, probe, scaler=grad_scaler, on_step=on_step,
                                 optimizer=optimizer if isinstance(optimizer, torch.optim.Optimizer) else None,
                                 keep_batches=verify or bool(r.trial), audit=audit, guard=guard,
                                 keep_first=KEPT_BATCHES if precision == "fp32" else 0)
        shield.disarm()  # the loop is over: a second Ctrl-C or a SIGTERM no longer aborts the report
        gather: Any = None
        if guard is not None:
            result, gather = _settle(guard, result, probe)
    return result, gather, guard, initial


def _nothing_to_report(result: RunResult, gather: Any, guard: Any, batch_src: Batches) -> None:
    """No step to report on this rank: raise why (the error, the signal, no batch); return on a rank other than 0."""
    if result.error is not None:
        raise result.error
    if gather == "nothing" and guard is not None and guard.rank != 0:
        return  # rank 0 speaks for the run
    if result.stopped == STOPPED_HANGUP:
        raise Hangup()
    if result.stopped == STOPPED_TERMINATED:
        raise Terminated()
    if result.interrupted:
        raise KeyboardInterrupt()
    raise InputError(f"{batch_src.description} yielded no batch; nothing was profiled")


def _run_extra(extra: Mapping[str, Any] | None, optimizer: Any, gather: Any) -> tuple[dict[str, Any], Any]:
    """The report's ``extra`` metadata (the caller's optimizer, rank 0's own steps) and how to gather it."""
    out = dict(extra or {})
    if isinstance(optimizer, torch.optim.Optimizer):  # the caller's own: recorded by class and learning rate
        name = next((k for k, cls in OPTIMIZERS.items() if type(optimizer) is cls), type(optimizer).__name__)
        out.setdefault("optimizer", {"name": name, "lr": optimizer.param_groups[0].get("lr")})
    if isinstance(gather, dict):  # rank 0 alone: what the report holds, and why
        out.update(gather)
        gather = "local"
    return out, gather


def _with_measurements(report: Report | None, r: ProfileRequest, model: nn.Module, result: RunResult, loss: Loss,
                       *, target: str, regime: str, guard: Any, fmt: str | Format) -> Report | None:
    """The report with the scaled formats' per-layer advice and, after a whole fp32 run, the emulated step."""
    if report is not None and report.blocks is not None:
        report = _with_block_advice(report, str(r.format), r.recipe)
    if report is not None and r.precision == "fp32" and guard is None and result.error is None:
        done = report
        report = _unless_stopped(
            lambda: with_effect(done, model, result.batches[:KEPT_BATCHES], loss, target=target, regime=regime,
                                kind=r.kind, fmt=fmt if isinstance(fmt, Format) else None),
            lambda why: done.with_sections({"emulation": Emulation(error=f"stopped: {why}")}))
    return report


def _unless_stopped(work: Callable[[], Report], stopped: Callable[[str], Report]) -> Report:
    """``work()``, a pass after the loop that a stop signal may end (the emulated step, verify); ``stopped(why)``
    instead when a signal came before it started or comes while it runs (``why``: interrupted, terminated, hangup).

    The shield (disarmed since the loop ended) is armed while the pass runs, so SIGTERM ends it at once rather
    than after its last step; it is armed before the check, so no signal falls between the two unseen.
    """
    from fp16probe.running.signals import STOP_SIGNALS, active

    shield = active()
    if shield is None:  # a profile_model called outside profile()'s shield
        return work()
    try:
        shield.armed = True
        if shield.received:  # a signal came while the report was made: the pass does not start
            return stopped(STOP_SIGNALS[shield.received[0]][1])
        return work()
    except KeyboardInterrupt as e:
        return stopped(STOPPED_HANGUP if isinstance(e, Hangup) else
                       STOPPED_TERMINATED if isinstance(e, Terminated) else STOPPED_INTERRUPTED)
    finally:
        shield.disarm()


def _check_hooks_kept(report: Report | None) -> None:
    """Raise ModelError, with the report, when the model removed hooked modules during the run."""
    removed = report.capture.removed_modules if report is not None and report.capture is not None else ()
    if removed:  # the model changed under the hooks: its statistics describe no one model
        error = ModelError(
            f"the model removed {len(removed)} hooked module(s) during the run ({', '.join(map(repr, removed[:3]))}"
            f"{' and more' if len(removed) > 3 else ''}): their statistics cover only the steps before it, so the "
            "verdict does not describe one model; the report is kept with that note. Profile a model whose modules "
            "stay as they are")
        error.report = report
        raise error


Progress = Callable[[int, bool], contextlib.AbstractContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def _no_progress(total: int, main: bool) -> Iterator[Callable[[int], None]]:
    yield lambda done: None


def profile_request(request: ProfileRequest, *, on_notes: Callable[[list[str]], None] | None = None,
                    progress: Progress = _no_progress) -> Report | None:
    """Load, feed and profile what ``request`` names; return the Report (None on ranks other than 0).

    What the command line runs, in the order torchinfo's ``summary()`` reads: resolve the device,
    seed, load, make the inputs and the loss, run. ``on_notes`` hears, on rank 0 before the run,
    what loading and the inputs changed (also kept in the report); ``progress(total, main)`` makes
    the context whose ``update(done)`` is called after each step (``FP16PROBE_DIST_TIMEOUT`` bounds
    torch.distributed's collectives, see docs/faults.md). Errors are :func:`profile`'s.
    """
    from fp16probe.running.ranks import joined_from_env

    with joined_from_env() as is_dist:
        return _profile_request(request, is_dist, on_notes, progress)


def _profile_request(r: ProfileRequest, is_dist: bool, on_notes: Callable[[list[str]], None] | None,
                     progress: Progress) -> Report | None:
    from fp16probe.capture import distributed

    rank = distributed.rank()
    dev = pick_device(r.device)
    if is_dist and dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(r.seed + rank)  # a factory's initialisation and dropout repeat from run to run
    check_inputs_before_load(r.model, dev, input_shape=r.input_shape, input_dtype=r.input_dtype,
                             vocab_size=r.vocab_size, batches=r.batches)
    loaded = load_model(r.model, weights=r.weights, trust_checkpoint=r.trust_checkpoint,
                        trust_remote_code=r.trust_remote_code)
    batch_src = make_batches(loaded, dev, input_shape=r.input_shape, input_dtype=r.input_dtype,
                             vocab_size=r.vocab_size, batches=r.batches,
                             seed=r.seed + rank)  # each rank draws its own synthetic batches
    if r.objective is not None:  # completions sampled now, before the probe is attached
        batch_src, loss_src = _objective_inputs(r, loaded.model, batch_src, dev, seed=r.seed + rank)
    else:
        loss_src = make_loss(loaded, r.loss, batch_src, seed=r.seed + rank)
    notes = [*loaded.notes, *batch_src.notes]
    if on_notes is not None and rank == 0:
        on_notes(notes)
    extra: dict[str, Any] = {"model_kind": loaded.kind, "model_source": loaded.source, "notes": notes,
                             **loaded.extra, **r.extra}
    if batch_src.family is not None:
        extra["family"] = batch_src.family
    if is_dist:
        extra["batches_per_rank"] = ("synthetic inputs seeded with --seed + rank" if batch_src.synthetic
                                     else "each rank ran the batches it was given")
    # a Hugging Face model's warnings (a loss_type it falls back from) would bury the summary
    quiet = quiet_transformers() if loaded.kind == "huggingface" else contextlib.nullcontext()
    with quiet, progress(r.steps, rank == 0) as update:
        return profile_model(r, loaded.model, batch_src, loss_src, device=dev, on_step=update, extra=extra,
                             modules=list(r.modules) or None, granularity=r.granularity)


def _objective_inputs(r: ProfileRequest, model: nn.Module, source: Batches, dev: torch.device, *,
                      seed: int) -> tuple[Batches, Loss]:
    """The RL objective's sampled batches (one per step) and its loss (fp16probe.running.objective)."""
    from fp16probe.running.objective import OBJECTIVES, objective_batches, objective_loss

    objective = OBJECTIVES[str(r.objective)]
    model.to(dev)
    batches, prompt = objective_batches(model, source, objective, r.steps, seed=seed)
    return batches, objective_loss(objective, prompt_tokens=prompt)


def _verified(report: Report, initial: Any, batches: tuple[Any, ...], loss: Loss, dev: torch.device,
              target: str | None = None) -> Report:
    """The report with its verification; a Ctrl-C or signal before or during it keeps the report, marked, without one."""
    from fp16probe.running.verify import verify as run_verification

    return _unless_stopped(
        lambda: report.with_verification(run_verification(initial, report, batches, loss, device=dev, target=target)),
        lambda why: _marked(report, why))


def _trialled(report: Report, r: ProfileRequest, initial: Any, batches: tuple[Any, ...], loss: Loss,
              dev: torch.device, target: str, regime: str, distributed: bool) -> Report:
    """The report with its training trial (the ``trial`` section); a Ctrl-C or signal during it keeps the report
    with the trial marked as stopped."""
    from fp16probe.analysis.trial import HURT_UNSEEN, report_agreement
    from fp16probe.running.trial import OFF_DISTRIBUTED, OFF_STOPPED, run_trial
    from fp16probe.sections import Trial

    rec = report.recommendation
    assert rec is not None and r.trial is not None  # the caller checked
    if distributed:  # every rank would train its own copies: the trial is a one-process check
        return report.with_sections({"trial": Trial(steps=r.trial, format=rec.format, off=OFF_DISTRIBUTED)})
    optimizer = r.optimizer if isinstance(r.optimizer, str) else None

    def trialled() -> Report:
        ends: list[nn.Module] = []
        trial = run_trial(initial, rec, batches, loss.outcome(), steps=r.trial, device=dev, target=target,
                          regime=regime, seed=r.seed, optimizer=optimizer, lr=r.lr, ends=ends)
        done = report.with_sections({"trial": trial})
        if ends and report_agreement(done) == HURT_UNSEEN:  # where it hurts, look where training ended
            end = _judged_at_end(report, ends[0], batches, loss.outcome(), target=target, regime=regime, kind=r.kind)
            if end is not None:
                done = report.with_sections({"trial": dataclasses.replace(trial, end=end)})
        return done

    return _unless_stopped(
        trialled,
        lambda why: report.with_sections({"trial": Trial(steps=r.trial, format=rec.format, off=OFF_STOPPED)}))


def _judged_at_end(report: Report, model: nn.Module, batches: tuple[Any, ...], loss: Loss, *, target: str,
                   regime: str, kind: str) -> TrialEnd | None:
    """The emulated step at ``model``'s weights (the trial's first fp32 run as it ended), judged as the profile
    judges its own: the report's verdict analysed afresh, then :func:`with_effect` on those weights and the
    profile's batches. None when the emulated step could not run there."""
    from fp16probe.analysis.recommend import analyze

    rec = report.recommendation
    assert rec is not None  # the caller checked
    base = report.with_recommendation(analyze(report, rec.format, kind=kind))
    late = with_effect(base, model, batches[:KEPT_BATCHES], loss, target=target, regime=regime, kind=kind)
    judged = late.recommendation
    em = None if judged is None else judged.evidence.get("emulated")
    if judged is None or not isinstance(em, Mapping):
        return None
    ev = judged.evidence
    if judged.verdict is Verdict.GRADIENT_ERROR:
        parameter, error, noise = em.get("first_parameter"), em.get("first_parameter_error"), em.get("first_parameter_noise")
    else:
        parameter, error, noise = (list(em.get("worst_parameters") or []) or [[None, None, None]])[0]
    fix_modules = tuple(str(m) for m in ev.get("fix_modules") or ())
    fix = em.get("fix") if fix_modules else em.get("loss_fix") if ev.get("fix_loss") else None
    return TrialEnd(verdict=judged.verdict.value, parameter=None if parameter is None else str(parameter),
                    error=error, noise=noise, fix_modules=fix_modules, fix_loss=bool(ev.get("fix_loss")),
                    fix_error=fix.get("error") if isinstance(fix, Mapping) else None,
                    loss_error=_loss_error(late))


def _loss_error(report: Report) -> float | None:
    """The whole-model error of the emulated step with the loss computed in fp32, where the report's emulation
    section ran one (:data:`fp16probe.emulation.LOSS`); None otherwise."""
    from fp16probe.analysis.effect import effect_at
    from fp16probe.emulation import LOSS

    section = report.section("emulation")
    if not isinstance(section, Emulation):
        return None
    data = section.to_dict()
    found = next((s for s in section.settings if list(s.keep_fp32) == [LOSS]), None)
    eff = None if found is None else effect_at(data, found.log2_scale, [LOSS])
    return None if eff is None else eff.error


def _marked(report: Report, why: str) -> Report:
    """``report`` noting that its verification did not run to the end (``why``: interrupted, terminated, hangup)."""
    return dataclasses.replace(report, workload=dataclasses.replace(report.workload or Workload(),
                                                                    verification_stopped=why))


def _block_options(format: str, recipe: str | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """Probe options for a scaled format: its statistics, and a delayed recipe asked for, counted live."""
    from fp16probe.analysis.blockformats import parse_recipe
    from fp16probe.blockscale import DelayedRecipe

    out = dict(options)
    if format not in SCALED_FORMATS:
        return out
    delayed = parse_recipe(SCALED_FORMATS[format].family, recipe)[1]  # the request checked it
    out.setdefault("block_formats", [format])
    recipes = [DelayedRecipe()] + ([delayed] if delayed is not None and delayed != DelayedRecipe() else [])
    out.setdefault("delayed_recipes", recipes)
    return out


def _with_block_advice(report: Report, format: str, recipe: str | None) -> Report:
    """The report with the per-layer scaled-format advice, its ``block_advice`` section."""
    from fp16probe.analysis.blockformats import advise
    from fp16probe.blockscale import block_stats_of

    stats = block_stats_of(report)
    if stats is None or format not in SCALED_FORMATS:
        return report
    return dataclasses.replace(report, block_advice=advise(stats, format, recipe))


def prepare_model(model: nn.Module, device: str | torch.device | None) -> tuple[nn.Module, torch.device, list[str]]:
    """Check the model can be profiled, cast it to fp32 master weights and move it to ``device``."""
    if not isinstance(model, nn.Module):
        raise InputError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise InputError(
            f"{type(model).__name__} has no trainable parameters (none requires grad); nothing to "
            "profile: unfreeze them (requires_grad_(True)) in the factory"
        )
    if any(p.is_meta for p in params) or any(b.is_meta for b in model.buffers()):
        raise ModelError(
            f"{type(model).__name__} has parameters on the meta device (shapes only, no values); "
            "materialise them (model.to_empty(device=...) and initialise, or load weights) before profiling"
        )
    notes: list[str] = []
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if dtypes - {torch.float32}:
        # Autocast and the fp32 reference both want fp32 master weights.
        notes.append(f"parameters cast from {', '.join(sorted(str(d) for d in dtypes))} to torch.float32")
        model = model.float()
    dev = torch.device(device) if device is not None else params[0].device
    return model.to(dev), dev, notes


def _as_batches(batches: Iterable[Any], device: torch.device) -> Batches:
    try:
        iterator = iter(batches)
    except TypeError as e:
        raise InputError(f"batches: expected an iterable of batches, got {type(batches).__name__}") from e
    moved = (move_to(b, device) for b in iterator)
    return Batches(moved, f"batches passed to fp16probe.profile ({type(batches).__name__})", synthetic=False)


def _make_scaler(scaler: Any, device: torch.device) -> Any:
    if not isinstance(scaler, (int, float)):  # None or a scaler of the caller's (the request allows nothing else)
        return scaler
    return torch.amp.GradScaler(device.type, init_scale=float(scaler))


def _scale_of(scaler: Any) -> float | None:
    if scaler is None:
        return None
    return float(scaler) if isinstance(scaler, (int, float)) else float(scaler.get_scale())


def _make_probe(model: nn.Module, scaler: Any, options: Mapping[str, Any]) -> Any:
    from fp16probe.capture.probe import Probe

    # No fp32 reruns here: profile() measures in fp32 by default, and a --precision fp16 profile
    # is asked for the run as it is (a Probe left on in training reruns, capture.shadow).
    probe = Probe(model, scaler=scaler, **{"shadow_every": 0, **options})
    patterns = options.get("modules")
    if patterns and not probe.hooked_modules:
        names = [n for n, _ in model.named_modules() if n][:6]
        raise InputError(f"modules={list(patterns) if not isinstance(patterns, str) else patterns!r}: "
                         f"no module name matches; names look like {', '.join(names)}", parameter="modules")
    return probe


def _distributed_runner(model: nn.Module) -> nn.Module:
    """Under torch.distributed, run the model as DDP while the Probe watches the plain module (clean names)."""
    from fp16probe.capture import distributed

    if not distributed.is_distributed():
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def _rank_guard(model: nn.Module) -> Any:
    """Under torch.distributed, the control group that keeps the ranks in step (checking the models match)."""
    from fp16probe.capture import distributed

    if not distributed.is_distributed():
        return None
    from fp16probe.running.ranks import RankGuard

    guard = RankGuard()
    guard.check_same_model(model)
    return guard


def _settle(guard: Any, result: RunResult, probe: Any) -> tuple[RunResult, Any]:
    """After the loop, agree with the other ranks on how it ended; the result to report and how to gather it.

    Returns the result (with the failing rank's error, when a rank failed) and ``None``
    (gather over the default group, as a whole run does), ``guard.group`` (every rank
    finished the same steps: gather over the control group), a dict of metadata (rank 0
    writes its own steps alone) or ``"nothing"`` (no step to report on this rank).
    """
    from fp16probe.running import ranks

    if result.agreed is not None:  # another rank's stop was heard before backward
        statuses, done = result.agreed
    else:
        statuses, done = guard.agree(result.steps_done, ranks.status_of(
            result.error, exhausted=result.exhausted, stopped=result.interrupted))
    if all(s == ranks.OK for s in statuses) or (all(s == ranks.EXHAUSTED for s in statuses) and len(set(done)) == 1):
        return result, None
    probe.discard_step()  # a step some rank did not finish is no step every rank finished
    said = str(result.error) if result.error is not None else guard.failure or result.stopped or ""
    settled = guard.settle(statuses, done, said)
    error = settled.error(guard.rank)
    if error is not None:
        if error is not result.error:
            error.__cause__ = result.error
        # Rank 0 prints the one error line; another rank stays quiet when rank 0 heard its message.
        error.reported_elsewhere = guard.rank != 0 and settled.messages is not None
    stopped = result.stopped if error is None else STOPPED_ERROR
    result = dataclasses.replace(result, error=error, stopped=stopped)
    if settled.same_steps:
        return result, guard.group
    if guard.rank != 0 or result.steps_done == 0:
        return result, "nothing"
    cause = settled.cause
    return result, {
        "ranks_in_report": [0],
        "rank_fault": {
            "rank": cause, "steps_finished_per_rank": list(done),
            "lost_contact": settled.broken,
        },
        "notes": [f"only rank 0's own {result.steps_done} step(s): "
                  + ("the other ranks could not be reached" if settled.broken
                     else f"the ranks finished {', '.join(map(str, done))} step(s)")],
    }


def _finish(probe: Any, result: RunResult, batch_src: Batches, loss: Loss, settings: RunSettings, *,
            format: str | Format, kind: str, notes: list[str], extra: Mapping[str, Any],
            gather: Any = None) -> Report | None:
    """Gather the report (every rank), add what the run knows, and analyse it."""
    from fp16probe.analysis.weight_updates import weight_update_loss
    from fp16probe.running.families import stand_in_line

    loss = loss.outcome()  # a default loss says now which way it went
    labels = batch_src.labels if loss.synthetic and batch_src.loss else None
    meta: dict[str, Any] = {
        "inputs": batch_src.description,
        "inputs_synthetic": batch_src.synthetic,
        "loss": loss.description,
        "loss_synthetic": loss.synthetic,
        "stand_in": stand_in_line(inputs_synthetic=batch_src.synthetic, loss=loss.description,
                                  loss_synthetic=loss.synthetic, labels=labels),
        "optimizer": None if settings.optimizer is None else {"name": settings.optimizer, "lr": settings.lr},
        "loss_scale": settings.loss_scale,
        "nonfinite_loss_steps": list(result.nonfinite_loss_steps),
        "steps_requested": settings.steps,
        **extra,
    }
    if labels:
        meta["labels"] = labels
    if not meta["stand_in"]:
        del meta["stand_in"]
    meta["notes"] = list(extra.get("notes", ())) + notes
    if result.exhausted:
        meta["notes"] = meta["notes"] + [f"the batches ran out after {result.steps_done} step(s)"]
    if result.stopped is not None:
        meta["stopped"] = result.stopped
    if result.error is not None:
        meta["error"] = str(result.error)
    if result.updates is not None:
        lost = weight_update_loss(result.weights_before, result.updates, format=format)
        wul = lost.to_dict()
        wul.pop("parameters")
        wul["measured_on"] = "the last optimizer step that moved the weights"
        meta["weight_update_loss"] = wul
    return conclude(probe, partial=result.stopped is not None, extra=meta, format=format, kind=kind, group=gather)


def conclude(probe: Any, *, partial: bool = False, extra: Mapping[str, Any] | None = None,
             format: str | Format = "fp16", kind: str = ALL_GRADS, group: Any = None) -> Report | None:
    """Merge every rank's statistics and analyse them: the Report with its recommendation on rank 0, else None.

    The last step of :func:`profile`, and of the training-loop callbacks. Every rank must
    call it (the merge is a collective over ``group``, the default group when None); it
    synchronises with the device. ``group="local"``: this rank's own report, no collective.
    """
    from fp16probe.analysis.recommend import analyze
    from fp16probe.capture import distributed

    if group == "local":
        report: Report | None = probe.report(partial=partial, extra=dict(extra or {}))
    else:
        report = distributed.gather_report(probe, partial=partial, extra=dict(extra or {}), group=group)
    if report is None:  # a rank other than 0: rank 0 analyses and writes
        return None
    if not isinstance(format, Format) and format not in FORMATS:  # MXFP8, NVFP4: their advice is per layer
        return report
    return report.with_recommendation(analyze(report, format, kind=kind))


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


# Messages of errors that say a batch does not fit the model (shape, dtype, arguments),
# as torch and Python phrase them: at the first step these are the input's fault.
_MISMATCH = re.compile(
    r"shape|size|dimension|dtype|must match|mat1|mat2|argument|index out of range|expected .*(input|tensor)",
    re.IGNORECASE,
)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel wrapper (whose forward says nothing)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, torch.nn.parallel.DistributedDataParallel) and inner is not None else model


def _step_error(step: int, what: str, e: BaseException, batch: Any, *, first_ok: bool,
                model: nn.Module | None = None) -> Fp16ProbeError:
    """Classify a failure at ``step`` (0-based): the input's only when the first batch does not fit."""
    name = "SystemExit" if isinstance(e, SystemExit) else type(e).__name__
    message = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {name}: {first_line(e)}"
    if (what == "forward" and not first_ok and not isinstance(e, (SystemExit, KeyError, AttributeError))
            and _MISMATCH.search(message_of(e))):
        from fp16probe.running.families import forward_signature

        wants = f"{forward_signature(model)} is what it takes: " if model is not None else ""
        error: Fp16ProbeError = InputError(
            f"the model rejected the input ({describe_batch(batch)}) at step 1: {name}: {first_line(e)}; "
            f"{wants}pass input_shape= with a shape it accepts (and a dtype it takes), or batches from "
            "package.module:function returning an iterable of batches (a tensor, a tuple of positional "
            "inputs, or a dict of keyword arguments)", parameter="input_shape"
        )
    else:
        error = ModelError(f"step {step + 1}: the {what} {message}")
    error.__cause__ = e
    return error


def run_profile(
    model: nn.Module,
    batches: Batches,
    loss: Loss,
    settings: RunSettings,
    probe: Any,
    *,
    scaler: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    on_step: Callable[[int], None] | None = None,
    keep_batches: bool = False,
    audit: Any = None,
    guard: Any = None,
    keep_first: int = 0,
) -> RunResult:
    """Run ``settings.steps`` forward+backward passes under the probe; Ctrl-C or a failure stops early.

    A failure of user code (the batches, the model, the loss, backward, the optimizer) ends
    the loop and comes back as ``RunResult.error`` beside the steps already finished. The
    loss is checked for inf/NaN each step, which synchronises with the device once per
    step; a non-finite loss is recorded (a finding), never raised. With a ``guard``
    (:class:`fp16probe.running.ranks.RankGuard`) the ranks agree before each backward that
    all of them got this far; when one did not, every rank stops here.
    """
    device = torch.device(settings.device)
    if optimizer is None and settings.optimizer:
        optimizer = make_optimizer(model, settings.optimizer, settings.lr)
    loop = _Loop(model, batches, loss, probe, device, settings.precision, scaler=scaler, optimizer=optimizer,
                 audit=audit, guard=guard)
    model.train()
    try:
        for step in range(settings.steps):
            loss_val = loop.step(step)
            if loss_val is None:  # out of batches, a failure, or another rank stopped
                break
            loop.close_step(step, loss_val, keep=keep_batches or len(loop.used) < keep_first)
            if on_step is not None:
                on_step(loop.done)
    except Hangup:
        loop.stopped = STOPPED_HANGUP
    except Terminated:
        loop.stopped = STOPPED_TERMINATED
    except KeyboardInterrupt:
        loop.stopped = STOPPED_INTERRUPTED
    if loop.stopped is not None:
        model.zero_grad(set_to_none=True)  # a step cut short leaves no half-made gradients behind
    return loop.result()


@dataclass
class _Loop:
    """:func:`run_profile`'s loop: its parts, and what it has done so far (read by its handlers)."""

    model: nn.Module
    batches: Batches
    loss: Loss
    probe: Any
    device: torch.device
    precision: str
    scaler: Any = None
    optimizer: torch.optim.Optimizer | None = None
    audit: Any = None
    guard: Any = None
    done: int = 0
    exhausted: bool = False
    stopped: str | None = None
    error: Fp16ProbeError | None = None
    agreed: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    before: dict[str, torch.Tensor] | None = None
    nonfinite: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    used: list[Any] = field(default_factory=list)
    batch: Any = None  # this step's, once drawn
    what: str = "batches"  # what this step is running: a failure names it

    def step(self, step: int) -> float | None:
        """Run step ``step`` (0-based); its loss's value, or None when the loop stops here.

        A KeyboardInterrupt (and a signal's) goes through to :func:`run_profile`; a failure of user
        code is kept as ``error`` with ``stopped`` set.
        """
        self.batch = None
        self.what = "batches"
        try:
            return self._forward_backward(step)
        except KeyboardInterrupt:
            raise
        except Fp16ProbeError as e:
            self.error = e
            self.stopped = STOPPED_ERROR
            return None
        except (Exception, SystemExit) as e:  # user code: the model's, the loss's or the batches'
            self.error = self._user_error(step, e)
            self.stopped = STOPPED_ERROR
            return None

    def _forward_backward(self, step: int) -> float | None:
        """Draw a batch, run forward, the loss and backward (and the optimizer); None when there is no step to take."""
        try:
            self.batch = next(self.batches.iterator)
        except StopIteration:
            self.exhausted = True
            return None
        self.what = "forward"
        value, loss_val = self._loss_value(step)
        if self.guard is not None and self._another_rank_stopped():
            return None
        self.what = "backward"
        self.probe.watch(value)  # the overflow ceiling also covers the loss function's own gradients
        (self.scaler.scale(value) if self.scaler is not None else value).backward()
        if self.optimizer is not None:
            self.what = "optimizer step"
            snapshot = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
            if _taken_step(self.optimizer, self.scaler, loss_val):
                self.before = snapshot
        return loss_val

    def _loss_value(self, step: int) -> tuple[torch.Tensor, float]:
        """Forward and the loss under autocast (and the audit); the checked scalar loss and its value on the host."""
        with _autocast(self.device, self.precision), (
                self.audit.step(step) if self.audit is not None else contextlib.nullcontext()):
            output = call_model(self.model, self.batch)
            self.what = f"loss ({self.loss.description})"
            value = self.loss.fn(output, self.batch)
            if self.audit is not None and isinstance(value, torch.Tensor):
                self.audit.note_loss(value)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise InputError(
                f"the loss ({self.loss.description}) returned {type(value).__name__}, expected a scalar tensor"
            )
        value = value.reshape(())
        loss_val = float(value.detach().float())  # one host sync per step, outside every hook
        if not value.requires_grad:
            raise InputError(
                f"the loss ({self.loss.description}) does not depend on any trainable parameter; "
                "check that the model's parameters require grad"
            )
        return value, loss_val

    def _another_rank_stopped(self) -> bool:
        """Before DDP's all-reduce: did every rank get this far? When one did not, stop here (``agreed``)."""
        statuses, finished = self.guard.agree(self.done)
        if any(statuses):
            self.agreed = (statuses, finished)
            self.stopped = STOPPED_ERROR
            return True
        return False

    def _user_error(self, step: int, e: BaseException) -> Fp16ProbeError:
        """The error for a failure of user code (or of a collective waiting on the other ranks) at ``step``."""
        if self.guard is not None and isinstance(e, RuntimeError) and _is_collective_error(e):
            error: Fp16ProbeError = ModelError(f"step {step + 1}: waited for the other ranks in the {self.what} "
                                               f"and gave up ({first_line(e)})")
            error.__cause__ = e
        elif self.what == "batches":
            error = InputError(f"step {step + 1}: the batches raised {type(e).__name__}: {first_line(e)}")
            error.__cause__ = e
        else:
            error = _step_error(step, self.what, e, self.batch, first_ok=self.done > 0, model=_unwrapped(self.model))
        return error

    def close_step(self, step: int, loss_val: float, *, keep: bool) -> None:
        """Record a finished step (its loss, its batch when ``keep``) and close it in the probe."""
        self.losses.append(loss_val)
        if not math.isfinite(loss_val):
            self.nonfinite.append(step)
        if keep:  # all for verify(), the first few for the emulation
            self.used.append(self.batch)
        self.model.zero_grad(set_to_none=True)
        self.probe.step()
        self.done += 1

    def result(self) -> RunResult:
        """What the loop did, with the last taken optimizer step's update."""
        updates = None
        if self.before is not None:
            # Later steps were skipped, so the weights still hold the last taken step's result.
            updates = {n: p.detach() - self.before[n] for n, p in self.model.named_parameters() if n in self.before}
        return RunResult(self.done, stopped=self.stopped, exhausted=self.exhausted, error=self.error,
                         nonfinite_loss_steps=tuple(self.nonfinite), losses=tuple(self.losses),
                         batches=tuple(self.used), weights_before=self.before, updates=updates, agreed=self.agreed)


def _is_collective_error(e: BaseException) -> bool:
    from fp16probe.running.ranks import is_collective_error

    return is_collective_error(e)


def _taken_step(optimizer: torch.optim.Optimizer, scaler: Any, loss_val: float) -> bool:
    """Step the optimizer (through the scaler when there is one); whether the weights moved."""
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)  # skips the step itself on inf/NaN gradients
        scaler.update()
        return scaler.get_scale() >= scale  # a skipped step backs the scale off
    if math.isfinite(loss_val):
        optimizer.step()
        return True
    return False
